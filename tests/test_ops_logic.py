"""Boolean and integer tensors against onnxruntime: comparisons giving
masks, Not/And/Or/Xor, Where, Cast between float32, int64, int32 and bool,
Gather with runtime indices (token ids into an embedding table) and int64,
int32 and bool model inputs and outputs."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import crosscompile
import minirt
from tests.onnx_models import IR_VERSION, reference

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
        np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL}


def typed_model(nodes, feeds: dict, outputs: dict, inits=(), opset=13):
    """A model whose inputs take the dtypes and shapes of `feeds` and whose
    outputs are {name: numpy dtype}."""
    graph = helper.make_graph(
        nodes, "typed",
        [helper.make_tensor_value_info(n, ELEM[v.dtype], v.shape) for n, v in feeds.items()],
        [helper.make_tensor_value_info(n, ELEM[np.dtype(t)], None) for n, t in outputs.items()],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in dict(inits).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)


def run_typed(model, feeds, tmp_path):
    """Outputs equal onnxruntime's, dtype and all."""
    lib = crosscompile.build(model)
    got = minirt.load(lib.export_library(tmp_path / "m.so")).run(feeds)
    want = reference(model, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    return lib


def values(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    if dtype == np.float32:
        return np.asarray(np.round(rng.standard_normal(shape) * 2), np.float32)  # ties for Equal
    return np.asarray(rng.integers(-3, 4, shape), dtype)


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.int32])
@pytest.mark.parametrize("a_shape,b_shape", [((3, 7), (3, 7)), ((2, 3, 5), (5,)), ((4, 1), (1, 6))])
def test_comparison(tmp_path, op, dtype, a_shape, b_shape):
    feeds = {"a": values(dtype, a_shape, 1), "b": values(dtype, b_shape, 2)}
    run_typed(typed_model([helper.make_node(op, ["a", "b"], ["y"])], feeds, {"y": np.bool_}, opset=16),
              feeds, tmp_path)


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
@pytest.mark.parametrize("a_shape,b_shape", [((3, 7), (3, 7)), ((2, 1, 5), (3, 1))])
def test_logical(tmp_path, op, a_shape, b_shape):
    feeds = {"a": values(np.bool_, a_shape, 1), "b": values(np.bool_, b_shape, 2)}
    nodes = [helper.make_node(op, ["a", "b"], ["c"]), helper.make_node("Not", ["c"], ["y"])]
    run_typed(typed_model(nodes, feeds, {"y": np.bool_}), feeds, tmp_path)


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
@pytest.mark.parametrize("shapes", [((3, 5), (3, 5), (3, 5)), ((1, 5), (4, 1), ()), ((2, 1, 3), (3,), (2, 4, 1))])
def test_where(tmp_path, dtype, shapes):
    feeds = {"c": values(np.bool_, shapes[0]), "x": values(dtype, shapes[1], 1), "z": values(dtype, shapes[2], 2)}
    run_typed(typed_model([helper.make_node("Where", ["c", "x", "z"], ["y"])], feeds, {"y": dtype}, opset=16),
              feeds, tmp_path)


def test_attention_mask_from_a_comparison_of_scores(tmp_path):
    # masked_fill as torch exports it: Where(mask == 0, -inf-ish, scores), then Softmax.
    feeds = {"scores": np.random.default_rng(0).standard_normal((2, 4, 4)).astype(np.float32),
             "mask": np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.int64)}
    nodes = [helper.make_node("Unsqueeze", ["mask", "axis"], ["m"]),
             helper.make_node("Equal", ["m", "zero"], ["hidden"]),
             helper.make_node("Where", ["hidden", "fill", "scores"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["y"], axis=-1)]
    inits = {"axis": np.array([1], np.int64), "zero": np.array(0, np.int64), "fill": np.array(-1e9, np.float32)}
    run_typed(typed_model(nodes, feeds, {"y": np.float32}, inits), feeds, tmp_path)


@pytest.mark.parametrize("source,target", [
    (np.float32, np.int64), (np.float32, np.int32), (np.float32, np.bool_), (np.int64, np.float32),
    (np.int32, np.float32), (np.bool_, np.float32), (np.int64, np.int32), (np.int32, np.int64),
    (np.bool_, np.int64), (np.int64, np.bool_), (np.float32, np.float32)])
def test_cast(tmp_path, source, target):
    x = values(source, (3, 11))
    if source == np.float32:
        x = (np.random.default_rng(3).standard_normal((3, 11)) * 5).astype(np.float32)
        x[0, :3] = [0.0, -0.0, -2.5]
    feeds = {"x": x}
    node = helper.make_node("Cast", ["x"], ["y"], to=ELEM[np.dtype(target)])
    run_typed(typed_model([node], feeds, {"y": target}), feeds, tmp_path)


@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("axis,ids", [(0, [[3, 0, 49, -1, 7, 7]]), (1, [2, -3]), (0, 5)])
def test_gather_with_runtime_indices(tmp_path, index_dtype, axis, ids):
    table = np.random.default_rng(0).standard_normal((50, 16)).astype(np.float32)
    if axis == 1:
        table = table.reshape(10, 5, 16)
    feeds = {"ids": np.array(ids, index_dtype)}
    node = helper.make_node("Gather", ["table", "ids"], ["y"], axis=axis)
    run_typed(typed_model([node], feeds, {"y": np.float32}, {"table": table}), feeds, tmp_path)


def test_token_and_position_embeddings_with_an_int64_mask(tmp_path):
    # A BERT-style input layer: word + position embeddings, and the additive
    # attention mask (1 - mask) * -10000 from int64 token ids and mask.
    rng = np.random.default_rng(1)
    inits = {"words": rng.standard_normal((30, 8)).astype(np.float32),
             "positions": rng.standard_normal((6, 8)).astype(np.float32),
             "position_ids": np.arange(6, dtype=np.int64).reshape(1, 6), "axes": np.array([1, 2], np.int64),
             "one": np.array(1.0, np.float32), "big": np.array(-10000.0, np.float32)}
    nodes = [helper.make_node("Gather", ["words", "ids"], ["w"]),
             helper.make_node("Gather", ["positions", "position_ids"], ["p"]),
             helper.make_node("Add", ["w", "p"], ["embedded"]),
             helper.make_node("Unsqueeze", ["mask", "axes"], ["m"]),
             helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Sub", ["one", "mf"], ["inverted"]),
             helper.make_node("Mul", ["inverted", "big"], ["bias"])]
    feeds = {"ids": rng.integers(0, 30, (2, 6)).astype(np.int64),
             "mask": np.array([[1] * 6, [1] * 4 + [0] * 2], np.int64)}
    run_typed(typed_model(nodes, feeds, {"embedded": np.float32, "bias": np.float32}, inits), feeds, tmp_path)


def test_int64_output_of_a_reshaped_input(tmp_path):
    feeds = {"ids": np.arange(12, dtype=np.int64).reshape(3, 4)}
    nodes = [helper.make_node("Reshape", ["ids", "shape"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
    lib = run_typed(typed_model(nodes, feeds, {"y": np.int64}, {"shape": np.array([2, 6], np.int64)}),
                    feeds, tmp_path)
    assert lib.metadata["outputs"][0]["dtype"] == "int64"


@pytest.mark.parametrize("nodes,feeds,pattern", [
    ([helper.make_node("Relu", ["ids"], ["y"], name="act")], {"ids": np.zeros(3, np.int64)},
     r"node 'act' \(Relu\): input 'ids' has dtype int64; Relu takes float32 tensors only"),
    ([helper.make_node("Where", ["c", "c", "c"], ["y"], name="pick")], {"c": np.zeros(3, np.float32)},
     r"node 'pick' \(Where\): Where takes a bool condition"),
    ([helper.make_node("Gather", ["t", "c"], ["y"], name="rows")], {"c": np.zeros(3, np.float32)},
     r"node 'rows' \(Gather\): Gather indices 'c' have dtype float32; int64 or int32"),
    ([helper.make_node("Equal", ["ids", "c"], ["y"], name="same")],
     {"ids": np.zeros(3, np.int64), "c": np.zeros(3, np.float32)},
     r"node 'same' \(Equal\): Equal takes inputs of one dtype"),
])
def test_wrong_dtypes_are_refused_naming_the_node(nodes, feeds, pattern):
    model = typed_model(nodes, feeds, {"y": np.float32}, {"t": np.zeros((4, 2), np.float32)})
    with pytest.raises(crosscompile.BuildError, match=pattern):
        crosscompile.build(model)


@pytest.mark.parametrize("source,target", [("float32", "int32"), ("int32", "float32"), ("uint16", "int16"),
                                           ("int8", "uint8"), ("bool", "uint8")])
def test_bitcast_reads_the_bits_as_the_other_type(tmp_path, source, target):
    """BitCast between types of one width, against numpy's view of the bits."""
    from onnx.helper import np_dtype_to_tensor_dtype
    x = np.random.default_rng(0).integers(-100, 100, (3, 5)).astype(source)
    if source == "float32":
        x = np.array([[1.5, -0.0, np.inf, -2.25e-39, 3e38]] * 3, np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("BitCast", ["x"], ["y"], to=np_dtype_to_tensor_dtype(np.dtype(target)))], "bitcast",
        [helper.make_tensor_value_info("x", np_dtype_to_tensor_dtype(x.dtype), x.shape)],
        [helper.make_tensor_value_info("y", np_dtype_to_tensor_dtype(np.dtype(target)), x.shape)]),
        opset_imports=[helper.make_opsetid("", 26)])
    path = crosscompile.build(model, "host").export_library(str(tmp_path / "bitcast.so"))
    got, = minirt.load(path).run({"x": x})
    np.testing.assert_array_equal(got, x.view(target))


def test_bitcast_of_float64_is_refused_by_name():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("BitCast", ["x"], ["y"], to=TensorProto.DOUBLE)], "bitcast",
        [helper.make_tensor_value_info("x", TensorProto.INT64, (2,))],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, (2,))]),
        opset_imports=[helper.make_opsetid("", 26)])
    with pytest.raises(crosscompile.BuildError, match="BitCast from int64 to float64 is not supported"):
        crosscompile.build(model, "host")
