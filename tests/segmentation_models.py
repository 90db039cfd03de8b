"""A U-Net built with onnx.helper the way torch.onnx.export writes it,
with random weights: two encoder stages of 3x3 Conv + Relu pairs and
MaxPool, a bottleneck, then a decoder that upsamples once by ConvTranspose
(kernel 2, stride 2) and once by bilinear Resize (nn.Upsample with
align_corners=False: pytorch_half_pixel), each followed by a Concat with
the encoder's skip connection, and a 1x1 Conv to the class scores.

    from tests.segmentation_models import unet
    model = unet()    # input "x" (1, 3, 32, 32) -> output "y" (1, 3, 32, 32)

And DeepLabV3's ASPP head as torchvision builds it on MobileNetV3-Large's
features (960 channels at 14 x 14, BatchNorm folded): a 1x1 branch, three
3x3 branches at dilations 12, 24 and 36, and a global-pooling branch, each
to 256 channels with Relu, concatenated and projected to 256.

    model = aspp()    # input "x" (1, 960, 14, 14) -> output (1, 256, 14, 14)
"""
from __future__ import annotations

import numpy as np

from tests.transformer_models import GraphBuilder


def unet(size: int = 32, channels=(8, 16, 32), classes: int = 3, opset: int = 13, seed: int = 0):
    b = GraphBuilder(opset, seed)

    def conv(x, size_in, out, kernel=3, relu=True):
        w = b.weight(out, size_in, kernel, kernel, scale=(size_in * kernel * kernel) ** -0.5)
        y = b.op("Conv", [x, w, b.weight(out, scale=0.1)], kernel_shape=[kernel, kernel],
                 pads=[kernel // 2] * 4)
        return b.op("Relu", [y]) if relu else y

    def double_conv(x, size_in, out):
        return conv(conv(x, size_in, out), out, out)

    def pool(x):
        return b.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    c1, c2, c3 = channels
    skip1 = double_conv("x", 3, c1)
    skip2 = double_conv(pool(skip1), c1, c2)
    bottom = double_conv(pool(skip2), c2, c3)
    up = b.op("ConvTranspose", [bottom, b.weight(c3, c2, 2, 2, scale=(c3 * 4) ** -0.5), b.weight(c2, scale=0.1)],
              kernel_shape=[2, 2], strides=[2, 2])
    h = double_conv(b.op("Concat", [up, skip2], axis=1), 2 * c2, c2)
    roi, scales = b.const(np.zeros(0), "roi"), b.const([1.0, 1.0, 2.0, 2.0], "scales")
    up = b.op("Resize", [h, roi, scales], mode="linear", coordinate_transformation_mode="pytorch_half_pixel")
    h = double_conv(b.op("Concat", [conv(up, c2, c1), skip1], axis=1), 2 * c1, c1)
    return b.model({"x": (1, 3, size, size)}, conv(h, c1, classes, kernel=1, relu=False), "unet")


def aspp(channels: int = 960, size: int = 14, width: int = 256, rates=(12, 24, 36),
         opset: int = 13, seed: int = 0):
    b = GraphBuilder(opset, seed)

    def conv_relu(x, size_in, kernel=1, dilation=1):
        w = b.weight(width, size_in, kernel, kernel, scale=(size_in * kernel * kernel) ** -0.5)
        pad = dilation * (kernel // 2)
        return b.op("Relu", [b.op("Conv", [x, w, b.weight(width, scale=0.1)], kernel_shape=[kernel, kernel],
                                  pads=[pad] * 4, dilations=[dilation, dilation])])
    branches = [conv_relu("x", channels)]
    branches += [conv_relu("x", channels, 3, rate) for rate in rates]
    pooled = conv_relu(b.op("GlobalAveragePool", ["x"]), channels)
    branches.append(b.op("Expand", [pooled, b.ints([1, width, size, size])]))
    joined = b.op("Concat", branches, axis=1)
    return b.model({"x": (1, channels, size, size)}, conv_relu(joined, width * len(branches)), "aspp")
