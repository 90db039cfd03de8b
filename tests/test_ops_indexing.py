"""GatherND, ScatterND, ScatterElements and OneHot with the parts onnx's
own cases leave out: an element-wise op fused after a scatter (it must see
the updates, not only the copied data), int64 data, batch_dims, and
OneHot of integer values along a middle axis; against onnxruntime."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

import crosscompile
import minirt
from tests.onnx_models import reference


def test_indexing_ops_match_onnxruntime(tmp_path):
    rng = np.random.default_rng(5)
    feeds = {"data": rng.standard_normal((4, 3, 5)).astype(np.float32),
             "ids": rng.integers(-50, 50, (2, 6, 3)).astype(np.int64),
             "nd": np.array([[[1], [0]], [[2], [2]]], np.int64),
             "rows": np.array([[2, 0], [-1, 1]], np.int64),
             "classes": np.array([[0, 2, -1], [1, 1, 3]], np.int64)}
    nodes = [
        helper.make_node("ScatterND", ["data", "rows_nd", "updates"], ["scattered"]),
        helper.make_node("Relu", ["scattered"], ["relu_after_scatter"]),
        helper.make_node("GatherND", ["ids", "nd"], ["gathered"], batch_dims=1),
        helper.make_node("ScatterElements", ["ids", "where", "more"], ["summed"], axis=1, reduction="add"),
        helper.make_node("OneHot", ["classes", "depth", "values"], ["hot"], axis=1),
    ]
    inits = {"rows_nd": np.array([[3], [0]], np.int64),
             "updates": rng.standard_normal((2, 3, 5)).astype(np.float32),
             "where": np.array([[[1, 5, 0]], [[-1, 0, 0]]], np.int64),
             "more": np.array([[[100, 200, 300]], [[7, 8, 9]]], np.int64),
             "depth": np.array(4, np.int64), "values": np.array([-3, 9], np.int64)}
    del feeds["rows"]
    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
             np.dtype(np.int32): TensorProto.INT32}
    graph = helper.make_graph(
        nodes, "indexing",
        [helper.make_tensor_value_info(n, types[v.dtype], v.shape) for n, v in feeds.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("relu_after_scatter", TensorProto.FLOAT), ("gathered", TensorProto.INT64),
          ("summed", TensorProto.INT64), ("hot", TensorProto.INT64))],
        [numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    lib = crosscompile.build(model, target="host")
    assert lib.summary["fused_ops"] == 1  # the Relu runs inside the ScatterND kernel
    got = minirt.load(lib.export_library(str(tmp_path / "m.so"))).run(feeds)
    want = reference(model, feeds)
    for name, g, w in zip(("relu_after_scatter", "gathered", "summed", "hot"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=0, atol=0, err_msg=name)
    # The scattered rows went through the Relu too.
    np.testing.assert_array_equal(got[0][3], np.maximum(inits["updates"][0], 0))


def test_compress_with_a_constant_condition_matches_onnxruntime(tmp_path):
    """Compress along a middle axis, along the last one (negative axis,
    a condition shorter than the axis) and without axis (the flattened
    input), on float32 and int64 data; and a condition given at run time,
    whose output is cut to the slices it keeps (crosscompile/bounded.py)."""
    rng = np.random.default_rng(9)
    feeds = {"x": rng.standard_normal((3, 4, 5)).astype(np.float32),
             "ids": rng.integers(-9, 9, (2, 6)).astype(np.int64)}
    inits = {"middle": np.array([True, False, True, True]), "last": np.array([False, True, False, True]),
             "flat": rng.random(12) > 0.5}
    nodes = [helper.make_node("Compress", ["x", "middle"], ["a"], axis=1),
             helper.make_node("Compress", ["x", "last"], ["b"], axis=-1),
             helper.make_node("Compress", ["ids", "flat"], ["c"])]
    graph = helper.make_graph(
        nodes, "compress",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (3, 4, 5)),
         helper.make_tensor_value_info("ids", TensorProto.INT64, (2, 6))],
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("a", TensorProto.FLOAT), ("b", TensorProto.FLOAT), ("c", TensorProto.INT64))],
        [numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got = minirt.load(crosscompile.build(model, target="host").export_library(str(tmp_path / "m.so"))).run(feeds)
    want = reference(model, feeds)
    for name, g, w in zip("abc", got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert got[2].shape == (int(inits["flat"].sum()),)

    del model.graph.initializer[0]
    model.graph.input.append(helper.make_tensor_value_info("middle", TensorProto.BOOL, (4,)))
    module = minirt.load(crosscompile.build(model, target="host").export_library(str(tmp_path / "r.so")))
    assert module.outputs[0].shape == (3, 4, 5) and module.outputs[0].count[0] == 1
    for middle in ([True, False, True, True], [False] * 4, [True] * 4):
        feeds["middle"] = np.array(middle)
        got, want = module.run(feeds)[0], reference(model, feeds)[0]
        assert got.shape == want.shape == (3, sum(middle), 5)
        np.testing.assert_array_equal(got, want)
