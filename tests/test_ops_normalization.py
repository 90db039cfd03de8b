"""LayerNormalization, InstanceNormalization, GroupNormalization and
LogSoftmax against onnxruntime, and the decomposed LayerNorm and GELU
that exporters write for older opsets recognised as one kernel each, as
is SiLU written as x * sigmoid(x)."""
import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import crosscompile
import minirt
from tests.onnx_models import make_model, rand, run_host, single_op


@pytest.mark.parametrize("shape,axis,scale_shape,bias", [
    ((2, 5, 48), -1, (48,), True),        # a token row of a transformer
    ((3, 37), 1, (37,), False),           # no bias, a row that is not a multiple of the vector width
    ((2, 3, 4, 5), 2, (4, 5), True),      # two normalized axes
    ((2, 3, 4, 5), 2, (1, 5), True),      # a scale broadcast along one of them
    ((4, 6), 0, (4, 6), True),            # everything
])
def test_layer_normalization(tmp_path, shape, axis, scale_shape, bias):
    inits = {"s": rand(*scale_shape, seed=2)}
    if bias:
        inits["b"] = rand(*scale_shape, seed=3)
    model = single_op("LayerNormalization", {"x": shape}, inits, opset=17, axis=axis, epsilon=1e-3)
    run_host(model, tmp_path, feeds={"x": rand(*shape) * 3 + 1})


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 4, 40), (2, 2, 3, 1, 9)])
def test_instance_normalization(tmp_path, shape):
    c = shape[1]
    model = single_op("InstanceNormalization", {"x": shape}, {"s": rand(c, seed=2), "b": rand(c, seed=3)},
                      epsilon=1e-4)
    run_host(model, tmp_path)


@pytest.mark.parametrize("opset,per", [(18, "group"), (21, "channel")])
@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 7), 3), ((1, 8, 33), 8), ((2, 4, 3, 3), 1)])
def test_group_normalization(tmp_path, opset, per, shape, groups):
    size = groups if per == "group" else shape[1]
    model = single_op("GroupNormalization", {"x": shape}, {"s": rand(size, seed=2), "b": rand(size, seed=3)},
                      opset=opset, num_groups=groups, epsilon=1e-4)
    if opset == 18:
        # onnxruntime has no opset-18 kernel; the ONNX reference implements the spec.
        x = rand(*shape)
        got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run({"x": x})[0]
        np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
    else:
        run_host(model, tmp_path)


def test_group_normalization_groups_must_divide_the_channels():
    model = single_op("GroupNormalization", {"x": (1, 6, 4)}, {"s": rand(6), "b": rand(6)},
                      opset=21, num_groups=4)
    with pytest.raises(crosscompile.BuildError, match="the_groupnormalization.*num_groups=4 does not divide"):
        crosscompile.build(model)


@pytest.mark.parametrize("shape,axis,opset", [
    ((3, 37), -1, 13), ((2, 40, 3), 1, 13), ((2, 3, 4), 1, 11), ((5,), 0, 13)])
def test_log_softmax(tmp_path, shape, axis, opset):
    model = single_op("LogSoftmax", {"x": shape}, opset=opset, axis=axis)
    run_host(model, tmp_path, feeds={"x": rand(*shape) * 20})


def decomposed_layer_norm(x, prefix, axes=(-1,), square="Pow", affine=True):
    """The nodes torch exports for nn.LayerNorm at opset <= 16."""
    p = prefix
    nodes = [helper.make_node("ReduceMean", [x], [f"{p}mean"], axes=list(axes)),
             helper.make_node("Sub", [x, f"{p}mean"], [f"{p}d"])]
    if square == "Pow":
        nodes.append(helper.make_node("Pow", [f"{p}d", "two"], [f"{p}sq"]))
    else:
        nodes.append(helper.make_node("Mul", [f"{p}d", f"{p}d"], [f"{p}sq"]))
    nodes += [helper.make_node("ReduceMean", [f"{p}sq"], [f"{p}var"], axes=list(axes)),
              helper.make_node("Add", [f"{p}var", "eps"], [f"{p}ve"]),
              helper.make_node("Sqrt", [f"{p}ve"], [f"{p}std"]),
              helper.make_node("Div", [f"{p}d", f"{p}std"], [f"{p}n" if affine else f"{p}out"])]
    if affine:
        nodes += [helper.make_node("Mul", [f"{p}n", f"{p}gamma"], [f"{p}s"]),
                  helper.make_node("Add", [f"{p}s", f"{p}beta"], [f"{p}out"])]
    return nodes


def decomposed_gelu(x, prefix, half_first=False):
    """The nodes torch exports for nn.GELU() before opset 20."""
    p = prefix
    nodes = [helper.make_node("Div", [x, "sqrt2"], [f"{p}q"]),
             helper.make_node("Erf", [f"{p}q"], [f"{p}e"]),
             helper.make_node("Add", [f"{p}e", "one"], [f"{p}a"])]
    if half_first:
        return nodes + [helper.make_node("Mul", [x, "half"], [f"{p}xh"]),
                        helper.make_node("Mul", [f"{p}xh", f"{p}a"], [f"{p}out"])]
    return nodes + [helper.make_node("Mul", [x, f"{p}a"], [f"{p}m"]),
                    helper.make_node("Mul", [f"{p}m", "half"], [f"{p}out"])]


PATTERN_CONSTANTS = {"two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32),
                     "sqrt2": np.array(np.sqrt(2.0), np.float32), "one": np.array(1.0, np.float32),
                     "half": np.array(0.5, np.float32)}


@pytest.mark.parametrize("square,affine,axes", [("Pow", True, (-1,)), ("Mul", True, (-1,)),
                                                 ("Pow", False, (-1,)), ("Pow", True, (1, 2))])
def test_decomposed_layer_norm_is_one_kernel(tmp_path, square, affine, axes):
    shape = (2, 7, 24)
    normalized = shape[min(a % 3 for a in axes):]
    nodes = decomposed_layer_norm("x", "", axes, square, affine) + [helper.make_node("Relu", ["out"], ["y"])]
    inits = dict(PATTERN_CONSTANTS, gamma=rand(*normalized, seed=2), beta=rand(*normalized, seed=3))
    if not affine:
        del inits["gamma"], inits["beta"]
    model = make_model(nodes, {"x": shape}, {"y": None}, inits, opset=13)
    lib = run_host(model, tmp_path, feeds={"x": rand(*shape) * 2 + 0.5})
    assert lib.summary["kernels"] == 1
    assert lib.metadata["steps"][0]["op"] == "LayerNormalization"


def test_decomposed_layer_norm_whose_centred_values_are_also_read_elsewhere_stays_apart(tmp_path):
    nodes = decomposed_layer_norm("x", "") + [helper.make_node("Add", ["out", "d"], ["y"])]
    model = make_model(nodes, {"x": (3, 16)}, {"y": None},
                       dict(PATTERN_CONSTANTS, gamma=rand(16, seed=2), beta=rand(16, seed=3)))
    lib = run_host(model, tmp_path)
    assert "LayerNormalization" not in {step["op"] for step in lib.metadata["steps"]}


@pytest.mark.parametrize("half_first", [False, True])
def test_decomposed_gelu_is_one_op_fused_into_the_matmul_with_its_bias(tmp_path, half_first):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "bias"], ["h"])]
    nodes += decomposed_gelu("h", "", half_first)
    model = make_model(nodes, {"x": (5, 12)}, {"out": None},
                       dict(PATTERN_CONSTANTS, w=rand(12, 20, seed=2) / 3, bias=rand(20, seed=3)))
    lib = run_host(model, tmp_path)
    (step,) = lib.metadata["steps"]
    assert step["op"] == "MatMul" and "Add" in step["fused"] and "Erf" in step["fused"]


def test_layer_normalization_mean_and_inverse_std_outputs(tmp_path):
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv_std"], axis=1)
    model = make_model([node], {"x": (3, 4, 5)}, {"y": None, "mean": None, "inv_std": None},
                       {"s": rand(4, 5, seed=2), "b": rand(4, 5, seed=3)}, opset=17)
    run_host(model, tmp_path)


def decomposed_tanh_gelu(x, prefix, cube="Mul", half_first=False):
    """The nodes torch exports for nn.GELU(approximate="tanh") before opset
    20 (cube="Mul"), or GPT-2's new GELU with torch.pow (cube="Pow")."""
    p = prefix
    if cube == "Pow":
        nodes = [helper.make_node("Pow", [x, "three"], [f"{p}cube"])]
    else:
        nodes = [helper.make_node("Mul", [x, x], [f"{p}sq"]), helper.make_node("Mul", [x, f"{p}sq"], [f"{p}cube"])]
    nodes += [helper.make_node("Mul", ["kappa", f"{p}cube"], [f"{p}kc"]),
              helper.make_node("Add", [x, f"{p}kc"], [f"{p}inner"]),
              helper.make_node("Mul", ["beta", f"{p}inner"], [f"{p}t"]),
              helper.make_node("Tanh", [f"{p}t"], [f"{p}e"]),
              helper.make_node("Add", ["one", f"{p}e"], [f"{p}a"])]
    if half_first:
        return nodes + [helper.make_node("Mul", ["half", x], [f"{p}xh"]),
                        helper.make_node("Mul", [f"{p}xh", f"{p}a"], [f"{p}out"])]
    return nodes + [helper.make_node("Mul", [x, f"{p}a"], [f"{p}m"]),
                    helper.make_node("Mul", ["half", f"{p}m"], [f"{p}out"])]


TANH_CONSTANTS = dict(PATTERN_CONSTANTS, three=np.array(3.0, np.float32),
                      kappa=np.array(0.044715, np.float32), beta=np.array(np.sqrt(2 / np.pi), np.float32))


@pytest.mark.parametrize("cube,half_first", [("Mul", False), ("Pow", True), ("Pow", False)])
def test_decomposed_tanh_gelu_is_one_op_fused_into_the_matmul_with_its_bias(tmp_path, cube, half_first):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "bias"], ["h"])]
    nodes += decomposed_tanh_gelu("h", "", cube, half_first)
    model = make_model(nodes, {"x": (5, 12)}, {"out": None},
                       dict(TANH_CONSTANTS, w=rand(12, 20, seed=2) / 3, bias=rand(20, seed=3)))
    lib = run_host(model, tmp_path)
    (step,) = lib.metadata["steps"]
    assert step["op"] == "MatMul" and "Add" in step["fused"] and "Tanh" in step["fused"]


def test_tanh_gelu_with_another_constant_is_left_as_written(tmp_path):
    nodes = decomposed_tanh_gelu("x", "")
    inits = dict(TANH_CONSTANTS, kappa=np.array(0.05, np.float32))
    lib = run_host(make_model(nodes, {"x": (3, 8)}, {"out": None}, inits), tmp_path)
    ops = [step["op"] for step in lib.metadata["steps"]]
    assert "Gelu" not in ops and len(ops) > 1, ops


@pytest.mark.parametrize("sigmoid_first", [False, True])
def test_silu_after_a_convolution_is_one_swish_pass(tmp_path, sigmoid_first):
    product = ["s", "h"] if sigmoid_first else ["h", "s"]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Mul", product, ["out"])]
    model = make_model(nodes, {"x": (1, 8, 9, 9)}, {"out": None},
                       {"w": rand(16, 8, 3, 3, seed=2) / 4, "b": rand(16, seed=3)})
    lib = run_host(model, tmp_path, feeds={"x": rand(1, 8, 9, 9) * 3})
    assert [step["op"] for step in lib.metadata["steps"]] == ["Conv", "Swish"], lib.metadata["steps"]


def test_a_sigmoid_read_twice_is_not_made_a_swish(tmp_path):
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["out"]),
             helper.make_node("Neg", ["s"], ["gate"])]
    lib = run_host(make_model(nodes, {"x": (3, 8)}, {"out": None, "gate": None}), tmp_path)
    ops = [step["op"] for step in lib.metadata["steps"]]
    assert "Swish" not in ops and "Sigmoid" in ops, ops
