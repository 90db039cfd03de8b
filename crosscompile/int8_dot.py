"""The 8-bit dot-product micro-kernel (AArch64 sdot, ARMv8.2 +dotprod):
a tile of int32 sums, 4 x 4 products a time per instruction; and its
ARMv8.0 forms (smull + smlal + sadalp, 16 products in three instructions;
smull + sadalp, 8 products in two).

Both operands are int8 in groups of 4 along the reduction. One side is
"vectors": 16 bytes holding 4 columns x 4 reduction values, packed as
[depth / 4][columns][4]; the other is "broadcasts": 4 reduction values of
one row (an i32 load, splat to every lane). A tile is `rows` rows by
`vectors` x 4 columns, its sums in rows x vectors registers; each sum
starts from an int32 bias and ends requantized to 8 bits, 4 columns at a
time, into an output whose columns are contiguous.

uint8 activations enter as int8 (x - 128): the pass (quantized.py) folds
(128 - x_zero) * sum(w) into the bias, so sums are those of
(x - x_zero) * (w - w_zero).

IntegerConv uses it with filters as rows (broadcast weights) and output
pixels as columns (activations packed from the input per call);
IntegerMatMul with rows of x as rows (copied to int8 per call) and the
weight's columns as columns (packed at compile time).
"""
from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir

from .conv import _deinterleaved
from .emit import F32, I8, I16, I32, Kernel
from .op_base import _prod
from .window import _resolve_window, _valid_range

# 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude
# below 2**22 to the nearest integer, ties to even, in the default
# rounding mode, with no libm call (llvm.roundeven becomes one on targets
# without a rounding instruction).
ROUNDING_MAGIC = 12582912.0
ROUNDING_LIMIT = 4194304.0

V16I8 = ir.VectorType(I8, 16)
V4I32 = ir.VectorType(I32, 4)
V4F32 = ir.VectorType(F32, 4)
V4I8 = ir.VectorType(I8, 4)


def _sdot(k: Kernel, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    return _intrinsic(k, "llvm.aarch64.neon.sdot.v4i32.v16i8", V4I32, [acc, a, b])


V8I8 = ir.VectorType(I8, 8)
V8I16 = ir.VectorType(ir.IntType(16), 8)


def _intrinsic(k: Kernel, name: str, result, args: list) -> ir.Value:
    fn = k.module.globals.get(name)
    if fn is None:
        fn = ir.Function(k.module, ir.FunctionType(result, [a.type for a in args]), name=name)
    return k.builder.call(fn, args)


def _half(k: Kernel, vector: ir.Value, high: bool) -> ir.Value:
    start = 8 if high else 0
    return k.builder.shuffle_vector(vector, ir.Constant(V16I8, ir.Undefined),
                                    ir.Constant(ir.VectorType(I32, 8), list(range(start, start + 8))))


V4I16 = ir.VectorType(ir.IntType(16), 4)


def _splat(k: Kernel, value: ir.Value, vector: ir.VectorType) -> ir.Value:
    b = k.builder
    one = b.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(I32, 0))
    return b.shuffle_vector(one, ir.Constant(vector, ir.Undefined), ir.Constant(ir.VectorType(I32, vector.count), [0] * vector.count))


class DotTile:
    """What a tile reads and writes; the callables emit addresses and values:

    vector(k4, column) -> i8* of the 16 packed bytes at reduction group k4, column;
    broadcast(row, k4) -> i8* of the 4 bytes of row at group k4;
    bias(row, column) / multiplier(row, column) -> <4 x i32> / <4 x float>
    for the 4 columns from column on; out(row, column) -> element offset in
    the output of (row, column), whose next 3 columns follow it.

    With lanes (kinds "dot" and "quads"), broadcast(row, g) is the i8* of
    16 bytes: rows row..row + 3 (row a multiple of 4), 4 reduction values
    each, and each row's 4 bytes are a lane of that one register (sdot by
    element, or a dup): a load for 4 rows rather than one for each.
    """

    def __init__(self, depth4: int, vector, broadcast, bias, multiplier, out, out_ptr, attrs, lanes: bool = False,
                 row_arrays: "tuple | None" = None):
        self.kind, self.lanes = attrs["int8_kernel"], lanes
        self.depth4, self.vector, self.broadcast = depth4, vector, broadcast
        self.bias, self.multiplier, self.out, self.out_ptr, self.attrs = bias, multiplier, out, out_ptr, attrs
        # (i32* bias, float* multiplier) of one value a row, where bias and
        # multiplier depend on the row only: a tile of whole quads of rows
        # then loads them 4 rows a load.
        self.row_arrays = row_arrays


def _row_values(k: Kernel, tile: DotTile, row0: ir.Value, rows: int, stored: int) -> "tuple | None":
    """(bias(i), multiplier(i)) callables for the tile's rows i, reading
    4 rows' values a load, or None where the tile cannot (values that
    depend on the column, or rows short of whole quads)."""
    if tile.row_arrays is None or stored != rows or rows % 4:
        return None
    b = k.builder
    quads = []
    for array, vector_type in zip(tile.row_arrays, (V4I32, V4F32)):
        quads.append([b.load(b.bitcast(b.gep(array, [b.add(row0, k.i64(4 * q))]), vector_type.as_pointer()),
                             align=4) for q in range(rows // 4)])

    def lane(which):
        return lambda i: b.shuffle_vector(quads[which][i // 4], ir.Constant(quads[which][0].type, ir.Undefined),
                                          ir.Constant(V4I32, [i % 4] * 4))
    return lane(0), lane(1)


def emit_tile(k: Kernel, tile: DotTile, row0: ir.Value, rows: int, column0: ir.Value, vectors: int,
              last_lanes: int = 4, stored_rows: "int | None" = None) -> None:
    """One tile: rows x (vectors * 4) sums from (row0, column0), all
    written but the last vector's lanes beyond last_lanes and the rows
    from stored_rows on (padding rows of a lanes tile).

    With tile.kind "dot" each sum is one register, 16 products a sdot.
    With "pairs" and "quads" (AArch64 without dot products) each is two
    registers of pair sums, columns 0-1 and 2-3, added pairwise (addp) at
    the end: 8 products a smull + sadalp ("pairs"), or 16 products of two
    groups a smull + smlal + sadalp ("quads")."""
    b = k.builder
    if tile.lanes and tile.depth4 <= OPAQUE_DEPTH4:
        row0 = _opaque(k, row0)
    zero = ir.Constant(V4I32, [0] * 4)
    parts = 1 if tile.kind == "dot" else 2
    stored = rows if stored_rows is None else stored_rows
    # Each stored row's sums start from its bias (a padding row's from 0;
    # pair sums, added pairwise at the end, take it then).
    by_row = _row_values(k, tile, row0, rows, stored) if parts == 1 else None
    accs = [[[k.variable((by_row[0](i) if by_row else
                          tile.bias(b.add(row0, k.i64(i)), b.add(column0, k.i64(4 * v))))
                         if parts == 1 and i < stored else zero) for _ in range(parts)]
             for v in range(vectors)] for i in range(rows)]

    one_load = tile.kind == "dot" and tile.lanes and tile.depth4 >= LD1_DEPTH4

    def step(groups: list) -> None:
        """The products of one or two groups of 4 along the reduction."""
        if tile.kind != "quads" and len(groups) > 1:  # one after the other: fewer registers live
            for g in groups:
                step([g])
            return
        loaded = [_vectors(k, tile.vector(g, column0), vectors, one_load) for g in groups]
        if tile.lanes:
            quads = [[b.load(b.bitcast(tile.broadcast(b.add(row0, k.i64(4 * q)), g), V4I32.as_pointer()), align=1)
                      for g in groups] for q in range(rows // 4)]
        for i in range(rows):
            row = b.add(row0, k.i64(i))
            if tile.lanes:
                splats = [b.bitcast(b.shuffle_vector(q, ir.Constant(V4I32, ir.Undefined),
                                                     ir.Constant(V4I32, [i % 4] * 4)), V16I8) for q in quads[i // 4]]
            else:
                splats = [b.bitcast(_splat(k, b.load(b.bitcast(tile.broadcast(row, g), I32.as_pointer()), align=1),
                                           V4I32), V16I8) for g in groups]
            for v in range(vectors):
                for part in range(parts):
                    acc = accs[i][v][part]
                    if tile.kind == "dot":
                        total = b.load(acc)
                        for a, splat in zip(loaded, splats):
                            total = _sdot(k, total, a[v], splat)
                    else:
                        # 8 products (columns 0-1 or 2-3, by the weights' 4
                        # values twice) a smull, the next group's added by
                        # smlal: 16-bit sums of two products, which cannot
                        # overflow while weights stay within +-127 ("quads").
                        products = [_intrinsic(k, "llvm.aarch64.neon.smull.v8i16", V8I16,
                                               [_half(k, a[v], part == 1), _half(k, splat, part == 1)])
                                    for a, splat in zip(loaded, splats)]
                        product = products[0] if len(products) == 1 else b.add(*products)
                        total = b.add(b.load(acc), _intrinsic(k, "llvm.aarch64.neon.saddlp.v4i32.v8i16",
                                                              V4I32, [product]))
                    b.store(total, acc)

    # Lanes tiles take DOT_UNROLL groups a trip (LD1_UNROLL for a long
    # reduction, whose groups' vectors load with one ld1 each); "quads"
    # tiles two, to add the second's products to the first's in 16 bits.
    unroll = 1
    if tile.kind == "quads":
        unroll = 2
    elif one_load:
        unroll = LD1_UNROLL
    elif tile.lanes and tile.depth4 > OPAQUE_DEPTH4:
        unroll = DOT_UNROLL
    with k.loop(tile.depth4 // unroll) as h:
        step([b.add(b.mul(h, k.i64(unroll)), k.i64(u)) for u in range(unroll)])
    for g in range(tile.depth4 - tile.depth4 % unroll, tile.depth4):
        step([k.i64(g)])
    # Rows of an odd number of vectors are requantized two at a time, so
    # that the 8-lane narrowing steps have no idle lanes.
    together = 2 if vectors % 2 else 1
    for first in range(0, stored, together):
        rows_here = [b.add(row0, k.i64(i)) for i in range(first, min(first + together, stored))]
        totals, multipliers = [], []
        for i, row in enumerate(rows_here, first):
            for v in range(vectors):
                sums = [b.load(acc) for acc in accs[i][v]]
                if parts == 1:
                    totals.append(sums[0])
                else:
                    total = _intrinsic(k, "llvm.aarch64.neon.addp.v4i32", V4I32, sums)
                    totals.append(b.add(total, tile.bias(row, b.add(column0, k.i64(4 * v)))))
                multipliers.append(by_row[1](i) if by_row else tile.multiplier(row, b.add(column0, k.i64(4 * v))))
        values = _requantize_row(k, totals, multipliers, tile.attrs)
        for r, row in enumerate(rows_here):
            at = b.gep(tile.out_ptr, [tile.out(row, column0)])
            store_bytes(k, values, 4 * vectors * r, 4 * (vectors - 1) + last_lanes, at)


def store_bytes(k: Kernel, values: ir.Value, start: int, count: int, at: ir.Value) -> None:
    """Stores lanes start..start + count - 1 of values (bytes, a multiple
    of 8 lanes) at at, in the widest pieces that fit and start on their
    8-lane group's boundary (16, 8, 4, 2 or 1 bytes a store)."""
    b = k.builder
    done = 0
    while done < count:
        width = next(w for w in (16, 8, 4, 2, 1) if w <= count - done and (start + done) % min(w, 8) == 0)
        _store_lanes(k, values, start + done, width, b.gep(at, [k.i64(done)]))
        done += width


def _vectors(k: Kernel, at: ir.Value, count: int, one_load: bool) -> list:
    """count 16-byte vectors from at on: with one_load (AArch64), 3 or 4 of
    them with one ld1 of as many registers (2 are one ldp anyway), else a
    load each."""
    b = k.builder
    if one_load and k.target.arch == "aarch64" and 3 <= count <= 4:
        loaded = _intrinsic(k, f"llvm.aarch64.neon.ld1x{count}.v16i8.p0i8", ir.LiteralStructType([V16I8] * count),
                            [at])
        return [b.extract_value(loaded, i) for i in range(count)]
    return [b.load(b.bitcast(b.gep(at, [k.i64(16 * v)]), V16I8.as_pointer()), align=1) for v in range(count)]


def _store_lanes(k: Kernel, values: ir.Value, first: int, width: int, at: ir.Value) -> None:
    """Stores lanes first..first + width - 1 of values (bytes, a multiple
    of 8 lanes) at at. 4 lanes go as the 32-bit half of their 8-lane
    group: LLVM takes a <4 x i8> apart byte by byte."""
    b = k.builder
    if width == 4:
        group = first - first % 8
        eight = b.shuffle_vector(values, values, ir.Constant(ir.VectorType(I32, 8), list(range(group, group + 8))))
        piece = b.extract_element(b.bitcast(eight, ir.VectorType(I32, 2)), ir.Constant(I32, first % 8 // 4))
    else:
        piece = b.shuffle_vector(values, values, ir.Constant(ir.VectorType(I32, width),
                                                             list(range(first, first + width))))
    b.store(piece, b.bitcast(at, piece.type.as_pointer()), align=1)


# Groups of 4 along the reduction a trip of a "dot" lanes tile's loop: the
# loop's counter, branch and pointer steps cost 7 instructions a trip
# against 24 sdot a group.
DOT_UNROLL = 4

# Reductions of at least LD1_DEPTH4 groups load a group's 3 vectors with
# one ld1 (3 consecutive registers), LD1_UNROLL groups a trip: 56
# instructions a trip against 48 sdot, where separate loads took 116
# against 96 (ResNet-50 int8 on the emulated Cortex-A76: 368.5 -> 363.8 M).
# With 4 groups a trip, or a short reduction that LLVM unrolls fully, it
# found no such registers beside the sums and spilled them (the 3-channel
# stems of SqueezeNet and MobileNetV2 counted some 20 % more).
LD1_DEPTH4 = 16
LD1_UNROLL = 2

# Reductions (in groups of 4) short enough for LLVM to unroll fully; see
# _opaque. Up to 8 groups went that way too: in the reduction loop they
# count fewer (MobileNetV2 int8 44.4 -> 44.0 M instructions on the
# emulated Cortex-A76, 102.6 -> 99.7 M on the Cortex-A72).
OPAQUE_DEPTH4 = 2


def _opaque(k: Kernel, value: ir.Value) -> ir.Value:
    """value, through an empty asm statement that LLVM cannot see through
    nor move: what is computed from it stays where it is. A tile's row
    passes through it so that, with a short reduction fully unrolled, the
    weights (the same for every tile of a row of tiles) are not all hoisted
    out of the loop over columns, splat, and spilled to the stack."""
    asm = ir.InlineAsm(ir.FunctionType(value.type, [value.type]), "", "=r,0", side_effect=True)
    return k.builder.call(asm, [value])


def _requantize_row(k: Kernel, sums: list, multipliers: list, attrs) -> ir.Value:
    """The vectors of sums (4 x i32 each, of one row's consecutive columns)
    requantized to one vector of their 8-bit values. fcvtns rounds to
    nearest, ties to even, into int32; sqxtn saturates to int16, where
    y_zero is added (saturating: within int16 that cannot change a value
    that the bytes' saturation keeps), then sqxtun / sqxtn saturates to
    the output's 8 bits, 8 lanes an instruction, and only bounds narrower
    than the type's (a Relu's) are applied as such."""
    b = k.builder
    if k.target.arch != "aarch64":
        parts = [_requantize_vector(k, acc, m, attrs) for acc, m in zip(sums, multipliers)]
        return _concatenated(k, parts)
    return rounded_to_8_bits(k, [b.fmul(b.sitofp(acc, V4F32), multiplier)
                                 for acc, multiplier in zip(sums, multipliers)], attrs)


def rounded_to_8_bits(k: Kernel, values: list, attrs) -> ir.Value:
    """Vectors of 4 float32 values (AArch64), each rounded half to even,
    offset by y_zero and saturated to the output's 8 bits (attrs' bounds
    applied), as one vector of their bytes in order: see _requantize_row."""
    b = k.builder
    halves = []
    for value in values:
        value = _intrinsic(k, "llvm.aarch64.neon.fcvtns.v4i32.v4f32", V4I32, [value])
        halves.append(_intrinsic(k, "llvm.aarch64.neon.sqxtn.v4i16", V4I16, [value]))
    wide = _concatenated(k, halves + [ir.Constant(V4I16, ir.Undefined)] * (len(halves) % 2))
    lanes = wide.type.count
    wide = _intrinsic(k, f"llvm.sadd.sat.v{lanes}i16", wide.type,
                      [wide, ir.Constant(wide.type, [attrs["output_zero"]] * lanes)])
    unsigned = attrs["output_dtype"] == "uint8"
    narrow = "sqxtun" if unsigned else "sqxtn"
    eighths = [b.shuffle_vector(wide, wide, ir.Constant(ir.VectorType(I32, 8), list(range(start, start + 8))))
               for start in range(0, lanes, 8)]
    value = _concatenated(k, [_intrinsic(k, f"llvm.aarch64.neon.{narrow}.v8i8", V8I8, [part]) for part in eighths])
    value_lanes = value.type.count
    low, high = (0, 255) if unsigned else (-128, 127)
    compare = b.icmp_unsigned if unsigned else b.icmp_signed
    if attrs["lowest"] > low:
        bound = ir.Constant(value.type, [attrs["lowest"] & 0xFF] * value_lanes)
        value = b.select(compare(">", value, bound), value, bound)
    if attrs["highest"] < high:
        bound = ir.Constant(value.type, [attrs["highest"] & 0xFF] * value_lanes)
        value = b.select(compare("<", value, bound), value, bound)
    return value


def _concatenated(k: Kernel, parts: list) -> ir.Value:
    """One vector of equal-length vectors, in order (pairs joined until one is left)."""
    b = k.builder
    while len(parts) > 1:
        if len(parts) % 2:
            parts = parts + [ir.Constant(parts[0].type, ir.Undefined)]
        count = parts[0].type.count
        parts = [b.shuffle_vector(a, c, ir.Constant(ir.VectorType(I32, 2 * count), list(range(2 * count))))
                 for a, c in zip(parts[::2], parts[1::2])]
    return parts[0]


def _requantize_vector(k: Kernel, acc: ir.Value, multiplier: ir.Value, attrs) -> ir.Value:
    """saturate(round_half_even(acc * multiplier) + y_zero) of 4 lanes (8 or 16 off AArch64; as
    quantize_ops._requantize does one)."""
    b = k.builder
    zero = attrs["output_zero"]
    if k.target.arch == "aarch64":
        # fcvtns rounds to nearest, ties to even, into int32 (saturating):
        # then y_zero and the bounds in integers.
        value = b.fmul(b.sitofp(acc, V4F32), multiplier)
        value = _intrinsic(k, "llvm.aarch64.neon.fcvtns.v4i32.v4f32", V4I32, [value])
        value = b.add(value, ir.Constant(V4I32, [zero] * 4))
        for bound, keep in ((attrs["lowest"], ">"), (attrs["highest"], "<")):
            limit = ir.Constant(V4I32, [bound] * 4)
            value = b.select(b.icmp_signed(keep, value, limit), value, limit)
        return b.trunc(value, V4I8)
    # Clamped to [lowest, highest] - y_zero before rounding (integer bounds,
    # so the same as after): the result is in the output type's range.
    lanes = acc.type.count  # 4, or the x86 kernels' 8 or 16
    with k.vector_constants(lanes):
        value = b.fmul(b.sitofp(acc, ir.VectorType(F32, lanes)), multiplier)
        value = k.clamp(value, attrs["lowest"] - zero, attrs["highest"] - zero)
        value = b.fsub(b.fadd(value, k.f32(ROUNDING_MAGIC)), k.f32(ROUNDING_MAGIC))
        value = b.fadd(value, k.f32(zero))
    return b.trunc(b.fptosi(value, ir.VectorType(I32, lanes)), ir.VectorType(I8, lanes))


@contextmanager
def shared_loop(k: Kernel, count: int):
    """for i in range(count), the indices handed out to the threads in
    chunks (Kernel.share) in a parallel kernel; the plain loop otherwise."""
    if not k.parallel:
        with k.loop(count) as i:
            yield i
        return
    with k.share(count) as (lo, hi), k.loop(hi, start=lo) as i:
        yield i


def emit_tiles(k: Kernel, tile: DotTile, rows: int, columns: int, tile_rows: int, tile_vectors: int) -> None:
    """Every tile of a rows x columns output: full tiles in loops, then the
    row and column remainders as smaller tiles (a last vector of fewer
    than 4 columns stores only those). In a parallel kernel the threads
    take the blocks of rows in chunks, each with all its columns (the
    code within a block as on one thread: the weights' addresses hoisted
    out of its loop over columns)."""
    full_rows = rows - rows % tile_rows
    whole_vectors = columns // 4
    full_vectors = whole_vectors - whole_vectors % tile_vectors
    row_parts = [(full_rows, tile_rows, None)] + ([(rows % tile_rows, rows % tile_rows, full_rows)]
                                                  if rows % tile_rows else [])
    for count, height, start in row_parts:
        # A lanes tile reads rows 4 at a time: the remainder is a whole
        # tile of the weight's padding rows, only its real rows stored.
        sums, stored = (tile_rows, height) if tile.lanes and start is not None else (height, None)

        def columns_of(row0):
            if full_vectors:
                with k.loop(full_vectors // tile_vectors) as c:
                    emit_tile(k, tile, row0, sums, k.builder.mul(c, k.i64(4 * tile_vectors)), tile_vectors,
                              stored_rows=stored)
            if whole_vectors % tile_vectors:
                emit_tile(k, tile, row0, sums, k.i64(4 * full_vectors), whole_vectors % tile_vectors,
                          stored_rows=stored)
            if columns % 4:
                emit_tile(k, tile, row0, sums, k.i64(4 * whole_vectors), 1, columns % 4, stored_rows=stored)
        if start is None:
            if count:
                with shared_loop(k, count // height) as r:
                    columns_of(k.builder.mul(r, k.i64(height)))
        elif k.parallel:
            with shared_loop(k, 1):
                columns_of(k.i64(start))
        else:
            columns_of(k.i64(start))


def _as_int8(k: Kernel, value: ir.Value, dtype: str) -> ir.Value:
    """An 8-bit activation as the kernel's int8: uint8 less 128 (its top bit flipped)."""
    return _as_operand(k, value, dtype)


def _as_operand(k: Kernel, value: ir.Value, dtype: str, unsigned: bool = False) -> ir.Value:
    """An 8-bit activation as the kernel's int8, or its uint8 when unsigned
    (int8 plus 128): its top bit flipped when the signs differ (see input_offset)."""
    if input_offset(dtype, unsigned) == 0:
        return value
    flip = ir.Constant(I8, 0x80)
    if isinstance(value.type, ir.VectorType):
        flip = ir.Constant(value.type, [0x80] * value.type.count)
    return k.builder.xor(value, flip)


def _fill(k: Kernel, ptr: ir.Value, start: ir.Value, count: int, value: ir.Value) -> None:
    if count > 0:
        with k.loop(count) as i:
            k.store(value, ptr, k.index((start, 1), (i, 1)))


def conv_geometry(x_shape, attrs) -> tuple:
    """(height, width, kernel rows, kernel columns, strides, dilations and
    begin pads along rows and columns, output rows, output columns) of a
    1-D or 2-D IntegerConv."""
    spatial, kernel, strides, dilations, begin, _, out = _resolve_window(
        x_shape, attrs["kernel_shape"], attrs, what="convolution")
    return (*spatial[1:], *kernel[1:], strides[1], strides[2], dilations[1], dilations[2], begin[1], begin[2],
            *out[1:])


def input_offset(dtype: str, unsigned: bool = False) -> int:
    """x less the 8-bit value the kernel reads for it: 128 for uint8 read as
    int8 (its top bit flipped), -128 for int8 read as uint8 (x86's
    vpdpbusd), else 0."""
    if unsigned:
        return -128 if dtype == "int8" else 0
    return 128 if dtype == "uint8" else 0


def packing_buffers(k: Kernel, inputs, attrs, unsigned: bool = False, wide: bool = False) -> tuple:
    """(x, packed, pad, convert) for pack_input: the input's typed pointer,
    the scratch, the value the padding packs as (the input's zero point as
    the kernel reads it) and the conversion of an input value to what is
    packed: the kernel's 8-bit operand (int8, or uint8 when unsigned), or
    with wide x - x_zero as int16 (padding 0)."""
    dtype, b = inputs[0].dtype, k.builder
    x = k.typed(k.inputs[0], dtype)
    if wide:
        extend = b.zext if dtype == "uint8" else b.sext
        return (x, k.typed(k.scratch, "int16"), ir.Constant(I16, 0),
                lambda value: b.sub(extend(value, I16), ir.Constant(I16, attrs["input_zero"])))
    return (x, k.typed(k.scratch, "int8"), ir.Constant(I8, (attrs["input_zero"] - input_offset(dtype, unsigned)) & 0xFF),
            lambda value: _as_operand(k, value, dtype, unsigned))


def pack_input(k: Kernel, buffers: tuple, inputs, attrs, n: ir.Value, groups4: int, step: int) -> None:
    """Pack image n of a convolution's input (converted as packing_buffers
    says) into scratch as [kernel row][kernel column][channel / 4] groups
    of [output pixel][4 channels], each group step pixels apart (the plane
    rounded up), padding as the input's zero point."""
    x_shape = inputs[0].shape
    height, width, kh_count, kw_count, sh, sw, dh, dw, ph, pw, oh_count, ow_count = conv_geometry(x_shape, attrs)
    channels = x_shape[1]
    plane = oh_count * ow_count
    b, dtype = k.builder, inputs[0].dtype
    x, packed, pad, convert = buffers
    # One shared range for the whole packing: the threads take channel
    # groups, each packed at every tap.
    with shared_loop(k, groups4) as c4:
        for kh in range(kh_count):
            rows = _valid_range(kh * dh - ph, sh, height, oh_count)
            for kw in range(kw_count):
                cols = _valid_range(kw * dw - pw, sw, width, ow_count)
                group = k.index((c4, step * 4), ((kh * kw_count + kw) * groups4, step * 4))
                _fill(k, packed, group, rows[0] * ow_count * 4, pad)
                _fill(k, packed, k.index((group, 1), (rows[1] * ow_count * 4, 1)),
                      (oh_count - rows[1]) * ow_count * 4, pad)
                lines, valid = [], []
                for j in range(4):
                    channel = b.add(b.mul(c4, k.i64(4)), k.i64(j))
                    valid.append(b.icmp_signed("<", channel, k.i64(channels)))
                    lines.append(k.index((n, channels * height * width),
                                         (k.smin(channel, k.i64(channels - 1)), height * width),
                                         (kh * dh - ph, width), (kw * dw - pw, 1)))
                if sh == 1 and sw == 1 and ow_count == width and (rows == (0, oh_count) and cols == (0, ow_count)
                                                                  or k.target.arch == "aarch64"):
                    _pack_plane(k, x, packed, lines, valid, group, rows, cols, ow_count, pad, convert)
                    continue
                with k.loop(rows[1], start=rows[0]) as oh:
                    row = k.index((group, 1), (oh, ow_count * 4))
                    _fill(k, packed, row, cols[0] * 4, pad)
                    _fill(k, packed, k.index((row, 1), (cols[1] * 4, 1)), (ow_count - cols[1]) * 4, pad)
                    tail_shift = kw * dw - pw + (cols[1] - PACK_LANES) * sw - 1
                    if (sw == 2 and k.target.arch == "aarch64" and cols[1] - cols[0] >= PACK_LANES
                            and tail_shift >= 0):
                        _pack_stride2(k, x, packed, [k.index((line, 1), (oh, sh * width)) for line in lines],
                                      valid, row, cols, pad, dtype)
                    else:
                        with k.loop(cols[1], start=cols[0]) as ow:
                            _pack_pixel(k, x, packed, [k.index((line, 1), (oh, sh * width), (ow, sw))
                                                       for line in lines], valid, k.index((row, 1), (ow, 4)),
                                        pad, convert)


def lower_conv(k: Kernel, inputs, outputs, attrs) -> None:
    """IntegerConv with the dot-product kernel: per image, the input packed
    (as int8) into scratch as [kernel row][kernel column][channel / 4]
    groups of [output pixel][4 channels] (the weight's order, see
    quantized._dot_constants), padding as the input's zero point; then the
    tiles of filters x output pixels."""
    x_shape = inputs[0].shape
    _, _, kh_count, kw_count, *_, oh_count, ow_count = conv_geometry(x_shape, attrs)
    batch = x_shape[0]
    filters = attrs["filters"]
    lanes = attrs["int8_kernel"] in ("dot", "quads")
    block = attrs["int8_tile"][0]  # rows of the weight's blocks, with lanes
    groups4 = inputs[1].shape[1] // (kh_count * kw_count) if lanes else inputs[1].shape[-1] // 4
    plane = oh_count * ow_count
    plane4 = -(-plane // 4) * 4
    depth4 = kh_count * kw_count * groups4
    b = k.builder
    buffers = packing_buffers(k, inputs, attrs)
    packed = buffers[1]
    weight, bias = k.typed(k.inputs[1], "int8"), k.typed(k.inputs[2], "int32")
    y = k.typed(k.outputs[0], attrs["output_dtype"])
    with k.loop(batch) as n:
        pack_input(k, buffers, inputs, attrs, n, groups4, plane4)
        k.barrier()  # every thread's tiles read all of the packed input
        kp = depth4 * 4

        def vector(g, column):
            return b.gep(packed, [k.index((g, plane4 * 4), (column, 4))])

        def broadcast(row, g):
            if lanes:  # [filters / block][depth4][block filters][4]
                shift = block.bit_length() - 1  # block is 4 or 8
                return b.gep(weight, [k.index((b.lshr(row, k.i64(shift)), depth4 * block * 4), (g, block * 4),
                                              (b.and_(row, k.i64(block - 1)), 4))])
            return b.gep(weight, [k.index((row, kp), (g, 4))])
        tile = DotTile(depth4, vector, broadcast,
                       lambda row, column: _splat(k, k.load(bias, row), V4I32),
                       lambda row, column: _splat(k, k.load(k.inputs[3], row), V4F32),
                       lambda row, column: k.index((n, filters * plane), (row, plane), (column, 1)), y, attrs,
                       lanes, (bias, k.typed(k.inputs[3], "float32")))
        emit_tiles(k, tile, filters, plane, *attrs["int8_tile"])
        if batch > 1:
            k.barrier()  # before the next image's packing overwrites this one's


def _pack_plane(k: Kernel, x: ir.Value, packed: ir.Value, lines: list, valid: list, group: ir.Value, rows: tuple,
                cols: tuple, width: int, pad: ir.Value, convert) -> None:
    """The packing of one kernel tap of a stride-1 convolution whose output
    rows are as wide as its input's (lines: the 4 channels' input at output
    pixel 0 of the tap; valid: whether each channel exists): the tap reads
    the input plane shifted, so the pixels from the first valid one to the
    last are one line, one loop that LLVM vectorises (st4), rather than a
    loop a row with its remainder one pixel at a time. The pixels of that
    line whose column falls in the padding read the row before or after;
    they are then overwritten with the padding, a few a row."""
    if rows[1] > rows[0] and cols[1] > cols[0]:
        first = rows[0] * width + cols[0]
        with k.loop((rows[1] - 1) * width + cols[1] - first) as p:
            _pack_pixel(k, x, packed, [k.index((line, 1), (p, 1), (first, 1)) for line in lines], valid,
                        k.index((group, 1), (p, 4), (first * 4, 1)), pad, convert)
    if cols == (0, width):
        return
    with k.loop(rows[1], start=rows[0]) as oh:
        row = k.index((group, 1), (oh, width * 4))
        _fill(k, packed, row, cols[0] * 4, pad)
        _fill(k, packed, k.index((row, 1), (cols[1] * 4, 1)), (width - cols[1]) * 4, pad)


def _pack_pixel(k: Kernel, x: ir.Value, packed: ir.Value, sources: list, valid: list, at: ir.Value,
                pad: ir.Value, convert) -> None:
    """One output pixel's 4 channels at one tap: x at sources (one offset
    a channel) converted, pad for a channel past the last, into packed at."""
    for j, (source, exists) in enumerate(zip(sources, valid)):
        value = k.builder.select(exists, convert(k.load(x, source)), pad)
        k.store(value, packed, k.index((at, 1), (j, 1)))


# Output pixels packed at a time from a convolution's stride-2 rows.
PACK_LANES = 16


def _pack_stride2(k: Kernel, x: ir.Value, packed: ir.Value, lines: list, valid: list, row: ir.Value,
                  cols: tuple, pad: ir.Value, dtype: str) -> None:
    """The packing of output pixels cols[0]..cols[1] of one row, one kernel
    tap, 4 channels (lines: their input rows at the tap; valid: whether
    each channel exists), for stride 2: 16 pixels a time, each channel's
    16 values from one ld2, the 4 channels interleaved into 64 bytes (st4).
    The last 16 end at the row's end (its ld2 starts a byte early and takes
    the odd lanes, so that it reads nothing past the row), rewriting some
    pixels before them with the same bytes."""
    b = k.builder
    vector = ir.VectorType(I8, PACK_LANES)
    pads = b.insert_element(ir.Constant(vector, ir.Undefined), pad, ir.Constant(I32, 0))
    pads = b.shuffle_vector(pads, pads, ir.Constant(ir.VectorType(I32, PACK_LANES), [0] * PACK_LANES))
    interleave = [j * PACK_LANES + p for p in range(PACK_LANES) for j in range(4)]

    def pack(ow: ir.Value, shift: int) -> None:
        values = []
        for line, exists in zip(lines, valid):
            loaded = _deinterleaved(k, x, k.index((line, 1), (ow, 2), (-shift, 1)), PACK_LANES)[shift]
            values.append(b.select(exists, _as_int8(k, loaded, dtype), pads))
        halves = [b.shuffle_vector(values[i], values[i + 1], ir.Constant(ir.VectorType(I32, 2 * PACK_LANES),
                                                                         list(range(2 * PACK_LANES))))
                  for i in (0, 2)]
        joined = b.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(I32, 4 * PACK_LANES), interleave))
        at = b.gep(packed, [k.index((row, 1), (ow, 4))])
        b.store(joined, b.bitcast(at, joined.type.as_pointer()), align=1)
    with k.loop((cols[1] - cols[0] - 1) // PACK_LANES) as c:
        pack(k.index((c, PACK_LANES), (cols[0], 1)), 0)
    pack(k.i64(cols[1] - PACK_LANES), 1)


def lower_matmul(k: Kernel, inputs, outputs, attrs) -> None:
    """IntegerMatMul with the dot-product kernel: the rows of x copied (as
    int8, the reduction padded to 4) into scratch; then the tiles of rows
    x columns of the packed weight."""
    depth4, columns4 = inputs[1].shape[:2]
    depth, columns = inputs[0].shape[-1], attrs["columns"]
    rows = _prod(inputs[0].shape[:-1])
    kp = depth4 * 4
    b, dtype = k.builder, inputs[0].dtype
    x = k.typed(k.inputs[0], dtype)
    copied = k.typed(k.scratch, "int8")
    weight, bias = k.typed(k.inputs[1], "int8"), k.typed(k.inputs[2], "int32")
    y = k.typed(k.outputs[0], attrs["output_dtype"])
    with k.loop(rows) as r:
        with k.loop(depth) as d:
            k.store(_as_int8(k, k.load(x, k.index((r, depth), (d, 1))), dtype), copied, k.index((r, kp), (d, 1)))
        _fill(k, copied, k.index((r, kp), (depth, 1)), kp - depth, ir.Constant(I8, 0))

    def vector(g, column):
        return b.gep(weight, [k.index((g, columns4 * 4), (column, 4))])

    def broadcast(row, g):
        return b.gep(copied, [k.index((row, kp), (g, 4))])

    def load_vector(ptr, column, vector_type):
        return b.load(b.bitcast(b.gep(ptr, [column]), vector_type.as_pointer()), align=4)
    tile = DotTile(depth4, vector, broadcast,
                   lambda row, column: load_vector(bias, column, V4I32),
                   lambda row, column: load_vector(k.inputs[3], column, V4F32),
                   lambda row, column: k.index((row, columns), (column, 1)), y, attrs)
    emit_tiles(k, tile, rows, columns, *attrs["int8_tile"])
