"""Blocks of modern architectures built with onnx.helper the way
torch.onnx.export writes them, with random weights:

- vit_block: a pre-norm Vision Transformer encoder block (LayerNorm,
  multi-head self-attention with one fused QKV projection, LayerNorm, MLP
  with GELU), as timm's ViT exports;
- convnext_block: a ConvNeXt block (7x7 depthwise Conv, channels-last
  LayerNorm, pointwise MLP with GELU, layer scale, residual), then the
  classifier head (mean over H and W, LayerNorm, Gemm);
- swin_block: a pair of Swin Transformer blocks (windows, then shifted
  windows) as torch exports them: torch.roll as Slice and Concat, the
  window partition and its reverse as Reshape and Transpose, a relative
  position bias per head and the shifted windows' attention mask added to
  the scores;
- bert_encoder: a BERT-style encoder as transformers exports it: int64
  token ids gathered from an embedding table, an int64 attention mask made
  into an additive mask (Unsqueeze, Cast, Sub, Mul), post-norm layers with
  the scores by MatMul or, as some models write them, by Einsum.

Before opset 17 LayerNorm is spelled out (ReduceMean ... Div, Mul, Add);
from 17 on it is one LayerNormalization node. GELU is spelled out with Erf
before opset 20 and is one Gelu node from 20 on.

    from tests.transformer_models import vit_block
    model = vit_block(opset=13)    # input "x" (1, 17, 64) -> output "y" (1, 17, 64)
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from tests.onnx_models import make_model


class GraphBuilder:
    """Nodes and initializers of one model, with fresh names per call."""

    def __init__(self, opset: int, seed: int):
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], {}
        self.count = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, value, hint="c", dtype=np.float32) -> str:
        name = self.name(hint)
        self.inits[name] = np.asarray(value, dtype=dtype)
        return name

    def weight(self, *shape, scale=None, hint="w") -> str:
        scale = 1.0 / np.sqrt(shape[0]) if scale is None else scale
        return self.const(self.rng.standard_normal(shape) * scale, hint)

    def op(self, op_type, inputs, **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def ints(self, values) -> str:
        return self.const(values, "shape", np.int64)

    def linear(self, x, fan_in, fan_out) -> str:
        """MatMul by a (fan_in, fan_out) weight, then Add the bias (torch's nn.Linear on 3-D input)."""
        return self.op("Add", [self.op("MatMul", [x, self.weight(fan_in, fan_out)]),
                               self.weight(fan_out, scale=0.1, hint="b")])

    def layer_norm(self, x, width, axes=(-1,)) -> str:
        gamma = self.const(1.0 + 0.1 * self.rng.standard_normal(width), "gamma")
        beta = self.const(0.1 * self.rng.standard_normal(width), "beta")
        if self.opset >= 17:
            return self.op("LayerNormalization", [x, gamma, beta], axis=axes[0], epsilon=1e-6)
        mean = self.reduce_mean(x, axes)
        centred = self.op("Sub", [x, mean])
        variance = self.reduce_mean(self.op("Pow", [centred, self.const(2.0)]), axes)
        std = self.op("Sqrt", [self.op("Add", [variance, self.const(1e-6, "eps")])])
        return self.op("Add", [self.op("Mul", [self.op("Div", [centred, std]), gamma]), beta])

    def reduce_mean(self, x, axes, keepdims=1) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.ints(list(axes))], keepdims=keepdims)
        return self.op("ReduceMean", [x], axes=list(axes), keepdims=keepdims)

    def gelu(self, x) -> str:
        if self.opset >= 20:
            return self.op("Gelu", [x])
        erf = self.op("Erf", [self.op("Div", [x, self.const(np.sqrt(2.0))])])
        inner = self.op("Mul", [x, self.op("Add", [erf, self.const(1.0)])])
        return self.op("Mul", [inner, self.const(0.5)])

    def model(self, inputs, output, name, int64_inputs=()):
        """The model with input shapes {name: shape} (float32, or int64 for
        those named in int64_inputs) and output "y"."""
        self.nodes.append(helper.make_node("Identity", [output], ["y"], name="output"))
        model = make_model(self.nodes, inputs, {"y": None}, self.inits, opset=self.opset, name=name)
        for vi in model.graph.input:
            if vi.name in int64_inputs:
                vi.type.tensor_type.elem_type = TensorProto.INT64
        return model


def vit_block(tokens: int = 17, width: int = 64, heads: int = 4, opset: int = 13, seed: int = 0):
    """x + Attention(LN(x)), then + MLP(LN(.)), on input "x" (1, tokens, width)."""
    b = GraphBuilder(opset, seed)
    head = width // heads
    h = b.layer_norm("x", width)
    qkv = b.linear(h, width, 3 * width)
    qkv = b.op("Reshape", [qkv, b.ints([1, tokens, 3, heads, head])])
    qkv = b.op("Transpose", [qkv], perm=[2, 0, 3, 1, 4])         # (3, 1, heads, tokens, head)
    q, k, v = (b.op("Gather", [qkv, b.ints(i)], axis=0) for i in range(3))
    scores = b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])])
    attn = b.op("Softmax", [b.op("Mul", [scores, b.const(head ** -0.5)])], axis=-1)
    ctx = b.op("Transpose", [b.op("MatMul", [attn, v])], perm=[0, 2, 1, 3])
    ctx = b.op("Reshape", [ctx, b.ints([1, tokens, width])])
    x = b.op("Add", ["x", b.linear(ctx, width, width)])
    mlp = b.linear(b.gelu(b.linear(b.layer_norm(x, width), width, 4 * width)), 4 * width, width)
    return b.model({"x": (1, tokens, width)}, b.op("Add", [x, mlp]), "vit_block")


def convnext_block(channels: int = 32, size: int = 14, classes: int = 10, opset: int = 13, seed: int = 0):
    """x + gamma * MLP(LN(dwconv(x))) in channels-last, then mean over H and W,
    LayerNorm and a Gemm head, on input "x" (1, channels, size, size)."""
    b = GraphBuilder(opset, seed)
    dw = b.op("Conv", ["x", b.weight(channels, 1, 7, 7, scale=1 / 7), b.weight(channels, scale=0.1)],
              group=channels, kernel_shape=[7, 7], pads=[3, 3, 3, 3])
    h = b.layer_norm(b.op("Transpose", [dw], perm=[0, 2, 3, 1]), channels)
    h = b.linear(b.gelu(b.linear(h, channels, 4 * channels)), 4 * channels, channels)
    h = b.op("Mul", [h, b.const(0.5 + 0.1 * b.rng.standard_normal(channels), "layer_scale")])
    x = b.op("Add", ["x", b.op("Transpose", [h], perm=[0, 3, 1, 2])])
    pooled = b.layer_norm(b.reduce_mean(x, [-2, -1], keepdims=0), channels)
    logits = b.op("Gemm", [pooled, b.weight(classes, channels), b.weight(classes, scale=0.1)], transB=1)
    return b.model({"x": (1, channels, size, size)}, logits, "convnext_block")


def swin_block(size: int = 8, window: int = 4, width: int = 32, heads: int = 2, opset: int = 13, seed: int = 0):
    """Two Swin blocks on input "x" (1, size * size, width): window attention
    (pre-norm, residual), an MLP, then the same with the windows shifted by
    half a window."""
    b = GraphBuilder(opset, seed)
    head, tokens, count = width // heads, window * window, (size // window) ** 2
    x = "x"
    for shift in (0, window // 2):
        h = b.op("Reshape", [b.layer_norm(x, width), b.ints([1, size, size, width])])
        if shift:
            h = _roll(b, _roll(b, h, -shift, 1, size), -shift, 2, size)
        # Window partition: (1, H/ws, ws, W/ws, ws, C) -> (windows, ws * ws, C).
        h = b.op("Reshape", [h, b.ints([1, size // window, window, size // window, window, width])])
        h = b.op("Transpose", [h], perm=[0, 1, 3, 2, 4, 5])
        h = b.op("Reshape", [h, b.ints([count, tokens, width])])
        qkv = b.op("Reshape", [b.linear(h, width, 3 * width), b.ints([count, tokens, 3, heads, head])])
        qkv = b.op("Transpose", [qkv], perm=[2, 0, 3, 1, 4])    # (3, windows, heads, tokens, head)
        q, k, v = (b.op("Gather", [qkv, b.ints(i)], axis=0) for i in range(3))
        q = b.op("Mul", [q, b.const(head ** -0.5)])
        scores = b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])])
        scores = b.op("Add", [scores, b.weight(heads, tokens, tokens, scale=0.5, hint="relative_position_bias")])
        if shift:
            scores = b.op("Add", [scores, b.const(_shifted_window_mask(size, window, shift), "attn_mask")])
        ctx = b.op("Transpose", [b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])], perm=[0, 2, 1, 3])
        h = b.linear(b.op("Reshape", [ctx, b.ints([count, tokens, width])]), width, width)
        # Window reverse, then the shift undone.
        h = b.op("Reshape", [h, b.ints([1, size // window, size // window, window, window, width])])
        h = b.op("Reshape", [b.op("Transpose", [h], perm=[0, 1, 3, 2, 4, 5]), b.ints([1, size, size, width])])
        if shift:
            h = _roll(b, _roll(b, h, shift, 1, size), shift, 2, size)
        x = b.op("Add", [x, b.op("Reshape", [h, b.ints([1, size * size, width])])])
        mlp = b.linear(b.gelu(b.linear(b.layer_norm(x, width), width, 4 * width)), 4 * width, width)
        x = b.op("Add", [x, mlp])
    return b.model({"x": (1, size * size, width)}, x, "swin_block")


def _roll(b: GraphBuilder, x: str, shift: int, axis: int, size: int) -> str:
    """torch.roll(x, shift, axis) as torch.onnx.export writes it: two Slices and a Concat."""
    cut = -shift % size

    def part(start, end):
        return b.op("Slice", [x, b.ints([start]), b.ints([end]), b.ints([axis])])
    return b.op("Concat", [part(cut, size), part(0, cut)], axis=axis)


def _shifted_window_mask(size: int, window: int, shift: int) -> np.ndarray:
    """(windows, 1, tokens, tokens): -100 between tokens of a shifted window
    that came from different regions of the image, 0 elsewhere (Swin's)."""
    regions = np.zeros((size, size))
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    label = 0
    for rows in bounds:
        for cols in bounds:
            regions[rows, cols] = label
            label += 1
    per_window = regions.reshape(size // window, window, size // window, window).transpose(0, 2, 1, 3)
    per_window = per_window.reshape(-1, window * window)
    mask = np.where(per_window[:, None, :] != per_window[:, :, None], -100.0, 0.0)
    return mask[:, None].astype(np.float32)


def bert_encoder(tokens: int = 16, width: int = 32, heads: int = 4, layers: int = 2, vocab: int = 50,
                 opset: int = 13, einsum: bool = False, seed: int = 0):
    """Embeddings, then `layers` post-norm encoder layers, on int64 inputs
    "input_ids" and "attention_mask" (1, tokens); output "y" (1, tokens, width)."""
    b = GraphBuilder(opset, seed)
    head = width // heads
    words = b.op("Gather", [b.weight(vocab, width, scale=1.0, hint="word_embeddings"), "input_ids"], axis=0)
    # Position and token type ids are constants: their Gathers fold at import.
    positions = b.op("Gather", [b.weight(tokens, width, scale=0.1, hint="position_embeddings"),
                                b.ints([list(range(tokens))])], axis=0)
    types = b.op("Gather", [b.weight(2, width, scale=0.1, hint="token_type_embeddings"),
                            b.ints([[0] * tokens])], axis=0)
    h = b.layer_norm(b.op("Add", [b.op("Add", [words, types]), positions]), width)
    mask = b.op("Cast", [b.op("Unsqueeze", ["attention_mask", b.ints([1, 2])])], to=TensorProto.FLOAT)
    mask = b.op("Mul", [b.op("Sub", [b.const(1.0), mask]), b.const(np.finfo(np.float32).min)])

    def split_heads(x):
        x = b.op("Reshape", [x, b.ints([1, tokens, heads, head])])
        return b.op("Transpose", [x], perm=[0, 2, 1, 3])           # (1, heads, tokens, head)
    for _ in range(layers):
        q, k, v = (split_heads(b.linear(h, width, width)) for _ in range(3))
        if einsum:
            scores = b.op("Einsum", [q, k], equation="bhid,bhjd->bhij")
        else:
            scores = b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])])
        scores = b.op("Add", [b.op("Div", [scores, b.const(np.sqrt(head))]), mask])
        probs = b.op("Softmax", [scores], axis=-1)
        if einsum:
            ctx = b.op("Einsum", [probs, v], equation="bhij,bhjd->bhid")
        else:
            ctx = b.op("MatMul", [probs, v])
        ctx = b.op("Reshape", [b.op("Transpose", [ctx], perm=[0, 2, 1, 3]), b.ints([1, tokens, width])])
        h = b.layer_norm(b.op("Add", [b.linear(ctx, width, width), h]), width)
        ffn = b.linear(b.gelu(b.linear(h, width, 4 * width)), 4 * width, width)
        h = b.layer_norm(b.op("Add", [ffn, h]), width)
    return b.model({"input_ids": (1, tokens), "attention_mask": (1, tokens)}, h, "bert_encoder",
                   int64_inputs=("input_ids", "attention_mask"))


def bert_feeds(model, seed: int = 1) -> dict:
    """Token ids across the vocabulary and a mask hiding the last quarter (padding)."""
    (ids, _), = [(vi, 0) for vi in model.graph.input if vi.name == "input_ids"]
    tokens = ids.type.tensor_type.shape.dim[1].dim_value
    vocab = next(i.dims[0] for i in model.graph.initializer if i.name.startswith("word_embeddings"))
    mask = np.ones((1, tokens), np.int64)
    mask[:, tokens - tokens // 4:] = 0
    return {"input_ids": np.random.default_rng(seed).integers(0, vocab, (1, tokens)).astype(np.int64),
            "attention_mask": mask}
