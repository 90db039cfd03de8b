"""Quantized ONNX models (QDQ, QOperator, dynamic) compile for the host and
give onnxruntime's int8 outputs; unsupported quantized forms are refused
naming the node and the reason.

The models are made in the test: an fp32 network built with onnx.helper,
quantized by onnxruntime's own quantizer (tests/quantized_models.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import crosscompile
import minirt
from tests.onnx_models import make_model
from tests.quantized_models import (DEFAULT_FORMS, FORMS, calibration, dense_net, input_shape, output_step,
                                    quantized_model)

ort = pytest.importorskip("onnxruntime")


def assert_within_one_step(ours: np.ndarray, theirs: np.ndarray, step: float, what: str) -> None:
    """At least 99.9 % of the elements within one quantization step (and
    every element within two)."""
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    close = np.mean(diff <= step * 1.001)
    assert close >= 0.999 and diff.max() <= 2.001 * step, (
        f"{what}: {close:.4%} of elements within one step {step:g}; largest difference {diff.max():g}")


@pytest.mark.parametrize("form", [
    pytest.param(form, marks=[] if form in DEFAULT_FORMS else [pytest.mark.quantized_forms]) for form in FORMS])
def test_quantized_model_matches_onnxruntime_on_host(form, tmp_path):
    model = quantized_model(form)
    module = minirt.load(crosscompile.build(model).export_library(tmp_path / "net.so"))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # The dynamic form's output is float: its step is that of the int32
    # products' scale, a small fraction of the output range.
    for feeds in calibration(3, seed=11, shape=input_shape(form)):
        theirs = session.run(None, feeds)[0]
        step = output_step(model) or 1e-3 * float(np.abs(theirs).max())
        assert_within_one_step(module.run(feeds)[0], theirs, step, form)


@pytest.mark.parametrize("form, target, kernels", [
    ("qdq_per_channel_s8", "rasp5", {"dot", "depthwise"}),
    ("qdq_per_channel_s8", "rasp4b64", {"quads", "depthwise"}),
    ("qdq_per_channel_s8", "rasp4b", {"widening", "depthwise"}),
    ("qoperator_u8", "rasp5", {"widening", "depthwise"}),  # uint8 weights less their zero point do not fit int8
])
def test_quantized_convolutions_and_products_become_integer_kernels(form, target, kernels):
    """The pass writes its decisions into the graph: no float Conv, MatMul or
    Gemm is left of the quantized ones, and each integer node names the
    kernel the target's capabilities chose (the depthwise kernel for the
    depthwise convolution on every target)."""
    from crosscompile.compiler import lowered_graph
    from crosscompile.schedule import tile_table
    from crosscompile.target import resolve_target

    target = resolve_target(target)
    _, _, graph = lowered_graph(quantized_model(form), target, None, tile_table(target, None))
    kinds = [node.op_type for node in graph.nodes]
    assert kinds.count("IntegerConv") == 4 and kinds.count("IntegerMatMul") == 2, kinds
    assert not {"Conv", "MatMul", "Gemm"} & set(kinds), kinds
    integer = [n for n in graph.nodes if n.op_type in ("IntegerConv", "IntegerMatMul")]
    assert {n.attrs["int8_kernel"] for n in integer} == kernels
    assert all(n.attrs["int8_kernel"] == "depthwise" for n in integer if n.attrs.get("group", 1) > 1)


@pytest.mark.parametrize("form", ["qdq_per_tensor_u8", "qoperator_u8", "wide_qdq_per_channel_u8s8"])
def test_quantized_model_computes_in_8_bits_from_its_first_quantize_to_its_last_dequantize(form):
    """Pools, Concat, Add, Mul and the activations between quantized
    convolutions run on the 8-bit values: the lowered graph quantizes its
    input once and dequantizes its output once, and every tensor in
    between is 8-bit."""
    from crosscompile.compiler import lowered_graph
    from crosscompile.schedule import tile_table
    from crosscompile.target import resolve_target

    target = resolve_target("rasp5")
    _, _, graph = lowered_graph(quantized_model(form), target, None, tile_table(target, None))
    kinds = [node.op_type for node in graph.nodes]
    assert kinds[0] == "QuantizeLinear" and kinds[-1] == "DequantizeLinear", kinds
    assert kinds.count("QuantizeLinear") == 1 and kinds.count("DequantizeLinear") == 1, kinds
    wide = {graph.tensors[out].dtype for node in graph.nodes[:-1] for out in node.outputs}
    assert wide <= {"uint8", "int8"}, (wide, kinds)


def test_batchnorm_and_sum_between_quantized_convolutions_run_in_8_bits(tmp_path):
    """A BatchNormalization the quantizer keeps apart from its convolution
    (a QuantizeLinear between them) becomes one table a channel, a Sum of
    two the 8-bit Add, Relus folded into both; the module gives
    onnxruntime's int8 outputs."""
    from crosscompile.compiler import lowered_graph
    from crosscompile.schedule import tile_table
    from crosscompile.target import resolve_target

    form = "bn_qdq_per_channel_u8s8"
    model = quantized_model(form)
    assert {"BatchNormalization", "Sum"} <= {n.op_type for n in model.graph.node}
    target = resolve_target("host")
    _, _, graph = lowered_graph(model, target, None, tile_table(target, None))
    kinds = [node.op_type for node in graph.nodes]
    assert not {"BatchNormalization", "Sum", "Relu"} & set(kinds), kinds
    assert kinds.count("QuantizeLinear") == 1 and kinds.count("DequantizeLinear") == 1, kinds
    tables = [graph.constants[n.inputs[1]].shape for n in graph.nodes if n.op_type == "IntegerTable"]
    assert tables.count((16, 256)) == 3 and kinds.count("IntegerBinary") == 1, (tables, kinds)
    module = minirt.load(crosscompile.build(model).export_library(tmp_path / "bn.so"))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feeds in calibration(3, seed=11, shape=input_shape(form)):
        assert_within_one_step(module.run(feeds)[0], session.run(None, feeds)[0], output_step(model), form)


def _dequantized_matmul(dtype: int, values) -> onnx.ModelProto:
    weight = helper.make_tensor("w_q", dtype, [4, 2], values)
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], name="weight_dq"),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    model = make_model(nodes, {"x": (1, 4)}, {"y": None}, {"w_scale": np.float32(0.5)}, opset=21)
    model.graph.initializer.append(weight)
    return model


@pytest.mark.parametrize("dtype", [TensorProto.INT16, TensorProto.UINT16], ids=["int16", "uint16"])
def test_sixteen_bit_weights_dequantized_into_a_matmul(dtype, tmp_path):
    # (int4, int2, float8 and float4 ones: tests/test_lowbit.py)
    model = _dequantized_matmul(dtype, [1, 2, 3, 0, 1, 1, 300, 65000 if dtype == TensorProto.UINT16 else -32000])
    x = np.array([[0.5, -1.0, 2.0, 0.25]], np.float32)
    _assert_matches_reference(model, {"x": x}, tmp_path / "sixteen.so")


def _assert_matches_reference(model, feeds, path):
    from onnx.reference import ReferenceEvaluator
    got = minirt.load(str(crosscompile.build(model).export_library(path))).run(feeds)
    for g, w in zip(got, ReferenceEvaluator(model).run(None, feeds)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_blocked_quantization_matches_the_reference(tmp_path):
    """A scale (and zero point) per block of 2 along an axis of 5: the last
    block is short. QuantizeLinear and DequantizeLinear of a runtime
    tensor, and a constant weight dequantized into a MatMul."""
    rng = np.random.default_rng(4)
    scale = rng.uniform(0.05, 0.5, (3, 3)).astype(np.float32)
    zero = rng.integers(-20, 20, (3, 3)).astype(np.int8)
    w_scale = rng.uniform(0.01, 0.1, (2, 3)).astype(np.float32)
    nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"], axis=1, block_size=2),
             helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"], axis=1, block_size=2),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], axis=0, block_size=3),
             helper.make_node("MatMul", ["y", "w"], ["z"])]
    inits = {"scale": scale, "zero": zero, "w_scale": w_scale,
             "w_q": rng.integers(-128, 128, (5, 3)).astype(np.int8)}
    model = make_model(nodes, {"x": (3, 5)}, {"q": (3, 5), "y": (3, 5), "z": (3, 3)}, inits, opset=21)
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.INT8
    x = (rng.standard_normal((3, 5)) * 4).astype(np.float32)
    _assert_matches_reference(model, {"x": x}, tmp_path / "blocked.so")


def test_quantize_rounds_half_to_even_and_saturates(tmp_path):
    """QuantizeLinear -> DequantizeLinear on values at .5 ties and beyond
    the range, as the ONNX specification (and onnxruntime) give them."""
    x = np.array([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 300.0, -300.0, 127.5, -128.5, 3.49, -3.51]], np.float32)
    for dtype, zero in ((np.int8, 0), (np.uint8, 128)):
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                 helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
        model = make_model(nodes, {"x": x.shape}, {"y": x.shape}, {"s": np.float32(1.0), "z": dtype(zero)})
        module = minirt.load(crosscompile.build(model).export_library(tmp_path / f"q_{zero}.so"))
        theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(module.run({"x": x})[0], theirs)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tether(*args, cwd):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "remote.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_tether_quantize_writes_a_model_that_compiles_and_reports_its_accuracy(tmp_path):
    """`tether quantize` on calibration samples in a folder: a QDQ model
    whose compiled module gives the model's int8 outputs, and the accuracy
    against fp32 on its output. The reference is onnxruntime without its
    graph optimizations (the QDQ arithmetic as ONNX defines it): with full
    8-bit weights, its fused kernels on x86 without VNNI saturate 16-bit
    sums (see tests/quantized_models.py)."""
    onnx.save(dense_net(), tmp_path / "fp32.onnx")
    samples = tmp_path / "samples"
    samples.mkdir()
    for index, feeds in enumerate(calibration(4)):
        np.save(samples / f"{index}.npy", feeds["x"][0])  # without the batch dimension
    done = _tether("quantize", "fp32.onnx", "--calibrate", "samples", "-o", "int8.onnx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "int8 against fp32 on 4 samples: cosine 0.9" in done.stdout, done.stdout
    model = onnx.load(tmp_path / "int8.onnx")
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in model.graph.node}
    module = minirt.load(crosscompile.build(model).export_library(tmp_path / "int8.so"))
    feeds = calibration(1, seed=5)[0]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert_within_one_step(module.run(feeds)[0], session.run(None, feeds)[0], output_step(model), "tether quantize")


def test_tether_quantize_refuses_an_empty_calibration_folder(tmp_path):
    onnx.save(dense_net(), tmp_path / "fp32.onnx")
    (tmp_path / "empty").mkdir()
    done = _tether("quantize", "fp32.onnx", "--calibrate", "empty", "-o", "int8.onnx", cwd=tmp_path)
    assert done.returncode == 1
    assert "calibration folder 'empty' holds no .npy or .npz samples" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "int8.onnx").exists()
