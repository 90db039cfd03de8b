"""Attention's MatMul(Q, K^T) -> scale -> (+ mask) -> Softmax -> MatMul(., V)
as one kernel (patterns.fuse_attention, crosscompile/attention.py): one
head's scores at a time per thread, compared with onnxruntime on 1, 2 and
3 threads; chains that differ keep their separate ops and stay correct;
a BERT-style encoder's workspace holds the scores of a few heads, not of
all of them."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
from crosscompile.patterns import ATTENTION_SLOTS
from tests.onnx_models import make_model
from tests.test_ops_matmul import run_threads, steps
from tests.transformer_models import bert_encoder


def attention(batch, heads, m, n, d, dv, mask=None, scale=("Div", 4.0), axis=-1, constant_mask=None):
    """softmax(Q @ K^T / scale + mask) @ V on inputs q (batch, heads, m, d),
    k (batch, heads, n, d), v (batch, heads, n, dv) and a mask input of
    shape `mask` (or the constant constant_mask)."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"])]
    inits, last = {}, "scores"
    if scale is not None:
        inits["s"] = np.float32(scale[1])
        nodes.append(helper.make_node(scale[0], [last, "s"], ["scaled"]))
        last = "scaled"
    inputs = {"q": (batch, heads, m, d), "k": (batch, heads, n, d), "v": (batch, heads, n, dv)}
    if mask is not None or constant_mask is not None:
        if constant_mask is not None:
            inits["mask"] = constant_mask
        else:
            inputs["mask"] = mask
        nodes.append(helper.make_node("Add", [last, "mask"], ["masked"]))
        last = "masked"
    nodes += [helper.make_node("Softmax", [last], ["probs"], axis=axis),
              helper.make_node("MatMul", ["probs", "v"], ["y"])]
    return make_model(nodes, inputs, {"y": None}, inits)


@pytest.mark.parametrize("batch,heads,m,n,d,dv,mask", [
    (1, 1, 5, 5, 8, 8, None),               # one head, fewer tokens than a vector
    (1, 4, 17, 17, 16, 16, None),           # a ViT block's heads
    (2, 3, 13, 19, 8, 5, (2, 1, 1, 19)),    # a padding mask per sequence, odd sizes
    (1, 6, 33, 33, 12, 12, (1, 6, 33, 33)),  # a mask per head and row
    (1, 2, 1, 9, 4, 3, (9,)),               # one query row
])
def test_fused_attention_matches_onnxruntime(tmp_path, batch, heads, m, n, d, dv, mask):
    lib = run_threads(attention(batch, heads, m, n, d, dv, mask), tmp_path)
    fused = ["MatMul", "Div"] + (["Add"] if mask else []) + ["Softmax", "MatMul"]
    assert ("FusedAttention", fused) in steps(lib)
    assert not {"Softmax", "MatMul"} & {op for op, _ in steps(lib)}


def test_scale_by_mul_and_two_constant_masks_fuse(tmp_path):
    """Swin's form: scale on Q (outside the chain), a bias per head and a mask per window."""
    rng = np.random.default_rng(3)
    model = attention(4, 2, 16, 16, 8, 8, scale=("Mul", 0.35), constant_mask=rng.standard_normal(
        (2, 16, 16)).astype(np.float32))
    graph = model.graph
    graph.initializer.append(helper.make_tensor("window_mask", 1, (4, 1, 16, 16),
                                                rng.standard_normal((4, 1, 16, 16)).ravel().tolist()))
    adds = [n for n in graph.node if n.op_type == "Add"]
    adds[0].output[0] = "biased"
    graph.node.insert(list(graph.node).index(adds[0]) + 1,
                      helper.make_node("Add", ["biased", "window_mask"], ["masked"]))
    lib = run_threads(model, tmp_path)
    assert ("FusedAttention", ["MatMul", "Mul", "Add", "Add", "Softmax", "MatMul"]) in steps(lib)


@pytest.mark.parametrize("kwargs", [
    {"mask": (1, 2, 7, 1)},   # a mask broadcast along the columns
    {"axis": 2},              # Softmax over the query rows
    {"scale": None, "mask": (1, 2, 7, 9)},  # no scale: still fused
])
def test_chains_that_differ_stay_correct(tmp_path, kwargs):
    lib = run_threads(attention(1, 2, 7, 9, 4, 6, **kwargs), tmp_path)
    fusable = kwargs.get("axis", -1) == -1 and kwargs.get("mask", (9,))[-1] == 9
    assert any(op == "FusedAttention" for op, _ in steps(lib)) == fusable


def test_bert_workspace_holds_a_few_heads_scores_not_all():
    tokens, heads = 128, 8
    lib = crosscompile.build(bert_encoder(tokens=tokens, width=64, heads=heads), "host")
    assert [op for op, _ in steps(lib)].count("FusedAttention") == 2
    all_scores = heads * tokens * tokens * 4
    assert ATTENTION_SLOTS < heads
    assert lib.summary["workspace_bytes"] < all_scores
    assert lib.summary["workspace_bytes"] >= ATTENTION_SLOTS * tokens * tokens * 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("padded", [False, True])
def test_narrow_causal_attention_rounds_its_steps_as_onnx_defines(tmp_path, dtype, padded):
    """Opset-23 causal Attention on float16 and bfloat16 tensors: its body's
    steps (the scaled Q and K, the scores, the softmax's Exp and sum, the
    probabilities) are each rounded to the type, so the module gives onnx's
    reference results bit for bit (over many draws, where computing them in
    float32 and rounding once is a unit off in the last place now and then)."""
    import ml_dtypes
    import onnx
    from onnx.reference import ReferenceEvaluator

    import minirt

    np_type = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    kind = {"bfloat16": onnx.TensorProto.BFLOAT16, "float16": onnx.TensorProto.FLOAT16}[dtype]
    shapes = {"Q": [2, 3, 4, 8], "K": [2, 3, 6, 8], "V": [2, 3, 6, 8]}
    inputs = [helper.make_tensor_value_info(name, kind, shape) for name, shape in shapes.items()]
    names = ["Q", "K", "V"]
    if padded:
        inputs.append(helper.make_tensor_value_info("nonpad_kv_seqlen", onnx.TensorProto.INT64, [2]))
        names += ["", "", "", "nonpad_kv_seqlen"]
    node = helper.make_node("Attention", names, ["Y"], is_causal=1)
    graph = helper.make_graph([node], "attention", inputs, [helper.make_tensor_value_info("Y", kind, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24 if padded else 23)])
    path = crosscompile.build(model, "host").export_library(str(tmp_path / "attention.so"))
    module, reference = minirt.load(path), ReferenceEvaluator(model)
    rng = np.random.default_rng(7)
    for _ in range(40):
        feeds = {name: rng.random(shape).astype(np_type) for name, shape in shapes.items()}
        if padded:
            feeds["nonpad_kv_seqlen"] = np.array([4, 5], np.int64)
        got, = module.run(feeds)
        want, = reference.run(None, feeds)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("attrs", [{}, {"scale": 0.3}])
def test_preview_flex_attention_is_expanded_into_its_body(tmp_path, attrs):
    """ai.onnx.preview's FlexAttention (grouped K and V heads) becomes the
    body ONNX builds for it, and matches onnx's reference."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    import minirt

    shapes = {"Q": [2, 4, 5, 8], "K": [2, 2, 7, 8], "V": [2, 2, 7, 6]}
    inputs = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    node = helper.make_node("FlexAttention", list(shapes), ["Y"], domain="ai.onnx.preview", **attrs)
    graph = helper.make_graph([node], "flex", inputs, [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT,
                                                                                      None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26),
                                                    helper.make_opsetid("ai.onnx.preview", 1)])
    rng = np.random.default_rng(8)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    got, = minirt.load(crosscompile.build(model, "host").export_library(str(tmp_path / "m.so"))).run(feeds)
    want, = ReferenceEvaluator(model).run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
