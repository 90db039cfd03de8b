"""The 8-bit convolution and matrix-product kernels of x86 cores, exact
in int32 as ONNX defines the sums:

- "madd" (AVX2): vpmaddwd multiplies 16 pairs of int16 and adds each pair
  into an int32 lane. The activations are int8 (uint8 less 128, as the
  ARM tiles take them) sign-extended to int16 as they are loaded, the
  weights int16 (w - w_zero, so any 8-bit weights and zero points); one
  instruction takes 4 columns x 4 reduction values, each column's sum in
  two lanes, added together once at the end of the reduction. Unlike
  vpmaddubsw (uint8 x int8 pairs into saturating int16, what onnxruntime's
  AVX2 kernels use), nothing can saturate.
- "vnni" (AVX-512 VNNI, or AVX-VNNI's 256-bit form): vpdpbusd multiplies
  uint8 by int8 in groups of 4 into int32 lanes, exactly: W columns x 4
  reduction values an instruction (W = 16 with 512-bit registers, else 8).
  The activations enter as uint8 (int8 plus 128), the weights (w - w_zero)
  as int8, and the pass folds the offset into the bias (quantized.py).

Both read the ARM dot-product kernel's layouts (int8_dot.py): a
convolution's input packed per call as [reduction / 4][output pixel][4]
(pack_input), its weight as one row of 4-value groups a filter, so a
tile broadcasts filters' 4 values and loads W pixels' 16 x W bytes; a
product's weight as [K / 4][N][4] and the rows of x copied per call.
A tile is rows x (vectors x W) int32 sums in registers; each ends
requantized to 8 bits W columns at a time (round half to even, saturate).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, NamedTuple

from llvmlite import ir

from .emit import F32, I8, I16, I32, I64, Kernel
from .int8_dot import (_as_operand, _intrinsic, _splat, conv_geometry, pack_input, shared_loop,
                       packing_buffers)
from .op_base import _prod

X86_KERNELS = ("madd", "vnni")


def tile(kernel: str, target) -> tuple:
    """(rows, vectors, columns a vector) of a kernel's tile: its rows x
    vectors sums, the vectors loaded, a broadcast and (madd) a product
    before it is added, all in the target's registers: 16 with AVX2 and
    AVX-VNNI (3 x 3 + 3 + 1 + 1 for madd, 4 x 3 + 3 + 1 for vnni), 32 with
    AVX-512 (8 x 3 + 3 + 1)."""
    if kernel == "madd":
        return (3, 3, 4)
    return (8, 3, 16) if vnni_bits(target) == 512 else (4, 3, 8)


def vnni_bits(target) -> int:
    """The width of the vpdpbusd a target takes: 512 bits with AVX-512
    VNNI and 512-bit vectors; 256 with AVX-VNNI, or AVX-512 VNNI and its
    256-bit forms (+avx512vl); 512 again for AVX-512 VNNI alone (the
    256-bit form needs +avx512vl, the 512-bit one nothing more)."""
    flags = target.feature_flags
    if "avx512vnni" in flags and target.vector_bits >= 512:
        return 512
    if "avxvnni" in flags or {"avx512vnni", "avx512vl"} <= flags:
        return 256
    return 512


def scratch_bytes(op_type: str, inputs, outputs, attrs) -> int:
    """The packed input of a convolution (plane rounded up to whole
    vectors), or the copied rows of a product's x."""
    width = attrs["int8_tile"][2]
    if op_type == "IntegerConv":
        plane = _prod(outputs[0].shape[2:])
        depth = inputs[1].shape[1] * 4  # the weight: [filters / rows][depth / 4][rows][4]
        return depth * -(-plane // width) * width * (2 if attrs["int8_kernel"] == "madd" else 1)
    depth4 = inputs[1].shape[0]
    return _prod(inputs[0].shape[:-1]) * depth4 * 4 * (2 if attrs["int8_kernel"] == "madd" else 1)


class Operands(NamedTuple):
    """What a tile reads and writes; the callables emit addresses and values:

    vector(g, column) -> pointer to the vector of columns column.. at
    reduction group g (vector_type: <16 x i8> or <16 x i16> for madd, 4
    columns; <4W x i8> for vnni); broadcast(row0, i, g) -> pointer to the
    4 values of row row0 + i at group g (int8 for vnni, int16 for madd),
    row0 the first row of a tile; bias(row, column, lanes)
    and multiplier(row, column, lanes) -> <lanes x i32> / <lanes x float>
    for the columns from column on; out(row, column) -> element offset in out_ptr of
    (row, column), the next W - 1 columns following it. With vnni,
    unsigned_vectors says which side is the uint8 operand. padded_rows:
    the broadcast side has whole tiles of rows (zeros past the last), so
    the rows left over are computed as a whole tile and the real ones
    stored."""

    kind: str
    width: int
    depth4: int
    vector: Callable
    vector_type: ir.VectorType
    broadcast: Callable
    unsigned_vectors: bool
    bias: Callable
    multiplier: Callable
    out: Callable
    out_ptr: ir.Value
    attrs: dict
    padded_rows: bool


V8I32 = ir.VectorType(I32, 8)
V16I16 = ir.VectorType(I16, 16)


def _accumulator_type(t: Operands) -> ir.VectorType:
    return V8I32 if t.kind == "madd" else ir.VectorType(I32, t.width)


def _load_vector(k: Kernel, t: Operands, g: ir.Value, column: ir.Value) -> ir.Value:
    b = k.builder
    value = b.load(b.bitcast(t.vector(g, column), t.vector_type.as_pointer()), align=1)
    if t.kind == "madd":
        return value if t.vector_type.element == I16 else b.sext(value, V16I16)
    return b.bitcast(value, ir.VectorType(I32, t.width))


def _load_broadcast(k: Kernel, t: Operands, row0: ir.Value, i: int, g: ir.Value) -> ir.Value:
    """A row's 4 values splat to a whole register: 4 int16 as one i64
    (madd), 4 bytes as one i32 (vnni)."""
    b = k.builder
    if t.kind == "madd":
        four = b.load(b.bitcast(t.broadcast(row0, i, g), I64.as_pointer()), align=2)
        return b.bitcast(_splat(k, four, ir.VectorType(I64, 4)), V16I16)
    four = b.load(b.bitcast(t.broadcast(row0, i, g), I32.as_pointer()), align=1)
    return _splat(k, four, ir.VectorType(I32, t.width))


def _product(k: Kernel, t: Operands, acc: ir.Value, vector: ir.Value, splat: ir.Value) -> ir.Value:
    if t.kind == "madd":
        return k.builder.add(acc, _intrinsic(k, "llvm.x86.avx2.pmadd.wd", V8I32, [vector, splat]))
    unsigned, signed = (vector, splat) if t.unsigned_vectors else (splat, vector)
    return _intrinsic(k, f"llvm.x86.avx512.vpdpbusd.{32 * t.width}", acc.type, [acc, unsigned, signed])


def _sums(k: Kernel, t: Operands, accs: list) -> ir.Value:
    """The column sums of one or two accumulators of consecutive columns
    (W each): madd's two lanes a column added together, two accumulators'
    into one vector of 8 (requantized 8 lanes at a time)."""
    if t.kind != "madd":
        return accs[0]
    b = k.builder
    other = accs[1] if len(accs) > 1 else ir.Constant(V8I32, ir.Undefined)
    lanes = 8 * len(accs)
    even, odd = (b.shuffle_vector(accs[0], other, ir.Constant(ir.VectorType(I32, lanes // 2),
                                                              list(range(first, lanes, 2))))
                 for first in (0, 1))
    return b.add(even, odd)


def emit_tile(k: Kernel, t: Operands, row0: ir.Value, rows: int, column0: ir.Value, vectors: int,
              last_lanes: int, stored: int) -> None:
    """One tile: rows x (vectors x W) sums from (row0, column0), the first
    stored rows stored but the last vector's lanes from last_lanes on."""
    b = k.builder
    width = t.width
    zero = ir.Constant(_accumulator_type(t), None)
    accs = [[k.variable(zero) for _ in range(vectors)] for _ in range(rows)]
    columns = [b.add(column0, k.i64(width * v)) for v in range(vectors)]

    def step(g: ir.Value) -> None:
        loaded = [_load_vector(k, t, g, column) for column in columns]
        for i in range(rows):
            splat = _load_broadcast(k, t, row0, i, g)
            for v in range(vectors):
                b.store(_product(k, t, b.load(accs[i][v]), loaded[v], splat), accs[i][v])

    # Two groups a trip: the loop's counter and branch against 2 x rows x
    # vectors products.
    unroll = 2 if t.depth4 > 1 else 1
    with k.loop(t.depth4 // unroll) as h:
        for u in range(unroll):
            step(b.add(b.mul(h, k.i64(unroll)), k.i64(u)))
    if t.depth4 % unroll:
        step(k.i64(t.depth4 - 1))
    # madd's vectors of 4 columns are requantized two at a time.
    together = 2 if t.kind == "madd" else 1
    for i in range(stored):
        row = b.add(row0, k.i64(i))
        for v in range(0, vectors, together):
            parts = list(range(v, min(v + together, vectors)))
            column, count = columns[v], width * len(parts)
            sums = b.add(_sums(k, t, [b.load(accs[i][p]) for p in parts]), t.bias(row, column, count))
            values = _requantize(k, sums, t.multiplier(row, column, count), t.attrs)
            at = b.gep(t.out_ptr, [t.out(row, column)])
            lanes = count if parts[-1] < vectors - 1 else count - width + last_lanes
            if lanes == count:
                b.store(values, b.bitcast(at, values.type.as_pointer()), align=1)
                continue
            for lane in range(lanes):
                b.store(b.extract_element(values, ir.Constant(I32, lane)), b.gep(at, [k.i64(lane)]))


# cvtps2dq by register width: float32 to int32 in the current rounding
# mode (round half to even unless a program changed it, which the other
# kernels' rounding assumes too).
_CONVERT = {4: "llvm.x86.sse2.cvtps2dq", 8: "llvm.x86.avx.cvt.ps2dq.256",
            16: "llvm.x86.avx512.mask.cvtps2dq.512"}


def _requantize(k: Kernel, sums: ir.Value, multiplier: ir.Value, attrs) -> ir.Value:
    """saturate(round_half_even(sums * multiplier) + y_zero) as bytes,
    the bounds ([lowest, highest] - y_zero) applied in float32 before the
    rounding (integer bounds: the same as after), then one cvtps2dq and
    y_zero added in int32."""
    b = k.builder
    lanes, zero = sums.type.count, attrs["output_zero"]
    floats, ints = ir.VectorType(F32, lanes), ir.VectorType(I32, lanes)
    with k.vector_constants(lanes):
        value = k.clamp(b.fmul(b.sitofp(sums, floats), multiplier), attrs["lowest"] - zero, attrs["highest"] - zero)
    extra = [] if lanes < 16 else [ir.Constant(ints, None), ir.Constant(ir.IntType(16), -1), ir.Constant(I32, 4)]
    rounded = _intrinsic(k, _CONVERT[lanes], ints, [value] + extra)
    return b.trunc(b.add(rounded, ir.Constant(ints, [zero] * lanes)), ir.VectorType(I8, lanes))


@contextmanager
def _starts(k: Kernel, count: int, size: int, start: int, shared: bool = False):
    """The first index of each of count blocks of size from start: a loop,
    or the constant when there is one block. shared hands the blocks out
    to the threads of a parallel kernel (int8_dot.shared_loop)."""
    if shared and k.parallel:
        with shared_loop(k, count) as i:
            yield k.index((i, size), (start, 1))
        return
    if count == 1:
        yield k.i64(start)
        return
    with k.loop(count) as i:
        yield k.index((i, size), (start, 1))


def emit_tiles(k: Kernel, t: Operands, rows: int, columns: int, rows_outer: bool) -> None:
    """Every tile of a rows x columns output: whole tiles in loops, then a
    smaller tile of the rows left and one of the columns left (a last
    vector of fewer than W columns stores only those). rows_outer runs
    the loop over rows outside the one over columns (the columns' operand
    is then read again for each block of rows: the smaller one should be).
    In a parallel kernel the threads take the outer loop's blocks in chunks."""
    tile_rows, tile_vectors, width = t.attrs["int8_tile"]
    row_parts = [(rows // tile_rows, tile_rows, 0, tile_rows)] if rows >= tile_rows else []
    if rows % tile_rows:
        left = rows % tile_rows
        row_parts.append((1, tile_rows if t.padded_rows else left, rows - left, left))
    span = tile_vectors * width
    column_parts = [(columns // span, tile_vectors, width, 0)] if columns >= span else []
    left = columns % span
    if left:
        vectors = -(-left // width)
        column_parts.append((1, vectors, left - (vectors - 1) * width, columns - left))
    if rows_outer:
        for count, height, start, stored in row_parts:
            with _starts(k, count, height, start, shared=True) as row0:
                for c_count, vectors, last, c_start in column_parts:
                    with _starts(k, c_count, vectors * width, c_start) as column0:
                        emit_tile(k, t, row0, height, column0, vectors, last, stored)
        return
    for c_count, vectors, last, c_start in column_parts:
        with _starts(k, c_count, vectors * width, c_start, shared=True) as column0:
            for count, height, start, stored in row_parts:
                with _starts(k, count, height, start) as row0:
                    emit_tile(k, t, row0, height, column0, vectors, last, stored)


def _splat_of(k: Kernel, array: ir.Value, index: ir.Value, lanes: int) -> ir.Value:
    value = k.load(array, index)
    return _splat(k, value, ir.VectorType(value.type, lanes))


def _vector_at(k: Kernel, array: ir.Value, index: ir.Value, lanes: int) -> ir.Value:
    b = k.builder
    element = array.type.pointee
    return b.load(b.bitcast(b.gep(array, [index]), ir.VectorType(element, lanes).as_pointer()), align=4)


def lower_conv(k: Kernel, inputs, outputs, attrs) -> None:
    """IntegerConv with "madd" or "vnni": per image, the input packed into
    scratch (int8_dot.pack_input: int8, or uint8 for vnni), the plane of
    each reduction group rounded up to whole vectors; then the tiles of
    filters x output pixels."""
    x_shape = inputs[0].shape
    _, _, kh_count, kw_count, *_, oh_count, ow_count = conv_geometry(x_shape, attrs)
    kind, (_, _, width) = attrs["int8_kernel"], attrs["int8_tile"]
    filters, plane = attrs["filters"], oh_count * ow_count
    step = -(-plane // width) * width
    tile_rows, depth4 = attrs["int8_tile"][0], inputs[1].shape[1]  # the weight: [filters / rows][depth4][rows][4]
    b = k.builder
    buffers = packing_buffers(k, inputs, attrs, unsigned=kind == "vnni", wide=kind == "madd")
    packed = buffers[1]
    weight = k.typed(k.inputs[1], "int16" if kind == "madd" else "int8")
    bias, multipliers = k.typed(k.inputs[2], "int32"), k.typed(k.inputs[3], "float32")
    y = k.typed(k.outputs[0], attrs["output_dtype"])
    with k.loop(x_shape[0]) as n:
        pack_input(k, buffers, inputs, attrs, n, depth4 // (kh_count * kw_count), step)
        k.barrier()  # every thread's tiles read all of the packed input
        t = Operands(kind, width, depth4,
                     lambda g, column: b.gep(packed, [k.index((g, step * 4), (column, 4))]),
                     ir.VectorType(I8, 4 * width) if kind == "vnni" else V16I16,
                     lambda row0, i, g: b.gep(weight, [k.index((row0, depth4 * 4), (g, tile_rows * 4), (i * 4, 1))]),
                     True,
                     lambda row, column, lanes: _splat_of(k, bias, row, lanes),
                     lambda row, column, lanes: _splat_of(k, multipliers, row, lanes),
                     lambda row, column: k.index((n, filters * plane), (row, plane), (column, 1)), y, attrs, True)
        # Columns outside: a block of pixels' packed input stays in the
        # cache while the weights, in the order the tiles read them, stream by.
        emit_tiles(k, t, filters, plane, rows_outer=False)
        if x_shape[0] > 1:
            k.barrier()  # before the next image's packing overwrites this one's


def lower_matmul(k: Kernel, inputs, outputs, attrs) -> None:
    """IntegerMatMul with "madd" or "vnni": the rows of x copied into
    scratch, the reduction padded to 4 with zeros (as int16 x - x_zero for
    madd, as uint8 for vnni); then the tiles of rows x columns of the
    weight packed at compile time ([K / 4][N][4], N rounded up to whole
    vectors)."""
    depth4, columns_padded = inputs[1].shape[:2]
    depth, columns = inputs[0].shape[-1], attrs["columns"]
    kind, (_, _, width) = attrs["int8_kernel"], attrs["int8_tile"]
    rows = _prod(inputs[0].shape[:-1])
    kp = depth4 * 4
    b, dtype = k.builder, inputs[0].dtype
    x = k.typed(k.inputs[0], dtype)
    weight = k.typed(k.inputs[1], "int16" if kind == "madd" else "int8")
    copied = k.typed(k.scratch, "int16" if kind == "madd" else "int8")
    element = copied.type.pointee
    with k.loop(rows) as r:
        with k.loop(depth) as d:
            value = k.load(x, k.index((r, depth), (d, 1)))
            if kind == "madd":
                extend = b.zext if dtype == "uint8" else b.sext
                value = b.sub(extend(value, I16), ir.Constant(I16, attrs["input_zero"]))
            else:
                value = _as_operand(k, value, dtype, unsigned=True)
            k.store(value, copied, k.index((r, kp), (d, 1)))
        if kp > depth:
            with k.loop(kp - depth) as d:
                k.store(ir.Constant(element, 0), copied, k.index((r, kp), (d, 1), (depth, 1)))
    bias, multipliers = k.typed(k.inputs[2], "int32"), k.typed(k.inputs[3], "float32")
    t = Operands(kind, width, depth4,
                 lambda g, column: b.gep(weight, [k.index((g, columns_padded * 4), (column, 4))]),
                 V16I16 if kind == "madd" else ir.VectorType(I8, 4 * width),
                 lambda row0, i, g: b.gep(copied, [k.index((row0, kp), (i, kp), (g, 4))]), False,
                 lambda row, column, lanes: _vector_at(k, bias, column, lanes),
                 lambda row, column, lanes: _vector_at(k, multipliers, column, lanes),
                 lambda row, column: k.index((row, columns), (column, 1)),
                 k.typed(k.outputs[0], attrs["output_dtype"]), attrs, False)
    # The copied rows (read again for each block of columns) against the
    # weight (read again for each block of rows).
    emit_tiles(k, t, rows, columns, rows_outer=rows * kp <= columns_padded * kp)
