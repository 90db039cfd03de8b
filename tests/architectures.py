"""Torchvision-like architectures as ONNX graphs with random parameters.

Shaped as torch exports them in inference mode: BatchNorm folded into each
Conv's bias, the activation after it (Relu; ReLU6 as Clip with constant
bounds; SiLU as Sigmoid and Mul), residual Adds, a global average pool and a
Gemm classifier (dropout is gone at inference). Weights are He-scaled so
activations stay in range.

    >>> model = resnet(18)                  # input "input" (1, 3, 224, 224) -> "logits" (1, 1000)
    >>> model = mobilenet_v2()              # the same input and output
    >>> model = efficientnet_b0()
    >>> model = regnet_x_400mf()
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from tests.onnx_models import make_model

# Blocks per stage of torchvision's ResNets: basic blocks up to 34 layers, bottlenecks after.
RESNET_STAGES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3)}
# torchvision's MobileNetV2 stages: expansion, output channels, blocks, first stride.
MOBILENET_V2_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))
# torchvision's RegNetX-400MF stages: blocks, output width (group width 16,
# bottleneck ratio 1, first block of each stage strided).
REGNET_X_400MF_STAGES = ((1, 32), (2, 64), (7, 160), (12, 400))
REGNET_GROUP_WIDTH = 16
# torchvision's EfficientNet-B0 stages: expansion, kernel, first stride, output channels, blocks.
EFFICIENTNET_B0_STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                          (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))


class _GraphBuilder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.params = [], {}

    def name(self, kind: str) -> str:
        return f"{kind}{len(self.nodes)}"

    def conv(self, x: str, cin: int, cout: int, kernel: int, stride: int = 1, act: "str | None" = "relu",
             group: int = 1) -> str:
        """Conv with bias, padded to keep the size (over the stride), then act:
        "relu", "relu6", "silu" or None."""
        w, b = self.name("w"), self.name("b")
        fan_in = cin // group * kernel * kernel
        self.params[w] = (self.rng.standard_normal((cout, cin // group, kernel, kernel))
                          * np.sqrt(2.0 / fan_in)).astype(np.float32)
        self.params[b] = (0.1 * self.rng.standard_normal(cout)).astype(np.float32)
        y = self.name("conv")
        self.nodes.append(helper.make_node("Conv", [x, w, b], [y], name=y, kernel_shape=[kernel] * 2,
                                           strides=[stride] * 2, pads=[kernel // 2] * 4, group=group))
        return self.activate(y, act)

    def activate(self, x: str, act: "str | None") -> str:
        if act is None:
            return x
        if act == "relu":
            return self.relu(x)
        if act == "relu6":
            # torch's ReLU6 at opset 11 and later: Clip with its bounds as inputs.
            self.params.setdefault("relu6_min", np.array(0.0, np.float32))
            self.params.setdefault("relu6_max", np.array(6.0, np.float32))
            y = self.name("clip")
            self.nodes.append(helper.make_node("Clip", [x, "relu6_min", "relu6_max"], [y], name=y))
            return y
        if act == "silu":
            return self.mul(x, self.unary("Sigmoid", x))
        raise ValueError(f"unknown activation {act!r}")

    def unary(self, op_type: str, x: str) -> str:
        y = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, [x], [y], name=y))
        return y

    def relu(self, x: str) -> str:
        return self.unary("Relu", x)

    def mul(self, a: str, b: str) -> str:
        y = self.name("mul")
        self.nodes.append(helper.make_node("Mul", [a, b], [y], name=y))
        return y

    def add(self, a: str, b: str) -> str:
        y = self.name("add")
        self.nodes.append(helper.make_node("Add", [a, b], [y], name=y))
        return y

    def add_relu(self, a: str, b: str) -> str:
        return self.relu(self.add(a, b))

    def classifier(self, x: str, cin: int, classes: int, size: int, name: str) -> onnx.ModelProto:
        """Global average pool, Flatten and a Gemm to "logits": the finished model."""
        pooled = self.unary("GlobalAveragePool", x)
        flat = self.name("flat")
        self.nodes.append(helper.make_node("Flatten", [pooled], [flat], name=flat))
        self.params["fc_w"] = (self.rng.standard_normal((classes, cin)) * np.sqrt(0.01 / cin)).astype(np.float32)
        self.params["fc_b"] = np.zeros(classes, np.float32)
        self.nodes.append(helper.make_node("Gemm", [flat, "fc_w", "fc_b"], ["logits"], name="fc", transB=1))
        return make_model(self.nodes, {"input": (1, 3, size, size)}, {"logits": (1, classes)}, self.params,
                          name=name)


def resnet(depth: int = 18, classes: int = 1000, size: int = 224, seed: int = 0) -> onnx.ModelProto:
    """ResNet-18, -34 or -50 (v1.5: the bottleneck's stride on its 3x3)."""
    g = _GraphBuilder(seed)
    x = g.conv("input", 3, 64, 7, stride=2)
    pooled = g.name("pool")
    g.nodes.append(helper.make_node("MaxPool", [x], [pooled], name=pooled, kernel_shape=[3, 3],
                                    strides=[2, 2], pads=[1, 1, 1, 1]))
    x, cin = pooled, 64
    bottleneck = depth >= 50
    for stage, blocks in enumerate(RESNET_STAGES[depth]):
        width = 64 << stage
        cout = width * 4 if bottleneck else width
        for block in range(blocks):
            stride = 2 if stage and not block else 1
            if bottleneck:
                y = g.conv(x, cin, width, 1)
                y = g.conv(y, width, width, 3, stride)
                y = g.conv(y, width, cout, 1, act=None)
            else:
                y = g.conv(x, cin, width, 3, stride)
                y = g.conv(y, width, width, 3, act=None)
            shortcut = g.conv(x, cin, cout, 1, stride, act=None) if stride > 1 or cin != cout else x
            x, cin = g.add_relu(y, shortcut), cout
    return g.classifier(x, cin, classes, size, f"resnet{depth}")


def mobilenet_v2(classes: int = 1000, size: int = 224, seed: int = 0) -> onnx.ModelProto:
    """MobileNetV2 (width 1.0): inverted residual blocks of a 1x1 expansion,
    a 3x3 depthwise convolution and a linear 1x1 projection, ReLU6 between."""
    g = _GraphBuilder(seed)
    x, cin = g.conv("input", 3, 32, 3, stride=2, act="relu6"), 32
    for expansion, cout, blocks, first_stride in MOBILENET_V2_STAGES:
        for block in range(blocks):
            stride = first_stride if not block else 1
            hidden = cin * expansion
            y = g.conv(x, cin, hidden, 1, act="relu6") if expansion != 1 else x
            y = g.conv(y, hidden, hidden, 3, stride, act="relu6", group=hidden)
            y = g.conv(y, hidden, cout, 1, act=None)
            x, cin = (g.add(x, y) if stride == 1 and cin == cout else y), cout
    x = g.conv(x, cin, 1280, 1, act="relu6")
    return g.classifier(x, 1280, classes, size, "mobilenet_v2")


def efficientnet_b0(classes: int = 1000, size: int = 224, seed: int = 0) -> onnx.ModelProto:
    """EfficientNet-B0: MBConv blocks (1x1 expansion, depthwise 3x3 or 5x5,
    squeeze-and-excitation, linear 1x1 projection) with SiLU."""
    g = _GraphBuilder(seed)
    x, cin = g.conv("input", 3, 32, 3, stride=2, act="silu"), 32
    for expansion, kernel, first_stride, cout, blocks in EFFICIENTNET_B0_STAGES:
        for block in range(blocks):
            stride = first_stride if not block else 1
            hidden = cin * expansion
            y = g.conv(x, cin, hidden, 1, act="silu") if expansion != 1 else x
            y = g.conv(y, hidden, hidden, kernel, stride, act="silu", group=hidden)
            # Squeeze-and-excitation: a per-channel gate from the pooled
            # features, squeezed to a quarter of the block's input channels.
            squeezed = max(1, cin // 4)
            gate = g.conv(g.unary("GlobalAveragePool", y), hidden, squeezed, 1, act="silu")
            gate = g.unary("Sigmoid", g.conv(gate, squeezed, hidden, 1, act=None))
            y = g.conv(g.mul(y, gate), hidden, cout, 1, act=None)
            x, cin = (g.add(y, x) if stride == 1 and cin == cout else y), cout
    x = g.conv(x, cin, 1280, 1, act="silu")
    return g.classifier(x, 1280, classes, size, "efficientnet_b0")


def regnet_x_400mf(classes: int = 1000, size: int = 224, seed: int = 0) -> onnx.ModelProto:
    """RegNetX-400MF: residual bottlenecks whose 3x3 convolution is grouped
    in groups of 16 channels (a 1x1, the grouped 3x3 strided in a stage's
    first block, a linear 1x1, a projection shortcut where the shape
    changes, ReLU after the Add)."""
    g = _GraphBuilder(seed)
    x, cin = g.conv("input", 3, 32, 3, stride=2), 32
    for blocks, width in REGNET_X_400MF_STAGES:
        for block in range(blocks):
            stride = 2 if not block else 1
            y = g.conv(x, cin, width, 1)
            y = g.conv(y, width, width, 3, stride, group=width // REGNET_GROUP_WIDTH)
            y = g.conv(y, width, width, 1, act=None)
            shortcut = g.conv(x, cin, width, 1, stride, act=None) if stride > 1 or cin != width else x
            x, cin = g.add_relu(y, shortcut), width
    return g.classifier(x, cin, classes, size, "regnet_x_400mf")
