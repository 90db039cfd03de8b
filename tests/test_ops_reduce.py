"""The Reduce family and the element-wise math transformers need (Pow,
Sqrt, Reciprocal, Log, Erf, Gelu) against onnxruntime: axes as attribute
and as input by opset, keepdims, noop_with_empty_axes, contiguous and
strided reductions, rows longer and shorter than the target's vectors,
and the exponent forms of Pow."""
import math

import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from tests.onnx_models import make_model, rand, run_host, single_op

REDUCE_OPS = ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]
# Opset from which each op takes its axes as an input.
AXES_INPUT_FROM = {op: 13 if op == "ReduceSum" else 18 for op in REDUCE_OPS}


def reduce_model(op, shape, axes, keepdims=1, opset=13, **attrs):
    """A one-node Reduce model, axes as an attribute or an input as the opset has them."""
    inits = {}
    if axes is not None and opset >= AXES_INPUT_FROM[op]:
        inits["axes"] = np.array(axes, np.int64)
    elif axes is not None:
        attrs["axes"] = axes
    return single_op(op, {"x": shape}, inits, opset=opset, keepdims=keepdims, **attrs)


def feeds_for(op, shape):
    x = rand(*shape)
    if op == "ReduceLogSum":
        x = np.abs(x) + 0.1  # log of a positive sum
    if op == "ReduceProd":
        x = 1.0 + 0.1 * x  # products of O(1) factors stay O(1)
    return {"x": x}


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("shape,axes,keepdims", [
    ((2, 5, 7, 19), [2, 3], 1),     # spatial mean (ResNet-style head): one contiguous run
    ((2, 5, 7, 19), [-1], 1),       # the last axis (LayerNorm)
    ((2, 5, 7, 19), [1], 0),        # a middle axis: strided
    ((2, 5, 7, 19), [0, 2], 0),     # two runs apart
    ((3, 70), [1], 0),              # a row of several vectors and a tail
    ((4, 3), None, 1),              # no axes: everything
])
def test_reduce_axes_and_keepdims(tmp_path, op, shape, axes, keepdims):
    run_host(reduce_model(op, shape, axes, keepdims), tmp_path, feeds=feeds_for(op, shape))


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceL2", "ReduceLogSumExp"])
def test_reduce_axes_as_input_at_opset_18(tmp_path, op):
    shape = (2, 6, 33)
    run_host(reduce_model(op, shape, [0, -1], keepdims=0, opset=18), tmp_path, feeds=feeds_for(op, shape))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceMean"])
def test_reduce_noop_with_empty_axes_reduces_nothing(tmp_path, op):
    model = reduce_model(op, (3, 4, 5), None, opset=18, noop_with_empty_axes=1)
    run_host(model, tmp_path, feeds=feeds_for(op, (3, 4, 5)))


def test_reduce_log_sum_exp_of_large_values_does_not_overflow(tmp_path):
    x = (rand(4, 40) * 30 + 200).astype(np.float32)
    run_host(reduce_model("ReduceLogSumExp", x.shape, [1]), tmp_path, feeds={"x": x})


def test_reduce_mean_then_relu_is_one_kernel(tmp_path):
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=0),
             helper.make_node("Relu", ["m"], ["y"])]
    lib = run_host(make_model(nodes, {"x": (2, 8, 7, 7)}, {"y": None}), tmp_path)
    assert lib.summary["kernels"] == 1 and lib.summary["fused_kernels"] == 1


def test_reduce_repeated_axis_is_refused_naming_the_node():
    model = reduce_model("ReduceMean", (2, 3), [1, -1])
    with pytest.raises(crosscompile.BuildError, match="node 'the_reducemean' \\(ReduceMean\\).*twice"):
        crosscompile.build(model)


def test_reduce_axes_attribute_at_opset_18_is_refused_with_the_fix():
    model = single_op("ReduceMean", {"x": (2, 3)}, opset=18, axes=[1])
    with pytest.raises(crosscompile.BuildError, match="the_reducemean.*input 1"):
        crosscompile.build(model)


@pytest.mark.parametrize("op_type,attrs,opset", [
    ("Sqrt", {}, 13), ("Reciprocal", {}, 13), ("Log", {}, 13), ("Erf", {}, 13),
    ("Gelu", {}, 20), ("Gelu", {"approximate": "tanh"}, 20),
])
def test_unary_math(tmp_path, op_type, attrs, opset):
    x = 3 * rand(3, 37)
    if op_type in ("Sqrt", "Log", "Reciprocal"):
        x = np.abs(x) + 0.05
    run_host(single_op(op_type, {"x": x.shape}, opset=opset, **attrs), tmp_path, feeds={"x": x})


def test_log_of_zero_and_negative_values_is_what_numpy_gives(tmp_path):
    x = np.array([[0.0, -1.0, 1.0, 2.5e-3, 1e30]], np.float32)
    module = minirt.load(crosscompile.build(single_op("Log", {"x": x.shape})).export_library(tmp_path / "m.so"))
    got = module.run({"x": x})[0]
    assert got[0, 0] == -np.inf and np.isnan(got[0, 1])
    np.testing.assert_allclose(got[0, 2:], np.log(x[0, 2:]), rtol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_erf_error_bound_scalar_and_in_conv_vector_epilogue(tmp_path, fused):
    # The bound stated in crosscompile/emit.py, over a dense sweep.
    x = np.linspace(-6.0, 6.0, 1 << 16).astype(np.float32).reshape(1, 16, 64, 64)
    if fused:
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Erf", ["c"], ["y"])]
        inits = {"w": np.eye(16, dtype=np.float32).reshape(16, 16, 1, 1)}
    else:
        nodes, inits = [helper.make_node("Erf", ["x"], ["y"])], {}
    lib = crosscompile.build(make_model(nodes, {"x": x.shape}, {"y": None}, inits))
    got = minirt.load(lib.export_library(tmp_path / "m.so")).run({"x": x})[0].astype(np.float64)
    exact = np.vectorize(math.erf)(x.astype(np.float64))
    assert np.abs(got - exact).max() < 2e-7


@pytest.mark.parametrize("exponent", [2.0, 3.0, -1.0, 0.5, 1.7, 0.0])
def test_pow_by_a_constant_runs_as_a_unary_op(tmp_path, exponent):
    x = np.abs(rand(3, 37)) + 0.1
    model = single_op("Pow", {"x": x.shape}, {"e": np.array(exponent, np.float32)})
    lib = run_host(model, tmp_path, feeds={"x": x})
    assert lib.summary["kernels"] == 1


def test_pow_by_a_constant_fuses_into_its_producer(tmp_path):
    nodes = [helper.make_node("Sub", ["a", "b"], ["d"]), helper.make_node("Pow", ["d", "two"], ["y"])]
    model = make_model(nodes, {"a": (2, 9), "b": (9,)}, {"y": None}, {"two": np.array(2.0, np.float32)})
    lib = run_host(model, tmp_path)
    assert lib.summary["kernels"] == 1 and lib.summary["fused_kernels"] == 1


@pytest.mark.parametrize("x_shape,p_shape", [((3, 8), (3, 8)), ((2, 3, 5), (5,)), ((4, 1), (1, 6))])
def test_pow_of_two_runtime_tensors_broadcasts(tmp_path, x_shape, p_shape):
    x = rand(*x_shape) * 2
    p = np.round(rand(*p_shape, seed=1) * 2)  # integer powers of negative bases have a sign
    p[..., :1] = 0.5                          # and fractional ones of negative bases are NaN
    model = single_op("Pow", {"x": x_shape, "p": p_shape})
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run({"x": x, "p": p})[0]
    with np.errstate(invalid="ignore"):
        want = np.power(x, p)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, equal_nan=True)


def test_pow_by_a_constant_tensor_reads_it_as_a_second_operand(tmp_path):
    x = np.abs(rand(2, 3)) + 0.1
    model = single_op("Pow", {"x": (2, 3)}, {"e": np.array([2.0, 3.0, 0.5], np.float32)})
    run_host(model, tmp_path, feeds={"x": x})
