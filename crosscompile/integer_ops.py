"""The 8-bit kernels between quantized convolutions: what quantized.lower_qdq
writes for DequantizeLinear -> pool / Add / activation -> QuantizeLinear,
so that a QDQ model stays in 8 bits from its first QuantizeLinear to its
last DequantizeLinear.

- IntegerTable: y = table[x], a 256-entry table of the whole
  DequantizeLinear -> f -> QuantizeLinear of one 8-bit input (an
  activation, or a change of scale), made by the pass with numpy in the
  float32 arithmetic ONNX defines, so it is exact by construction.
- IntegerPool: MaxPool (the maximum of the 8-bit values: requantizing is
  monotonic, so it commutes with the maximum, and a table after it changes
  the scale when input and output differ) and AveragePool /
  GlobalAveragePool (int32 sums, then one requantization per output).
- IntegerBinary: Add or Mul of two 8-bit tensors of one shape, each
  dequantized, combined and quantized in float32 as ONNX specifies (round
  half to even, saturate).

Kernels run one tap of the window at a time along output rows, padding
skipped by each tap's valid output range (as quantize_ops.IntegerConv does).
"""
from __future__ import annotations

from llvmlite import ir

from .emit import F32, I32, I64, Kernel
from .int8_dot import ROUNDING_LIMIT
from .op_base import _prod
from .quantize_ops import QUANT_RANGES, _IntegerOp, _extend, round_half_even, saturate, window_taps
from .window import _resolve_window


def pool_geometry(x_shape, attrs) -> tuple:
    """(height, width, kernel rows, kernel columns, strides, dilations and
    begin pads along rows and columns, output rows, output columns) of a
    1-D or 2-D pool."""
    spatial, kernel, strides, dilations, begin, _, out = _resolve_window(
        x_shape, attrs["kernel_shape"], attrs, bool(attrs["ceil_mode"]), what="pool")
    return (*spatial[1:], *kernel[1:], strides[1], strides[2], dilations[1], dilations[2], begin[1], begin[2],
            *out[1:])


def quantize_value(k: Kernel, value: ir.Value, attrs) -> ir.Value:
    """QuantizeLinear of a float32 value with attrs' output_scale and
    output_zero into output_dtype, clamped to [lowest, highest] (a Relu
    folded in): saturate(round_half_even(value / scale) + zero)."""
    b, zero = k.builder, attrs["output_zero"]
    scaled = b.fdiv(value, k.f32(attrs["output_scale"]))
    scaled = k.clamp(scaled, max(attrs["lowest"] - zero, -ROUNDING_LIMIT), min(attrs["highest"] - zero,
                                                                                  ROUNDING_LIMIT))
    return saturate(k, b.fadd(round_half_even(k, scaled), k.f32(zero)), attrs["output_dtype"])


def _dequantized(k: Kernel, value: ir.Value, dtype: str, scale: float, zero: int) -> ir.Value:
    """(x - zero) * scale in float32, as DequantizeLinear computes it."""
    b = k.builder
    return b.fmul(b.sitofp(b.sub(_extend(k, value, dtype), ir.Constant(I32, zero)), F32), k.f32(scale))


class IntegerTable(_IntegerOp):
    """y = table[x] for an 8-bit x: inputs x and the 256-entry table (indexed
    by x's bits read as unsigned)."""

    op_type = "IntegerTable"

    def infer(self, inputs, attrs):
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        b = k.builder
        x, table = k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.inputs[1], attrs["output_dtype"])
        y = k.typed(k.outputs[0], attrs["output_dtype"])
        with k.loop(outputs[0].size) as i:
            k.store(k.load(table, b.zext(k.load(x, i), I64)), y, i)


class IntegerBinary(_IntegerOp):
    """y = Q(DQ(a) + DQ(b)) or Q(DQ(a) * DQ(b)) (attrs["operation"] "Add" /
    "Mul") of two 8-bit tensors of one shape, in float32 in ONNX's order;
    attrs a_scale, a_zero, b_scale, b_zero and the output's."""

    op_type = "IntegerBinary"

    def infer(self, inputs, attrs):
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        b = k.builder
        a, c = (k.typed(ptr, t.dtype) for ptr, t in zip(k.inputs, inputs))
        y = k.typed(k.outputs[0], attrs["output_dtype"])
        combine = b.fadd if attrs["operation"] == "Add" else b.fmul
        with k.loop(outputs[0].size) as i:
            value = combine(_dequantized(k, k.load(a, i), inputs[0].dtype, attrs["a_scale"], attrs["a_zero"]),
                            _dequantized(k, k.load(c, i), inputs[1].dtype, attrs["b_scale"], attrs["b_zero"]))
            k.store(quantize_value(k, value, attrs), y, i)


class IntegerPool(_IntegerOp):
    """MaxPool or AveragePool (attrs["mode"] "max" / "average") of an 8-bit
    NCHW tensor, 1-D or 2-D, the window attributes of the pool.

    max: inputs x and, when the output's scale or zero point differ from
    x's, the table requantizing one value; the maximum is taken on the
    8-bit values (requantizing is monotonic).
    average: inputs x and counts (int32, the number of values each output
    averages, padding counted or not as the pool says); int32 sums, then
    Q(DQ(sum) / count)."""

    op_type = "IntegerPool"

    def infer(self, inputs, attrs):
        x = inputs[0]
        *_, out = _resolve_window(x, attrs["kernel_shape"], attrs, bool(attrs["ceil_mode"]), what="pool")
        return [(x[0], x[1], *out[5 - len(x):])]

    def scratch_bytes(self, inputs, outputs, attrs):
        return 4 * _prod(outputs[0].shape[2:]) if attrs["mode"] == "average" else 0

    def lower(self, k, inputs, outputs, attrs):
        x_shape = inputs[0].shape
        geometry = pool_geometry(x_shape, attrs)
        height, width, kh_count, kw_count, _, _, _, _, ph, pw, oh_count, ow_count = geometry
        plane, dtype = oh_count * ow_count, inputs[0].dtype
        b = k.builder
        average = attrs["mode"] == "average"
        x, y = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], attrs["output_dtype"])
        if average:
            acc, combine = k.typed(k.scratch, "int32"), b.add
            start = ir.Constant(I32, 0)
        else:
            acc, combine = y, (lambda m, v: b.select(_above(k, v, m, dtype), v, m))
            start = ir.Constant(y.type.pointee, QUANT_RANGES[dtype][0] & 0xFF)
        with k.loop(x_shape[0] * x_shape[1]) as nc:
            out = k.index((nc, plane))
            source = k.index((nc, height * width))
            window = kh_count * kw_count == height * width and plane == 1 and not ph and not pw
            if window and average:
                # A global pool: one sum over the plane, which LLVM vectorises.
                total = k.variable(start)
                with k.loop(height * width) as i:
                    b.store(b.add(b.load(total), _extend(k, k.load(x, k.index((source, 1), (i, 1))), dtype)),
                            total)
                k.store(b.load(total), acc, k.i64(0))
            else:
                with k.loop(plane) as p:
                    k.store(start, acc, p if average else b.add(out, p))
                for _, source_at, at in window_taps(k, source, geometry):
                    value = k.load(x, source_at)
                    if average:
                        value = _extend(k, value, dtype)
                    else:
                        at = b.add(out, at)
                    k.store(combine(k.load(acc, at), value), acc, at)
            with k.loop(plane) as p:
                if average:
                    count = k.load(k.typed(k.inputs[1], "int32"), p)
                    total = b.sub(k.load(acc, p), b.mul(count, ir.Constant(I32, attrs["input_zero"])))
                    value = b.fmul(b.sitofp(total, F32), k.f32(attrs["input_scale"]))
                    k.store(quantize_value(k, b.fdiv(value, b.sitofp(count, F32)), attrs), y, b.add(out, p))
                elif len(inputs) == 2:
                    table = k.typed(k.inputs[1], attrs["output_dtype"])
                    at = b.add(out, p)
                    k.store(k.load(table, b.zext(k.load(y, at), I64)), y, at)


def _above(k: Kernel, a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    """a > b for two 8-bit values of dtype."""
    compare = k.builder.icmp_unsigned if dtype == "uint8" else k.builder.icmp_signed
    return compare(">", a, b)
