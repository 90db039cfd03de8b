"""The ops written out as other ops at import (crosscompile/decompositions.py):
DFT, STFT, Det, MaxUnpool, ReverseSequence, TensorScatter, EyeLike, the
Optional ops, BatchNormalization in training mode and the training
optimizers (Adagrad, Adam, Momentum), compiled for the host and run,
against onnx's reference evaluator (numpy's FFT, linalg.det) over their
attributes; and the clear errors for what they refuse."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import crosscompile
import minirt


def one_node(op_type, runtime: dict, constants: dict, opset: int, output_type=TensorProto.FLOAT, **attrs):
    """A model of one node: runtime inputs {name: array} (their dtypes kept)
    and constants {name: array}, in the node's input order as given, with
    "" for an input left out."""
    names = [n for n in list(runtime) + list(constants)]
    order = attrs.pop("order", names)
    node = helper.make_node(op_type, order, ["y"], name=f"the_{op_type.lower()}", **attrs)
    graph = helper.make_graph(
        [node], op_type.lower(),
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in runtime.items()],
        [helper.make_tensor_value_info("y", output_type, None)],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def compiled_and_reference(model, feeds, tmp_path):
    got = minirt.load(crosscompile.build(model, "host").export_library(str(tmp_path / "m.so"))).run(feeds)[0]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    return got, want


def signal(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape,attrs,length,axis,opset", [
    ((2, 12, 1), {}, None, 1, 17),                                  # real input, full spectrum
    ((2, 12, 2), {"inverse": 1}, None, 1, 17),                      # inverse of a complex signal
    ((3, 9, 1), {"onesided": 1}, None, 1, 17),                      # rfft of an odd length
    ((2, 7, 2), {}, 10, 1, 17),                                     # dft_length past the input: zeros after
    ((2, 5, 6, 2), {}, 4, -2, 20),                                  # cut short, opset 20's axis input
    ((4, 3, 5, 1), {"onesided": 1}, None, 1, 20),                   # a middle axis
    ((2, 6, 2), {"inverse": 1, "onesided": 1}, None, 1, 20),        # irfft: one-sided in, 10 real points out
    ((2, 6, 2), {"inverse": 1, "onesided": 1}, 9, 1, 20),           # irfft to an odd length
])
def test_dft_matches_the_onnx_reference(tmp_path, shape, attrs, length, axis, opset):
    constants = {}
    order = ["x", ""]
    if length is not None:
        constants["dft_length"] = np.array(length, np.int64)
        order[1] = "dft_length"
    if opset >= 20:
        constants["axis"] = np.array(axis, np.int64)
        order.append("axis")
    else:
        attrs = {**attrs, "axis": axis}
    x = signal(*shape)
    model = one_node("DFT", {"x": x}, constants, opset, order=order, **attrs)
    got, want = compiled_and_reference(model, {"x": x}, tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_inverse_of_a_real_signal_spectrum_is_exactly_real(tmp_path):
    # The sums of mirrored points cancel before any multiplication, so the
    # imaginary parts are zeros, not float32's rounding.
    x = signal(3, 16, 1)
    spectrum = np.fft.fft(x[..., 0], axis=1)
    feeds = {"x": np.stack([spectrum.real, spectrum.imag], -1).astype(np.float32)}
    model = one_node("DFT", feeds, {}, 17, inverse=1, axis=1)
    got, _ = compiled_and_reference(model, feeds, tmp_path)
    assert np.all(got[..., 1] == 0)
    np.testing.assert_allclose(got[..., 0], x[..., 0], atol=1e-5)


@pytest.mark.parametrize("window,frame_length,onesided", [(True, None, 1), (False, 8, 0)])
def test_stft_matches_the_onnx_reference(tmp_path, window, frame_length, onesided):
    x = signal(2, 40, 1, seed=3)
    runtime = {"x": x}
    order = ["x", "step", "", ""]
    constants = {"step": np.array(6, np.int64)}
    if window:
        runtime["window"] = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(10) / 10)).astype(np.float32)
        order[2] = "window"
    if frame_length:
        constants["frame_length"] = np.array(frame_length, np.int64)
        order[3] = "frame_length"
    model = one_node("STFT", runtime, constants, 17, order=order, onesided=onesided)
    got, want = compiled_and_reference(model, runtime, tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(2, 2), (3, 3, 3), (2, 1, 4, 4), (1, 1)])
def test_det_matches_the_onnx_reference(tmp_path, shape):
    x = signal(*shape, seed=5)
    got, want = compiled_and_reference(one_node("Det", {"x": x}, {}, 13), {"x": x}, tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("output_shape", [None, (1, 2, 7, 6)])
def test_max_unpool_puts_values_where_max_pool_found_them(tmp_path, output_shape):
    # Indices as MaxPool gives them for a 2x2 window of stride 2 on 6x4;
    # a larger output_shape adds zeros after the unpooled 6x4.
    image = signal(1, 2, 6, 4, seed=7)
    pooled = ReferenceEvaluator(helper.make_model(helper.make_graph(
        [helper.make_node("MaxPool", ["x"], ["v", "i"], kernel_shape=[2, 2], strides=[2, 2])], "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, image.shape)],
        [helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("i", TensorProto.INT64, None)]),
        opset_imports=[helper.make_opsetid("", 13)])).run(None, {"x": image})
    feeds = {"x": pooled[0], "i": pooled[1]}
    constants = {} if output_shape is None else {"shape": np.array(output_shape, np.int64)}
    model = one_node("MaxUnpool", feeds, constants, 11, kernel_shape=[2, 2], strides=[2, 2])
    got, want = compiled_and_reference(model, feeds, tmp_path)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("time_axis,batch_axis", [(0, 1), (1, 0)])
def test_reverse_sequence_matches_the_onnx_reference(tmp_path, time_axis, batch_axis):
    shape = [0, 0, 3]
    shape[time_axis], shape[batch_axis] = 5, 4
    x = signal(*shape, seed=9)
    feeds = {"x": x, "lens": np.array([5, 1, 0, 3], np.int64)}
    model = one_node("ReverseSequence", feeds, {}, 10, time_axis=time_axis, batch_axis=batch_axis)
    got, want = compiled_and_reference(model, feeds, tmp_path)
    np.testing.assert_array_equal(got, want)


def test_eye_like_is_the_constant_of_its_input_shape(tmp_path):
    feeds = {"x": np.zeros((3, 5), np.float32)}
    model = one_node("EyeLike", feeds, {}, 9, output_type=TensorProto.INT32, k=2, dtype=TensorProto.INT32)
    got, want = compiled_and_reference(model, feeds, tmp_path)
    np.testing.assert_array_equal(got, want)


def test_refusals_name_the_node_and_the_reason():
    runtime_length = one_node("DFT", {"x": signal(2, 8, 1), "n": np.array(8, np.int64)}, {}, 17)
    with pytest.raises(crosscompile.BuildError, match=r"node 'the_dft' \(DFT\): input 'n' \(dft_length\) must be a "
                                                      "constant"):
        crosscompile.build(runtime_length, "host")
    big = one_node("Det", {"x": signal(6, 6)}, {}, 13)
    with pytest.raises(crosscompile.BuildError, match=r"node 'the_det' \(Det\): a 6x6 determinant is not supported"):
        crosscompile.build(big, "host")


def test_optional_ops_on_tensors(tmp_path):
    # A tensor is an optional that has its element; a left-out input is not.
    x = signal(2, 3)
    nodes = [helper.make_node("OptionalHasElement", ["x"], ["has"]),
             helper.make_node("OptionalHasElement", [""], ["has_not"]),
             helper.make_node("OptionalGetElement", ["x"], ["element"]),
             helper.make_node("Relu", ["element"], ["y"])]
    graph = helper.make_graph(nodes, "optional", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("has", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("has_not", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got = minirt.load(crosscompile.build(model, "host").export_library(str(tmp_path / "m.so"))).run({"x": x})
    want = ReferenceEvaluator(model).run(None, {"x": x})
    assert [bool(got[0]), bool(got[1])] == [bool(want[0]), bool(want[1])] == [True, False]
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("mode,axis,starts", [
    ("linear", -2, [0, 3]),
    ("circular", 2, [5, 6]),          # wraps past the cache's end
    ("linear", 1, None),              # no write_indices: from position 0
])
def test_tensor_scatter_writes_the_update_into_the_cache(tmp_path, mode, axis, starts):
    cache, update = [2, 5, 7, 4], [2, 5, 7, 4]
    update[axis] = 3
    runtime = {"cache": signal(*cache, seed=10), "update": signal(*update, seed=11)}
    order = ["cache", "update"]
    if starts is not None:
        runtime["starts"] = np.array(starts, np.int64)
        order.append("starts")
    model = one_node("TensorScatter", runtime, {}, 24, order=order, mode=mode, axis=axis)
    got, want = compiled_and_reference(model, runtime, tmp_path)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("opset,shape,attrs", [(15, (2, 3, 4, 5), {}), (18, (4, 2, 6), {"epsilon": 1e-2,
                                                                                   "momentum": 0.7})])
def test_batch_norm_in_training_mode_uses_the_batch_statistics(tmp_path, opset, shape, attrs):
    channels = shape[1]
    feeds = {"x": signal(*shape, seed=12), "scale": signal(channels, seed=13), "bias": signal(channels, seed=14),
             "mean": signal(channels, seed=15), "var": np.abs(signal(channels, seed=16)) + 0.5}
    node = helper.make_node("BatchNormalization", list(feeds), ["y", "running_mean", "running_var"], training_mode=1,
                            **attrs)
    graph = helper.make_graph([node], "bn", [helper.make_tensor_value_info(n, TensorProto.FLOAT, v.shape)
                                             for n, v in feeds.items()],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    got = minirt.load(crosscompile.build(model, "host").export_library(str(tmp_path / "m.so"))).run(feeds)
    for g, w in zip(got, ReferenceEvaluator(model).run(None, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op_type,states,attrs", [
    ("Adagrad", 1, {"decay_factor": 0.1, "epsilon": 1e-5, "norm_coefficient": 0.01}),
    ("Adam", 2, {"alpha": 0.9, "beta": 0.8, "epsilon": 1e-3, "norm_coefficient": 0.01, "norm_coefficient_post": 0.1}),
    ("Momentum", 1, {"alpha": 0.9, "beta": 0.5, "mode": "nesterov", "norm_coefficient": 0.02}),
])
def test_training_optimizers_update_every_tensor(tmp_path, op_type, states, attrs):
    # Two tensors of different shapes; the step count is read at run time,
    # and its first step (0) takes another form than the later ones.
    shapes = [(3,), (2, 4)]
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(0, np.int64)}
    names = [f"{kind}{i}" for kind in ["X", "G"] + [f"S{k}" for k in range(states)] for i in range(len(shapes))]
    for seed, name in enumerate(names):
        values = signal(*shapes[int(name[-1])], seed=20 + seed)
        feeds[name] = np.abs(values) if name.startswith("S") else values
    outputs = [f"{name}_new" for name in names if not name.startswith("G")]
    node = helper.make_node(op_type, list(feeds), outputs, domain="ai.onnx.preview.training", **attrs)
    graph = helper.make_graph([node], "optimizer", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(
        v.dtype), v.shape) for n, v in feeds.items()], [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                        for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("ai.onnx.preview.training", 1)])
    module = minirt.load(crosscompile.build(model, "host").export_library(str(tmp_path / "m.so")))
    for step in (0, 3):
        feeds["T"] = np.array(step, np.int64)
        got, want = module.run(feeds), ReferenceEvaluator(model).run(None, feeds)
        assert [g.shape for g in got] == [w.shape for w in want] and len(got) == len(outputs)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
