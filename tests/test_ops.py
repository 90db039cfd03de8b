"""Per-op correctness against onnxruntime on random inputs, including odd
shapes: 1x1 images, sizes that are not multiples of the vector width,
padding larger than the kernel and strides larger than the kernel."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt

from tests.onnx_models import assert_zoo_close, conv_relu_model, make_model, rand, reference, run_host, single_op


def conv_model(x_shape, w_shape, bias=True, opset=13, **attrs):
    inits = {"w": rand(*w_shape, seed=1)}
    if bias:
        inits["b"] = rand(w_shape[0], seed=2)
    return single_op("Conv", {"x": x_shape}, inits, opset=opset, **attrs)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 3, 9, 11), (5, 3, 3, 3), {}),
    ((2, 3, 9, 11), (5, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 4, 1, 1), (6, 4, 1, 1), {}),                                   # 1x1 image
    ((1, 4, 1, 1), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 3, 17, 13), (7, 3, 1, 1), {}),                                 # pointwise
    ((1, 3, 17, 13), (7, 3, 3, 5), {"strides": [2, 3]}),
    ((1, 2, 8, 8), (3, 2, 2, 2), {"strides": [3, 3]}),                  # stride > kernel
    ((1, 2, 5, 5), (3, 2, 2, 2), {"pads": [3, 4, 3, 2]}),               # padding > kernel
    ((1, 3, 12, 12), (4, 3, 3, 3), {"dilations": [2, 3], "pads": [2, 1, 0, 3]}),
    ((1, 6, 10, 9), (6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1]}),  # depthwise
    ((1, 6, 10, 9), (4, 3, 3, 3), {"group": 2, "strides": [2, 2]}),
    ((1, 3, 10, 9), (4, 3, 3, 4), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 3, 10, 9), (4, 3, 4, 3), {"auto_pad": "SAME_LOWER", "strides": [3, 2]}),
    ((1, 3, 10, 9), (4, 3, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}),
    ((1, 3, 19), (4, 3, 3), {"pads": [1, 2], "strides": [2]}),          # 1-D
])
@pytest.mark.parametrize("bias", [True, False])
def test_conv(tmp_path, x_shape, w_shape, attrs, bias):
    run_host(conv_model(x_shape, w_shape, bias, **attrs), tmp_path)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 5, 9, 11), (29, 5, 3, 3), {"pads": [1, 1, 1, 1]}),    # full and partial tiles in rows and columns
    ((2, 16, 8, 9), (24, 16, 1, 1), {}),                        # pointwise, rows a multiple of every tile
    ((1, 7, 15, 15), (13, 7, 3, 3), {"strides": [2, 2], "pads": [0, 1, 2, 1]}),
    ((2, 6, 9, 9), (26, 3, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),  # 13 rows per group
    ((1, 12, 7, 7), (15, 4, 1, 1), {"group": 3}),
    # depthwise: vector pieces of several widths, strides 1 and 2, dilation, 1-D
    ((2, 5, 12, 40), (5, 1, 3, 3), {"group": 5, "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((1, 4, 9, 37), (4, 1, 3, 5), {"group": 4, "pads": [1, 2, 1, 2], "dilations": [2, 1]}),
    ((1, 3, 50), (3, 1, 3), {"group": 3, "pads": [1, 1]}),
])
def test_conv_register_tiles_with_partial_tiles_and_fused_relu(tmp_path, x_shape, w_shape, attrs):
    lib = run_host(conv_relu_model(x_shape, w_shape, attrs), tmp_path)
    assert lib.summary["fused_kernels"] == 1


def test_conv_old_opset_with_fused_relu_and_clip(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Clip", ["r"], ["y"], min=0.0, max=0.5)]
    model = make_model(nodes, {"x": (1, 3, 7, 7)}, {"y": None},
                       {"w": rand(4, 3, 3, 3, seed=1), "b": rand(4, seed=2)}, opset=7)
    lib = run_host(model, tmp_path)
    assert lib.summary["fused_kernels"] == 1 and lib.summary["kernels"] == 1


def test_conv_then_batchnorm_is_folded(tmp_path):
    c = 5
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["y"], epsilon=1e-3)]
    inits = {"w": rand(c, 3, 3, 3, seed=1), "s": rand(c, seed=2), "bb": rand(c, seed=3),
             "m": rand(c, seed=4), "v": np.abs(rand(c, seed=5)) + 0.1}
    lib = run_host(make_model(nodes, {"x": (2, 3, 8, 8)}, {"y": None}, inits), tmp_path)
    assert lib.summary["folded_into_conv"] == 1 and lib.summary["kernels"] == 1


@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (3, 7), (2, 3, 5)])
def test_batchnorm_alone(tmp_path, shape):
    c = shape[1]
    inits = {"s": rand(c, seed=2), "bb": rand(c, seed=3), "m": rand(c, seed=4),
             "v": np.abs(rand(c, seed=5)) + 0.1}
    run_host(single_op("BatchNormalization", {"x": shape}, inits, opset=9), tmp_path)


@pytest.mark.parametrize("op_type,attrs,opset", [
    ("Relu", {}, 13), ("LeakyRelu", {"alpha": 0.3}, 13), ("Sigmoid", {}, 13), ("Tanh", {}, 13),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, 13), ("HardSwish", {}, 14),
    ("Clip", {"min": -0.5, "max": 0.7}, 6), ("Neg", {}, 13), ("Abs", {}, 13), ("Exp", {}, 13),
])
def test_unary(tmp_path, op_type, attrs, opset):
    x = 4 * rand(3, 37)
    x[0, :5] = [0.0, 1e-6, -1e-6, 0.1, -0.1]
    run_host(single_op(op_type, {"x": x.shape}, opset=opset, **attrs), tmp_path, feeds={"x": x})


@pytest.mark.parametrize("inits", [{}, {"lo": np.float32(-0.5)}, {"lo": np.float32(-0.5), "hi": np.float32(0.2)}])
def test_clip_input_form(tmp_path, inits):
    names = ["x"] + (["lo"] if "lo" in inits else []) + (["hi"] if "hi" in inits else [])
    model = make_model([helper.make_node("Clip", names, ["y"])], {"x": (3, 9)}, {"y": None}, inits)
    run_host(model, tmp_path)


def test_clip_with_only_max(tmp_path):
    model = make_model([helper.make_node("Clip", ["x", "", "hi"], ["y"])], {"x": (3, 9)}, {"y": None},
                       {"hi": np.float32(0.25)})
    run_host(model, tmp_path)


@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("a_shape,b_shape", [((2, 3, 4, 5), (3, 1, 1)), ((1, 17), (3, 1)),
                                             ((5,), (2, 1, 5)), ((2, 3), (2, 3))])
def test_binary_broadcasting(tmp_path, op_type, a_shape, b_shape):
    feeds = {"a": rand(*a_shape), "b": rand(*b_shape, seed=1) + (3.0 if op_type == "Div" else 0.0)}
    run_host(single_op(op_type, {"a": a_shape, "b": b_shape}), tmp_path, feeds=feeds)


@pytest.mark.parametrize("op_type", ["Sum", "Max", "Min", "Mean"])
def test_variadic(tmp_path, op_type):
    run_host(single_op(op_type, {"a": (2, 3, 4), "b": (3, 1), "c": (4,)}), tmp_path)


@pytest.mark.parametrize("slope_shape", [(1,), (3, 1, 1), (3, 4, 5)])
def test_prelu(tmp_path, slope_shape):
    run_host(single_op("PRelu", {"x": (2, 3, 4, 5)}, {"s": rand(*slope_shape, seed=1)}), tmp_path)


POOLS = [
    ((1, 3, 9, 11), {"kernel_shape": [3, 3]}),
    ((2, 3, 9, 11), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ((1, 2, 8, 8), {"kernel_shape": [2, 2], "strides": [3, 3]}),
    ((1, 2, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 6, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ((1, 2, 1, 1), {"kernel_shape": [1, 1]}),
    ((1, 2, 9, 10), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 13), {"kernel_shape": [4], "strides": [3], "pads": [2, 1]}),
]


@pytest.mark.parametrize("x_shape,attrs", POOLS)
def test_max_pool(tmp_path, x_shape, attrs):
    run_host(single_op("MaxPool", {"x": x_shape}, opset=12, **attrs), tmp_path)


@pytest.mark.parametrize("x_shape,attrs", [
    ((2, 3, 7, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ((1, 2, 6, 9), {"kernel_shape": [2, 3], "storage_order": 1, "dilations": [2, 1]}),  # column-major indices
    ((2, 2, 11), {"kernel_shape": [4], "strides": [3], "pads": [2, 1]}),
])
def test_max_pool_indices_match_onnxruntime(tmp_path, x_shape, attrs):
    from onnx import TensorProto
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    feeds = {"x": rand(*x_shape)}
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run(feeds)
    want = reference(model, feeds)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1].dtype == np.int64
    np.testing.assert_array_equal(got[1], want[1])


def test_max_pool_dilated(tmp_path):
    run_host(single_op("MaxPool", {"x": (1, 2, 11, 11)}, opset=12, kernel_shape=[3, 3],
                       dilations=[2, 2], pads=[1, 1, 1, 1]), tmp_path)


@pytest.mark.parametrize("x_shape,attrs", POOLS)
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool(tmp_path, x_shape, attrs, count_include_pad):
    run_host(single_op("AveragePool", {"x": x_shape}, opset=12, count_include_pad=count_include_pad,
                       **attrs), tmp_path)


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 7, 5), (1, 4, 1, 1), (1, 3, 17), (1, 5, 13, 13), (1, 2, 8, 8)])
def test_global_pool(tmp_path, op_type, shape):
    run_host(single_op(op_type, {"x": shape}), tmp_path)


@pytest.mark.parametrize("op_type", ["AveragePool", "MaxPool"])
@pytest.mark.parametrize("shape", [(1, 6, 7, 7), (2, 3, 5, 9)])
def test_pool_whose_window_is_the_whole_input(tmp_path, op_type, shape):
    # Runs as a global pool (ResNet-50's 7x7 AveragePool).
    run_host(single_op(op_type, {"x": shape}, kernel_shape=list(shape[2:])), tmp_path)


@pytest.mark.parametrize("size", [1, 3, 5])
def test_lrn(tmp_path, size):
    run_host(single_op("LRN", {"x": (2, 7, 3, 4)}, size=size, alpha=1e-2, beta=0.75, bias=2.0), tmp_path)


def test_softmax_after_gemm_is_fused(tmp_path):
    nodes = [helper.make_node("Gemm", ["x", "w"], ["g"]), helper.make_node("Sigmoid", ["g"], ["y"])]
    lib = run_host(make_model(nodes, {"x": (2, 5)}, {"y": None}, {"w": rand(5, 3)}), tmp_path)
    assert lib.summary["fused_kernels"] == 1


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_concat(tmp_path, axis):
    shapes = {"a": [2, 3, 4], "b": [2, 3, 4], "c": [2, 3, 4]}
    for name, extra in zip(shapes, (1, 2, 3)):
        shapes[name][axis] = extra
    run_host(single_op("Concat", {k: tuple(v) for k, v in shapes.items()}, axis=axis), tmp_path)


@pytest.mark.parametrize("opset,split", [(11, [2, 3]), (13, [1, 4]), (13, None), (18, None)])
def test_split(tmp_path, opset, split):
    inits, names = {}, ["x"]
    attrs = {"axis": 1}
    if split is not None and opset >= 13:
        inits["s"] = np.array(split, np.int64)
        names.append("s")
    elif split is not None:
        attrs["split"] = split
    if opset >= 18 and split is None:
        attrs["num_outputs"] = 2
    outs = ["y0", "y1"] if split or opset >= 18 else ["y0", "y1", "y2", "y3", "y4"]
    node = helper.make_node("Split", names, outs, **attrs)
    model = make_model([node], {"x": (2, 5, 3)}, {o: None for o in outs}, inits, opset=opset)
    run_host(model, tmp_path)


@pytest.mark.parametrize("perm", [None, [0, 2, 1, 3], [3, 1, 0, 2]])
def test_transpose(tmp_path, perm):
    attrs = {} if perm is None else {"perm": perm}
    run_host(single_op("Transpose", {"x": (2, 3, 4, 5)}, **attrs), tmp_path)


def test_channel_shuffle_reshape_transpose_reshape(tmp_path):
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", ["t", "s2"], ["y"])]
    inits = {"s1": np.array([1, 3, 4, 5, 5], np.int64), "s2": np.array([1, 12, 5, 5], np.int64)}
    run_host(make_model(nodes, {"x": (1, 12, 5, 5)}, {"y": None}, inits), tmp_path)


@pytest.mark.parametrize("opset", [11, 13])
def test_squeeze_unsqueeze(tmp_path, opset):
    if opset < 13:
        nodes = [helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0, 3]),
                 helper.make_node("Squeeze", ["u"], ["s"], axes=[0]),
                 helper.make_node("Relu", ["s"], ["y"])]
        inits = {}
    else:
        nodes = [helper.make_node("Unsqueeze", ["x", "a"], ["u"]),
                 helper.make_node("Squeeze", ["u", "b"], ["s"]),
                 helper.make_node("Relu", ["s"], ["y"])]
        inits = {"a": np.array([0, 3], np.int64), "b": np.array([0], np.int64)}
    run_host(make_model(nodes, {"x": (2, 3, 4)}, {"y": None}, inits, opset=opset), tmp_path)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("pads", [[0, 1, 2, 0, 2, 1], [1, 0, 0, 0, 0, 2]])
def test_pad(tmp_path, mode, pads):
    inits = {"p": np.array(pads, np.int64), "v": np.float32(1.5)}
    names = ["x", "p", "v"] if mode == "constant" else ["x", "p"]
    if mode != "constant":
        inits.pop("v")
    model = make_model([helper.make_node("Pad", names, ["y"], mode=mode)], {"x": (2, 3, 4)},
                       {"y": None}, inits)
    run_host(model, tmp_path)


@pytest.mark.parametrize("mode,dtype", [("wrap", np.float32), ("wrap", np.int32), ("reflect", np.int64),
                                        ("constant", np.uint8), ("edge", np.bool_)])
def test_pad_of_every_mode_and_dtype_matches_the_onnx_reference(tmp_path, mode, dtype):
    # wrap repeats the input, here further than its own length on axis 1.
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator
    x = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    pads = [0, 4, 1, 1, 1, 2] if mode != "reflect" else [1, 2, 0, 0, 0, 3]
    inits = [numpy_helper.from_array(np.array(pads, np.int64), "p")]
    names = ["x", "p"]
    if mode == "constant":
        inits.append(numpy_helper.from_array(np.array(5, dtype), "v"))
        names.append("v")
    kind = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph([helper.make_node("Pad", names, ["y"], mode=mode)], "pad",
                              [helper.make_tensor_value_info("x", kind, x.shape)],
                              [helper.make_tensor_value_info("y", kind, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run({"x": x})[0]
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_pad_attribute_form_larger_than_input(tmp_path):
    model = single_op("Pad", {"x": (1, 2, 2, 2)}, opset=2, pads=[0, 0, 3, 4, 0, 0, 5, 1], value=-1.0)
    run_host(model, tmp_path)


def test_slice(tmp_path):
    inits = {"st": np.array([1, -1], np.int64), "en": np.array([3, -100], np.int64),
             "ax": np.array([0, 2], np.int64), "sp": np.array([1, -2], np.int64)}
    node = helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["y"])
    run_host(make_model([node], {"x": (4, 3, 7)}, {"y": None}, inits), tmp_path)


def test_shape_arithmetic_is_folded(tmp_path):
    """Flatten written the way exporters do it: Shape, Gather, Unsqueeze,
    Concat, Reshape; plus Range/ConstantOfShape/Cast feeding an Add."""
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Range", ["r0", "r1", "r2"], ["range"]),
        helper.make_node("Cast", ["range"], ["rangef"], to=1),
        helper.make_node("ConstantOfShape", ["cshape"], ["ones"],
                         value=helper.make_tensor("v", 1, [1], [0.5])),
        helper.make_node("Add", ["rangef", "ones"], ["bias"]),
        helper.make_node("Add", ["flat", "bias"], ["y"]),
    ]
    inits = {"zero": np.array(0, np.int64), "axes": i64(0), "minus1": i64(-1),
             "r0": np.array(0, np.int64), "r1": np.array(60, np.int64), "r2": np.array(1, np.int64),
             "cshape": i64(60)}
    lib = run_host(make_model(nodes, {"x": (2, 3, 4, 5)}, {"y": None}, inits), tmp_path)
    assert lib.metadata["ops"] == ["Add", "Reshape"]


def test_unknown_dims_fixed_by_input_shapes(tmp_path):
    model = conv_model(("N", 3, "H", "W"), (4, 3, 3, 3))
    feeds = {"x": rand(2, 3, 6, 7)}
    run_host(model, tmp_path, feeds=feeds, input_shapes={"x": (2, 3, 6, 7)})


@pytest.mark.parametrize("a_shape,b_shape", [((2, 3, 4), (2, 4, 5)), ((3, 1, 3, 4), (1, 2, 4, 2)),
                                             ((4,), (2, 4, 3)), ((1, 2, 4, 3), (3,)), ((3,), (3,))])
def test_batched_matmul(tmp_path, a_shape, b_shape):
    run_host(single_op("MatMul", {"a": a_shape, "b": b_shape}), tmp_path)


@pytest.mark.parametrize("x_shape,shape", [((3, 1), (2, 1, 6)), ((1, 4), (3, 1)), ((2, 3), (2, 3))])
def test_expand(tmp_path, x_shape, shape):
    run_host(single_op("Expand", {"x": x_shape}, {"s": np.array(shape, np.int64)}), tmp_path)


@pytest.mark.parametrize("axis,indices", [(0, [2, 0, -1]), (1, [[0, 3], [3, 1]]), (2, 1)])
def test_gather_with_constant_indices(tmp_path, axis, indices):
    model = single_op("Gather", {"x": (3, 4, 5)}, {"i": np.array(indices, np.int64)}, axis=axis)
    run_host(model, tmp_path)


def test_constant_graph_output_is_copied_out(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("ConstantOfShape", ["s"], ["c"], value=helper.make_tensor("v", 1, [1], [2.5]))]
    model = make_model(nodes, {"x": (2, 3)}, {"y": None, "c": None}, {"s": np.array([3, 2], np.int64)})
    run_host(model, tmp_path)


@pytest.mark.parametrize("attrs", [{}, {"pads": [1, 0, 2, 1, 1, 0], "strides": [2, 1, 2]},
                                   {"dilations": [2, 1, 1], "group": 2}])
def test_conv_3d(tmp_path, attrs):
    w_shape = (4, 2 if attrs.get("group") else 4, 3, 2, 3)
    run_host(conv_model((1, 4, 6, 5, 7), w_shape, **attrs), tmp_path)


@pytest.mark.parametrize("op_type", ["MaxPool", "AveragePool"])
def test_pool_3d(tmp_path, op_type):
    run_host(single_op(op_type, {"x": (1, 2, 5, 6, 7)}, opset=12, kernel_shape=[2, 3, 2],
                       strides=[2, 2, 3], pads=[1, 0, 1, 0, 1, 1]), tmp_path)


@pytest.mark.parametrize("m,k,n", [(1, 100, 9), (2, 75, 7), (3, 64, 4)])
def test_fully_connected_gemm_with_vector_dot_products_and_tails(tmp_path, m, k, n):
    # K past several vector widths plus a remainder; N not a multiple of the
    # four rows done at once; weights scaled like a trained layer's.
    weight = (rand(n, k, seed=1) / np.sqrt(k)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["a", "w", "c"], ["g"], transB=1),
             helper.make_node("Relu", ["g"], ["y"])]
    model = make_model(nodes, {"a": (m, k)}, {"y": None}, {"w": weight, "c": rand(n, seed=2)})
    run_host(model, tmp_path)


@pytest.mark.parametrize("op_type,conv_first", [("Add", True), ("Sum", False)])
def test_residual_add_after_conv_runs_in_the_conv_epilogue(tmp_path, op_type, conv_first):
    # y = relu(conv(relu(conv(x))) + x): the shortcut is the model input,
    # the second conv's Add and Relu fold into its epilogue.
    def weight(seed):
        return (rand(16, 16, 3, 3, seed=seed) / 12).astype(np.float32)
    add_inputs = ["c2", "x"] if conv_first else ["x", "c2"]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node(op_type, add_inputs, ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, {"x": (2, 16, 9, 13)}, {"y": None},
                       {"w1": weight(1), "b1": rand(16, seed=2), "w2": weight(3)})
    # Whether a 3x3 convolution goes through Winograd's transforms (which round
    # differently from a direct sum) depends on the host's vector width: compare
    # as a model, not to the last bits.
    lib = run_host(model, tmp_path, close=assert_zoo_close)
    assert lib.summary["kernels"] == 2


@pytest.mark.parametrize("op_type,lo,hi,max_abs,max_rel", [
    ("Exp", -87.0, 88.0, None, 2e-7), ("Sigmoid", -40.0, 40.0, 1e-7, 3e-7), ("Tanh", -12.0, 12.0, 1e-7, 5e-7)])
@pytest.mark.parametrize("fused", [True, False])
def test_exp_sigmoid_tanh_error_bounds_scalar_and_in_conv_vector_epilogue(
        tmp_path, op_type, lo, hi, max_abs, max_rel, fused):
    # The bounds stated in crosscompile/emit.py, over a dense sweep; fused
    # runs the op on vectors in the convolution's epilogue (identity 1x1 conv).
    x = np.linspace(lo, hi, 1 << 16).astype(np.float32).reshape(1, 16, 64, 64)
    if fused:
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node(op_type, ["c"], ["y"])]
        inits = {"w": np.eye(16, dtype=np.float32).reshape(16, 16, 1, 1)}
    else:
        nodes, inits = [helper.make_node(op_type, ["x"], ["y"])], {}
    model = make_model(nodes, {"x": x.shape}, {"y": None}, inits)
    lib = crosscompile.build(model)
    got = minirt.load(lib.export_library(tmp_path / "m.so")).run({"x": x})[0].astype(np.float64)
    exact = {"Exp": np.exp, "Sigmoid": lambda v: 1 / (1 + np.exp(-v)), "Tanh": np.tanh}[op_type](
        x.astype(np.float64))
    error = np.abs(got - exact)
    if max_abs is not None:
        assert error.max() < max_abs
    assert (error / np.abs(exact)).max() < max_rel


def test_op_classes_register_themselves_and_a_second_class_for_an_op_is_refused():
    from crosscompile.op_base import Op
    from crosscompile.ops import OPS
    # One from each module of ops: defining the class is all it takes.
    assert {"Gemm", "Relu", "Add", "Conv", "MaxPool", "GlobalAveragePool"} <= set(OPS)
    with pytest.raises(TypeError, match="two classes lower ONNX op Relu: crosscompile.elementwise and"):
        type("AnotherRelu", (Op,), {"op_type": "Relu"})
    assert type(OPS["Relu"]).__module__ == "crosscompile.elementwise"
