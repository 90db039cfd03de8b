"""The element-wise float ops built without libm (activations, rounding,
trigonometric and hyperbolic functions, NaN and infinity tests), compiled
once as one model and checked against numpy in float64 over wide ranges and
the special values (+-0, +-inf, NaN) that onnx's own cases leave out."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import crosscompile
import minirt
from tests.onnx_models import make_model

SELU_ALPHA, SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875


def _softplus(x):
    return np.logaddexp(0.0, x)


# op -> (attributes, float64 reference, the values it is checked on: "all"
# or "unit" for functions defined on [-1, 1], "trig" for |x| <= 1000)
FUNCTIONS = {
    "Softplus": ({}, _softplus, "all"),
    "Mish": ({}, lambda x: x * np.tanh(_softplus(x)), "all"),
    "Elu": ({"alpha": 0.7}, lambda x: np.where(x < 0, 0.7 * np.expm1(x), x), "all"),
    "Selu": ({}, lambda x: SELU_GAMMA * np.where(x < 0, SELU_ALPHA * np.expm1(x), x), "all"),
    "Celu": ({"alpha": 2.0}, lambda x: np.maximum(x, 0) + np.minimum(0, 2.0 * np.expm1(x / 2.0)), "all"),
    "Softsign": ({}, lambda x: x / (1 + np.abs(x)), "all"),
    "ThresholdedRelu": ({"alpha": 0.5}, lambda x: np.where(x > 0.5, x, 0.0), "all"),
    "Shrink": ({"lambd": 1.5, "bias": 0.25},
               lambda x: np.where(x < -1.5, x + 0.25, np.where(x > 1.5, x - 0.25, 0.0)), "all"),
    "Round": ({}, np.round, "all"),
    "Floor": ({}, np.floor, "all"),
    "Ceil": ({}, np.ceil, "all"),
    "Sign": ({}, np.sign, "all"),
    "Sin": ({}, np.sin, "trig"),
    "Cos": ({}, np.cos, "trig"),
    "Tan": ({}, np.tan, "trig"),
    "Atan": ({}, np.arctan, "all"),
    "Asin": ({}, np.arcsin, "unit"),
    "Acos": ({}, np.arccos, "unit"),
    "Sinh": ({}, np.sinh, "all"),
    "Cosh": ({}, np.cosh, "all"),
    "Asinh": ({}, np.arcsinh, "all"),
    "Acosh": ({}, np.arccosh, "all"),
    "Atanh": ({}, np.arctanh, "unit"),
}
TESTS = {
    "IsNaN": ({}, np.isnan),
    "IsInf": ({}, np.isinf),
    "IsInf_negative": ({"detect_positive": 0}, np.isneginf),
    "IsInf_positive": ({"detect_negative": 0}, np.isposinf),
}


def _values():
    rng = np.random.default_rng(7)
    magnitudes = np.concatenate([np.geomspace(1e-30, 1e30, 400), rng.uniform(0, 4, 300),
                                 np.arange(0, 8, 0.25), np.array([0.5, 1.5, 2.5, 1e-3, 88.0, 89.0])])
    wide = np.concatenate([magnitudes, -magnitudes, [0.0, -0.0, np.inf, -np.inf, np.nan]])
    unit = np.concatenate([rng.uniform(-1, 1, 400), np.geomspace(1e-20, 1, 100), -np.geomspace(1e-20, 1, 100),
                           1 - np.geomspace(1e-7, 1e-1, 50), [1.0, -1.0, 1.0001, -1.5, np.nan]])
    trig = np.concatenate([rng.uniform(-1000, 1000, 400), rng.uniform(-10, 10, 400), [0.0, np.nan, np.inf]])
    return {name: v.astype(np.float32) for name, v in (("all", wide), ("unit", unit), ("trig", trig))}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    values = _values()
    nodes, outputs = [], {}
    for op, (attrs, _, domain) in FUNCTIONS.items():
        nodes.append(helper.make_node(op, [domain], [op], name=op.lower(), **attrs))
        outputs[op] = None
    for name, (attrs, _) in TESTS.items():
        nodes.append(helper.make_node(name.split("_")[0], ["all"], [name], name=name.lower(), **attrs))
    model = make_model(nodes, {k: v.shape for k, v in values.items()}, outputs, opset=18)
    for name in TESTS:
        model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.BOOL, None))
    lib = crosscompile.build(model, target="host")
    module = minirt.load(lib.export_library(str(tmp_path_factory.mktemp("unary") / "m.so")))
    got = module.run(values)
    return values, dict(zip([o.name for o in model.graph.output], got))


@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_float_function_matches_numpy_in_float64(outputs, op):
    values, got = outputs
    _, function, domain = FUNCTIONS[op]
    x = values[domain]
    with np.errstate(all="ignore"):
        want = function(x.astype(np.float64)).astype(np.float32)
    # Relative 1e-5 (a few float32 ulp) with an absolute floor of 1e-6 of the
    # input where a function's answer nears 0 around a root (Sin at k pi).
    atol = 1e-6 * np.maximum(1.0, np.abs(x)) if domain == "trig" else 1e-30
    with np.errstate(invalid="ignore"):
        bad = ~np.isclose(got[op], want, rtol=1e-5, atol=0, equal_nan=True) & ~(np.abs(got[op] - want) <= atol)
    assert not bad.any(), [(float(a), float(g), float(w)) for a, g, w in zip(x[bad], got[op][bad], want[bad])][:8]


@pytest.mark.parametrize("name", list(TESTS))
def test_float_tests_give_bool_tensors(outputs, name):
    values, got = outputs
    assert got[name].dtype == np.bool_
    np.testing.assert_array_equal(got[name], TESTS[name][1](values["all"]))
