"""Audio models built with onnx.helper the way torch.onnx.export writes
them, with random weights:

- kws_lstm: a keyword spotter: MFCC frames (batch first) through a
  bidirectional LSTM and a second LSTM, the last hidden state into a
  linear classifier (torch's nn.LSTM exports a Transpose to time-major,
  zero initial states and, after a bidirectional layer, Transpose and
  Reshape to join the directions);
- speech_ctc: a small CTC acoustic model: strided and depthwise-separable
  1-D convolutions over mel frames, a bidirectional GRU
  (linear_before_reset, as nn.GRU exports), a linear layer and LogSoftmax
  over the vocabulary for each frame.

    from tests.audio_models import kws_lstm
    model = kws_lstm()    # input "x" (1, 49, 40) -> output "y" (1, 12)
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from tests.transformer_models import GraphBuilder


def _recurrent(b: GraphBuilder, op: str, x, size: int, hidden: int, bidirectional: bool, **attrs):
    """One torch-exported recurrent layer over time-major x (steps, 1, size):
    its Y joined across directions as (steps, 1, directions * hidden), and
    its Y_h (directions, 1, hidden)."""
    gates = {"LSTM": 4, "GRU": 3}[op]
    directions = 2 if bidirectional else 1
    inputs = [x, b.weight(directions, gates * hidden, size, scale=size ** -0.5, hint="W"),
              b.weight(directions, gates * hidden, hidden, scale=hidden ** -0.5, hint="R"),
              b.weight(directions, 2 * gates * hidden, scale=0.1, hint="B"), ""]
    zeros = b.const(np.zeros((directions, 1, hidden)), "zeros")
    inputs += [zeros] * (2 if op == "LSTM" else 1)
    y, y_h = b.name("Y"), b.name("Y_h")
    outputs = [y, y_h] + ([b.name("Y_c")] if op == "LSTM" else [])
    b.nodes.append(helper.make_node(op, inputs, outputs, name=b.name(op.lower()), hidden_size=hidden,
                                    direction="bidirectional" if bidirectional else "forward", **attrs))
    joined = b.op("Transpose", [y], perm=[0, 2, 1, 3])                      # (steps, 1, directions, hidden)
    return b.op("Reshape", [joined, b.ints([0, 0, -1])]), y_h


def kws_lstm(frames: int = 49, features: int = 40, hidden: int = 32, classes: int = 12,
             opset: int = 13, seed: int = 0):
    """Input "x" (1, frames, features) -> logits "y" (1, classes)."""
    b = GraphBuilder(opset, seed)
    x = b.op("Transpose", ["x"], perm=[1, 0, 2])
    y, _ = _recurrent(b, "LSTM", x, features, hidden, bidirectional=True)
    _, y_h = _recurrent(b, "LSTM", y, 2 * hidden, 2 * hidden, bidirectional=False)
    last = b.op("Squeeze", [y_h, b.ints([0])])                              # (1, 2 * hidden)
    logits = b.op("Gemm", [last, b.weight(classes, 2 * hidden, scale=(2 * hidden) ** -0.5),
                           b.weight(classes, scale=0.1)], transB=1)
    return b.model({"x": (1, frames, features)}, logits, "kws_lstm")


def speech_ctc(mels: int = 40, frames: int = 64, channels: int = 48, hidden: int = 32, vocab: int = 29,
               opset: int = 13, seed: int = 0):
    """Input "x" (1, mels, frames) -> log-probabilities "y" (frames / 2, 1, vocab)."""
    b = GraphBuilder(opset, seed)

    def conv(x, out, size, kernel, **attrs):
        groups = attrs.get("group", 1)
        w = b.weight(out, size // groups, kernel, scale=(size // groups * kernel) ** -0.5)
        return b.op("Conv", [x, w, b.weight(out, scale=0.1)], kernel_shape=[kernel], **attrs)
    h = b.op("Relu", [conv("x", channels, mels, 5, strides=[2], pads=[2, 2])])
    h = conv(h, channels, channels, 7, group=channels, pads=[3, 3])
    h = b.op("Relu", [conv(h, channels, channels, 1)])
    h = b.op("Transpose", [h], perm=[2, 0, 1])                              # (steps, 1, channels)
    y, _ = _recurrent(b, "GRU", h, channels, hidden, bidirectional=True, linear_before_reset=1)
    logits = b.linear(y, 2 * hidden, vocab)
    return b.model({"x": (1, mels, frames)}, b.op("LogSoftmax", [logits], axis=-1), "speech_ctc")
