"""QDQ recognition: the graph pass that turns quantized convolutions and
matrix products into integer kernels, and those kernels.

Every quantized model reaches the passes in QDQ form (quantize_ops.py
rewrites the QOperator and integer ops). lower_qdq finds

    DequantizeLinear(x: uint8/int8, per-tensor)      (runtime activations)
    DequantizeLinear(w: uint8/int8 constant, per-tensor or per output channel)
    [DequantizeLinear(bias: int32 constant) or a float constant bias]
      -> Conv / MatMul / Gemm -> [Relu] -> QuantizeLinear(per-tensor)

and writes one IntegerConv or IntegerMatMul node (quantize_ops.py) in its place: products of
(x - x_zero) and (w - w_zero) summed in int32 from an int32 bias, then
requantized with one float multiplier per output channel,
x_scale * w_scale / y_scale (computed in float32 in that order, as
onnxruntime does), rounded half to even, offset by y_zero and saturated.
Relu becomes the lower bound y_zero. Everything the kernels need
(integer weights with their zero point taken out, the int32 bias, the
multipliers, the kernel variant for the target) is decided here and
written into the graph; the kernels only read it.

What the pass does not lower runs as the float op between the exact
DequantizeLinear and QuantizeLinear kernels; DequantizeLinear of constants
left over becomes a float constant (fold_constant_dequantize).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np

from .ir import Graph, Node, Tensor
from .op_base import _axis
from .passes import eliminate_dead_code
from .quantize_ops import QUANT_RANGES, dequantize_array
from .target import Target


def int8_kernel(target: Target, weight: np.ndarray, group: int) -> str:
    """The integer kernel for a convolution or product on a target:

    - "dot": the dot-product micro-kernel (int8_dot.py), where the core has
      sdot (Target.has_dot_product on AArch64), the weights less their zero point fit
      int8 (symmetric int8 weights, as quantize_static writes them) and the
      convolution has one group;
    - "pairs": the same tiles with ARMv8.0's smull + sadalp, on the other
      AArch64 cores (Cortex-A53, A72), under the same conditions;
    - "widening": 8-bit values widened and multiplied into 32-bit sums
      along output rows, on every target (x86, 32-bit ARM, and depthwise
      convolutions everywhere).
    """
    fits = weight.size == 0 or (weight.min() >= -128 and weight.max() <= 127)
    if target.arch != "aarch64" or not fits or group != 1:
        return "widening"
    return "dot" if target.has_dot_product else "pairs"


def int8_tile(kernel: str) -> tuple:
    """(rows, vectors of 4 columns) of a dot-product tile in AArch64's 32
    registers: 16 sum registers, the loaded vectors and a broadcast ("pairs"
    keeps two registers per sum, so half the columns)."""
    return (4, 2) if kernel == "pairs" else (4, 4)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _dot_constants(op: str, weight: np.ndarray, bias: np.ndarray, multipliers: np.ndarray, offset: int):
    """(weight, bias, multipliers) in the dot-product kernel's layouts, the
    bias corrected for activations entering as x - offset (see int8_dot.py):
    a convolution's weight as (M, KH, KW, C padded to 4) rows; a product's
    as [K / 4][N padded to 4][4], its bias and multipliers padded to N."""
    if op == "Conv":
        sums = weight.reshape(weight.shape[0], -1).astype(np.int64).sum(axis=1)
        rows = np.moveaxis(weight, 1, -1)
        pad = _round_up(rows.shape[-1], 4) - rows.shape[-1]
        rows = np.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, pad)])
        corrected = bias.astype(np.int64) + offset * sums
        return np.ascontiguousarray(rows.astype(np.int8)), corrected.astype(np.int32), multipliers
    depth, columns = weight.shape
    sums = weight.astype(np.int64).sum(axis=0)
    padded = np.pad(weight, [(0, _round_up(depth, 4) - depth), (0, _round_up(columns, 4) - columns)])
    packed = padded.reshape(-1, 4, padded.shape[1]).transpose(0, 2, 1)
    extra = padded.shape[1] - columns
    corrected = np.pad(bias.astype(np.int64) + offset * sums, (0, extra))
    return (np.ascontiguousarray(packed.astype(np.int8)), corrected.astype(np.int32),
            np.pad(multipliers, (0, extra)).astype(np.float32))


# -- the pass -------------------------------------------------------------------------

class _Match:
    """One recognised pattern: the float op, its quantized input, weight,
    bias and output quantization."""

    def __init__(self, op: Node, x: str, x_scale: float, x_zero: int, weight: np.ndarray, w_zero: np.ndarray,
                 w_scale: np.ndarray, bias: "np.ndarray | None", relu: bool, quantize: Node,
                 y_scale: float, y_zero: int, y_dtype: str):
        self.op, self.x, self.x_scale, self.x_zero = op, x, x_scale, x_zero
        self.weight, self.w_zero, self.w_scale, self.bias = weight, w_zero, w_scale, bias
        self.relu, self.quantize, self.y_scale, self.y_zero, self.y_dtype = relu, quantize, y_scale, y_zero, y_dtype


def _scalar(graph: Graph, name: "str | None"):
    """The single value of a constant of one element, else None."""
    if name is None:
        return None
    value = graph.constants.get(name)
    return None if value is None or value.size != 1 else value.reshape(())


def _dequantized_input(graph: Graph, node: "Node | None"):
    """(x, scale, zero point) of a per-tensor DequantizeLinear of a runtime
    8-bit tensor, else None."""
    if node is None or node.op_type != "DequantizeLinear" or node.inputs[0] in graph.constants:
        return None
    x = graph.tensors[node.inputs[0]]
    scale = _scalar(graph, node.inputs[1])
    zero = _scalar(graph, node.inputs[2]) if len(node.inputs) == 3 else np.zeros((), x.dtype)
    if x.dtype not in QUANT_RANGES or scale is None or zero is None:
        return None
    return x.name, np.float32(scale), int(zero)


def _dequantized_weight(graph: Graph, node: "Node | None", channel_axis: int):
    """(integer weight, zero points, scales) of a constant DequantizeLinear,
    zero points and scales as one value per output channel (along
    channel_axis of the weight), else None."""
    if (node is None or node.op_type != "DequantizeLinear"
            or not all(t in graph.constants for t in node.inputs)):
        return None
    weight = graph.constants[node.inputs[0]]
    if weight.dtype.name not in QUANT_RANGES:
        return None
    scale = graph.constants[node.inputs[1]].astype(np.float32).reshape(-1)
    zero = (graph.constants[node.inputs[2]] if len(node.inputs) == 3 else np.zeros(1, weight.dtype)).reshape(-1)
    channels = weight.shape[channel_axis]
    if scale.size != 1 and (_axis(node.attrs["axis"], weight.ndim) != channel_axis or scale.size != channels):
        return None
    return weight, np.broadcast_to(zero, (channels,)), np.broadcast_to(scale, (channels,))


def _bias(graph: Graph, producer: dict, name: "str | None"):
    """A constant bias, as float32, from a constant or a DequantizeLinear of
    constants; (None, True) for no bias, (None, False) for one that is not
    constant."""
    if name is None:
        return None, True
    if name in graph.constants:
        return graph.constants[name].astype(np.float32), True
    node = producer.get(name)
    if node is None or node.op_type != "DequantizeLinear" or not all(t in graph.constants for t in node.inputs):
        return None, False
    values = [graph.constants[t] for t in node.inputs]
    return dequantize_array(values[0], *values[1:], axis=node.attrs["axis"]), True


def _match(graph: Graph, op: Node, producer: dict, readers: dict) -> "_Match | None":
    attrs = op.attrs
    if op.op_type == "Conv":
        if len(graph.tensors[op.inputs[0]].shape) not in (3, 4):
            return None
        channel_axis = 0
    elif op.op_type == "Gemm":
        if attrs["transA"] or attrs["alpha"] != 1.0 or attrs["beta"] != 1.0:
            return None
        channel_axis = 0 if attrs["transB"] else 1
    else:
        if len(graph.tensors[op.inputs[0]].shape) < 2 or len(graph.tensors[op.inputs[1]].shape) != 2:
            return None
        channel_axis = 1
    activation = _dequantized_input(graph, producer.get(op.inputs[0]))
    weight = _dequantized_weight(graph, producer.get(op.inputs[1]), channel_axis)
    bias, constant_bias = _bias(graph, producer, op.inputs[2] if len(op.inputs) == 3 else None)
    if activation is None or weight is None or not constant_bias:
        return None
    out, relu = op.outputs[0], False
    following = readers.get(out, [])
    if len(following) == 1 and following[0].op_type == "Relu":
        out, relu = following[0].outputs[0], True
        following = readers.get(out, [])
    if len(following) != 1 or following[0].op_type != "QuantizeLinear" or out in graph.outputs:
        return None
    quantize = following[0]
    y_scale = _scalar(graph, quantize.inputs[1])
    y_zero = _scalar(graph, quantize.inputs[2]) if len(quantize.inputs) == 3 else 0
    if y_scale is None or y_zero is None:
        return None
    return _Match(op, *activation, *weight, bias, relu, quantize, np.float32(y_scale), int(y_zero),
                  graph.tensors[quantize.outputs[0]].dtype)


def _integer_node(graph: Graph, match: _Match, target: Target, constants: dict, tensors: dict) -> Node:
    """The IntegerConv / IntegerMatMul node of a match, adding its weight,
    bias and multiplier constants."""
    op = match.op
    conv = op.op_type == "Conv"
    weight = match.weight.astype(np.int16)
    if conv:
        weight = weight - match.w_zero.astype(np.int16).reshape((-1,) + (1,) * (weight.ndim - 1))
    else:
        if op.op_type == "Gemm" and op.attrs["transB"]:
            weight = weight.T
        weight = np.ascontiguousarray(weight - match.w_zero.astype(np.int16).reshape(1, -1))
    # float32 throughout, in onnxruntime's order: the same rounding.
    bias_scale = match.x_scale * match.w_scale.astype(np.float32)
    multipliers = (bias_scale / match.y_scale).astype(np.float32)
    channels = multipliers.size
    if match.bias is None:
        bias = np.zeros(channels, np.int32)
    else:
        scaled = match.bias.astype(np.float64).reshape(-1) / bias_scale.astype(np.float64)
        bias = np.clip(np.rint(scaled), -2**31, 2**31 - 1).astype(np.int32)
    group = op.attrs["group"] if conv else 1
    columns = weight.shape[1]
    kernel = int8_kernel(target, weight, group)
    x_dtype = graph.tensors[match.x].dtype
    if kernel in ("dot", "pairs"):
        offset = (128 if x_dtype == "uint8" else 0) - match.x_zero
        weight, bias, multipliers = _dot_constants(op.op_type if conv else "MatMul", weight, bias, multipliers, offset)
    names = [f"{op.name}/integer_weight", f"{op.name}/integer_bias", f"{op.name}/multipliers"]
    for name, value in zip(names, (weight, bias, multipliers)):
        constants[name] = value
        tensors[name] = Tensor(name, value.shape, value.dtype.name)
    lo, hi = QUANT_RANGES[match.y_dtype]
    attrs = {"input_zero": match.x_zero, "output_zero": match.y_zero, "output_dtype": match.y_dtype,
             "lowest": max(lo, match.y_zero) if match.relu else lo, "highest": hi,
             "int8_kernel": kernel, "int8_tile": int8_tile(kernel)}
    if conv:
        attrs.update({key: op.attrs[key] for key in ("strides", "pads", "auto_pad", "dilations", "group")})
        attrs["kernel_shape"] = tuple(match.weight.shape[2:])
        attrs["filters"] = int(match.weight.shape[0])
    else:
        attrs["columns"] = int(columns)
    return Node("IntegerConv" if conv else "IntegerMatMul", op.name, [match.x] + names,
                list(match.quantize.outputs), attrs)


def lower_qdq(graph: Graph, target: Target) -> Graph:
    """Replace each recognised DequantizeLinear -> Conv/MatMul/Gemm ->
    [Relu] -> QuantizeLinear pattern by an integer node; then fold the
    DequantizeLinear of constants left over.

    >>> lowered = lower_qdq(import_onnx("model_qdq.onnx"), resolve_target("rasp5"))  # doctest: +SKIP
    """
    producer = {out: node for node in graph.nodes for out in node.outputs}
    readers = defaultdict(list)
    for node in graph.nodes:
        for name in node.inputs:
            readers[name].append(node)
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    replaced, dropped = {}, set()
    for node in graph.nodes:
        if node.op_type not in ("Conv", "MatMul", "Gemm"):
            continue
        match = _match(graph, node, producer, readers)
        if match is None:
            continue
        replaced[node.name] = _integer_node(graph, match, target, constants, tensors)
        dropped.update(n.name for n in readers[node.outputs[0]])  # Relu or QuantizeLinear
        dropped.add(match.quantize.name)
    nodes = [replaced.get(n.name, n) for n in graph.nodes if n.name not in dropped]
    return fold_constant_dequantize(eliminate_dead_code(replace(graph, nodes=nodes, constants=constants,
                                                                tensors=tensors)))


def fold_constant_dequantize(graph: Graph) -> Graph:
    """DequantizeLinear of constants (a weight no integer kernel took)
    becomes a float constant, so the float passes see constant weights."""
    constants, kept = dict(graph.constants), []
    for node in graph.nodes:
        if node.op_type == "DequantizeLinear" and all(t in constants for t in node.inputs):
            values = [constants[t] for t in node.inputs]
            constants[node.outputs[0]] = dequantize_array(values[0], *values[1:], axis=node.attrs["axis"])
        else:
            kept.append(node)
    if len(kept) == len(graph.nodes):
        return graph
    return eliminate_dead_code(replace(graph, nodes=kept, constants=constants))
