"""Ops over an axis whose size depends on the data (crosscompile/bounded.py,
crosscompile/extents.py): the Shape of a selection setting a TopK's k and
a ConstantOfShape's size, Concat along counted axes, reductions and Slices
over counted rows, equal NonZero nodes sharing one count, and the
post-processing torchvision's SSD exports (per-class TopK, concatenation,
class offsets, NMS, the first N), each against onnxruntime with nothing
selected, some, and everything (the count at its bound).
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import crosscompile
import minirt
from tests.detection_models import postprocess_input, torchvision_postprocess
from tests.onnx_models import reference

SIZE = 12  # elements the selections choose from


def selection_model(tail: list, outputs: list, extra_inits: dict = None) -> onnx.ModelProto:
    """x [SIZE] -> picked = x[x > 0.5] (Greater, NonZero, Transpose,
    GatherND as torch exports it), then the nodes of tail."""
    inits = {"half": np.array(0.5, np.float32), "zero": np.array(0, np.int64), "axis0": np.array([0], np.int64),
             **(extra_inits or {})}
    nodes = [helper.make_node("Greater", ["x", "half"], ["mask"]), helper.make_node("NonZero", ["mask"], ["nz"]),
             helper.make_node("Transpose", ["nz"], ["where"], perm=[1, 0]),
             helper.make_node("GatherND", ["x", "where"], ["picked"]), *tail]
    graph = helper.make_graph(nodes, "selection", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SIZE])],
                              [helper.make_tensor_value_info(name, kind, None) for name, kind in outputs],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def inputs_selecting(counts=(0, 5, SIZE)):
    """x with `count` elements above 0.5, for each count: none, some, all."""
    rng = np.random.default_rng(len(counts))
    for count in counts:
        x = rng.random(SIZE, dtype=np.float32) * 0.4
        x[rng.permutation(SIZE)[:count]] += 0.55
        yield {"x": x}


def assert_matches_onnxruntime(model, module, feeds_list, counts_seen=None):
    seen = set()
    for feeds in feeds_list:
        got, want = module.run(feeds), reference(model, feeds)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        seen.add(got[0].shape[0] if got[0].ndim else None)
    return seen


def compiled(model, tmp_path, name="m"):
    return minirt.load(crosscompile.build(model, target="host").export_library(str(tmp_path / f"{name}.so")))


def test_the_shape_of_a_selection_sets_a_topk_k_and_a_constant_of_shape(tmp_path):
    """k = min(4, found) as torchvision computes it; labels by a
    ConstantOfShape of the TopK's Shape; boxes picked by a second NonZero
    of the same mask, which shares the first one's count."""
    tail = [helper.make_node("NonZero", ["mask"], ["nz_again"]),
            helper.make_node("Transpose", ["nz_again"], ["where_again"], perm=[1, 0]),
            helper.make_node("GatherND", ["rows", "where_again"], ["picked_rows"]),
            helper.make_node("Shape", ["picked"], ["shape"]), helper.make_node("Gather", ["shape", "zero"], ["n"]),
            helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
            helper.make_node("Concat", ["four", "n1"], ["choices"], axis=0),
            helper.make_node("ReduceMin", ["choices"], ["k0"], keepdims=0),
            helper.make_node("Reshape", ["k0", "axis1"], ["k"]),
            helper.make_node("TopK", ["picked", "k"], ["top", "top_index"], axis=-1),
            helper.make_node("Gather", ["picked_rows", "top_index"], ["top_rows"], axis=0),
            helper.make_node("Shape", ["top"], ["top_shape"]),
            helper.make_node("ConstantOfShape", ["top_shape"], ["labels"],
                             value=numpy_helper.from_array(np.array([7], np.int64)))]
    rows = np.arange(SIZE * 3, dtype=np.float32).reshape(SIZE, 3)
    model = selection_model(tail, [("top", TensorProto.FLOAT), ("top_index", TensorProto.INT64),
                                   ("top_rows", TensorProto.FLOAT), ("labels", TensorProto.INT64)],
                            {"four": np.array([4], np.int64), "axis1": np.array([1], np.int64), "rows": rows})
    module = compiled(model, tmp_path)
    # k is at most 4, known from min(4, ...): the outputs are planned for 4.
    assert [spec.shape for spec in module.outputs] == [(4,), (4,), (4, 3), (4,)]
    assert [step["op"] for step in module.metadata["steps"]].count("NonZero") == 1
    assert {spec.count[1] for spec in module.outputs} == {module.outputs[0].count[1]}
    assert assert_matches_onnxruntime(model, module, inputs_selecting()) == {0, 4}
    assert assert_matches_onnxruntime(model, module, inputs_selecting((3,))) == {3}


def test_concat_along_counted_axes_adds_their_counts(tmp_path):
    """Two selections of different masks and a fixed part between them."""
    tail = [helper.make_node("Less", ["x", "third"], ["low"]), helper.make_node("NonZero", ["low"], ["nz_low"]),
            helper.make_node("Transpose", ["nz_low"], ["where_low"], perm=[1, 0]),
            helper.make_node("GatherND", ["x", "where_low"], ["picked_low"]),
            helper.make_node("Concat", ["picked", "fixed", "picked_low"], ["joined"], axis=0),
            helper.make_node("Neg", ["joined"], ["negated"])]
    model = selection_model(tail, [("negated", TensorProto.FLOAT)],
                            {"third": np.array(0.3, np.float32), "fixed": np.array([-1.0, -2.0], np.float32)})
    module = compiled(model, tmp_path)
    assert module.outputs[0].shape == (2 * SIZE + 2,)
    x = np.full(SIZE, 0.4, np.float32)  # neither selection takes anything
    everything = np.linspace(0.55, 0.9, SIZE).astype(np.float32)
    seen = assert_matches_onnxruntime(model, module, [{"x": x}, {"x": everything}, *inputs_selecting((5,))])
    assert {2, SIZE + 2} <= seen


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceSum", "ReduceMin"])
def test_a_reduction_over_counted_rows_reduces_only_the_rows_selected(op, tmp_path):
    tail = [helper.make_node("Unsqueeze", ["picked", "axis1"], ["column"]),
            helper.make_node("Concat", ["column", "column"], ["pairs"], axis=1),
            helper.make_node(op, ["pairs"], ["all"], keepdims=0),
            helper.make_node(op, ["pairs", "axis0"], ["per_column"], keepdims=1)]
    model = selection_model(tail, [("all", TensorProto.FLOAT), ("per_column", TensorProto.FLOAT)],
                            {"axis1": np.array([1], np.int64)})
    module = compiled(model, tmp_path)
    # The empty selection: ReduceMax/Min of nothing differ between runtimes.
    counts = (5, SIZE) if op != "ReduceSum" else (0, 5, SIZE)
    for feeds in inputs_selecting(counts):
        got, want = module.run(feeds), reference(model, feeds)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-6)


def test_a_slice_keeps_the_first_rows_of_a_counted_axis(tmp_path):
    """[:3] (torchvision's detections_per_img), [1:4], and [0:big] that keeps them all."""
    tail = [helper.make_node("Slice", ["picked", "start", "three", "axis0"], ["first"]),
            helper.make_node("Slice", ["picked", "one", "four", "axis0"], ["middle"]),
            helper.make_node("Slice", ["picked", "start", "big", "axis0"], ["whole"])]
    model = selection_model(tail, [(n, TensorProto.FLOAT) for n in ("first", "middle", "whole")],
                            {"start": np.array([0], np.int64), "one": np.array([1], np.int64),
                             "three": np.array([3], np.int64), "four": np.array([4], np.int64),
                             "big": np.array([2 ** 63 - 1], np.int64)})
    module = compiled(model, tmp_path)
    assert [spec.shape for spec in module.outputs] == [(3,), (3,), (SIZE,)]
    for feeds in inputs_selecting((0, 1, 2, 5, SIZE)):
        got, want = module.run(feeds), reference(model, feeds)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_array_equal(g, w)


def test_ops_over_a_counted_axis_that_stay_refused_name_the_node_and_tensor():
    model = selection_model([helper.make_node("ReduceMean", ["picked"], ["mean"], keepdims=0, name="average"),
                             helper.make_node("Size", ["picked"], ["many"], name="how_many")],
                            [("mean", TensorProto.FLOAT), ("many", TensorProto.INT64)])
    with pytest.raises(crosscompile.BuildError) as info:
        crosscompile.build(model, target="host")
    text = str(info.value)
    assert "node 'average' (ReduceMean)" in text and "'picked' along axis 0" in text
    assert "node 'how_many' (Size): input 'picked' has a size that depends on the data" in text


POSTPROCESS_CASES = ((0, 0.5), (1, 0.0), (2, 1.0), (3, 0.08))  # (seed, share found): some, none, all, few


def assert_detections_match(got, want):
    assert [g.shape for g in got] == [w.shape for w in want]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


def test_torchvision_shaped_postprocessing_matches_onnxruntime_on_the_host(tmp_path):
    model = torchvision_postprocess()
    module = compiled(model, tmp_path, "post")
    kept = set()
    for seed, found in POSTPROCESS_CASES:
        feeds = postprocess_input(seed, found=found)
        got = module.run(feeds)
        assert_detections_match(got, reference(model, feeds))
        kept.add(got[0].shape[0])
    assert 0 in kept and 6 in kept and len(kept) >= 3, kept


@pytest.mark.emulated
def test_torchvision_shaped_postprocessing_on_an_emulated_arm64_board(tmp_path):
    """Compiled for rasp4b64, run by the native board server under
    qemu-aarch64, which cuts the outputs to their counts."""
    from tests import board_servers
    from tests.onnx_node_suite import board_runner, board_server
    board_servers.command("native-aarch64")  # skips without qemu-user or the server's build
    model = torchvision_postprocess()
    path = crosscompile.build(model, target="rasp4b64").export_library(str(tmp_path / "post.so"))
    with board_server("native-aarch64", str(tmp_path)) as child:
        run = board_runner(child.port)
        for seed, found in POSTPROCESS_CASES:
            feeds = postprocess_input(seed, found=found)
            assert_detections_match(run(path, feeds), reference(model, feeds))


def test_a_topk_whose_k_is_a_model_input_gives_k_entries(tmp_path):
    """k given at run time: outputs planned for the whole axis, counted by k."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1, largest=0)], "topk",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7]),
         helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, [2, None]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, [2, None])]),
        opset_imports=[helper.make_opsetid("", 13)])
    module = compiled(model, tmp_path, "topk")
    assert [spec.shape for spec in module.outputs] == [(2, 7), (2, 7)]
    x = np.random.default_rng(5).integers(0, 4, (2, 7)).astype(np.float32)  # ties: the lower index first
    for k in (0, 3, 7):
        feeds = {"x": x, "k": np.array([k], np.int64)}
        got, want = module.run(feeds), reference(model, feeds)
        for g, w in zip(got, want):
            assert g.shape == w.shape == (2, k)
            np.testing.assert_array_equal(g, w)


def test_a_gather_along_a_counted_axis_counts_negative_indices_from_the_count(tmp_path):
    model = selection_model([helper.make_node("Gather", ["picked", "at"], ["ends"], axis=0)],
                            [("ends", TensorProto.FLOAT)])
    model.graph.input.append(helper.make_tensor_value_info("at", TensorProto.INT64, [3]))
    module = compiled(model, tmp_path, "ends")
    for feeds in inputs_selecting((1, 5, SIZE)):
        feeds["at"] = np.array([-1, 0, -2 if len(feeds["x"][feeds["x"] > 0.5]) > 1 else 0], np.int64)
        got, want = module.run(feeds), reference(model, feeds)
        np.testing.assert_array_equal(got[0], want[0])
