"""TopK, ArgMax/ArgMin, CumSum, GatherElements and Einsum against
onnxruntime: axes, keepdims, ties, select_last_index, exclusive and
reverse sums, runtime and constant indices, and the equations attention
is written with."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
from tests.onnx_models import make_model, rand, run_host
from tests.test_ops_logic import run_typed, typed_model, values


@pytest.mark.parametrize("shape,k,axis,largest", [
    ((2, 10), 5, -1, 1),        # a classifier's top five
    ((3, 7, 4), 3, 1, 0),       # the smallest, along a middle axis
    ((1, 37), 37, 1, 1),        # a full sort
    ((4, 6), 1, 0, 1),
    ((2, 5), 0, 1, 1),          # nothing
])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_topk(tmp_path, shape, k, axis, largest, dtype):
    # values() draws from few levels: ties must keep the lower index first.
    feeds = {"x": values(dtype, shape, 3)}
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)
    run_typed(typed_model([node], feeds, {"v": dtype, "i": np.int64}, {"k": np.array([k], np.int64)}, opset=11),
              feeds, tmp_path)


def test_topk_at_opset_1_takes_k_as_an_attribute(tmp_path):
    feeds = {"x": rand(3, 9)}
    node = helper.make_node("TopK", ["x"], ["v", "i"], k=4)
    run_typed(typed_model([node], feeds, {"v": np.float32, "i": np.int64}, opset=9), feeds, tmp_path)


def test_topk_larger_than_the_axis_is_refused():
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="top")
    model = typed_model([node], {"x": rand(2, 4)}, {"v": np.float32, "i": np.int64}, {"k": np.array([5], np.int64)})
    with pytest.raises(crosscompile.BuildError, match="node 'top' \\(TopK\\).*k=5 is outside"):
        crosscompile.build(model)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis,keepdims,last", [(0, 1, 0), (1, 0, 0), (-1, 1, 1), (2, 0, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_arg_max_min(tmp_path, op, axis, keepdims, last, dtype):
    feeds = {"x": values(dtype, (3, 5, 6), 4)}  # few levels: ties everywhere
    node = helper.make_node(op, ["x"], ["y"], axis=axis, keepdims=keepdims, select_last_index=last)
    run_typed(typed_model([node], feeds, {"y": np.int64}), feeds, tmp_path)


def test_argmax_of_logits_gives_token_ids(tmp_path):
    # A greedy decoder: ArgMax over the vocabulary, its ids gathered back into an embedding.
    feeds = {"logits": rand(2, 5, 11)}
    nodes = [helper.make_node("ArgMax", ["logits"], ["ids"], axis=-1, keepdims=0),
             helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)]
    run_typed(typed_model(nodes, feeds, {"y": np.float32}, {"table": rand(11, 4, seed=2)}), feeds, tmp_path)


@pytest.mark.parametrize("shape,axis", [((3, 17), 1), ((4, 5, 6), 0), ((2, 3, 4), -2), ((9,), 0)])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(tmp_path, shape, axis, exclusive, reverse):
    model = make_model([helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)],
                       {"x": shape}, {"y": None}, {"axis": np.array(axis, np.int64)}, opset=14)
    run_host(model, tmp_path)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_cumsum_of_an_attention_mask_gives_positions(tmp_path, dtype):
    # Position ids from a padding mask, as some exporters write them.
    feeds = {"mask": np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype)}
    node = helper.make_node("CumSum", ["mask", "axis"], ["y"])
    run_typed(typed_model([node], feeds, {"y": dtype}, {"axis": np.array(1, np.int32)}), feeds, tmp_path)


@pytest.mark.parametrize("data_shape,index_shape,axis", [
    ((3, 4), (3, 4), 1), ((3, 4), (2, 4), 0), ((2, 3, 5), (2, 3, 2), 2), ((4, 3, 2), (6, 2, 1), 0)])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_gather_elements(tmp_path, data_shape, index_shape, axis, dtype):
    rng = np.random.default_rng(5)
    size = data_shape[axis]
    feeds = {"data": rand(*data_shape), "idx": rng.integers(-size, size, index_shape).astype(dtype)}
    node = helper.make_node("GatherElements", ["data", "idx"], ["y"], axis=axis)
    run_typed(typed_model([node], feeds, {"y": np.float32}), feeds, tmp_path)


def test_gather_elements_with_constant_indices(tmp_path):
    feeds = {"data": values(np.int64, (3, 5))}
    node = helper.make_node("GatherElements", ["data", "idx"], ["y"], axis=1)
    run_typed(typed_model([node], feeds, {"y": np.int64}, {"idx": np.array([[4, 0], [1, 1], [-1, 2]], np.int64)}),
              feeds, tmp_path)


def einsum_model(equation, *shapes):
    names = [f"x{i}" for i in range(len(shapes))]
    node = helper.make_node("Einsum", names, ["y"], equation=equation, name="the_einsum")
    return make_model([node], dict(zip(names, shapes)), {"y": None}, opset=12)


@pytest.mark.parametrize("equation,shapes", [
    ("bhid,bhjd->bhij", [(1, 4, 9, 8), (1, 4, 11, 8)]),      # attention scores
    ("bhij,bhjd->bhid", [(2, 2, 9, 11), (2, 2, 11, 8)]),     # attention context
    ("bid,bjd->bij", [(3, 7, 5), (3, 6, 5)]),
    ("bij,bjk->bik", [(2, 4, 5), (2, 5, 3)]),
    ("ij,jk", [(4, 5), (5, 3)]),                              # implicit output
    ("bnd,dh->bnh", [(2, 6, 8), (8, 4)]),                     # a projection with a shared weight
    ("...ij,...kj->...ik", [(2, 3, 4, 5), (1, 3, 6, 5)]),     # broadcast batch
])
def test_einsum_products(tmp_path, equation, shapes):
    run_host(einsum_model(equation, *shapes), tmp_path)


@pytest.mark.parametrize("equation,shapes", [
    ("ij->ji", [(4, 6)]),
    ("ii->i", [(5, 5)]),
    ("bij->b", [(3, 4, 5)]),
    ("bhid,bhjd->bhji", [(1, 2, 4, 3), (1, 2, 5, 3)]),        # output not in row, column order
    ("i,i->", [(7,), (7,)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
])
def test_einsum_other_forms(tmp_path, equation, shapes):
    run_host(einsum_model(equation, *shapes), tmp_path)


def test_einsum_with_mismatched_sizes_is_refused():
    with pytest.raises(crosscompile.BuildError, match="the_einsum.*subscript 'j' has sizes 5 and 4"):
        crosscompile.build(einsum_model("ij,jk->ik", (3, 5), (4, 2)))
