"""Control flow written out at import (If, Loop, Scan),
integer tensors of every width at the module's boundary, float64 and
float16 models and Casts to float16 and bfloat16, each compiled, run and
compared with onnxruntime (or numpy's rounding)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import crosscompile
import minirt
from crosscompile.frontend import import_onnx
from tests.onnx_models import IR_VERSION, reference
from tests.test_ops_logic import run_typed


def typed_model(nodes, feeds: dict, outputs: dict, inits=(), opset=13):
    """A model whose inputs take the dtypes and shapes of `feeds` (any
    numpy dtype) and whose outputs are {name: numpy dtype}."""
    def elem(dtype):
        return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        nodes, "typed", [helper.make_tensor_value_info(n, elem(v.dtype), v.shape) for n, v in feeds.items()],
        [helper.make_tensor_value_info(n, elem(t), None) for n, t in outputs.items()],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in dict(inits).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)


def test_scan_becomes_one_body_copy_per_step(tmp_path):
    # A running sum over the sequence axis, and each step's sum as a scan output.
    body = helper.make_graph(
        [helper.make_node("Add", ["sum_in", "x_t"], ["sum_out"]),
         helper.make_node("Identity", ["sum_out"], ["step"])], "body",
        [helper.make_tensor_value_info("sum_in", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("sum_out", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("step", TensorProto.FLOAT, [3])])
    feeds = {"init": np.ones(3, np.float32),
             "x": np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)}
    scan = helper.make_node("Scan", ["init", "x"], ["total", "steps"], body=body, num_scan_inputs=1,
                            scan_output_directions=[1])
    run_typed(typed_model([scan], feeds, {"total": np.float32, "steps": np.float32}, opset=16), feeds, tmp_path)


def _branch(op, shape=(2, 3)):
    return helper.make_graph([helper.make_node(op, ["x", "x"], ["y_branch"])], op,
                             [], [helper.make_tensor_value_info("y_branch", TensorProto.FLOAT, list(shape))])


def test_if_with_a_constant_condition_is_its_branch(tmp_path):
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    node = helper.make_node("If", ["cond"], ["y"], then_branch=_branch("Mul"), else_branch=_branch("Add"))
    model = typed_model([node], feeds, {"y": np.float32}, {"cond": np.array(False)})
    run_typed(model, feeds, tmp_path)
    assert [n.op_type for n in import_onnx(model).nodes] == ["Add"]


def test_if_with_a_runtime_condition_picks_between_both_branches(tmp_path):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    node = helper.make_node("If", ["cond"], ["y"], then_branch=_branch("Mul"), else_branch=_branch("Sub"))
    model = typed_model([node], {"x": x, "cond": np.array(True)}, {"y": np.float32})
    module = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so"))
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        np.testing.assert_array_equal(module.run(feeds)[0], ReferenceEvaluator(model).run(None, feeds)[0])


def test_if_whose_runtime_branches_differ_in_shape_is_refused():
    other = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y_branch"], keepdims=0)], "sum", [],
                              [helper.make_tensor_value_info("y_branch", TensorProto.FLOAT, None)])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=_branch("Mul"), else_branch=other, name="pick")
    model = typed_model([node], {"x": np.ones((2, 3), np.float32), "cond": np.array(True)}, {"y": np.float32})
    with pytest.raises(crosscompile.BuildError, match=r"node 'pick' \(If\): its condition 'cond' is computed at run "
                                                      r"time and its branches give output 0 different shapes"):
        crosscompile.build(model)


def loop_model(trip, cond, stop_after=None, inputs=()):
    """A Loop adding iteration * x to a running sum, with each sum as a scan
    output; its body's condition stays true, or turns false once the
    iteration number reaches stop_after. inputs: names of trip/cond given
    at run time."""
    nodes = [helper.make_node("Cast", ["i"], ["i_float"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["i_float", "x"], ["step"]),
             helper.make_node("Add", ["sum_in", "step"], ["sum_out"]),
             helper.make_node("Identity", ["sum_out"], ["each"])]
    if stop_after is None:
        nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    else:
        nodes += [helper.make_node("Constant", [], ["last"], value=numpy_helper.from_array(np.array(stop_after))),
                  helper.make_node("Less", ["i", "last"], ["cond_out"])]
    body = helper.make_graph(nodes, "body", [
        helper.make_tensor_value_info("i", TensorProto.INT64, []),
        helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        helper.make_tensor_value_info("sum_in", TensorProto.FLOAT, [3])], [
        helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
        helper.make_tensor_value_info("sum_out", TensorProto.FLOAT, [3]),
        helper.make_tensor_value_info("each", TensorProto.FLOAT, [3])])
    loop = helper.make_node("Loop", ["trip" if trip is not None else "", "cond" if cond is not None else "", "start"],
                            ["total", "sums"], body=body, name="the_loop")
    feeds = {"x": np.array([1.0, -2.0, 0.5], np.float32), "start": np.ones(3, np.float32)}
    known = {name: value for name, value in (("trip", trip), ("cond", cond)) if value is not None}
    feeds.update((name, known.pop(name)) for name in inputs)
    return typed_model([loop], feeds, {"total": np.float32, "sums": np.float32}, known), feeds


@pytest.mark.parametrize("trip,cond,stop_after", [
    (np.array(4), np.array(True), None),   # four iterations
    (np.array(6), None, 2),                # the body's condition ends it after three
    (None, np.array(True), 4),             # no trip count: the condition alone
])
def test_loop_with_a_known_course_is_one_body_copy_per_iteration(tmp_path, trip, cond, stop_after):
    model, feeds = loop_model(trip, cond, stop_after)
    lib = crosscompile.build(model)
    got = minirt.load(lib.export_library(tmp_path / "m.so")).run(feeds)
    want = reference(model, feeds)
    assert want[1].shape[0] == (4 if stop_after is None else stop_after + 1)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_loop_whose_course_is_decided_at_run_time_is_refused():
    model, _ = loop_model(np.array(3), np.array(True), inputs=["trip"])
    with pytest.raises(crosscompile.BuildError, match=r"node 'the_loop' \(Loop\): its trip count 'trip' is computed "
                                                      "at run time"):
        crosscompile.build(model)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.uint32, np.uint64])
def test_narrow_and_unsigned_integers_wrap_compare_and_divide_as_onnxruntime(tmp_path, dtype):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(1)
    a = rng.integers(info.min, info.max, size=(4, 6), dtype=dtype, endpoint=True)
    b = rng.integers(max(info.min, -9), 9, size=(6,), dtype=dtype, endpoint=True)
    b[b == 0] = 1
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Mul", ["a", "b"], ["product"]),
             helper.make_node("Div", ["a", "b"], ["quotient"]), helper.make_node("Max", ["a", "b"], ["larger"]),
             helper.make_node("Less", ["a", "b"], ["less"])]
    feeds = {"a": a, "b": b}
    outputs = {"sum": dtype, "product": dtype, "quotient": dtype, "larger": dtype, "less": np.bool_}
    model = typed_model(nodes, feeds, outputs, opset=18)
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run(feeds)
    # onnx's reference (numpy's arithmetic): onnxruntime lacks some of these kernels.
    for g, w in zip(got, ReferenceEvaluator(model).run(None, feeds)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def test_a_float64_model_keeps_float64_at_its_boundary(tmp_path):
    feeds = {"x": np.random.default_rng(2).standard_normal((3, 4))}
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("CumSum", ["e", "axis"], ["y"])]
    model = typed_model(nodes, feeds, {"y": np.float64}, {"axis": np.array(1, np.int64)})
    lib = crosscompile.build(model)
    got = minirt.load(lib.export_library(tmp_path / "m.so")).run(feeds)[0]
    assert got.dtype == np.float64
    # Computed in float32 inside: float32's rounding, not float64's.
    np.testing.assert_allclose(got, np.cumsum(np.exp(feeds["x"]), axis=1), rtol=1e-6)


def test_a_float16_model_keeps_float16_at_its_boundary_and_matches_onnxruntime(tmp_path):
    import onnxruntime as ort
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((1, 3, 6, 6)).astype(np.float16)}
    inits = {"w": (rng.standard_normal((4, 3, 3, 3)) / 5).astype(np.float16),
             "b": rng.standard_normal(4).astype(np.float16), "scale": np.float32(1.7)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Cast", ["c"], ["c32"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["c32", "scale"], ["m"]),
             helper.make_node("Cast", ["m"], ["m16"], to=TensorProto.FLOAT16),
             helper.make_node("Relu", ["m16"], ["y"])]
    model = typed_model(nodes, feeds, {"y": np.float16}, inits)
    module = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so"))
    assert [(s.name, s.dtype) for s in module.inputs + module.outputs] == [("x", "float16"), ("y", "float16")]
    got = module.run(feeds)[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert got.dtype == want.dtype == np.float16 and got.shape == want.shape
    # The Conv is computed in float32 and rounded to float16 once, as
    # onnxruntime's does: at most one float16 step apart.
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=1e-3)
    assert np.any(got != 0)


def test_casts_to_float16_and_bfloat16_round_as_numpy_does(tmp_path):
    import ml_dtypes  # onnx's own dependency: numpy's bfloat16
    bits = np.random.default_rng(4).integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e9, np.inf, -np.inf, np.nan, 2.0 ** -24,
                        2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14 - 2.0 ** -25, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
                        1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 6e-8, -7.3e-5], np.float32)
    x = np.concatenate([bits.view(np.float32), special,
                        np.random.default_rng(5).standard_normal(500).astype(np.float32)])
    feeds = {"x": x}
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["x"], ["bf"], to=TensorProto.BFLOAT16),
             helper.make_node("Cast", ["h"], ["h32"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["bf"], ["bf32"], to=TensorProto.FLOAT)]
    model = typed_model(nodes, feeds, {"h32": np.float32, "bf32": np.float32})
    h32, bf32 = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run(feeds)
    with np.errstate(over="ignore", invalid="ignore"):  # numpy's own casts of inf and NaN
        np.testing.assert_array_equal(h32, x.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(bf32, x.astype(ml_dtypes.bfloat16).astype(np.float32))
