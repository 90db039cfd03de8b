"""Outputs whose size depends on the data (crosscompile/bounded.py): a
detection head with NonMaxSuppression (tests/detection_models.py) and
NonZero graphs, compiled and run against onnxruntime on the host and on
the native board server under qemu-aarch64; what a loader that knows
nothing of counts gets; and the refusals of ops that would mix the rows
past the count into the others.
"""
import ctypes
import os

import numpy as np
import pytest
from onnx import TensorProto, helper

import crosscompile
import minirt
from tests.detection_models import detection_head, detection_input
from tests.onnx_models import reference

# Inputs whose heads keep different numbers of boxes, below the bound and at it.
SEEDS = (7, 0)


def assert_detections_equal(got, want):
    """Boxes and scores within float32 rounding, labels (and the count) exact."""
    assert [g.shape for g in got] == [w.shape for w in want]
    boxes, scores, labels = got
    np.testing.assert_allclose(boxes, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(labels, want[2])


@pytest.fixture(scope="module")
def head():
    return detection_head()


@pytest.fixture(scope="module")
def head_module(head, tmp_path_factory):
    path = os.path.join(tmp_path_factory.mktemp("head"), "head.so")
    return crosscompile.build(head, target="host").export_library(path)


def test_detection_head_matches_onnxruntime_on_the_host(head, head_module):
    module = minirt.load(head_module)
    sizes = set()
    for seed in SEEDS:
        feeds = {"features": detection_input(seed)}
        got = module.run(feeds)
        assert_detections_equal(got, reference(head, feeds))
        sizes.add(got[0].shape[0])
    bound = module.outputs[0].shape[0]
    assert len(sizes) == 2 and min(sizes) < bound, (sizes, bound)
    assert [spec.count[0] for spec in module.outputs] == [0, 0, 0]


def test_a_loader_that_ignores_counts_gets_the_bound_with_zeros_past_the_count(head, head_module):
    """docs/module-abi.md: tether_run alone fills every output at its upper
    bound, the selected rows first and zeros after them."""
    module = minirt.load(head_module)
    feeds = {"features": detection_input(SEEDS[0])}
    want = module.run(feeds)
    lib = ctypes.CDLL(head_module)
    outputs = [np.full(spec.shape, 7, dtype=spec.dtype) for spec in module.outputs]
    workspace = np.zeros(module.metadata["workspace_bytes"] + 64, np.uint8)
    start = (-workspace.ctypes.data) % 64
    x = np.ascontiguousarray(feeds["features"])
    ins = (ctypes.c_void_p * 1)(x.ctypes.data)
    outs = (ctypes.c_void_p * 3)(*[o.ctypes.data for o in outputs])
    assert lib.tether_run(ins, outs, ctypes.c_void_p(workspace.ctypes.data + start)) == 0
    count = want[0].shape[0]
    offset = start + module.outputs[0].count[1]
    assert int(workspace[offset:offset + 8].view(np.int64)[0]) == count
    for full, cut in zip(outputs, want):
        np.testing.assert_array_equal(full[:count], cut)
    # Past the count, the gathered rows of the zero indices NMS pads with:
    # box 0 of class 0, and label 0 + 1.
    assert (outputs[2][count:] == 1).all() and count < len(outputs[2])


def nonzero_model(then: str = "Transpose"):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    nodes = [helper.make_node("NonZero", ["x"], ["nz"])]
    if then == "Transpose":
        nodes.append(helper.make_node("Transpose", ["nz"], ["y"], perm=[1, 0]))
    else:  # a Cast passes the count on, then `then` reduces along it
        nodes += [helper.make_node("Cast", ["nz"], ["nz_float"], to=TensorProto.FLOAT),
                  helper.make_node(then, ["nz_float"], ["y"], keepdims=0, name="total")]
    y = helper.make_tensor_value_info("y", TensorProto.INT64 if then == "Transpose" else TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(nodes, "nonzero", [x], [y]),
                             opset_imports=[helper.make_opsetid("", 13)])


def test_nonzero_through_a_transpose_moves_its_counted_axis(tmp_path):
    model = nonzero_model()
    module = minirt.load(crosscompile.build(model, target="host").export_library(str(tmp_path / "nz.so")))
    assert module.outputs[0].shape == (12, 2) and module.outputs[0].count[0] == 0
    for x in (np.zeros((3, 4), np.float32), np.eye(3, 4, dtype=np.float32), np.ones((3, 4), np.float32),
              np.array([[0, np.nan, 0, -1]] * 3, np.float32)):
        got, = module.run({"x": x})
        want, = reference(model, {"x": x})
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_a_boolean_mask_picks_the_elements_it_marks(tmp_path):
    """x[x > 0.5] as torch exports it: Greater, NonZero, Transpose, GatherND."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Greater", ["x", "half"], ["mask"]), helper.make_node("NonZero", ["mask"], ["nz"]),
         helper.make_node("Transpose", ["nz"], ["where"], perm=[1, 0]),
         helper.make_node("GatherND", ["x", "where"], ["picked"])],
        "mask", [x], [helper.make_tensor_value_info("picked", TensorProto.FLOAT, ["n"])], [half]),
        opset_imports=[helper.make_opsetid("", 13)])
    module = minirt.load(crosscompile.build(model, target="host").export_library(str(tmp_path / "mask.so")))
    for seed in range(3):
        feeds = {"x": np.random.default_rng(seed).random((4, 5), dtype=np.float32)}
        got, = module.run(feeds)
        want, = reference(model, feeds)
        assert got.shape == want.shape and 0 < len(want) < 20
        np.testing.assert_array_equal(got, want)


def test_ops_that_would_mix_the_rows_past_the_count_are_refused_by_name():
    with pytest.raises(crosscompile.BuildError) as info:
        crosscompile.build(nonzero_model("ReduceMean"), target="host")
    assert "node 'total' (ReduceMean)" in str(info.value)
    assert "depends on the data" in str(info.value)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])
    size = helper.make_model(helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Size", ["nz"], ["s"], name="size")],
        "size_of_nonzero", [x], [helper.make_tensor_value_info("s", TensorProto.INT64, [])]),
        opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(crosscompile.BuildError, match="node 'size' \\(Size\\): input 'nz' has a size that "
                                                      "depends on the data"):
        crosscompile.build(size, target="host")


def test_a_dynamic_dimension_with_counted_outputs_is_refused(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["nz"])], "nonzero", [x],
        [helper.make_tensor_value_info("nz", TensorProto.INT64, [2, None])]),
        opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(crosscompile.BuildError, match="graph outputs \\['nz'\\] have sizes that depend on the data"):
        crosscompile.build(model, target="host", dynamic={"N": (1, 4)})


@pytest.mark.emulated
def test_detection_head_matches_onnxruntime_on_an_emulated_arm64_board(head, tmp_path):
    """Compiled for rasp4b64, run through a session with the native board
    server under qemu-aarch64, which cuts the outputs to the counts."""
    from tests import board_servers
    from tests.onnx_node_suite import board_runner, board_server
    board_servers.command("native-aarch64")  # skips without qemu-user or the server's build
    path = crosscompile.build(head, target="rasp4b64").export_library(str(tmp_path / "head.so"))
    with board_server("native-aarch64", str(tmp_path)) as child:
        run = board_runner(child.port)
        for seed in SEEDS:
            feeds = {"features": detection_input(seed)}
            assert_detections_equal(run(path, feeds), reference(head, feeds))


def test_detection_head_through_a_session_with_the_python_board_server(head, head_module, tmp_path):
    """The Python board server runs modules with minirt and sends the cut outputs."""
    from tests.onnx_node_suite import board_runner, board_server
    with board_server("python", str(tmp_path)) as child:
        run = board_runner(child.port)
        for seed in SEEDS:
            feeds = {"features": detection_input(seed)}
            assert_detections_equal(run(head_module, feeds), reference(head, feeds))


def test_minirt_refuses_a_count_it_cannot_read(head_module, tmp_path):
    """A count that is not an aligned int64 in the workspace: a damaged module."""
    offset = minirt.load(head_module).outputs[0].count[1]
    data = open(head_module, "rb").read()
    old, new = f'"offset":{offset}}}'.encode(), f'"offset":{offset + 4}}}'.encode()
    assert data.count(old) == 3 and len(old) == len(new)
    broken = tmp_path / "broken.so"
    broken.write_bytes(data.replace(old, new))
    with pytest.raises(minirt.ModuleLoadError, match="output 'boxes' has a count .* not \\{axis, offset\\} of one of "
                                                     "its axes and an aligned offset inside the workspace"):
        minirt.load(str(broken))


def test_nms_over_many_boxes_with_tied_scores_keeps_what_onnxruntime_keeps(tmp_path):
    """Candidates sorted once (equal scores: the lower index first), then
    each kept box suppresses the later ones it overlaps."""
    boxes_n, classes = 300, 2
    model = helper.make_model(helper.make_graph(
        [helper.make_node("NonMaxSuppression", ["boxes", "scores", "most", "iou", "floor"], ["selected"])],
        "nms", [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, boxes_n, 4]),
                helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, classes, boxes_n])],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, ["n", 3])],
        [helper.make_tensor("most", TensorProto.INT64, [1], [120]), helper.make_tensor("iou", TensorProto.FLOAT, [1], [0.3]),
         helper.make_tensor("floor", TensorProto.FLOAT, [1], [0.2])]),
        opset_imports=[helper.make_opsetid("", 13)])
    module = minirt.load(crosscompile.build(model, target="host").export_library(str(tmp_path / "nms.so")))
    rng = np.random.default_rng(3)
    corner = rng.random((1, boxes_n, 2), dtype=np.float32) * 10
    feeds = {"boxes": np.concatenate([corner, corner + 0.5 + rng.random((1, boxes_n, 2), dtype=np.float32)], axis=2),
             "scores": rng.integers(0, 8, (1, classes, boxes_n)).astype(np.float32) / 8}  # many ties
    got, = module.run(feeds)
    want, = reference(model, feeds)
    assert 20 < len(want) <= 2 * 120
    np.testing.assert_array_equal(got, want)
