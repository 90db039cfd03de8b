"""MatMul and Gemm on the GEMM micro-kernel (crosscompile/matmul.py
lower_tiled): weights packed in column panels at compile time, runtime
right-hand sides read in place, batches that broadcast, a Linear layer's
bias, layer scale, activation and residual folded into the product; and
depthwise convolutions over a zero-padded copy of each channel
(conv.emit_depthwise_padded). Shapes leave partial tiles in rows and
columns for any vector width; results are compared with onnxruntime on 1,
2 and 3 threads."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from tests.onnx_models import make_model, rand, reference, sample_input


def run_threads(model, tmp_path, feeds=None):
    """Build for the host and compare with onnxruntime on 1, 2 and 3 threads."""
    feeds = feeds or sample_input(model)
    want = reference(model, feeds)
    lib = crosscompile.build(model, target="host")
    module = minirt.load(lib.export_library(tmp_path / "m.so"))
    for threads in (1, 2, 3):
        module.set_threads(threads)
        for got, expected in zip(module.run(feeds), want):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    module.close()
    return lib


def steps(lib) -> list:
    return [(step["op"], step["fused"]) for step in lib.metadata["steps"]]


@pytest.mark.parametrize("a_shape,k,n", [
    ((1, 17, 64), 64, 192),    # a ViT block's QKV projection
    ((5, 3), 3, 7),            # fewer rows and columns than one tile
    ((2, 3, 13, 40), 40, 33),  # rows of every batch in one product
    ((40,), 40, 9),            # one row
])
def test_matmul_by_constant_weights_matches_onnxruntime(tmp_path, a_shape, k, n):
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": a_shape}, {"y": None},
                       {"w": rand(k, n, seed=2)})
    run_threads(model, tmp_path)


@pytest.mark.parametrize("a_shape,b_shape", [
    ((2, 4, 17, 16), (2, 4, 16, 17)),  # attention scores per head
    ((1, 5, 8), (3, 8, 6)),            # A broadcast over B's batch
    ((3, 5, 8), (1, 8, 6)),            # B broadcast over A's batch
    ((3, 5, 8), (8, 6)),               # a runtime matrix for every row
])
def test_matmul_of_two_runtime_tensors_matches_onnxruntime(tmp_path, a_shape, b_shape):
    model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": a_shape, "b": b_shape}, {"y": None})
    run_threads(model, tmp_path)


def test_linear_bias_gelu_layer_scale_and_residual_run_in_the_product(tmp_path):
    """x + s * (gelu(x @ W1 + b1) @ W2 + b2), as ViT and ConvNeXt blocks
    write it, is two kernels: the bias, Gelu, layer scale and residual
    Add run in the products' registers."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Gelu", ["hb"], ["g"]),
             helper.make_node("MatMul", ["g", "w2"], ["o"]), helper.make_node("Add", ["b2", "o"], ["ob"]),
             helper.make_node("Mul", ["ob", "s"], ["os"]), helper.make_node("Add", ["x", "os"], ["y"])]
    inits = {"w1": rand(24, 52, seed=1), "b1": rand(52, seed=2), "w2": rand(52, 24, seed=3),
             "b2": rand(1, 24, seed=4), "s": rand(24, seed=5)}
    model = make_model(nodes, {"x": (1, 11, 24)}, {"y": None}, inits, opset=20)
    lib = run_threads(model, tmp_path)
    assert steps(lib) == [("MatMul", ["Add", "Gelu"]), ("MatMul", ["Add", "Mul", "Add"])]


@pytest.mark.parametrize("attrs,a_shape,b_shape,c_shape", [
    ({}, (6, 10), (10, 13), (13,)),
    ({"transB": 1, "alpha": 0.5, "beta": 2.0}, (7, 10), (13, 10), (1, 13)),
    ({"transA": 1}, (10, 7), (10, 13), ()),
    ({"transA": 1, "transB": 1}, (10, 3), (5, 10), None),
    ({"transB": 1}, (1, 30), (11, 30), (11,)),  # one row: the matrix-vector kernel
])
def test_gemm_with_constant_weights_matches_onnxruntime(tmp_path, attrs, a_shape, b_shape, c_shape):
    inits = {"b": rand(*b_shape, seed=2)}
    names = ["a", "b"]
    if c_shape is not None:
        inits["c"] = rand(*c_shape, seed=3) if c_shape else np.float32(0.25)
        names.append("c")
    nodes = [helper.make_node("Gemm", names, ["g"], **attrs), helper.make_node("Relu", ["g"], ["y"])]
    lib = run_threads(make_model(nodes, {"a": a_shape}, {"y": None}, inits), tmp_path)
    assert lib.summary["kernels"] == 1


@pytest.mark.parametrize("x_shape,kernel,attrs", [
    ((1, 9, 14, 14), 7, {"pads": [3, 3, 3, 3]}),                    # a ConvNeXt block's
    ((2, 5, 7, 7), 3, {"pads": [1, 1, 1, 1]}),                      # a late MobileNet layer's
    ((1, 4, 15, 13), 5, {"pads": [2, 1, 2, 3], "strides": [2, 2]}),
    ((1, 3, 11, 10), 3, {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    # Stride 2 (on x86 the copy's rows split into even and odd columns):
    # rows of whole vectors of each phase and a remainder, odd and even
    # widths, uneven padding, 5 x 5 and dilated taps.
    ((1, 6, 9, 70), 3, {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((1, 4, 8, 67), 3, {"pads": [0, 1, 1, 2], "strides": [2, 2]}),
    ((2, 3, 12, 41), 5, {"pads": [2, 2, 2, 2], "strides": [2, 2]}),
    ((1, 5, 10, 37), 3, {"pads": [2, 2, 2, 2], "strides": [2, 2], "dilations": [2, 2]}),
])
def test_depthwise_convolution_over_padded_planes_matches_onnxruntime(tmp_path, x_shape, kernel, attrs):
    c = x_shape[1]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=c, **attrs),
             helper.make_node("Relu", ["c"], ["y"])]
    inits = {"w": rand(c, 1, kernel, kernel, seed=1), "b": rand(c, seed=2)}
    model = make_model(nodes, {"x": x_shape}, {"y": None}, inits)
    assert run_threads(model, tmp_path).summary["kernels"] == 1
