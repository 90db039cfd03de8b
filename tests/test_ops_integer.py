"""Integer tensors at run time: int32 and int64 arithmetic under
broadcasting (Add, Sub, Mul, Div, Mod, Neg, Abs, Max, Min, Sum), the
element-moving ops on integer tensors, and the position-id subgraph
RoBERTa exports (a mask, an int32 CumSum times the mask, plus an offset),
checked against onnxruntime and numpy."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import crosscompile
import minirt
from tests.onnx_models import reference

INT_TYPES = {np.int32: TensorProto.INT32, np.int64: TensorProto.INT64}


def _build_and_run(model, feeds, tmp_path):
    lib = crosscompile.build(model, target="host")
    return minirt.load(lib.export_library(str(tmp_path / "m.so"))).run(feeds)


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(
        nodes, "ints",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()],
        [numpy_helper.from_array(v, n) for n, v in dict(initializers).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_arithmetic_matches_numpy(tmp_path, dtype):
    rng = np.random.default_rng(3)
    a = rng.integers(-50, 50, (3, 4, 5)).astype(dtype)
    b = rng.integers(-7, 8, (4, 1)).astype(dtype)  # broadcast, zeros and -1 included
    b[0, 0], b[1, 0], b[2, 0] = 0, -1, 3
    a[0, 0, 0] = np.iinfo(dtype).min
    t = INT_TYPES[dtype]
    ops = {"Add": {}, "Sub": {}, "Mul": {}, "Div": {}, "Max": {}, "Min": {}, "Sum": {},
           "Mod": {}, "Mod_fmod": {"fmod": 1}}
    nodes = [helper.make_node(op.split("_")[0], ["a", "b"], [op], **attrs) for op, attrs in ops.items()]
    nodes += [helper.make_node("Neg", ["a"], ["Neg"]), helper.make_node("Abs", ["b"], ["Abs"])]
    model = _model(nodes, {"a": (t, a.shape), "b": (t, b.shape)}, {n.output[0]: t for n in nodes})
    got = dict(zip([n.output[0] for n in nodes], _build_and_run(model, {"a": a, "b": b}, tmp_path)))
    with np.errstate(all="ignore"):
        wide_a, wide_b = a.astype(np.int64), np.broadcast_to(b, a.shape).astype(np.int64)
        safe = np.where(wide_b == 0, 1, wide_b)
        want = {"Add": a + b, "Sub": a - b, "Mul": a * b, "Max": np.maximum(a, b), "Min": np.minimum(a, b),
                "Sum": a + b, "Neg": -a, "Abs": np.abs(b),
                # C's truncating division; 0 where the divisor is 0.
                "Div": np.where(wide_b == 0, 0, np.trunc(wide_a / safe)).astype(np.int64).astype(dtype),
                "Mod": np.where(wide_b == 0, 0, np.mod(wide_a, safe)).astype(dtype),
                "Mod_fmod": np.where(wide_b == 0, 0, np.fmod(wide_a, safe)).astype(dtype)}
    for name, value in want.items():
        assert got[name].dtype == dtype, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_roberta_position_ids_match_onnxruntime(tmp_path):
    # position_ids = cumsum(mask) * mask + padding_idx, in int32 then int64.
    nodes = [helper.make_node("Equal", ["ids", "pad"], ["is_pad"]),
             helper.make_node("Not", ["is_pad"], ["keep"]),
             helper.make_node("Cast", ["keep"], ["mask"], to=TensorProto.INT32),
             helper.make_node("CumSum", ["mask", "axis"], ["running"]),
             helper.make_node("Mul", ["running", "mask"], ["masked"]),
             helper.make_node("Cast", ["masked"], ["wide"], to=TensorProto.INT64),
             helper.make_node("Add", ["wide", "pad"], ["positions"]),
             helper.make_node("Tile", ["positions", "repeats"], ["tiled"]),
             helper.make_node("Transpose", ["tiled"], ["swapped"], perm=[1, 0]),
             helper.make_node("Concat", ["swapped", "swapped"], ["joined"], axis=0)]
    model = _model(nodes, {"ids": (TensorProto.INT64, (2, 7))}, {"positions": TensorProto.INT64,
                                                                  "joined": TensorProto.INT64},
                   {"pad": np.array(1, np.int64), "axis": np.array(1, np.int64),
                    "repeats": np.array([2, 1], np.int64)})
    ids = np.array([[0, 31, 414, 232, 2, 1, 1], [0, 9, 2, 1, 1, 1, 1]], np.int64)
    got = _build_and_run(model, {"ids": ids}, tmp_path)
    want = reference(model, {"ids": ids})
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got[0], [[2, 3, 4, 5, 6, 1, 1], [2, 3, 4, 1, 1, 1, 1]])
