"""Torchvision-like architectures as ONNX graphs with random parameters.

Shaped as torch exports them in inference mode: BatchNorm folded into each
Conv's bias, ReLU after it, residual Adds, a global average pool and a Gemm
classifier. Weights are He-scaled so activations stay in range.

    >>> model = resnet(18)                  # input "input" (1, 3, 224, 224) -> "logits" (1, 1000)
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from tests.onnx_models import make_model

# Blocks per stage of torchvision's ResNets: basic blocks up to 34 layers, bottlenecks after.
RESNET_STAGES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3)}


class _GraphBuilder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.params = [], {}

    def name(self, kind: str) -> str:
        return f"{kind}{len(self.nodes)}"

    def conv(self, x: str, cin: int, cout: int, kernel: int, stride: int = 1, relu: bool = True) -> str:
        w, b = self.name("w"), self.name("b")
        fan_in = cin * kernel * kernel
        self.params[w] = (self.rng.standard_normal((cout, cin, kernel, kernel))
                          * np.sqrt(2.0 / fan_in)).astype(np.float32)
        self.params[b] = (0.1 * self.rng.standard_normal(cout)).astype(np.float32)
        y = self.name("conv")
        self.nodes.append(helper.make_node("Conv", [x, w, b], [y], name=y, kernel_shape=[kernel] * 2,
                                           strides=[stride] * 2, pads=[kernel // 2] * 4))
        return self.relu(y) if relu else y

    def relu(self, x: str) -> str:
        y = self.name("relu")
        self.nodes.append(helper.make_node("Relu", [x], [y], name=y))
        return y

    def add_relu(self, a: str, b: str) -> str:
        y = self.name("add")
        self.nodes.append(helper.make_node("Add", [a, b], [y], name=y))
        return self.relu(y)


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
                y = g.conv(y, width, cout, 1, relu=False)
            else:
                y = g.conv(x, cin, width, 3, stride)
                y = g.conv(y, width, width, 3, relu=False)
            shortcut = g.conv(x, cin, cout, 1, stride, relu=False) if stride > 1 or cin != cout else x
            x, cin = g.add_relu(y, shortcut), cout
    pooled, flat = g.name("gap"), g.name("flat")
    g.nodes.append(helper.make_node("GlobalAveragePool", [x], [pooled], name=pooled))
    g.nodes.append(helper.make_node("Flatten", [pooled], [flat], name=flat))
    g.params["fc_w"] = (g.rng.standard_normal((classes, cin)) * np.sqrt(0.01 / cin)).astype(np.float32)
    g.params["fc_b"] = np.zeros(classes, np.float32)
    g.nodes.append(helper.make_node("Gemm", [flat, "fc_w", "fc_b"], ["logits"], name="fc", transB=1))
    return make_model(g.nodes, {"input": (1, 3, size, size)}, {"logits": (1, classes)}, g.params,
                      name=f"resnet{depth}")
