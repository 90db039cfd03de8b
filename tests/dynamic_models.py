"""Models with a symbolic batch dimension "N", for tests/test_dynamic.py and
benchmarks/bench_dynamic.py: every op keeps batch rows apart.

    from tests.dynamic_models import conv_net
    model = conv_net()    # input "x" (N, 3, 12, 12) -> output "y" (N, 5)
"""
from tests.transformer_models import GraphBuilder


def conv_net(size=12, channels=8, classes=5):
    """Conv -> Relu -> MaxPool -> Conv -> Relu -> GlobalAveragePool ->
    Flatten -> Gemm, input "x" (N, 3, size, size), output "y" (N, classes)."""
    b = GraphBuilder(13, 0)
    wide = 2 * channels
    h = b.op("Relu", [b.op("Conv", ["x", b.weight(channels, 3, 3, 3, scale=0.3), b.weight(channels, scale=0.1)],
                           pads=[1] * 4)])
    h = b.op("MaxPool", [h], kernel_shape=[2, 2], strides=[2, 2])
    h = b.op("Relu", [b.op("Conv", [h, b.weight(wide, channels, 3, 3, scale=(9 * channels) ** -0.5)], pads=[1] * 4)])
    h = b.op("Flatten", [b.op("GlobalAveragePool", [h])])
    out = b.op("Gemm", [h, b.weight(classes, wide, scale=wide ** -0.5), b.weight(classes, scale=0.1)], transB=1)
    return b.model({"x": ("N", 3, size, size)}, out, "dynamic_conv")


def attention_block(tokens=5, width=16, heads=2, mlp=True):
    """x + Attention(LN(x)) then (with mlp) + MLP(LN(.)), batch-first
    throughout (heads split by Reshape [0, tokens, heads, head]), input "x"
    and output "y" (N, tokens, width)."""
    b = GraphBuilder(13, 1)
    head = width // heads

    def split(t):
        return b.op("Transpose", [b.op("Reshape", [t, b.ints([0, tokens, heads, head])])], perm=[0, 2, 1, 3])

    h = b.layer_norm("x", width)
    q, k, v = (split(b.linear(h, width, width)) for _ in range(3))
    scores = b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])]), b.const(head ** -0.5)])
    ctx = b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])
    ctx = b.op("Reshape", [b.op("Transpose", [ctx], perm=[0, 2, 1, 3]), b.ints([0, tokens, width])])
    x = b.op("Add", ["x", b.linear(ctx, width, width)])
    if mlp:
        x = b.op("Add", [x, b.linear(b.gelu(b.linear(b.layer_norm(x, width), width, 2 * width)), 2 * width, width)])
    return b.model({"x": ("N", tokens, width)}, x, "dynamic_attention")
