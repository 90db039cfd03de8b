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
from typing import NamedTuple

import numpy as np

from .int8_dot import input_offset
from .int8_x86 import X86_KERNELS, tile as x86_tile
from .ir import Graph, Node, Tensor
from .op_base import _axis
from .passes import eliminate_dead_code
from .quantize_ops import QUANT_RANGES, dequantize_array, quantize_array
from .window import _resolve_window
from .target import Target


def int8_kernel(target: Target, weight: np.ndarray, group: int) -> str:
    """The integer kernel for a convolution or product on a target:

    - "dot": the dot-product micro-kernel (int8_dot.py), where the core has
      sdot (Target.has_dot_product on AArch64), the weights less their zero point fit
      int8 (symmetric int8 weights, as quantize_static writes them) and the
      convolution has one group;
    - "quads": the same tiles with ARMv8.0's smull + smlal + sadalp (16
      products of two groups of 4 in three instructions, their 16-bit sums
      of two products safe while the weights stay within +-127, as
      symmetric int8 weights do), on the other AArch64 cores (Cortex-A53,
      A72), under the same conditions;
    - "pairs": smull + sadalp (8 products in two instructions), there for
      weights that reach -128;
    - "depthwise": a 2-D convolution of one filter per channel, on every
      target (int8_depthwise.py: int16 products summed into int32 lanes,
      8 outputs of a row at a time; 3 x 3 layers with sdot on cores that
      have it);
    - "vnni": x86's vpdpbusd (uint8 x int8 groups of 4 into int32, exact;
      int8_x86.py), where the core has AVX-512 VNNI or AVX-VNNI, the
      weights less their zero point fit int8 and the convolution has one
      group;
    - "madd": AVX2's vpmaddwd (int16 x int16 pairs into int32, exact for
      any 8-bit weights and zero points) on the other x86 cores with AVX2,
      for products and convolutions of one group;
    - "widening": 8-bit values widened and multiplied into 32-bit sums
      along output rows, on every target (x86 without AVX2, 32-bit ARM,
      and the other grouped convolutions everywhere).
    """
    if group > 1 and weight.ndim == 4 and weight.shape[0] == group and weight.shape[1] == 1:
        return "depthwise"
    fits = weight.size == 0 or (weight.min() >= -128 and weight.max() <= 127)
    if target.arch == "x86_64" and group == 1:
        if target.has_vnni and fits:
            return "vnni"
        if target.has_avx2:
            return "madd"
    if target.arch != "aarch64" or not fits or group != 1:
        return "widening"
    if target.has_dot_product:
        return "dot"
    return "quads" if weight.size == 0 or weight.min() >= -127 else "pairs"


def int8_tile(kernel: str, target: Target) -> tuple:
    """(rows, vectors of 4 columns) of a dot-product tile in AArch64's 32
    registers: 16 sum registers, the loaded vectors and a broadcast ("pairs"
    and "quads" keep two registers per sum, so half the columns); for the
    x86 kernels (rows, vectors, columns a vector), see int8_x86.tile."""
    if kernel in X86_KERNELS:
        return x86_tile(kernel, target)
    if kernel == "dot":  # 24 sums, 3 loaded vectors and 2 of 4 rows' weights (sdot by element)
        return (8, 3)
    return (4, 2)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _dot_constants(op: str, weight: np.ndarray, bias: np.ndarray, multipliers: np.ndarray, offset: int,
                   lanes: int = 0, columns: int = 4, dtype=np.int8):
    """(weight, bias, multipliers) in the dot-product kernel's layouts, the
    bias corrected for activations entering as x - offset (see int8_dot.py):
    a convolution's weight as (M, KH, KW, C padded to 4) rows, or with
    lanes (a tile's rows, read 4 at a time: sdot by element, or dup) as
    [M / lanes][KH * KW * C / 4][lanes][4], M padded with zero filters; a
    product's as [K / 4][N padded to a multiple of columns][4], its bias
    and multipliers padded to N. The weights in dtype (int16 for
    vpmaddwd)."""
    if op == "Conv":
        sums = weight.reshape(weight.shape[0], -1).astype(np.int64).sum(axis=1)
        rows = np.moveaxis(weight, 1, -1)
        pad = _round_up(rows.shape[-1], 4) - rows.shape[-1]
        rows = np.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, pad)])
        corrected = bias.astype(np.int64) + offset * sums
        if lanes:
            rows = rows.reshape(rows.shape[0], -1, 4)
            rows = np.pad(rows, [(0, _round_up(rows.shape[0], lanes) - rows.shape[0]), (0, 0), (0, 0)])
            rows = rows.reshape(-1, lanes, rows.shape[1], 4).transpose(0, 2, 1, 3)
        return np.ascontiguousarray(rows.astype(dtype)), corrected.astype(np.int32), multipliers
    depth, count = weight.shape
    sums = weight.astype(np.int64).sum(axis=0)
    padded = np.pad(weight, [(0, _round_up(depth, 4) - depth), (0, _round_up(count, columns) - count)])
    packed = padded.reshape(-1, 4, padded.shape[1]).transpose(0, 2, 1)
    extra = padded.shape[1] - count
    corrected = np.pad(bias.astype(np.int64) + offset * sums, (0, extra))
    return (np.ascontiguousarray(packed.astype(dtype)), corrected.astype(np.int32),
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
    if (node is None or node.op_type != "DequantizeLinear" or node.attrs.get("block_size")
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
    return dequantize_array(values[0], *values[1:], axis=node.attrs["axis"],
                            block_size=node.attrs.get("block_size", 0)), True


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
    output = _quantized_output(graph, op, readers)
    if output is None:
        return None
    return _Match(op, *activation, *weight, bias, output.relu, output.node, output.scale, output.zero,
                  output.dtype)


class _Output(NamedTuple):
    """The per-tensor QuantizeLinear an op's output goes to (through a Relu
    when relu)."""

    node: Node
    scale: np.float32
    zero: int
    dtype: str
    relu: bool

    def attrs(self) -> dict:
        """What the integer kernels read of it (Relu as the lower bound)."""
        lo, hi = QUANT_RANGES[self.dtype]
        return {"output_scale": float(self.scale), "output_zero": self.zero, "output_dtype": self.dtype,
                "lowest": max(lo, self.zero) if self.relu else lo, "highest": hi}


def _quantized_output(graph: Graph, op: Node, readers: dict, relu: bool = True) -> "_Output | None":
    """The QuantizeLinear op's only output goes to, directly or (if relu) through
    a Relu, else None."""
    out, through_relu = op.outputs[0], False
    following = readers.get(out, [])
    if relu and len(following) == 1 and following[0].op_type == "Relu" and out not in graph.outputs:
        out, through_relu = following[0].outputs[0], True
        following = readers.get(out, [])
    if len(following) != 1 or following[0].op_type != "QuantizeLinear" or out in graph.outputs:
        return None
    quantize = following[0]
    y_scale = _scalar(graph, quantize.inputs[1])
    y_zero = _scalar(graph, quantize.inputs[2]) if len(quantize.inputs) == 3 else 0
    if y_scale is None or y_zero is None:
        return None
    return _Output(quantize, np.float32(y_scale), int(y_zero), graph.tensors[quantize.outputs[0]].dtype,
                   through_relu)


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
    tile = int8_tile(kernel, target)
    if kernel in ("dot", "pairs", "quads"):
        offset = (128 if x_dtype == "uint8" else 0) - match.x_zero
        weight, bias, multipliers = _dot_constants(op.op_type if conv else "MatMul", weight, bias, multipliers, offset,
                                                   lanes=tile[0] if conv and kernel != "pairs" else 0)
    elif kernel in X86_KERNELS:
        # vpmaddwd takes x - x_zero itself, as int16 (int8_x86.py).
        offset = 0 if kernel == "madd" else input_offset(x_dtype, kernel == "vnni") - match.x_zero
        weight, bias, multipliers = _dot_constants(op.op_type if conv else "MatMul", weight, bias, multipliers, offset,
                                                   lanes=tile[0] if conv else 0, columns=tile[2],
                                                   dtype=np.int16 if kernel == "madd" else np.int8)
    names = [f"{op.name}/integer_weight", f"{op.name}/integer_bias", f"{op.name}/multipliers"]
    for name, value in zip(names, (weight, bias, multipliers)):
        constants[name] = value
        tensors[name] = Tensor(name, value.shape, value.dtype.name)
    attrs = _Output(match.quantize, match.y_scale, match.y_zero, match.y_dtype, match.relu).attrs()
    attrs.update({"input_zero": match.x_zero, "int8_kernel": kernel, "int8_tile": tile})
    if kernel == "depthwise":  # whether sdot can take the weights (int8_depthwise.lower_dot)
        attrs["int8_weights"] = bool(weight.size == 0 or (weight.min() >= -128 and weight.max() <= 127))
    if conv:
        attrs.update({key: op.attrs[key] for key in ("strides", "pads", "auto_pad", "dilations", "group")})
        attrs["kernel_shape"] = tuple(match.weight.shape[2:])
        attrs["filters"] = int(match.weight.shape[0])
    else:
        attrs["columns"] = int(columns)
    return Node("IntegerConv" if conv else "IntegerMatMul", op.name, [match.x] + names,
                list(match.quantize.outputs), attrs)


# -- what lies between the convolutions: pools, Add, Concat, activations, shapes --------

class _Quantized(NamedTuple):
    """A per-tensor quantized runtime tensor: name, dtype, scale, zero point."""

    name: str
    dtype: str
    scale: np.float32
    zero: int

    def same(self, output: _Output) -> bool:
        return (self.dtype, float(self.scale), self.zero) == (output.dtype, float(output.scale), output.zero)


def _table(x: _Quantized, output: _Output, function=None) -> np.ndarray:
    """The 256 values of QuantizeLinear(function(DequantizeLinear(x))), in
    float32 as ONNX computes them, indexed by x's bits read as unsigned."""
    codes = np.arange(256, dtype=np.uint8).view(x.dtype)
    values = dequantize_array(codes, x.scale, np.array(x.zero, x.dtype))
    if function is not None:
        values = np.asarray(function(values), np.float32)
    return quantize_array(values, output.scale, np.array(output.zero, output.dtype))


# float32 functions of the element-wise ops a table replaces, with their attributes.
UNARY_FUNCTIONS = {
    "Relu": lambda v, a: np.maximum(v, np.float32(0)),
    "Clip": lambda v, a: np.clip(v, np.float32(-np.inf if a["min"] is None else a["min"]),
                                 np.float32(np.inf if a["max"] is None else a["max"])),
    "LeakyRelu": lambda v, a: np.where(v >= 0, v, v * np.float32(a["alpha"])),
    "Sigmoid": lambda v, a: np.float32(1) / (np.float32(1) + np.exp(-v)),
    "HardSigmoid": lambda v, a: np.clip(v * np.float32(a["alpha"]) + np.float32(a["beta"]), 0, 1),
    "HardSwish": lambda v, a: v * np.clip(v / np.float32(6) + np.float32(0.5), 0, 1),
    "Tanh": lambda v, a: np.tanh(v),
}


class _Chain:
    """Builds the 8-bit nodes replacing one DequantizeLinear -> op ->
    QuantizeLinear, adding their constants and intermediate tensors."""

    def __init__(self, graph: Graph, op: Node, output: _Output, constants: dict, tensors: dict):
        self.graph, self.op, self.output = graph, op, output
        self.constants, self.tensors, self.nodes = constants, tensors, []
        self.parameters: list = []

    def constant(self, suffix: str, value: np.ndarray) -> str:
        name = f"{self.op.name}/{suffix}"
        self.constants[name] = value
        self.tensors[name] = Tensor(name, value.shape, value.dtype.name)
        return name

    def node(self, op_type: str, suffix: str, inputs: list, out: "str | None", attrs: dict, like: str) -> str:
        """Add a node; out None names a new tensor shaped as `like` in the
        output's dtype."""
        if out is None:
            out = f"{self.op.name}/{suffix}"
            self.tensors[out] = Tensor(out, self.tensors[like].shape, self.output.dtype)
        self.nodes.append(Node(op_type, f"{self.op.name}/{suffix}" if suffix else self.op.name, inputs, [out],
                               attrs))
        return out

    def table(self, x: _Quantized, suffix: str, out: "str | None", function=None) -> str:
        attrs = {"output_dtype": self.output.dtype}
        return self.node("IntegerTable", suffix, [x.name, self.constant(f"{suffix}_table", _table(
            x, self.output, function))], out, attrs, like=x.name)

    def requantized(self, x: _Quantized, suffix: str) -> str:
        """x in the output's quantization: x itself, or a table's output."""
        return x.name if x.same(self.output) else self.table(x, suffix, None)


def _chain_unary(chain: _Chain, inputs: list) -> bool:
    function = UNARY_FUNCTIONS[chain.op.op_type]
    chain.table(inputs[0], "", chain.output.node.outputs[0], lambda v: function(v, chain.op.attrs))
    return True


def _chain_alias(chain: _Chain, inputs: list) -> bool:
    """A shape op (Flatten, Reshape, ...) on the 8-bit values, then a table
    when the output's quantization differs."""
    (x,), out = inputs, chain.output.node.outputs[0]
    if x.same(chain.output):
        chain.node(chain.op.op_type, "", [x.name], out, dict(chain.op.attrs), like=x.name)
        return True
    moved = f"{chain.op.name}/moved"
    chain.tensors[moved] = Tensor(moved, chain.tensors[out].shape, x.dtype)
    chain.node(chain.op.op_type, "moved", [x.name], moved, dict(chain.op.attrs), like=x.name)
    chain.table(x._replace(name=moved), "requantize", out)
    return True


def _chain_concat(chain: _Chain, inputs: list) -> bool:
    parts = [chain.requantized(x, f"requantize_{i}") for i, x in enumerate(inputs)]
    chain.node("Concat", "", parts, chain.output.node.outputs[0], dict(chain.op.attrs), like=parts[0])
    return True


def _chain_binary(chain: _Chain, inputs: list) -> bool:
    """Add, Sum or Mul of two tensors of the output's shape (a residual, a gate)."""
    shape = chain.tensors[chain.op.outputs[0]].shape
    if len(inputs) != 2 or any(chain.tensors[x.name].shape != shape for x in inputs):
        return False
    a, b = inputs
    attrs = dict(chain.output.attrs(), operation="Add" if chain.op.op_type == "Sum" else chain.op.op_type, a_scale=float(a.scale), a_zero=a.zero,
                 b_scale=float(b.scale), b_zero=b.zero)
    chain.node("IntegerBinary", "", [a.name, b.name], chain.output.node.outputs[0], attrs, like=a.name)
    return True


def _chain_batchnorm(chain: _Chain, inputs: list) -> bool:
    """BatchNormalization of constant parameters on an N x C x ... tensor
    (one a Conv's rounding keeps from being folded into it): one table a
    channel, of the float32 arithmetic ops.BatchNormalization does, then a
    Relu if one follows."""
    (x,), op, shape = inputs, chain.op, chain.tensors[inputs[0].name].shape
    if len(shape) < 2 or any(value is None for value in chain.parameters):
        return False
    scale, bias, mean, var = (np.asarray(v, np.float32).reshape(-1) for v in chain.parameters)
    if any(v.size != shape[1] for v in (scale, bias, mean, var)):
        return False
    a = scale / np.sqrt(var + np.float32(op.attrs["epsilon"]))
    b = bias - mean * a
    codes = np.arange(256, dtype=np.uint8).view(x.dtype)
    values = dequantize_array(codes, x.scale, np.array(x.zero, x.dtype))
    y = values[None, :] * a[:, None] + b[:, None]
    if chain.output.relu:
        y = np.maximum(y, np.float32(0))
    table = quantize_array(y.astype(np.float32), chain.output.scale, np.array(chain.output.zero, chain.output.dtype))
    attrs = {"output_dtype": chain.output.dtype}
    chain.node("IntegerTable", "", [x.name, chain.constant("table", np.ascontiguousarray(table))],
               chain.output.node.outputs[0], attrs, like=x.name)
    return True


def _chain_pool(chain: _Chain, inputs: list) -> bool:
    (x,), op = inputs, chain.op
    shape = chain.tensors[x.name].shape
    if len(shape) not in (3, 4) or len(op.outputs) != 1:  # a MaxPool giving Indices keeps its float kernel
        return False
    if op.op_type == "GlobalAveragePool":
        window = {"kernel_shape": tuple(shape[2:]), "strides": None, "pads": None, "auto_pad": "NOTSET",
                  "dilations": None, "ceil_mode": 0, "count_include_pad": 0}
    else:
        window = {key: op.attrs.get(key) for key in ("kernel_shape", "strides", "pads", "auto_pad", "dilations",
                                                      "ceil_mode", "count_include_pad")}
    attrs = dict(chain.output.attrs(), **window, mode="max" if op.op_type == "MaxPool" else "average",
                 input_scale=float(x.scale), input_zero=x.zero)
    extra = []
    if attrs["mode"] == "average":
        extra = [chain.constant("counts", _pool_counts(shape, attrs))]
    elif not x.same(chain.output):
        extra = [chain.constant("table", _table(x, chain.output))]
    chain.node("IntegerPool", "", [x.name] + extra, chain.output.node.outputs[0], attrs, like=x.name)
    return True


def _pool_counts(shape, attrs) -> np.ndarray:
    """How many values each output of an average pool divides by: the
    window's positions inside the input, or inside the padded input with
    count_include_pad."""
    from .integer_ops import pool_geometry

    height, width, kh, kw, sh, sw, dh, dw, ph, pw, oh, ow = pool_geometry(shape, attrs)
    _, _, _, _, _, end, _ = _resolve_window(shape, attrs["kernel_shape"], attrs, bool(attrs["ceil_mode"]))
    lower, upper = ((-ph, -pw), (height + end[1], width + end[2])) if attrs["count_include_pad"] else \
        ((0, 0), (height, width))
    rows = [sum(lower[0] <= o * sh + i * dh - ph < upper[0] for i in range(kh)) for o in range(oh)]
    cols = [sum(lower[1] <= o * sw + j * dw - pw < upper[1] for j in range(kw)) for o in range(ow)]
    return np.outer(rows, cols).astype(np.int32).reshape(-1)


CHAINS = {"Concat": _chain_concat, "Add": _chain_binary, "Sum": _chain_binary, "Mul": _chain_binary,
          "BatchNormalization": _chain_batchnorm, "MaxPool": _chain_pool,
          "AveragePool": _chain_pool,
          "GlobalAveragePool": _chain_pool, **{op: _chain_unary for op in UNARY_FUNCTIONS},
          **{op: _chain_alias for op in ("Flatten", "Reshape", "Squeeze", "Unsqueeze", "Dropout", "Identity")}}


# Ops of one runtime input whose other inputs are constant parameters.
PARAMETRISED = ("BatchNormalization",)


def _lower_chain(graph: Graph, op: Node, producer: dict, readers: dict, constants: dict, tensors: dict):
    """The 8-bit nodes replacing DequantizeLinear(s) -> op -> [Relu] ->
    QuantizeLinear, and the QuantizeLinear (and Relu) they replace; None
    when op does not fit."""
    runtime = op.inputs[:1] if op.op_type in PARAMETRISED else op.inputs
    inputs = [_dequantized_input(graph, producer.get(name)) for name in runtime]
    if not inputs or None in inputs:
        return None
    output = _quantized_output(graph, op, readers, relu=op.op_type in ("Add", "Sum", "Mul", "BatchNormalization"))
    if output is None:
        return None
    quantized = [_Quantized(x, graph.tensors[x].dtype, scale, zero) for x, scale, zero in inputs]
    chain = _Chain(graph, op, output, constants, tensors)
    # A parametrised op's other inputs: constants, or DequantizeLinear of constants (None if not).
    chain.parameters = [_bias(graph, producer, name)[0] for name in op.inputs[len(runtime):]]
    return (chain.nodes, [n.name for n in readers[op.outputs[0]]] + [output.node.name]) \
        if CHAINS[op.op_type](chain, quantized) else None


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
        if node.op_type in CHAINS:
            lowered = _lower_chain(graph, node, producer, readers, constants, tensors)
            if lowered is not None:
                replaced[node.name], gone = lowered
                dropped.update(gone)
            continue
        if node.op_type not in ("Conv", "MatMul", "Gemm"):
            continue
        match = _match(graph, node, producer, readers)
        if match is None:
            continue
        replaced[node.name] = [_integer_node(graph, match, target, constants, tensors)]
        dropped.update(n.name for n in readers[node.outputs[0]])  # Relu or QuantizeLinear
        dropped.add(match.quantize.name)
    nodes = [new for n in graph.nodes if n.name not in dropped for new in replaced.get(n.name, [n])]
    return fold_constant_dequantize(eliminate_dead_code(replace(graph, nodes=nodes, constants=constants,
                                                                tensors=tensors)))


def fold_constant_dequantize(graph: Graph) -> Graph:
    """DequantizeLinear of constants (a weight no integer kernel took)
    becomes a float constant, so the float passes see constant weights."""
    constants, kept = dict(graph.constants), []
    for node in graph.nodes:
        if node.op_type == "DequantizeLinear" and all(t in constants for t in node.inputs):
            values = [constants[t] for t in node.inputs]
            constants[node.outputs[0]] = dequantize_array(values[0], *values[1:], axis=node.attrs["axis"],
                                                          block_size=node.attrs.get("block_size", 0))
        else:
            kept.append(node)
    if len(kept) == len(graph.nodes):
        return graph
    return eliminate_dead_code(replace(graph, nodes=kept, constants=constants))
