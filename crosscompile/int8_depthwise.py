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

On cores with dot products (lower_dot), 3 x 3 layers of stride 1 or 2
gather each output's 3 inputs of a kernel row with tbl instead, and sdot
adds their 3 products (12 products an instruction, against smlal's 4).
"""
from __future__ import annotations

from llvmlite import ir

from .emit import I8, I16, I32, Kernel
from .conv import _deinterleaved
from .int8_dot import (V4F32, V4I32, V16I8, _as_int8, _intrinsic, _requantize_row, _sdot, _splat, conv_geometry,
                       store_bytes)

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
    dot_rows, dot_columns, _, _ = dot_plane(x_shape, attrs)
    return max(2 * rows * columns, dot_rows * dot_columns)


def takes_dot(k: Kernel, x_shape, attrs) -> bool:
    """Whether lower_dot computes this depthwise convolution: a core with
    sdot, 3 x 3 taps, dilation 1, stride 1 or 2 both ways, int8 weights."""
    _, _, kh_count, kw_count, sh, sw, dh, dw, *_ = conv_geometry(x_shape, attrs)
    return (k.target.arch == "aarch64" and k.target.has_dot_product and attrs.get("int8_weights", False)
            and (kh_count, kw_count, dh, dw) == (3, 3, 1, 1) and sh == sw and sw in (1, 2))


def dot_plane(x_shape, attrs) -> tuple:
    """(rows, columns, outputs a block, blocks a row) of lower_dot's padded int8 plane."""
    _, _, _, _, sh, sw, _, _, _, _, oh_count, ow_count = conv_geometry(x_shape, attrs)
    width = DOT_BLOCK if ow_count > DOT_BLOCK // 2 else DOT_BLOCK // 2
    blocks = -(-ow_count // width)
    # A block's taps read (width - 1) * sw + 3 bytes, loaded as 16 * (sw + 1).
    return (oh_count - 1) * sh + 3, (blocks - 1) * width * sw + 16 * (sw + 1), width, blocks


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


def _buffers(k: Kernel, inputs, attrs) -> tuple:
    """The typed pointers x, weight (int16), bias (int32) and y."""
    return (k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.inputs[1], "int16"), k.typed(k.inputs[2], "int32"),
            k.typed(k.outputs[0], attrs["output_dtype"]))


# Outputs of a row lower_dot computes at a time (8 for rows of 8 or fewer).
DOT_BLOCK = 16


def lower_dot(k: Kernel, inputs, outputs, attrs) -> None:
    """A 3 x 3 depthwise convolution with sdot: per output row and block of
    16 (or 8) outputs, for each kernel row, a table lookup (tbl) gathers
    each output's 3 inputs (and a fourth, its weight 0) from the row's
    loaded bytes, 4 outputs a register, and one sdot by the row's weights
    adds them: 12 products an instruction. The plane is copied per channel
    as int8 (x - 128 for uint8), inside a border of the zero point's value;
    each channel's bias takes (128 - x_zero) * sum(weights) for the offset."""
    x_shape = inputs[0].shape
    height, width, _, _, sh, sw, _, _, ph, pw, oh_count, ow_count = conv_geometry(x_shape, attrs)
    rows, columns, block, blocks = dot_plane(x_shape, attrs)
    batch, channels = x_shape[:2]
    b, dtype = k.builder, inputs[0].dtype
    x, weight, bias, y = _buffers(k, inputs, attrs)
    plane = k.typed(k.scratch, "int8")
    offset = 128 if dtype == "uint8" else 0
    with k.loop(rows * columns) as i:
        k.store(ir.Constant(I8, (attrs["input_zero"] - offset) & 0xFF), plane, i)
    used_rows = max(0, min(height, rows - ph))
    used_columns = max(0, min(width, columns - pw))
    loads = sw + 1  # 16-byte registers a block's kernel row reads
    # Output 4j + m's tap t is byte (4j + m) * sw + t of the loaded row (t = 3: weight 0).
    gathers = [ir.Constant(V16I8, [min((4 * j + m) * sw + t, 16 * loads - 1) for m in range(4) for t in range(4)])
               for j in range(block // 4)]
    out_plane = oh_count * ow_count
    with k.loop(batch * channels) as nc:
        channel = b.urem(nc, k.i64(channels))
        with k.loop(used_rows) as r, k.loop(used_columns) as c:
            value = _as_int8(k, k.load(x, k.index((nc, height * width), (r, width), (c, 1))), dtype)
            k.store(value, plane, k.index((r, columns), (c, 1), (ph * columns + pw, 1)))
        taps = [k.load(weight, k.index((channel, 9), (t, 1))) for t in range(9)]
        total = taps[0]
        for tap in taps[1:]:
            total = b.add(total, tap)
        start = b.add(k.load(bias, channel), b.mul(b.sext(total, I32), ir.Constant(I32, offset - attrs["input_zero"])))
        start = _splat(k, start, V4I32)
        row_weights = []
        for kh in range(3):
            word = ir.Constant(V16I8, ir.Undefined)
            for lane in range(16):
                value = b.trunc(taps[kh * 3 + lane % 4], I8) if lane % 4 < 3 else ir.Constant(I8, 0)
                word = b.insert_element(word, value, ir.Constant(I32, lane))
            row_weights.append(word)
        multiplier = _splat(k, k.load(k.inputs[3], channel), V4F32)
        with k.loop(oh_count) as oh, k.loop(blocks) as blk:
            accs = [start] * (block // 4)
            for kh in range(3):
                at = k.index((oh, sh * columns), (kh, columns), (blk, block * sw))
                table = [b.load(b.bitcast(b.gep(plane, [k.index((at, 1), (16 * i, 1))]), V16I8.as_pointer()),
                              align=1) for i in range(loads)]
                for j, gather in enumerate(gathers):
                    picked = _intrinsic(k, f"llvm.aarch64.neon.tbl{loads}.v16i8", V16I8, table + [gather])
                    accs[j] = _sdot(k, accs[j], picked, row_weights[kh])
            out = _requantize_row(k, accs, [multiplier] * len(accs), attrs)
            base = k.index((nc, out_plane), (oh, ow_count), (blk, block))
            _store_block(k, out, y, base, blk, blocks, ow_count, block)


def lower(k: Kernel, inputs, outputs, attrs) -> None:
    """IntegerConv with attrs["int8_kernel"] == "depthwise": inputs x,
    weight (int16, (channels, 1, KH, KW), zero point taken out), bias
    (int32), multipliers (float32), one of each per channel."""
    if takes_dot(k, inputs[0].shape, attrs):
        lower_dot(k, inputs, outputs, attrs)
        return
    x_shape = inputs[0].shape
    height, width, kh_count, kw_count, sh, sw, dh, dw, ph, pw, oh_count, ow_count = conv_geometry(x_shape, attrs)
    rows, columns, blocks = padded_plane(x_shape, attrs)
    batch, channels = x_shape[:2]
    b, dtype = k.builder, inputs[0].dtype
    x, weight, bias, y = _buffers(k, inputs, attrs)
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
                 ow_count: int, lanes: int = LANES) -> None:
    """Store a block of lanes outputs at y + base; the last block of a row
    stores only the outputs the row has."""
    b = k.builder
    tail = ow_count - (blocks - 1) * lanes
    at = b.gep(y, [base])
    if tail == lanes:
        b.store(values, b.bitcast(at, ir.VectorType(I8, lanes).as_pointer()), align=1)
        return
    with k.builder.if_else(b.icmp_signed("<", block, k.i64(blocks - 1))) as (whole, part):
        with whole:
            b.store(values, b.bitcast(at, ir.VectorType(I8, lanes).as_pointer()), align=1)
        with part:
            if lanes % 8 == 0:
                store_bytes(k, values, 0, tail, at)
            else:
                for lane in range(tail):
                    b.store(b.extract_element(values, ir.Constant(I32, lane)), b.gep(at, [k.i64(lane)]))

