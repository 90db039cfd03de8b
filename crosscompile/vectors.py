"""Vector building blocks the kernels share (GEMM tiles, convolutions,
pools): splats, fused multiply-adds, strided loads, horizontal reductions,
and in-register transposes between vectors of rows and a row-major tile.
"""
from __future__ import annotations

from llvmlite import ir

from .emit import F32, HALF, Kernel


def _vector_ptr(k: Kernel, ptr: ir.Value, offset: ir.Value, lanes: int) -> ir.Value:
    """A pointer to `lanes` elements of ptr's element type from ptr[offset]."""
    return k.builder.bitcast(k.builder.gep(ptr, [offset]), ir.VectorType(ptr.type.pointee, lanes).as_pointer())


def vector_runs(count: int, lanes: int) -> list:
    """(first group, groups, items per group) covering `count` items laid
    side by side: whole vectors of `lanes` items, then one at a time.

    >>> vector_runs(40, 16), vector_runs(3, 4)
    ([(0, 2, 16), (32, 8, 1)], [(0, 3, 1)])
    """
    whole = count // lanes if lanes > 1 else 0
    runs = [(0, whole, lanes)] if whole else []
    if count - whole * lanes:
        runs.append((whole * lanes, count - whole * lanes, 1))
    return runs


def splat(k: Kernel, value: ir.Value, lanes: int) -> ir.Value:
    b = k.builder
    vty = ir.VectorType(value.type, lanes)
    one = b.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return b.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                            ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def lane_splat(k: Kernel, vec: ir.Value, lane: int, lanes: int) -> ir.Value:
    """A vector of `lanes` copies of lane `lane` of vec: on targets that
    multiply by a lane (Target.multiplies_by_lane) an FMA reads it in place."""
    return k.builder.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined),
                                    ir.Constant(ir.VectorType(ir.IntType(32), lanes), [lane] * lanes))


def broadcast_sources(k: Kernel, ptr: ir.Value, offset: ir.Value, count: int, lanes: "int | None" = None):
    """values(i, lanes): element offset + i of ptr (i < count) splatted to
    `lanes` lanes. Where the target multiplies by a lane, the elements are
    loaded a vector at a time (whole vectors only: none past offset + count)
    and splatted from registers; elsewhere each is loaded on its own and
    splatted, which x86 folds into a broadcast from memory. A vector holds
    `lanes` of ptr's elements: the target's float32 lanes unless given (twice
    as many halves)."""
    lanes = lanes or k.target.lanes
    vectors = count // lanes if k.target.multiplies_by_lane and lanes > 1 else 0
    align = 2 if ptr.type.pointee == HALF else 4
    loaded = [k.builder.load(_vector_ptr(k, ptr, k.builder.add(offset, k.i64(q * lanes)), lanes), align=align)
              for q in range(vectors)]

    def values(i: int, width: int) -> ir.Value:
        if i < vectors * lanes:
            return lane_splat(k, loaded[i // lanes], i % lanes, width)
        return splat(k, k.load(ptr, k.builder.add(offset, k.i64(i))), width)
    return values


def _fmuladd(k: Kernel, a, b, c):
    # fmuladd fuses where the target has FMA and stays mul + add elsewhere
    # (armv7 without VFPv4): llvm.fma could become a libm call there.
    name = f"llvm.fmuladd.v{a.type.count}{'f16' if a.type.element == HALF else 'f32'}"
    fn = k.module.globals.get(name)
    if fn is None:
        fn = ir.Function(k.module, ir.FunctionType(a.type, [a.type] * 3), name=name)
    return k.builder.call(fn, [a, b, c])


def vector_epilogue(k: Kernel) -> bool:
    """Whether every fused element-wise op of the kernel has a vector form
    (else the caller runs the scalar epilogue over the stored output)."""
    return bool(k.epilogue) and all(getattr(fn, "vectorizable", False) for fn in k.epilogue)


def horizontal_reduce(k: Kernel, vec: ir.Value, combine=None) -> ir.Value:
    """One value from a vector's lanes, combined pairwise by halving
    shuffles (combine(a, b) of two vectors; fadd by default)."""
    b = k.builder
    combine = combine or b.fadd
    i32 = ir.IntType(32)
    lanes = vec.type.count
    while lanes > 1:
        half = lanes // 2
        lo = b.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, half), list(range(half))))
        hi = b.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, half), list(range(half, lanes))))
        with k.vector_constants(half):
            vec, lanes = combine(lo, hi), half
    return b.extract_element(vec, ir.Constant(i32, 0))


def row_pieces(lo: int, hi: int, lanes: int, stride: int) -> tuple:
    """([(first, width)], end): vectors of decreasing width (lanes, lanes / 2,
    ... down to 4) covering output columns [lo, end) of a row, end <= hi;
    the caller finishes [end, hi) one column at a time. Rows are short (7
    to 56 columns) next to a 16-lane register, where a loop vectorised by
    LLVM at full width would run only its scalar remainder. Strides above
    2 get no vectors (see load_strided)."""
    pieces, at, width = [], lo, lanes
    while width >= 4 and stride <= 2:
        while hi - at >= width:
            pieces.append((at, width))
            at += width
        width //= 2
    return pieces, at


def load_strided(k: Kernel, ptr: ir.Value, offset: ir.Value, width: int, stride: int,
                 spare: int = 0) -> ir.Value:
    """A vector of ptr[offset + i * stride] for i < width: one contiguous
    load of stride * width - (stride - 1) values keeping every stride-th.
    With spare >= stride - 1 more values readable after the last one it
    loads stride * width values instead: a whole number of registers,
    where the odd length costs a chain of partial loads."""
    b = k.builder
    align = 2 if ptr.type.pointee == HALF else 4
    if stride == 1:
        return b.load(_vector_ptr(k, ptr, offset, width), align=align)
    count = width * stride - (0 if spare >= stride - 1 else stride - 1)
    wide = b.load(_vector_ptr(k, ptr, offset, count), align=align)
    picks = ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(0, width * stride, stride)))
    return b.shuffle_vector(wide, wide, picks)


def interleave(k: Kernel, vectors: list) -> ir.Value:
    """One vector of n x w lanes from n vectors of w lanes, lane j holding
    lane j // n of vectors[j % n]: the n phases of a stride-n run of
    outputs put back in order (x86 unpacks, NEON zips).

    >>> interleave(k, [evens, odds])  # doctest: +SKIP
    """
    n = len(vectors)
    if n == 1:
        return vectors[0]
    b = k.builder
    w = vectors[0].type.count
    size = 1
    while size < n:
        size *= 2
    parts = list(vectors) + [ir.Constant(vectors[0].type, ir.Undefined)] * (size - n)
    while len(parts) > 1:  # concatenated pairwise
        both = _shuffle_mask(list(range(2 * parts[0].type.count)))
        parts = [b.shuffle_vector(parts[i], parts[i + 1], both) for i in range(0, len(parts), 2)]
    return b.shuffle_vector(parts[0], ir.Constant(parts[0].type, ir.Undefined),
                            _shuffle_mask([j % n * w + j // n for j in range(n * w)]))


# Moving a tile between vectors of rows (lanes = rows of C, one vector per
# column) and C's row-major layout. With the vectors padded by undefined
# ones to a power of two n, log2(n) rounds of interleaving pairs (the
# perfect shuffle) transpose them: after them, their concatenation holds
# each row's n values in a run, so a row's columns are one vector load or
# store (one per vector they span) in place of one per value. Loading runs
# the rounds backwards (de-interleaving).

def _shuffle_mask(values) -> ir.Constant:
    return ir.Constant(ir.VectorType(ir.IntType(32), len(values)), values)


def _row_runs(w: int, count: int):
    """(lane, column, vector, at, width): where each piece of each row's run
    of `count` columns lies among the transposed vectors of w lanes."""
    n = 1
    while n < count:
        n *= 2
    for lane in range(w):
        j = 0
        while j < count:
            q, at = divmod(lane * n + j, w)
            width = min(count - j, w - at)
            yield lane, j, q, at, width
            j += width


def _store_transposed(k: Kernel, columns: list, c_ptr: ir.Value, ldc: ir.Value, row0: int) -> None:
    """C[(row0 + l) * ldc + j] = columns[j][l] for every lane l (see above)."""
    b = k.builder
    w, count = columns[0].type.count, len(columns)
    vty = ir.VectorType(F32, w)
    n = 1
    while n < count:
        n *= 2
    vecs = list(columns) + [ir.Constant(vty, ir.Undefined)] * (n - count)
    low = _shuffle_mask([x for lane in range(w // 2) for x in (lane, lane + w)])
    high = _shuffle_mask([x for lane in range(w // 2, w) for x in (lane, lane + w)])
    for _ in range(n.bit_length() - 1):
        vecs = [b.shuffle_vector(vecs[i], vecs[i + n // 2], half) for i in range(n // 2) for half in (low, high)]
    for lane, j, q, at, width in _row_runs(w, count):
        piece = b.shuffle_vector(vecs[q], ir.Constant(vty, ir.Undefined), _shuffle_mask(list(range(at, at + width))))
        dest = b.gep(c_ptr, [b.add(b.mul(k.i64(row0 + lane), ldc), k.i64(j))])
        b.store(piece, b.bitcast(dest, ir.VectorType(F32, width).as_pointer()), align=4)


def _load_transposed(k: Kernel, ptr: ir.Value, ldc: ir.Value, row0: int, w: int, count: int) -> list:
    """[vector of ptr[(row0 + l) * ldc + j] over lanes l for j < count]: the
    inverse of _store_transposed."""
    b = k.builder
    vty = ir.VectorType(F32, w)
    n = 1
    while n < count:
        n *= 2
    vecs = [ir.Constant(vty, ir.Undefined)] * n
    for lane, j, q, at, width in _row_runs(w, count):
        src = b.gep(ptr, [b.add(b.mul(k.i64(row0 + lane), ldc), k.i64(j))])
        piece = b.load(b.bitcast(src, ir.VectorType(F32, width).as_pointer()), align=4)
        # Widen the piece to w lanes, then blend it in at lanes [at, at + width).
        wide = b.shuffle_vector(piece, ir.Constant(piece.type, ir.Undefined),
                                _shuffle_mask([min(i, width - 1) for i in range(w)]) if width < w else
                                _shuffle_mask(list(range(w))))
        picks = [w + i - at if at <= i < at + width else i for i in range(w)]
        vecs[q] = b.shuffle_vector(vecs[q], wide, _shuffle_mask(picks))
    evens = _shuffle_mask(list(range(0, 2 * w, 2)))
    odds = _shuffle_mask(list(range(1, 2 * w, 2)))
    for _ in range(n.bit_length() - 1):
        firsts = [b.shuffle_vector(vecs[2 * i], vecs[2 * i + 1], evens) for i in range(n // 2)]
        seconds = [b.shuffle_vector(vecs[2 * i], vecs[2 * i + 1], odds) for i in range(n // 2)]
        vecs = firsts + seconds
    return vecs[:count]
