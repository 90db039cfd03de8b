"""Quantized ONNX models: the three forms onnxruntime's quantizer writes,
brought to one.

- QDQ (QuantizeLinear / DequantizeLinear around float ops) imports as is:
  QuantizeLinear and DequantizeLinear are ops of their own (below), and
  so are the integer kernels quantized.lower_qdq writes (IntegerConv,
  IntegerMatMul).
- QOperator (QLinearConv, QLinearMatMul, com.microsoft's QLinearAdd, ...)
  and dynamic quantization (MatMulInteger, ConvInteger) are rewritten by
  expand_operators, before import, into the QDQ form of the same
  arithmetic: DequantizeLinear of each quantized input, the float op, and
  QuantizeLinear of the output. DynamicQuantizeLinear is an op of its own.

So every quantized model reaches the graph passes in QDQ form, and
quantized.lower_qdq is the one place that recognises
DequantizeLinear -> Conv/MatMul/Gemm -> [Relu] -> QuantizeLinear and turns
it into an integer kernel; whatever it leaves runs as the float op between
exact dequantize and quantize kernels.

Rounding and saturation follow the ONNX specification: round half to even,
then clamp to the integer type's range.
"""
from __future__ import annotations

import numpy as np
import onnx
from llvmlite import ir
from onnx import helper, numpy_helper

from . import int8_depthwise, int8_dot, int8_x86, lowbit
from .emit import ELEMENT_TYPES, F32, I32, Kernel
from .int8_dot import ROUNDING_LIMIT, ROUNDING_MAGIC
from .errors import BuildError, ShapeError
from .op_base import Op, _axis, _prod
from .window import _resolve_window, _valid_range

# The integer types a quantized tensor may have, with their ranges.
QUANT_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}
# ... and those only QuantizeLinear and DequantizeLinear take (the integer
# kernels of quantized.lower_qdq are 8-bit).
SIXTEEN_BIT_RANGES = {"uint16": (0, 65535), "int16": (-32768, 32767)}
QUANTIZE_RANGES = {**QUANT_RANGES, **SIXTEEN_BIT_RANGES}
# ... and what DequantizeLinear also takes: int32 (a bias quantized with
# scale x_scale * w_scale, as quantize_static writes it).
DEQUANTIZE_DTYPES = (*QUANTIZE_RANGES, "int32")

TENSOR_DTYPES = {onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.INT8: "int8",
                 onnx.TensorProto.UINT16: "uint16", onnx.TensorProto.INT16: "int16"}
# QuantizeLinear also quantizes to the low-bit types, which a module holds in
# int32 or float32 (crosscompile.lowbit): output_dtype names the type.
LOW_BIT_OUTPUTS = {number: name for number, name in lowbit.TENSOR_TYPES.items() if name != "float8_e8m0fnu"}


def _unsupported_dtype(what: str, dtype: str, allowed) -> BuildError:
    return BuildError(f"{what} is {dtype}; quantized tensors of {dtype} are not supported "
                      f"(supported: {', '.join(allowed)}); quantize the model to 8 bits, e.g. "
                      "`tether quantize MODEL --calibrate DIR -o OUT.onnx`")


# -- the arithmetic, in numpy: the reference the kernels and tests follow ---------------

def _per_axis(value: np.ndarray, rank: int, axis: int, block_size: int = 0, length: int = 0) -> np.ndarray:
    """value (a scale or zero point) shaped to broadcast over a tensor of
    rank `rank` along axis: one value per index, or with block_size one per
    block of that many (the axis is `length` long)."""
    value = np.asarray(value)
    if block_size and value.ndim:
        return np.take(np.repeat(value, block_size, axis=axis), range(length), axis=axis)
    if value.ndim == 0 or rank == 0:
        return value.reshape(()) if value.size == 1 else value
    shape = [1] * rank
    shape[axis] = value.size
    return value.reshape(shape)


def quantize_array(x: np.ndarray, scale, zero_point, axis: int = 1) -> np.ndarray:
    """ONNX QuantizeLinear: saturate(round_half_even(x / scale) + zero_point).

    >>> quantize_array(np.array([0.5, 1.5, -300.0], np.float32), 1.0, np.uint8(0))
    array([0, 2, 0], dtype=uint8)
    """
    x = np.asarray(x, np.float32)
    zero_point = np.asarray(zero_point)
    axis = axis % x.ndim if x.ndim else 0
    lo, hi = QUANT_RANGES[zero_point.dtype.name]
    scaled = x / _per_axis(np.asarray(scale, np.float32), x.ndim, axis)
    value = np.rint(scaled) + _per_axis(zero_point.astype(np.float32), x.ndim, axis)
    return np.clip(value, lo, hi).astype(zero_point.dtype)


def dequantize_array(x: np.ndarray, scale, zero_point=None, axis: int = 1, block_size: int = 0) -> np.ndarray:
    """ONNX DequantizeLinear: (x - zero_point) * scale in float32.

    >>> dequantize_array(np.array([0, 255], np.uint8), np.float32(0.5), np.uint8(128))
    array([-64. ,  63.5], dtype=float32)
    """
    x = np.asarray(x)
    axis = axis % x.ndim if x.ndim else 0
    length = x.shape[axis] if x.ndim else 0
    scale = _per_axis(np.asarray(scale, np.float32), x.ndim, axis, block_size, length)
    if x.dtype == np.float32:  # float8 or float4 held in float32: no zero point
        return (x * scale).astype(np.float32)
    zero = np.zeros((), x.dtype) if zero_point is None else np.asarray(zero_point)
    shifted = x.astype(np.int64) - _per_axis(zero, x.ndim, axis, block_size, length).astype(np.int64)
    return (shifted.astype(np.float32) * scale).astype(np.float32)


# -- the ops -------------------------------------------------------------------------

def _channel_geometry(shape, scale_shape, axis_attr: int, what: str, block_size: int = 0):
    """(outer, channels, inner) of a per-tensor (channels == 1), per-axis
    or blocked scale over a tensor of `shape`."""
    count = _prod(scale_shape)
    if block_size:
        axis = _axis(axis_attr, len(shape))
        blocks = -(-shape[axis] // block_size)
        wanted = (*shape[:axis], blocks, *shape[axis + 1:])
        if tuple(scale_shape) != wanted:
            raise ShapeError(f"{what}'s scale has shape {tuple(scale_shape)}; blocks of {block_size} along axis "
                             f"{axis} of {tuple(shape)} take one of shape {wanted}")
        return _prod(shape[:axis]), shape[axis], _prod(shape[axis + 1:])
    if len(scale_shape) == 0 or count == 1 and len(scale_shape) <= 1:
        return _prod(shape), 1, 1
    if len(scale_shape) != 1:
        raise ShapeError(f"{what}'s scale has shape {tuple(scale_shape)}; a scalar, a 1-D per-axis "
                         "scale or a blocked one (block_size) is supported")
    axis = _axis(axis_attr, len(shape))
    if shape[axis] != count:
        raise ShapeError(f"{what}'s scale has {count} values but axis {axis} of {tuple(shape)} has {shape[axis]}")
    return _prod(shape[:axis]), count, _prod(shape[axis + 1:])


def _parse_axis(raw: dict, op_type: str) -> dict:
    block_size = int(raw.get("block_size", 0))
    if block_size < 0:
        raise BuildError(f"{op_type} with block_size={block_size}: it must be positive (or 0, not blocked)")
    return {"axis": int(raw.get("axis", 1)), **({"block_size": block_size} if block_size else {})}


def _extend(k: Kernel, value: ir.Value, dtype: str) -> ir.Value:
    """An integer element of dtype as an i32 (a float32 one as it is)."""
    if dtype in ("int32", "float32"):
        return value
    return k.builder.zext(value, I32) if dtype in ("uint8", "uint16") else k.builder.sext(value, I32)


def round_half_even(k: Kernel, value: ir.Value) -> ir.Value:
    """value rounded to the nearest integer, ties to even (scalars or
    vectors), for |value| below ROUNDING_LIMIT; callers clamp first."""
    b = k.builder
    return b.fsub(b.fadd(value, k.f32(ROUNDING_MAGIC)), k.f32(ROUNDING_MAGIC))


def saturate(k: Kernel, value: ir.Value, dtype: str) -> ir.Value:
    """A float value already rounded, clamped to dtype's range and converted
    to its element type."""
    lo, hi = QUANTIZE_RANGES[dtype]
    return k.builder.trunc(k.builder.fptosi(k.clamp(value, lo, hi), I32), ELEMENT_TYPES[dtype])


class _LinearQuantization(Op):
    """What QuantizeLinear and DequantizeLinear share: the loops over a
    tensor with one scale and zero point, or one per channel along axis."""

    def attributes(self, raw, constants, opset):
        return _parse_axis(raw, self.op_type)

    def quantized(self, inputs, outputs) -> str:
        """The dtype of the integer side."""
        raise NotImplementedError

    def channel(self, k: Kernel, dtype: str, scale: ir.Value, zero: "ir.Value | None", attrs: dict):
        """Emit what is per channel (scale, and zero point as an i32, or a
        float for a float8 or float4 type held in float32) and return
        element(offset), which emits what is per element."""
        raise NotImplementedError

    def lower(self, k, inputs, outputs, attrs):
        dtype = self.quantized(inputs, outputs)
        zeros = k.typed(k.inputs[2], dtype) if len(inputs) == 3 else None
        block_size = attrs.get("block_size", 0)
        outer, channels, inner = _channel_geometry(inputs[0].shape, inputs[1].shape, attrs["axis"], self.op_type,
                                                   block_size)
        if block_size:  # a scale and zero point per element of the blocked axis's block
            blocks = -(-channels // block_size)
            with k.loop(outer) as o, k.loop(channels) as c, k.loop(inner) as i:
                at = k.index((o, blocks * inner), (k.builder.udiv(c, k.i64(block_size)), inner), (i, 1))
                zero = None if zeros is None else _extend(k, k.load(zeros, at), dtype)
                self.channel(k, dtype, k.load(k.inputs[1], at), zero, attrs)(
                    k.index((o, channels * inner), (c, inner), (i, 1)))
            return
        with k.loop(outer) as o, k.loop(channels) as c:
            zero = None if zeros is None else _extend(k, k.load(zeros, c), dtype)
            element = self.channel(k, dtype, k.load(k.inputs[1], c), zero, attrs)
            with k.loop(inner) as i:
                element(k.index((o, channels * inner), (c, inner), (i, 1)))


class DequantizeLinear(_LinearQuantization):
    """y = (x - zero_point) * scale, per tensor, along `axis` or per block
    of `block_size` along it; x is uint8, int8, uint16, int16 or int32, or
    a low-bit type held in int32 (int4, int2, ...) or float32 (float8 and
    float4, whose zero points ONNX ignores; crosscompile.lowbit). Constant
    weights keep this node until
    quantized.lower_qdq has looked at them (it folds the ones it does
    not lower)."""

    op_type = "DequantizeLinear"

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise ShapeError(f"DequantizeLinear takes x, scale and an optional zero point, got {len(inputs)} inputs")
        _channel_geometry(inputs[0], inputs[1], attrs["axis"], "DequantizeLinear", attrs.get("block_size", 0))
        if len(inputs) == 3 and tuple(inputs[2]) != tuple(inputs[1]) and _prod(inputs[2]) != _prod(inputs[1]):
            raise ShapeError(f"DequantizeLinear's zero point {tuple(inputs[2])} and scale {tuple(inputs[1])} differ")
        return [inputs[0]]

    def output_dtype(self, inputs, attrs):
        x = inputs[0]
        if x.dtype not in DEQUANTIZE_DTYPES + ("float32",):
            raise _unsupported_dtype(f"input {x.name!r}", x.dtype, DEQUANTIZE_DTYPES + lowbit.LOW_BIT_DTYPES)
        if inputs[1].dtype != "float32":
            raise BuildError(f"scale {inputs[1].name!r} is {inputs[1].dtype}; only float32 scales are supported")
        if len(inputs) == 3 and inputs[2].dtype != x.dtype:
            raise BuildError(f"zero point {inputs[2].name!r} is {inputs[2].dtype} but x is {x.dtype}")
        return "float32"

    def quantized(self, inputs, outputs) -> str:
        return inputs[0].dtype

    def channel(self, k, dtype, scale, zero, attrs):
        x, b = k.typed(k.inputs[0], dtype), k.builder
        offset = ir.Constant(I32, 0) if zero is None else zero

        def element(at):
            if dtype == "float32":  # float8 or float4, held in float32: zero points are 0
                value = k.load(x, at)
            else:
                value = b.sitofp(b.sub(_extend(k, k.load(x, at), dtype), offset), F32)
            k.store(k.activate(b.fmul(value, scale)), k.outputs[0], at)
        return element


class QuantizeLinear(_LinearQuantization):
    """y = saturate(round_half_even(x / scale) + zero_point) into the zero
    point's type (else output_dtype's, else uint8), per tensor, along `axis`
    or per block of `block_size` along it.

    The type may be uint8, int8, uint16, int16, or a low-bit one (int4,
    uint4, int2, uint2, held in int32, and float8 and float4, held in
    float32; crosscompile.lowbit): float8 is x / scale rounded to the type,
    saturating unless saturate=0, and float4 adds its zero point."""

    op_type = "QuantizeLinear"

    def attributes(self, raw, constants, opset):
        attrs = super().attributes(raw, constants, opset)
        to = int(raw.get("output_dtype", 0))
        if to and to not in TENSOR_DTYPES and to not in LOW_BIT_OUTPUTS:
            raise _unsupported_dtype("its output_dtype", onnx.TensorProto.DataType.Name(to).lower(),
                                     tuple(QUANTIZE_RANGES) + tuple(LOW_BIT_OUTPUTS.values()))
        attrs["to"] = TENSOR_DTYPES.get(to) or LOW_BIT_OUTPUTS.get(to, "uint8")
        if attrs["to"] in lowbit.FORMATS:
            attrs["saturate"] = bool(int(raw.get("saturate", 1)))
        return attrs

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise ShapeError(f"QuantizeLinear takes x, scale and an optional zero point, got {len(inputs)} inputs")
        _channel_geometry(inputs[0], inputs[1], attrs["axis"], "QuantizeLinear", attrs.get("block_size", 0))
        return [inputs[0]]

    def output_dtype(self, inputs, attrs):
        if inputs[0].dtype != "float32" or inputs[1].dtype != "float32":
            raise BuildError(f"QuantizeLinear of {inputs[0].dtype} with a {inputs[1].dtype} scale is not "
                             "supported; x and scale must be float32")
        if attrs["to"] in lowbit.LOW_BIT_DTYPES:  # its zero point is held as its output is
            held = lowbit.held_dtype(attrs["to"])
            if len(inputs) == 3 and inputs[2].dtype != held:
                raise BuildError(f"zero point {inputs[2].name!r} is {inputs[2].dtype}, not {attrs['to']}")
            return held
        if len(inputs) == 3:
            if inputs[2].dtype not in QUANTIZE_RANGES:
                raise _unsupported_dtype(f"zero point {inputs[2].name!r}", inputs[2].dtype,
                                         tuple(QUANTIZE_RANGES) + tuple(LOW_BIT_OUTPUTS.values()))
            return inputs[2].dtype
        return attrs["to"]

    def quantized(self, inputs, outputs) -> str:
        return outputs[0].dtype

    def channel(self, k, dtype, scale, zero, attrs):
        y, b = k.typed(k.outputs[0], dtype), k.builder
        to = attrs["to"]
        if to in lowbit.FORMATS:
            return _to_minifloat(k, y, scale, zero, to, attrs["saturate"])
        offset = k.f32(0.0) if zero is None else b.sitofp(zero, F32)

        def element(at):
            scaled = k.clamp(b.fdiv(k.load(k.inputs[0], at), scale), -ROUNDING_LIMIT, ROUNDING_LIMIT)
            rounded = b.fadd(round_half_even(k, scaled), offset)
            if to in lowbit.INTEGERS:  # int4, int2, ...: held in int32
                lo, hi = lowbit.integer_range(to)
                k.store(b.fptosi(k.clamp(rounded, lo, hi), I32), y, at)
            else:
                k.store(saturate(k, rounded, dtype), y, at)
        return element



def _to_minifloat(k: Kernel, y: ir.Value, scale: ir.Value, zero: "ir.Value | None", to: str, saturating: bool):
    """QuantizeLinear's element(at) for a float8 or float4 type: float8 is
    x / scale rounded to the type (saturating unless saturate=0; its zero
    point is 0 and onnx's reference ignores it), float4 is x / scale + zero
    point, rounded. Stored as the type's value, held in float32."""
    b = k.builder

    def element(at):
        value = b.fdiv(k.load(k.inputs[0], at), scale)
        if zero is not None and to == "float4_e2m1fn":
            value = b.fadd(value, zero)
        k.store(lowbit.decode(k, lowbit.encode(k, value, "float32", to, saturating), to), y, at)
    return element


class DynamicQuantizeLinear(Op):
    """uint8 quantization with scale and zero point from the data's range
    (which always includes 0): scale = (max - min) / 255, zero point =
    saturate(round(-min / scale)); outputs y, scale and zero point."""

    op_type = "DynamicQuantizeLinear"

    def infer(self, inputs, attrs):
        return [inputs[0], (), ()]

    def output_dtype(self, inputs, attrs):
        if inputs[0].dtype != "float32":
            raise BuildError(f"input {inputs[0].name!r} is {inputs[0].dtype}; DynamicQuantizeLinear takes float32")
        return ["uint8", "float32", "uint8"]

    def lower(self, k, inputs, outputs, attrs):
        b = k.builder
        size = inputs[0].size
        low, high = k.variable(k.f32(0.0)), k.variable(k.f32(0.0))
        with k.loop(size) as i:
            value = k.load(k.inputs[0], i)
            b.store(k.minimum(b.load(low), value), low)
            b.store(k.maximum(b.load(high), value), high)
        spread = b.fsub(b.load(high), b.load(low))
        # All zeros: onnxruntime takes scale 1 rather than dividing by 0.
        scale = b.select(b.fcmp_ordered("==", spread, k.f32(0.0)), k.f32(1.0), b.fdiv(spread, k.f32(255.0)))
        k.store(scale, k.outputs[1], k.i64(0))
        start = k.clamp(b.fdiv(b.fsub(k.f32(0.0), b.load(low)), scale), -ROUNDING_LIMIT, ROUNDING_LIMIT)
        zero = saturate(k, round_half_even(k, start), "uint8")
        k.store(zero, k.typed(k.outputs[2], "uint8"), k.i64(0))
        offset = b.uitofp(zero, F32)
        y = k.typed(k.outputs[0], "uint8")
        with k.loop(size) as i:
            scaled = k.clamp(b.fdiv(k.load(k.inputs[0], i), scale), -ROUNDING_LIMIT, ROUNDING_LIMIT)
            k.store(saturate(k, b.fadd(round_half_even(k, scaled), offset), "uint8"), y, i)


# -- the integer kernels quantized.lower_qdq writes ---------------------------------------

def _requantize(k: Kernel, acc: ir.Value, count: int, multiplier, out: ir.Value, base: ir.Value, attrs) -> None:
    """out[base + p] = saturate(round(acc[p] * multiplier(p)) + y_zero) for
    p < count, clamped to [lowest, highest] (lowest is y_zero after a Relu)."""
    b = k.builder
    zero = attrs["output_zero"]
    lo, hi = attrs["lowest"] - zero, attrs["highest"] - zero
    with k.loop(count) as p:
        value = b.fmul(b.sitofp(k.load(acc, p), F32), multiplier(p))
        value = b.fadd(round_half_even(k, k.clamp(value, lo, hi)), k.f32(zero))
        k.store(saturate(k, value, attrs["output_dtype"]), out, k.index((base, 1), (p, 1)))


def window_taps(k: Kernel, source: ir.Value, geometry: tuple):
    """Emit a window's taps one at a time along output rows, skipping
    padding: for each tap (kernel row, column) with a valid output range,
    loops over those outputs, inside which this yields (the tap's index
    kh * kernel columns + kw, the input element's offset from source, the
    output's offset in its plane). geometry is int8_dot.conv_geometry's."""
    height, width, kh_count, kw_count, sh, sw, dh, dw, ph, pw, oh_count, ow_count = geometry
    for kh in range(kh_count):
        rows = _valid_range(kh * dh - ph, sh, height, oh_count)
        for kw in range(kw_count):
            cols = _valid_range(kw * dw - pw, sw, width, ow_count)
            if rows[0] == rows[1] or cols[0] == cols[1]:
                continue
            with k.loop(rows[1], start=rows[0]) as oh:
                line = k.index((source, 1), (oh, sh * width), (kh * dh - ph, width), (kw * dw - pw, 1))
                with k.loop(cols[1], start=cols[0]) as ow:
                    yield kh * kw_count + kw, k.index((line, 1), (ow, sw)), k.index((oh, ow_count), (ow, 1))


class _IntegerOp(Op):
    """Written by lower_qdq only; a model naming it is refused."""

    def attributes(self, raw, constants, opset):
        raise BuildError(f"{self.op_type} is written by crosscompile's quantization pass, not read from models")

    def output_dtype(self, inputs, attrs):
        return attrs["output_dtype"]

    @staticmethod
    def buffers(k: Kernel, inputs, attrs):
        """The kernel's typed pointers (x, integer weight, int32 bias, int32
        sums in scratch, y) and x's zero point as an i32."""
        return (k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.inputs[1], "int16"),
                k.typed(k.inputs[2], "int32"), k.typed(k.scratch, "int32"),
                k.typed(k.outputs[0], attrs["output_dtype"]), ir.Constant(I32, attrs["input_zero"]))


class IntegerConv(_IntegerOp):
    """A quantized 1-D or 2-D convolution, NCHW, with groups: for each
    output channel, int32 sums over a plane held in scratch, one kernel tap
    at a time along output rows (contiguous for stride 1, so LLVM widens
    and vectorises the multiply-accumulate), padding skipped by computing
    each tap's valid output range here; then one requantizing pass."""

    op_type = "IntegerConv"

    def infer(self, inputs, attrs):
        x = inputs[0]
        *_, out = _resolve_window(x, attrs["kernel_shape"], attrs, what="convolution")
        return [(x[0], attrs["filters"], *out[5 - len(x):])]

    def scratch_bytes(self, inputs, outputs, attrs):
        plane = _prod(outputs[0].shape[2:])
        if attrs["int8_kernel"] == "depthwise":
            return int8_depthwise.scratch_bytes(inputs[0].shape, attrs)
        if attrs["int8_kernel"] in int8_x86.X86_KERNELS:
            return int8_x86.scratch_bytes(self.op_type, inputs, outputs, attrs)
        if attrs["int8_kernel"] in ("dot", "quads"):  # the packed input: depth4 groups of 4 per output pixel
            return inputs[1].shape[1] * 4 * -(-plane // 4) * 4
        if attrs["int8_kernel"] != "widening":
            return _prod(inputs[1].shape[1:]) * -(-plane // 4) * 4
        return 4 * plane

    def parallel(self, attrs):
        # The packing and tile kernels (int8_dot, int8_x86) hand out the
        # packing's channel groups and the tiles; the others run on one thread.
        return attrs["int8_kernel"] in ("dot", "quads", "pairs") + int8_x86.X86_KERNELS

    def lower(self, k, inputs, outputs, attrs):
        if attrs["int8_kernel"] == "depthwise":
            int8_depthwise.lower(k, inputs, outputs, attrs)
            return
        if attrs["int8_kernel"] in int8_x86.X86_KERNELS:
            int8_x86.lower_conv(k, inputs, outputs, attrs)
            return
        if attrs["int8_kernel"] != "widening":
            int8_dot.lower_conv(k, inputs, outputs, attrs)
            return
        x_shape = inputs[0].shape
        geometry = int8_dot.conv_geometry(x_shape, attrs)
        height, width, kh_count, kw_count, *_, oh_count, ow_count = geometry
        batch, channels = x_shape[:2]
        filters, group = attrs["filters"], attrs["group"]
        per_group, per_filter = channels // group, filters // group
        plane = oh_count * ow_count
        b, dtype = k.builder, inputs[0].dtype
        x, w, bias, acc, y, x_zero = self.buffers(k, inputs, attrs)
        with k.loop(batch) as n, k.loop(filters) as m:
            start = k.load(bias, m)
            with k.loop(plane) as p:
                k.store(start, acc, p)
            first = b.mul(b.udiv(m, k.i64(per_filter)), k.i64(per_group))
            with k.loop(per_group) as c:
                source = k.index((n, channels * height * width), (first, height * width), (c, height * width))
                taps = k.index((m, per_group * kh_count * kw_count), (c, kh_count * kw_count))
                for tap, source_at, at in window_taps(k, source, geometry):
                    weight = b.sext(k.load(w, k.index((taps, 1), (tap, 1))), I32)
                    value = b.sub(_extend(k, k.load(x, source_at), dtype), x_zero)
                    k.store(b.add(k.load(acc, at), b.mul(value, weight)), acc, at)
            multiplier = k.load(k.inputs[3], m)
            _requantize(k, acc, plane, lambda p: multiplier, y, k.index((n, filters * plane), (m, plane)), attrs)


class IntegerMatMul(_IntegerOp):
    """A quantized matrix product x (..., K) by a constant (K, N): for each
    row, int32 sums over N held in scratch, a row of weights at a time
    (contiguous, widened and vectorised by LLVM); then the row is
    requantized with one multiplier per column."""

    op_type = "IntegerMatMul"

    def infer(self, inputs, attrs):
        return [(*inputs[0][:-1], attrs["columns"])]

    def scratch_bytes(self, inputs, outputs, attrs):
        if attrs["int8_kernel"] in int8_x86.X86_KERNELS:
            return int8_x86.scratch_bytes(self.op_type, inputs, outputs, attrs)
        if attrs["int8_kernel"] != "widening":
            return _prod(inputs[0].shape[:-1]) * inputs[1].shape[0] * 4
        return 4 * attrs["columns"]

    def lower(self, k, inputs, outputs, attrs):
        if attrs["int8_kernel"] in int8_x86.X86_KERNELS:
            int8_x86.lower_matmul(k, inputs, outputs, attrs)
            return
        if attrs["int8_kernel"] != "widening":
            int8_dot.lower_matmul(k, inputs, outputs, attrs)
            return
        depth, columns = inputs[1].shape
        rows = _prod(inputs[0].shape[:-1])
        b, dtype = k.builder, inputs[0].dtype
        x, w, bias, acc, y, x_zero = self.buffers(k, inputs, attrs)
        with k.loop(rows) as r:
            with k.loop(columns) as j:
                k.store(k.load(bias, j), acc, j)
            with k.loop(depth) as d:
                value = b.sub(_extend(k, k.load(x, k.index((r, depth), (d, 1))), dtype), x_zero)
                with k.loop(columns) as j:
                    product = b.mul(value, b.sext(k.load(w, k.index((d, columns), (j, 1))), I32))
                    k.store(b.add(k.load(acc, j), product), acc, j)
            _requantize(k, acc, columns, lambda j: k.load(k.inputs[3], j), y, k.index((r, columns)), attrs)


# -- QOperator and integer-op models, rewritten to QDQ before import ----------------------

class _Rewriter:
    """Builds the replacement nodes of one model, naming new tensors after
    the node they come from."""

    def __init__(self, proto: onnx.ModelProto):
        self.initializers = {t.name: t for t in proto.graph.initializer}
        self.new_initializers: list = []
        self.nodes: list = []

    def constant(self, name: str, value: np.ndarray) -> str:
        self.new_initializers.append(numpy_helper.from_array(np.asarray(value), name))
        self.initializers[name] = self.new_initializers[-1]
        return name

    def value(self, name: str, where: str) -> np.ndarray:
        if name not in self.initializers:
            raise BuildError(f"{where}: input {name!r} must be a constant (an initializer)")
        return numpy_helper.to_array(self.initializers[name])

    def dequantize(self, base: str, x: str, scale: str, zero: str, axis: "int | None" = None) -> str:
        out = f"{base}/dequantized_{x}"
        attrs = {} if axis is None else {"axis": axis}
        self.nodes.append(helper.make_node("DequantizeLinear", [x, scale, zero] if zero else [x, scale],
                                           [out], name=f"{base}/dequantize_{x}", **attrs))
        return out

    def quantize(self, base: str, y: str, scale: str, zero: str, out: str) -> None:
        self.nodes.append(helper.make_node("QuantizeLinear", [y, scale, zero] if zero else [y, scale], [out],
                                           name=f"{base}/quantize"))

    def float_op(self, base: str, op_type: str, inputs: list, attributes, out: "str | None" = None) -> str:
        out = out or f"{base}/float_output"
        node = helper.make_node(op_type, inputs, [out], name=f"{base}/{op_type}")
        node.attribute.extend(attributes)
        self.nodes.append(node)
        return out


def _inputs(node: onnx.NodeProto, count: int) -> list:
    return list(node.input) + [""] * (count - len(node.input))


def _weight_axis(rewriter: _Rewriter, scale: str, axis: int):
    """axis for a per-channel weight scale, None for a per-tensor one."""
    known = rewriter.initializers.get(scale)
    per_tensor = known is not None and numpy_helper.to_array(known).size == 1
    return None if per_tensor else axis


def _expand_linear(rw: _Rewriter, node, base: str, where: str) -> None:
    """QLinearConv and QLinearMatMul: DQ(x), DQ(w), [DQ(bias)], the float op, Q(y)."""
    conv = node.op_type == "QLinearConv"
    x, xs, xz, w, ws, wz, ys, yz, *rest = _inputs(node, 9)
    xf = rw.dequantize(base, x, xs, xz)
    wf = rw.dequantize(base, w, ws, wz, _weight_axis(rw, ws, 0 if conv else -1))
    inputs = [xf, wf]
    if conv and rest and rest[0]:
        bias_scale = (rw.value(xs, where).astype(np.float32).reshape(-1)
                      * rw.value(ws, where).astype(np.float32).reshape(-1))
        scale = rw.constant(f"{base}/bias_scale", bias_scale.astype(np.float32))
        inputs.append(rw.dequantize(base, rest[0], scale, "", None if bias_scale.size == 1 else 0))
    attributes = [a for a in node.attribute] if conv else []
    rw.quantize(base, rw.float_op(base, "Conv" if conv else "MatMul", inputs, attributes), ys, yz, node.output[0])


def _expand_gemm(rw: _Rewriter, node, base: str, where: str) -> None:
    """com.microsoft's QGemm(A, a_scale, a_zero, B, b_scale, b_zero, [C int32 with
    scale a_scale * b_scale], [y_scale, y_zero]): DQ, Gemm, and Q when y_scale
    is given (a float output otherwise)."""
    a, a_s, a_z, b, b_s, b_z, c, ys, yz = _inputs(node, 9)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if float(attrs.get("alpha", 1.0)) != 1.0:
        raise BuildError(f"{where}: QGemm with alpha={attrs['alpha']} is not supported (alpha=1 only)")
    trans_b = int(attrs.get("transB", 0))
    inputs = [rw.dequantize(base, a, a_s, a_z),
              rw.dequantize(base, b, b_s, b_z, _weight_axis(rw, b_s, 0 if trans_b else 1))]
    if c:
        bias_scale = (rw.value(a_s, where).astype(np.float32).reshape(-1)
                      * rw.value(b_s, where).astype(np.float32).reshape(-1))
        scale = rw.constant(f"{base}/bias_scale", bias_scale.astype(np.float32))
        inputs.append(rw.dequantize(base, c, scale, "", None if bias_scale.size == 1 else 0))
    attributes = [helper.make_attribute("transA", int(attrs.get("transA", 0))),
                  helper.make_attribute("transB", trans_b)]
    if not ys:
        rw.float_op(base, "Gemm", inputs, attributes, out=node.output[0])
        return
    rw.quantize(base, rw.float_op(base, "Gemm", inputs, attributes), ys, yz, node.output[0])


def _expand_integer(rw: _Rewriter, node, base: str, where: str) -> None:
    """MatMulInteger and ConvInteger: int32 products of (x - x_zero) and
    (w - w_zero), as DQ with scale 1, the float op and a Cast to int32. The
    float products are exact while each sum stays below 2**24 in magnitude."""
    conv = node.op_type == "ConvInteger"
    x, w, xz, wz = _inputs(node, 4)
    one = rw.constant(f"{base}/unit_scale", np.float32(1.0))
    if xz and xz in rw.initializers and rw.value(xz, where).size != 1:
        raise BuildError(f"{where}: a per-row zero point for input {x!r} is not supported; use one zero point")
    xf = rw.dequantize(base, x, one, xz)
    w_axis = None
    if wz and wz in rw.initializers and rw.value(wz, where).size != 1:
        w_axis = 0 if conv else -1
        count = rw.value(wz, where).size
        one = rw.constant(f"{base}/unit_scales", np.ones(count, np.float32))
    wf = rw.dequantize(base, w, one, wz, w_axis)
    attributes = [a for a in node.attribute] if conv else []
    product = rw.float_op(base, "Conv" if conv else "MatMul", [xf, wf], attributes)
    rw.nodes.append(helper.make_node("Cast", [product], [node.output[0]], name=f"{base}/to_int32",
                                     to=onnx.TensorProto.INT32))


def _expand_elementwise(rw: _Rewriter, node, base: str, where: str) -> None:
    """com.microsoft's QLinear element-wise ops: DQ of each input, the float
    op with the node's other attributes, Q of the output."""
    op_type = node.op_type[len("QLinear"):]
    if op_type in ("Add", "Mul"):
        a, a_s, a_z, b, b_s, b_z, ys, yz = _inputs(node, 8)
        inputs = [rw.dequantize(base, a, a_s, a_z), rw.dequantize(base, b, b_s, b_z)]
    else:
        x, xs, xz, ys, yz = _inputs(node, 5)
        inputs = [rw.dequantize(base, x, xs, xz)]
    attributes = [a for a in node.attribute if a.name != "channels_last"]
    if any(a.name == "channels_last" and a.i for a in node.attribute):
        raise BuildError(f"{where}: channels_last=1 is not supported (NCHW only)")
    rw.quantize(base, rw.float_op(base, op_type, inputs, attributes), ys, yz, node.output[0])


def _expand_concat(rw: _Rewriter, node, base: str, where: str) -> None:
    """QLinearConcat(y_scale, y_zero, x0, s0, z0, x1, s1, z1, ...)."""
    ys, yz, *rest = node.input
    if len(rest) % 3:
        raise BuildError(f"{where}: QLinearConcat takes y_scale, y_zero_point and (x, scale, zero_point) triples")
    inputs = [rw.dequantize(base, *rest[i:i + 3]) for i in range(0, len(rest), 3)]
    rw.quantize(base, rw.float_op(base, "Concat", inputs, list(node.attribute)), ys, yz, node.output[0])


EXPANSIONS = {
    "QLinearConv": _expand_linear, "QLinearMatMul": _expand_linear, "QGemm": _expand_gemm,
    "MatMulInteger": _expand_integer, "ConvInteger": _expand_integer,
    "QLinearAdd": _expand_elementwise, "QLinearMul": _expand_elementwise,
    "QLinearGlobalAveragePool": _expand_elementwise, "QLinearAveragePool": _expand_elementwise,
    "QLinearSigmoid": _expand_elementwise, "QLinearLeakyRelu": _expand_elementwise,
    "QLinearConcat": _expand_concat,
}
# com.microsoft's own QuantizeLinear / DequantizeLinear (written for 16-bit
# and other contrib types) mean the standard ops.
CONTRIB_ALIASES = ("QuantizeLinear", "DequantizeLinear")
CONTRIB_DOMAINS = ("com.microsoft",)


def expand_operators(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its QOperator and integer ops in QDQ form (the same
    model when it has none).

    >>> expand_operators(onnx.load("model_qoperator.onnx"))  # doctest: +SKIP
    """
    graph = proto.graph
    if not any(n.op_type in EXPANSIONS or n.op_type in CONTRIB_ALIASES and n.domain in CONTRIB_DOMAINS
               for n in graph.node):
        return proto
    rw = _Rewriter(proto)
    for index, node in enumerate(graph.node):
        base = node.name or f"{node.op_type}_{index}"
        where = f"node {base!r} ({node.op_type})"
        known_domain = node.domain in ("", "ai.onnx") + CONTRIB_DOMAINS
        if node.op_type in EXPANSIONS and known_domain:
            EXPANSIONS[node.op_type](rw, node, base, where)
        elif node.op_type in CONTRIB_ALIASES and node.domain in CONTRIB_DOMAINS:
            standard = onnx.NodeProto()
            standard.CopyFrom(node)
            standard.domain = ""
            rw.nodes.append(standard)
        else:
            rw.nodes.append(node)
    expanded = onnx.ModelProto()
    expanded.CopyFrom(proto)
    del expanded.graph.node[:]
    expanded.graph.node.extend(rw.nodes)
    expanded.graph.initializer.extend(rw.new_initializers)
    return expanded


# The 8-bit kernels between the convolutions (pools, Add, tables) register
# with the ops of this module; they build on its helpers, so they come last.
from . import integer_ops  # noqa: E402,F401
