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

from .conv import _deinterleaved
from .emit import F32, I8, I32, I64, Kernel
from .int8_dot import ROUNDING_LIMIT, V4F32, _intrinsic, rounded_to_8_bits
from .op_base import _prod
from .quantize_ops import QUANT_RANGES, _IntegerOp, _extend, round_half_even, saturate, window_taps
from .window import _resolve_window, _valid_range


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
    by x's bits read as unsigned), or one such table per channel (axis 1 of
    an N x C x ... x), shaped (C, 256)."""

    op_type = "IntegerTable"

    def infer(self, inputs, attrs):
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        x, table = k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.inputs[1], attrs["output_dtype"])
        y = k.typed(k.outputs[0], attrs["output_dtype"])
        if len(inputs[1].shape) == 1:
            look_up(k, table, x, y, k.i64(0), outputs[0].size)
            return
        batch, channels, inner = inputs[0].shape[0], inputs[0].shape[1], _prod(inputs[0].shape[2:])
        with k.loop(batch * channels) as plane:
            channel = k.builder.urem(plane, k.i64(channels))
            look_up(k, k.builder.gep(table, [k.index((channel, 256))]), x, y, k.index((plane, inner)), inner)


# Bytes a table lookup takes at a time on AArch64.
TABLE_LANES = 16


def look_up(k: Kernel, table: ir.Value, x: ir.Value, y: ir.Value, start: ir.Value, count: int) -> None:
    """y[start + i] = table[x[start + i]] for i < count (x may be y). On
    AArch64, 16 values at a time: the 256-byte table held in 16 registers,
    one tbl of its first 64 bytes and a tbx of each next 64 (the index
    less 64 each time: tbx leaves lanes whose index is out of range)."""
    b = k.builder
    whole = count // TABLE_LANES if k.target.arch == "aarch64" else 0
    if whole:
        vector = ir.VectorType(I8, TABLE_LANES)
        pointer = vector.as_pointer()
        rows = [b.load(b.bitcast(b.gep(table, [k.i64(TABLE_LANES * i)]), pointer), align=1)
                for i in range(256 // TABLE_LANES)]
        quarter = ir.Constant(vector, [64] * TABLE_LANES)
        with k.loop(whole) as i:
            at = b.add(start, b.mul(i, k.i64(TABLE_LANES)))
            index = b.load(b.bitcast(b.gep(x, [at]), pointer), align=1)
            value = _intrinsic(k, "llvm.aarch64.neon.tbl4.v16i8", vector, rows[:4] + [index])
            for part in range(1, 4):
                index = b.sub(index, quarter)
                value = _intrinsic(k, "llvm.aarch64.neon.tbx4.v16i8", vector,
                                   [value] + rows[4 * part:4 * part + 4] + [index])
            b.store(value, b.bitcast(b.gep(y, [at]), pointer), align=1)
    with k.loop(count, start=whole * TABLE_LANES) as i:
        at = b.add(start, i)
        k.store(k.load(table, b.zext(k.load(x, at), I64)), y, at)


# Values an AArch64 IntegerBinary takes at a time: 16 bytes of each input.
BINARY_LANES = 16


def _dequantized_quarters(k: Kernel, x: ir.Value, at: ir.Value, dtype: str, scale: float, zero: int) -> list:
    """DequantizeLinear of x[at:at + 16] (8-bit) as 4 vectors of 4 float32:
    x - zero in 16 bits (usubl / ssubl), then widened, converted and scaled,
    the same float32 values _dequantized gives one at a time."""
    b = k.builder
    x16 = ir.VectorType(ir.IntType(16), BINARY_LANES)
    loaded = b.load(b.bitcast(b.gep(x, [at]), ir.VectorType(I8, BINARY_LANES).as_pointer()), align=1)
    extend = b.zext if dtype == "uint8" else b.sext
    shifted = b.sub(extend(loaded, x16), ir.Constant(x16, [zero] * BINARY_LANES))
    wide = b.sext(shifted, ir.VectorType(I32, BINARY_LANES))
    scaled = b.fmul(b.sitofp(wide, ir.VectorType(F32, BINARY_LANES)), ir.Constant(ir.VectorType(F32, BINARY_LANES),
                                                                                   [scale] * BINARY_LANES))
    return [b.shuffle_vector(scaled, scaled, ir.Constant(ir.VectorType(I32, 4), list(range(q, q + 4))))
            for q in range(0, BINARY_LANES, 4)]


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
        whole = outputs[0].size // BINARY_LANES if k.target.arch == "aarch64" else 0
        if whole:
            with k.loop(whole) as i:
                at = b.mul(i, k.i64(BINARY_LANES))
                quarters = [combine(x, z) for x, z in zip(
                    _dequantized_quarters(k, a, at, inputs[0].dtype, attrs["a_scale"], attrs["a_zero"]),
                    _dequantized_quarters(k, c, at, inputs[1].dtype, attrs["b_scale"], attrs["b_zero"]))]
                scale = ir.Constant(V4F32, [attrs["output_scale"]] * 4)
                value = rounded_to_8_bits(k, [b.fdiv(q, scale) for q in quarters], attrs)
                b.store(value, b.bitcast(b.gep(y, [at]), value.type.as_pointer()), align=1)
        with k.loop(outputs[0].size, start=whole * BINARY_LANES) as i:
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
            acc, start = k.typed(k.scratch, "int32"), ir.Constant(I32, 0)
        else:
            acc, start = y, ir.Constant(y.type.pointee, QUANT_RANGES[dtype][0] & 0xFF)
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
                if average:
                    for _, source_at, at in window_taps(k, source, geometry):
                        value = _extend(k, k.load(x, source_at), dtype)
                        k.store(b.add(k.load(acc, at), value), acc, at)
                else:
                    _maximum_taps(k, x, y, source, out, geometry, dtype)
            if average:
                with k.loop(plane) as p:
                    count = k.load(k.typed(k.inputs[1], "int32"), p)
                    total = b.sub(k.load(acc, p), b.mul(count, ir.Constant(I32, attrs["input_zero"])))
                    value = b.fmul(b.sitofp(total, F32), k.f32(attrs["input_scale"]))
                    k.store(quantize_value(k, b.fdiv(value, b.sitofp(count, F32)), attrs), y, b.add(out, p))
            elif len(inputs) == 2:
                look_up(k, k.typed(k.inputs[1], attrs["output_dtype"]), y, y, out, plane)


# Outputs of a max pool's row taken at a time: a 16-byte vector, or an
# 8-byte one for rows of 8 to 15.
POOL_LANES = (16, 8)


def _maximum_taps(k: Kernel, x: ir.Value, y: ir.Value, source: ir.Value, out: ir.Value, geometry: tuple,
                  dtype: str) -> None:
    """y = max(y, tap) for each tap of the window, as window_taps visits
    them, 16 (or 8) outputs of a row at a time where the tap's row has at
    least that many and the stride is 1 or 2 (a load of 16 x stride bytes
    and its even or odd lanes: one ld2 on AArch64); the last 16 of the row
    end at its end, overlapping the ones before (the maximum is idempotent)."""
    height, width, kh_count, kw_count, sh, sw, dh, dw, ph, pw, oh_count, ow_count = geometry
    b = k.builder
    for kh in range(kh_count):
        rows = _valid_range(kh * dh - ph, sh, height, oh_count)
        for kw in range(kw_count):
            cols = _valid_range(kw * dw - pw, sw, width, ow_count)
            count, offset = cols[1] - cols[0], kw * dw - pw
            if rows[0] == rows[1] or count == 0:
                continue
            lanes = next((n for n in POOL_LANES if n <= count), POOL_LANES[0])
            vector = ir.VectorType(I8, lanes)
            # The last vector's load starts sw - 1 bytes early and takes the
            # odd lanes, so that it ends at the row's last value; or, where
            # that start is before the row, at the first value (its load then
            # ends sw - 1 bytes past the value, still in the row).
            tail_start = (cols[1] - lanes) * sw + offset
            if tail_start - (sw - 1) >= 0:
                tail_shift = sw - 1
            elif (cols[1] - 1) * sw + offset + sw - 1 < width:
                tail_shift = 0
            else:
                tail_shift = None
            vectored = sw <= 2 and count >= lanes and tail_shift is not None
            with k.loop(rows[1], start=rows[0]) as oh:
                line = k.index((source, 1), (oh, sh * width), (kh * dh - ph, width), (offset, 1))
                row = k.index((out, 1), (oh, ow_count))
                if not vectored:
                    with k.loop(cols[1], start=cols[0]) as ow:
                        at = b.add(row, ow)
                        value = k.load(x, k.index((line, 1), (ow, sw)))
                        current = k.load(y, at)
                        k.store(b.select(_above(k, value, current, dtype), value, current), y, at)
                    continue

                def maximum(ow: ir.Value, shift: int) -> None:
                    offset = k.index((line, 1), (ow, sw), (-shift, 1))
                    if sw == 2 and k.target.arch == "aarch64":
                        # ld2 itself: LLVM rebuilds a wide load's even lanes a lane at a time.
                        loaded = _deinterleaved(k, x, offset, lanes)[shift]
                    else:
                        loaded = b.load(b.bitcast(b.gep(x, [offset]), ir.VectorType(I8, lanes * sw).as_pointer()),
                                        align=1)
                    if sw > 1 and loaded.type.count != lanes:
                        loaded = b.shuffle_vector(loaded, ir.Constant(loaded.type, ir.Undefined),
                                                  ir.Constant(ir.VectorType(I32, lanes),
                                                              [shift + sw * j for j in range(lanes)]))
                    at = b.bitcast(b.gep(y, [b.add(row, ow)]), vector.as_pointer())
                    current = b.load(at, align=1)
                    b.store(b.select(_above(k, loaded, current, dtype), loaded, current), at, align=1)
                with k.loop((count - 1) // lanes) as c:
                    maximum(k.index((c, lanes), (cols[0], 1)), 0)
                maximum(k.i64(cols[1] - lanes), tail_shift)


def _above(k: Kernel, a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    """a > b for two 8-bit values of dtype."""
    compare = k.builder.icmp_unsigned if dtype == "uint8" else k.builder.icmp_signed
    return compare(">", a, b)
