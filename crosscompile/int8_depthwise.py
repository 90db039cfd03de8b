"""The 8-bit depthwise convolution (one filter per channel, NCHW), vectorised
with widening multiply-accumulate: 8 outputs of a row at a time, int16
inputs times an int16 tap summed into int32 lanes (AArch64's smlal /
smlal2, ARMv7's vmlal, x86's pmaddwd: LLVM picks them from the generic
vector IR), then requantized 4 lanes at a time as the dot-product tiles are.

Per channel the input plane is first copied into scratch as int16
x - x_zero, inside a border of zeros (the padding, which is x_zero before
the subtraction) wide enough that every tap of every block of 8 outputs
reads inside it; so the inner loop has no bounds to test. The border is
written once per call: each channel only rewrites the interior.
"""
from __future__ import annotations

from llvmlite import ir

from .emit import I8, I16, I32, Kernel
from .conv import _deinterleaved
from .int8_dot import V4F32, _requantize_row, _splat, conv_geometry

LANES = 8
V8I16 = ir.VectorType(I16, LANES)
V8I32 = ir.VectorType(I32, LANES)


def padded_plane(x_shape, attrs) -> tuple:
    """(rows, columns, blocks of LANES outputs per row) of the zero-bordered
    int16 plane the kernel reads."""
    _, _, kh_count, kw_count, sh, sw, dh, dw, _, _, oh_count, ow_count = conv_geometry(x_shape, attrs)
    blocks = -(-ow_count // LANES)
    rows = (oh_count - 1) * sh + (kh_count - 1) * dh + 1
    columns = blocks * LANES * sw + (kw_count - 1) * dw + 1
    return rows, columns, blocks


def scratch_bytes(x_shape, attrs) -> int:
    rows, columns, _ = padded_plane(x_shape, attrs)
    return 2 * rows * columns


def _lanes(k: Kernel, padded: ir.Value, at: ir.Value, stride: int) -> ir.Value:
    """LANES int16 values at padded + at, stride elements apart (stride 2 on
    AArch64: one ld2, where LLVM rebuilds a wide load's even lanes a lane
    at a time)."""
    b = k.builder
    ptr = b.gep(padded, [at])
    if stride == 1:
        return b.load(b.bitcast(ptr, V8I16.as_pointer()), align=2)
    if stride == 2 and k.target.arch == "aarch64":
        return _deinterleaved(k, padded, at, LANES)[0]
    wide = ir.VectorType(I16, LANES * stride)
    loaded = b.load(b.bitcast(ptr, wide.as_pointer()), align=2)
    return b.shuffle_vector(loaded, ir.Constant(wide, ir.Undefined),
                            ir.Constant(ir.VectorType(I32, LANES), [i * stride for i in range(LANES)]))


def _half(k: Kernel, vector: ir.Value, high: bool) -> ir.Value:
    start = LANES // 2 if high else 0
    return k.builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined),
                                    ir.Constant(ir.VectorType(I32, LANES // 2), list(range(start, start + 4))))


def lower(k: Kernel, inputs, outputs, attrs) -> None:
    """IntegerConv with attrs["int8_kernel"] == "depthwise": inputs x,
    weight (int16, (channels, 1, KH, KW), zero point taken out), bias
    (int32), multipliers (float32), one of each per channel."""
    x_shape = inputs[0].shape
    height, width, kh_count, kw_count, sh, sw, dh, dw, ph, pw, oh_count, ow_count = conv_geometry(x_shape, attrs)
    rows, columns, blocks = padded_plane(x_shape, attrs)
    batch, channels = x_shape[:2]
    b, dtype = k.builder, inputs[0].dtype
    x = k.typed(k.inputs[0], dtype)
    weight, bias = k.typed(k.inputs[1], "int16"), k.typed(k.inputs[2], "int32")
    y = k.typed(k.outputs[0], attrs["output_dtype"])
    padded = k.typed(k.scratch, "int16")
    zero16 = ir.Constant(I16, 0)
    with k.loop(rows * columns) as i:
        k.store(zero16, padded, i)
    # Input (r, c) sits at (r + ph, c + pw) of the plane; rows and columns
    # no output reads (a stride's leftovers) are left out.
    used_rows = max(0, min(height, rows - ph))
    used_columns = max(0, min(width, columns - pw))
    x_zero = ir.Constant(I32, attrs["input_zero"])
    extend = b.zext if dtype == "uint8" else b.sext
    plane = oh_count * ow_count
    with k.loop(batch * channels) as nc:
        channel = b.urem(nc, k.i64(channels))
        with k.loop(used_rows) as r, k.loop(used_columns) as c:
            value = b.sub(extend(k.load(x, k.index((nc, height * width), (r, width), (c, 1))), I32), x_zero)
            k.store(b.trunc(value, I16), padded, k.index((r, columns), (c, 1), (ph * columns + pw, 1)))
        taps = [_splat(k, b.sext(k.load(weight, k.index((channel, kh_count * kw_count), (t, 1))), I32), V8I32)
                for t in range(kh_count * kw_count)]
        start = _splat(k, k.load(bias, channel), V8I32)
        multiplier = _splat(k, k.load(k.inputs[3], channel), V4F32)
        with k.loop(oh_count) as oh, k.loop(blocks) as block:
            acc = start
            for kh in range(kh_count):
                for kw in range(kw_count):
                    at = k.index((oh, sh * columns), (block, LANES * sw), (kh * dh, columns), (kw * dw, 1))
                    values = b.sext(_lanes(k, padded, at, sw), V8I32)
                    acc = b.add(acc, b.mul(values, taps[kh * kw_count + kw]))
            out = _requantize_row(k, [_half(k, acc, high) for high in (False, True)], [multiplier] * 2, attrs)
            base = k.index((nc, plane), (oh, ow_count), (block, LANES))
            _store_block(k, out, y, base, block, blocks, ow_count)


def _store_block(k: Kernel, values: ir.Value, y: ir.Value, base: ir.Value, block: ir.Value, blocks: int,
                 ow_count: int) -> None:
    """Store a block of LANES outputs at y + base; the last block of a row
    stores only the outputs the row has."""
    b = k.builder
    tail = ow_count - (blocks - 1) * LANES
    at = b.gep(y, [base])
    if tail == LANES:
        b.store(values, b.bitcast(at, ir.VectorType(I8, LANES).as_pointer()), align=1)
        return
    with k.builder.if_else(b.icmp_signed("<", block, k.i64(blocks - 1))) as (whole, part):
        with whole:
            b.store(values, b.bitcast(at, ir.VectorType(I8, LANES).as_pointer()), align=1)
        with part:
            for lane in range(tail):
                b.store(b.extract_element(values, ir.Constant(I32, lane)), b.gep(at, [k.i64(lane)]))

