"""Register-blocked matrix multiply with explicit vector types: the core of
Conv (B read in place, or through im2col) and of 1x1 convolutions.

C[M, N] = A[M, K] @ B[K, N] for a constant A packed at compile time and a
row-major B read through a row stride. C and B stay row-major, so a
convolution keeps NCHW at its boundaries: M is the output channel, N the
output pixel and K the (input channel, kernel tap) reduction.

The micro-kernel holds a tile of `mr` rows x `nv` vectors of C in registers
for the whole K reduction: per k it loads nv vectors of B and broadcasts mr
scalars of A, so each loaded value feeds several FMAs. The tile size comes
from the Target's vector width and register count (see tile_for). The
transposed tile of emit_channel_gemm holds vectors of rows (output
channels) instead, and broadcasts one input value per output pixel.

Example:
    >>> from crosscompile.target import resolve_target
    >>> tile_for(resolve_target("rasp4b64"))
    GemmTile(lanes=4, mr=8, nv=3, pixels=0, precision='fp32')
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from llvmlite import ir

from .emit import F32, F32_PTR, HALF, I32, Kernel
from .vectors import (_fmuladd, _load_transposed, _store_transposed, _vector_ptr, broadcast_sources,
                      horizontal_reduce, splat)


@dataclass(frozen=True)
class GemmTile:
    lanes: int  # elements (of the tile's precision) in one vector register
    mr: int     # rows of C (output channels) per register tile
    nv: int     # vectors of C columns (output pixels) per register tile
    # With pixels, the tile is transposed (emit_channel_gemm): nv vectors of
    # output channels (mr = nv * lanes of them) by `pixels` output pixels.
    pixels: int = 0
    # "fp16": the tile multiplies and accumulates in half precision, its
    # packed A (weights, or rows packed by matmul.pack_rows) holds halves,
    # and what it stores is float32 (see crosscompile.precision).
    precision: str = "fp32"

    @property
    def element(self):
        """The LLVM type the tile computes in: float, or half for an fp16 tile."""
        return HALF if self.precision == "fp16" else F32

    @property
    def dtype(self) -> str:
        """The numpy dtype of the tile's packed A: float32 or float16."""
        return "float16" if self.precision == "fp16" else "float32"

    @property
    def nr(self) -> int:
        return self.pixels or self.lanes * self.nv

    @property
    def spec(self) -> list:
        """[mr, nv], or [mr, nv, pixels] for a transposed tile: how
        schedules, tuning caches and module metadata name a tile."""
        return [self.mr, self.nv, self.pixels] if self.pixels else [self.mr, self.nv]

    @property
    def label(self) -> str:
        return "x".join(str(v) for v in self.spec)


def tile_for(target, precision: str = "fp32") -> GemmTile:
    """The register tile for a target: mr * nv accumulators plus nv loaded
    vectors and one broadcast must fit the vector register file. An fp16
    tile has the same shape in registers, each holding twice as many
    lanes (8 x 3 vectors of 8 halves on AArch64: 8 rows by 24 columns).

    >>> from crosscompile.target import resolve_target
    >>> tile_for(resolve_target("rasp5"), "fp16")
    GemmTile(lanes=8, mr=8, nv=3, pixels=0, precision='fp16')
    """
    if precision == "fp16":
        return replace(tile_for(target), lanes=max(1, target.vector_bits // 16), precision="fp16")
    lanes = target.lanes
    registers = target.vector_registers
    if registers >= 32:
        # AVX-512: 6 x 4 vectors measured a few per cent faster on ResNet-50
        # than 12 x 2 (fewer loads per FMA: broadcasts fold into the FMA).
        # AArch64 (weights loaded a vector at a time, multiplied by lane):
        # SqueezeNet counted 145.4 M instructions per inference on an emulated
        # Cortex-A72 with 8 x 3, 157.4 M with 12 x 2, 165.3 M with 8 x 2.
        return GemmTile(lanes, 8, 3) if lanes <= 4 else GemmTile(lanes, 6, 4)
    return GemmTile(lanes, 6, 2) if lanes >= 8 else GemmTile(lanes, 4, 2)


def pack_weights(weight: np.ndarray, mr: int, dtype: str = "float32") -> np.ndarray:
    """[M, K...] -> [ceil(M / mr), K, mr], zero rows padding the last block,
    so the micro-kernel reads the mr values of one k contiguously (as
    `dtype`: float16 for an fp16 tile).

    >>> pack_weights(np.arange(6, dtype=np.float32).reshape(3, 2), 2).tolist()
    [[[0.0, 2.0], [1.0, 3.0]], [[4.0, 0.0], [5.0, 0.0]]]
    """
    m = weight.shape[0]
    a = weight.reshape(m, -1).astype(np.float32)
    blocks = -(-m // mr)
    padded = np.zeros((blocks * mr, a.shape[1]), np.float32)
    padded[:m] = a
    return np.ascontiguousarray(padded.reshape(blocks, mr, -1).transpose(0, 2, 1), dtype)


def pack_columns(weight: np.ndarray, nr: int, dtype: str = "float32") -> np.ndarray:
    """[K, N] -> the column-panel layout emit_gemm reads with b_panels (see
    panel_offset): each full panel of nr columns as a [K][nr] block, then
    the last N % nr columns as a [K][N % nr] block.

    >>> pack_columns(np.arange(6, dtype=np.float32).reshape(2, 3), 2).tolist()
    [0.0, 1.0, 3.0, 4.0, 2.0, 5.0]
    """
    kdim, n = weight.shape
    full = n // nr * nr
    panels = weight[:, :full].reshape(kdim, n // nr, nr).transpose(1, 0, 2).reshape(-1)
    return np.ascontiguousarray(np.concatenate([panels, weight[:, full:].reshape(-1)]), dtype)


def emit_gemm(k: Kernel, tile: GemmTile, m: int, kdim: int, n: int,
              a_packed: ir.Value, b_ptr: ir.Value, b_base, ldb: int,
              c_ptr: ir.Value, c_base, bias: "ir.Value | None", vector_epilogue: bool,
              residual: "ir.Value | None" = None, residual_at: int = 0,
              b_panels: bool = False, pack=None, b_offsets: "ir.Value | None" = None,
              lda: "int | None" = None, bias_columns: bool = False, b_half: bool = False) -> None:
    """C[c_base + i * n + j] = epilogue(bias[i] + sum_p A[i, p] * B[b_base + p * ldb + j]).

    a_packed is laid out by pack_weights(A, tile.mr), or with lda given it
    is A itself, row-major with rows lda apart (each value is broadcast on
    its own then, as x86 does from memory anyway). With bias_columns the
    bias is per column (bias[j], a Linear layer's) rather than per row. With vector_epilogue
    the kernel's fused element-wise ops are applied in registers; a residual
    (laid out like C) is added after the first residual_at of them.

    With b_panels, B is instead laid out in column panels (see
    panel_offset): the micro-kernel then reads one contiguous block per
    panel rather than K rows a page or more apart, which the TLB and the
    prefetchers handle far better. pack(first, end), when given, emits
    the code filling panels [first, end) of B; it is called for chunks of
    about PACK_CHUNK_BYTES of the thread's own panels just before they are
    multiplied (only when threads split the columns, see splits_columns).

    With b_offsets (an i32 pointer to kdim offsets), B[p, j] is instead
    b_ptr[b_base + b_offsets[p] + j]: every row of B is a window of one
    buffer (ldb unused), which lets a convolution read its input in place
    of an im2col copy (see conv._direct_plan).

    An fp16 tile computes in half precision: packed A holds halves (A read
    in place, with lda, stays float32), B holds halves with b_half (weights
    packed in panels) and floats otherwise, converted as loaded; offsets
    count elements of each. C, bias and residual are float32.
    """
    b = k.builder
    if tile.precision == "fp16":
        if lda is None:
            a_packed = b.bitcast(a_packed, HALF.as_pointer())
        if b_half:
            b_ptr = b.bitcast(b_ptr, HALF.as_pointer())
    full_m, tail_m = divmod(m, tile.mr)
    full_n, tail_n = divmod(n, tile.nr)
    # (count, first block, shape): full blocks, then one partial block.
    row_blocks = [(full_m, 0, tile.mr)] + ([(1, full_m, tail_m)] if tail_m else [])
    col_blocks = [(full_n, 0, (tile.lanes,) * tile.nv)]
    if tail_n:
        col_blocks.append((1, full_n, tuple(_split(tail_n, tile.lanes))))
    # Threads split the column panels when there are enough of them to go
    # round, otherwise the row blocks.
    panels, blocks = full_n + bool(tail_n), full_m + bool(tail_m)
    split_columns = splits_columns(tile, m, n)
    if pack is None:
        with k.share(panels if split_columns else blocks) as share:
            every = (k.i64(0), k.i64(blocks if split_columns else panels))
            cols, rows = (share, every) if split_columns else (every, share)
            _emit_panels(k, tile, kdim, n, col_blocks, row_blocks, *cols, *rows,
                         a_packed, b_ptr, b_base, ldb, c_ptr, c_base, bias, vector_epilogue,
                         residual, residual_at, b_panels, b_offsets, lda, bias_columns)
        return
    if not split_columns:
        raise ValueError("pack needs the columns split between threads")
    chunk = max(1, PACK_CHUNK_BYTES // (4 * kdim * tile.nr))
    with k.share(panels) as (col_lo, col_hi):
        chunks = b.add(divide(k, b.sub(b.sub(col_hi, col_lo), k.i64(1)), chunk), k.i64(1))
        with k.loop(chunks) as q:
            first = b.add(col_lo, b.mul(q, k.i64(chunk)))
            end = k.smin(b.add(first, k.i64(chunk)), col_hi)
            pack(first, end)
            _emit_panels(k, tile, kdim, n, col_blocks, row_blocks, first, end, k.i64(0), k.i64(blocks),
                         a_packed, b_ptr, b_base, ldb, c_ptr, c_base, bias, vector_epilogue,
                         residual, residual_at, b_panels, b_offsets)


def divide(k: Kernel, value: ir.Value, divisor: int) -> ir.Value:
    """value // divisor (rounded toward 0) for an i64 value that fits in
    32 bits: divided as i32, since a 64-bit division on ARMv7 is a libgcc
    call the module cannot link, while a 32-bit division by a constant
    becomes a multiply everywhere."""
    b = k.builder
    return b.sext(b.sdiv(b.trunc(value, ir.IntType(32)), ir.Constant(ir.IntType(32), divisor)), ir.IntType(64))


# B chunk packed at a time: well inside a core's L2 next to A's packed weights.
PACK_CHUNK_BYTES = 384 * 1024


def splits_columns(tile: GemmTile, m: int, n: int) -> bool:
    """Whether threads split C's column panels (else its row blocks): when
    there are enough panels to go round."""
    return -(-n // tile.nr) >= -(-m // tile.mr)


def _emit_panels(k, tile, kdim, n, col_blocks, row_blocks, col_lo, col_hi, row_lo, row_hi,
                 a_packed, b_ptr, b_base, ldb, c_ptr, c_base, bias, vector_epilogue,
                 residual, residual_at, b_panels, b_offsets=None, lda=None, bias_columns=False) -> None:
    """Every register tile of column panels [col_lo, col_hi) and row blocks [row_lo, row_hi)."""
    b = k.builder
    for n_count, n_first, widths in col_blocks:
        if not n_count:
            continue
        n_lo = k.smax(col_lo, k.i64(n_first))
        n_hi = k.smin(col_hi, k.i64(n_first + n_count))
        with k.loop(n_hi, start=n_lo) as nb:
            col0 = b.mul(nb, k.i64(tile.nr))
            if b_panels:
                b_col = b.gep(b_ptr, [b.add(b_base, b.mul(nb, k.i64(kdim * tile.nr)))])
                b_ld = k.i64(sum(widths))
            else:
                b_col = b.gep(b_ptr, [b.add(b_base, col0)])
                b_ld = k.i64(0 if b_offsets is not None else ldb)
            b_col = b.bitcast(b_col, F32_PTR)  # the tile's argument type, whatever B holds
            for m_count, m_first, rows in row_blocks:
                if not m_count:
                    continue
                bias_kind = ("columns" if bias_columns else "rows") if bias is not None else None
                fn = _tile_function(k, tile, rows, widths, bias_kind, vector_epilogue,
                                    residual_at if residual is not None else None, b_offsets is not None,
                                    lda is not None, b_ptr.type.pointee == HALF)
                m_lo = k.smax(row_lo, k.i64(m_first))
                m_hi = k.smin(row_hi, k.i64(m_first + m_count))
                with k.loop(m_hi, start=m_lo) as block:
                    row0 = b.mul(block, k.i64(tile.mr))
                    a_step = kdim * tile.mr if lda is None else lda * tile.mr
                    a = b.bitcast(b.gep(a_packed, [b.mul(block, k.i64(a_step))]), F32_PTR)
                    c_offset = b.add(c_base, b.add(b.mul(row0, k.i64(n)), col0))
                    c = b.gep(c_ptr, [c_offset])
                    null = ir.Constant(F32.as_pointer(), None)
                    bias_at = col0 if bias_columns else row0
                    bias_row = b.gep(bias, [bias_at]) if bias is not None else null
                    res = b.gep(residual, [c_offset]) if residual is not None else null
                    offsets = b_offsets if b_offsets is not None else ir.Constant(I32.as_pointer(), None)
                    extra = [k.i64(lda)] if lda is not None else []
                    b.call(fn, [a, b_col, c, bias_row, res, k.i64(kdim), b_ld, k.i64(n), offsets] + extra)


def panel_offset(k: Kernel, tile: GemmTile, kdim: int, n: int, row: ir.Value, panel: ir.Value) -> ir.Value:
    """Where B[row, panel * nr] lives in the column-panel layout of a K x N
    matrix (emit_gemm's b_panels), minus panel * nr, so that adding a column
    index of that panel gives its element: full panels are [K][nr] blocks,
    the last partial panel a [K][N % nr] block, K * N values in all."""
    b = k.builder
    width = k.i64(tile.nr)
    if n % tile.nr:
        last = b.icmp_signed("==", panel, k.i64(n // tile.nr))
        width = b.select(last, k.i64(n % tile.nr), width)
    start = b.mul(panel, k.i64(kdim * tile.nr))
    return b.sub(b.add(start, b.mul(row, width)), b.mul(panel, k.i64(tile.nr)))


def _split(count: int, lanes: int) -> list[int]:
    widths = [lanes] * (count // lanes)
    return widths + ([count % lanes] if count % lanes else [])


def _tile_function(k: Kernel, tile: GemmTile, rows: int, widths: tuple, bias_kind: "str | None",
                   vector_epilogue: bool, residual_at: "int | None", row_table: bool = False,
                   rows_apart: bool = False, b_half: bool = False) -> ir.Function:
    """The micro-kernel for one register-tile shape, as a function shared by
    every convolution of the module with that shape and epilogue:
    void(a, b, c, bias, residual, kdim, ldb, ldc, b_offsets[, lda]). Sharing keeps code size and compile
    time independent of the number of distinct layers. With row_table, row p
    of B starts at b_offsets[p] rather than p * ldb. bias_kind is None,
    "rows" (bias[r] added to row r) or "columns" (bias[j] to column j).
    With rows_apart, A is read in place, row r at a + r * lda, instead of
    packed. An fp16 tile accumulates in halves (see emit_gemm; B holds
    halves with b_half) and widens its sums to float32 for the bias, the
    epilogue and the store."""
    key = (tile.mr, rows, widths, bias_kind, k.epilogue_key if vector_epilogue else None, residual_at,
           row_table, rows_apart, tile.precision, b_half)
    i64 = ir.IntType(64)
    t = _new_tile_kernel(k, key, f"tile{{}}_{rows}x{sum(widths)}", vector_epilogue, residual_at,
                         (i64, i64, i64, I32.as_pointer()) + ((i64,) if rows_apart else ()))
    if not isinstance(t, Kernel):
        return t
    a_ptr, b_ptr, c_ptr, bias, res_ptr = t.inputs
    kdim, ldb, ldc, b_offsets = t.extra[:4]
    b = t.builder
    element = tile.element
    half = element == HALF
    if half and not rows_apart:
        a_ptr = b.bitcast(a_ptr, HALF.as_pointer())
    if b_half:
        b_ptr = b.bitcast(b_ptr, HALF.as_pointer())
    offsets = [sum(widths[:v]) for v in range(len(widths))]
    if residual_at is not None:
        # The residual is read only after the K loop, from rows far apart that
        # the hardware prefetchers do not follow: ask for its lines now.
        for r in range(rows):
            for off in range(0, sum(widths), max(1, tile.lanes)):
                prefetch(t, b.gep(res_ptr, [b.add(b.mul(t.i64(r), ldc), t.i64(off))]))
    accs = [[t.variable(ir.Constant(ir.VectorType(element, w), [0.0] * w)) for w in widths]
            for _ in range(rows)]

    def computed(value):
        """A loaded value (or vector) in the tile's precision: float32 ones narrowed for an fp16 tile."""
        if not half or getattr(value.type, "element", value.type) == HALF:
            return value
        vector = isinstance(value.type, ir.VectorType)
        return b.fptrunc(value, ir.VectorType(HALF, value.type.count) if vector else HALF)

    if rows_apart:
        a_rows = [b.gep(a_ptr, [b.mul(t.i64(r), t.extra[4])]) for r in range(rows)]

    def step(p):
        brow = b.sext(t.load(b_offsets, p), i64) if row_table else b.mul(p, ldb)
        bvecs = [computed(b.load(_vector_ptr(t, b_ptr, b.add(brow, t.i64(off)), w), align=2 if b_half else 4))
                 for off, w in zip(offsets, widths)]
        if rows_apart:
            def a(r, w):
                return splat(t, computed(t.load(a_rows[r], p)), w)
        else:
            a = broadcast_sources(t, a_ptr, b.mul(p, t.i64(tile.mr)), rows, tile.lanes)
        for r in range(rows):
            for v, w in enumerate(widths):
                b.store(_fmuladd(t, a(r, w), bvecs[v], b.load(accs[r][v])), accs[r][v])
    _reduction_loop(t, kdim, step)
    for r in range(rows):
        start = t.load(bias, t.i64(r)) if bias_kind == "rows" else None
        for v, w in enumerate(widths):
            value = b.load(accs[r][v])
            if half:
                value = b.fpext(value, ir.VectorType(F32, w))
            if start is not None:
                value = b.fadd(value, splat(t, start, w))
            elif bias_kind == "columns":
                value = b.fadd(value, b.load(_vector_ptr(t, bias, t.i64(offsets[v]), w), align=4))
            out = b.add(b.mul(t.i64(r), ldc), t.i64(offsets[v]))
            with t.vector_constants(w):
                for pos, fn in enumerate(t.epilogue):
                    if pos == residual_at:
                        value = b.fadd(value, b.load(_vector_ptr(t, res_ptr, out, w), align=4))
                    value = fn(t, value)
            if residual_at is not None and residual_at >= len(t.epilogue):
                value = b.fadd(value, b.load(_vector_ptr(t, res_ptr, out, w), align=4))
            b.store(value, _vector_ptr(t, c_ptr, out, w), align=4)
    t.finish()
    k.tiles[key] = t.function
    return t.function


def _reduction_loop(t: Kernel, kdim: ir.Value, step) -> None:
    """step(p) for p in [0, kdim) (kdim an i64 argument, not negative),
    Target.reduction_unroll steps per trip and the remainder one at a time."""
    unroll = t.target.reduction_unroll
    if unroll == 1:
        with t.loop(kdim) as p:
            step(p)
        return
    b = t.builder
    trips = b.udiv(kdim, t.i64(unroll))
    with t.loop(trips) as q:
        first = b.mul(q, t.i64(unroll))
        for u in range(unroll):
            step(b.add(first, t.i64(u)))
    with t.loop(kdim, start=b.mul(trips, t.i64(unroll))) as p:
        step(p)


def _new_tile_kernel(k: Kernel, key: tuple, name: str, vector_epilogue: bool, residual_at,
                     extra_args: tuple) -> "Kernel | ir.Function":
    """The module's function for a micro-kernel `key` if it has one, else a
    new Kernel `void(a, b, c, bias, residual, *extra_args)` to emit it into
    (name formatted with the module's tile count). The caller finishes it and
    records it under key."""
    if key in k.tiles:
        return k.tiles[key]
    t = Kernel(k.module, name.format(len(k.tiles)), 5, 0, k.target,
               k.epilogue if vector_epilogue else (), extra_args=extra_args, tiles=k.tiles)
    if residual_at is not None:
        # C may be the residual's buffer: each element is read, then written.
        for arg in (t.inputs[2], t.inputs[4]):
            arg.attributes.discard("noalias")
    return t


def emit_dot_rows(k: Kernel, lanes: int, m: int, kdim: int, n: int,
                  a_ptr: ir.Value, bt_ptr: ir.Value, c_ptr: ir.Value) -> None:
    """C[i, j] = sum_p A[i, p] * Bt[j, p] for row-major A [M, K] and Bt [N, K]
    (Gemm with transB, e.g. a fully connected layer).

    With one input row this is a matrix-vector product bound by reading Bt,
    so it is streamed once: four rows of Bt at a time against the same
    vectors of A, two vector accumulators per row to hide FMA latency.
    """
    b = k.builder
    rows, unroll = 4, 2
    step = lanes * unroll
    full_p = kdim // step * step
    vty = ir.VectorType(F32, lanes)
    with k.loop(m) as i:
        a_row = b.mul(i, k.i64(kdim))
        for count, first, block in ((n // rows, 0, rows), (n % rows, n // rows * rows, 1)):
            if not count:
                continue
            with k.loop(first // block + count, start=first // block) as jb:
                j0 = b.mul(jb, k.i64(block))
                accs = [[k.variable(ir.Constant(vty, [0.0] * lanes)) for _ in range(unroll)]
                        for _ in range(block)]
                if full_p:
                    with k.loop(full_p // step) as pb:
                        p0 = b.mul(pb, k.i64(step))
                        xs = [b.load(_vector_ptr(k, a_ptr, b.add(a_row, b.add(p0, k.i64(u * lanes))), lanes),
                                     align=4) for u in range(unroll)]
                        for r in range(block):
                            w_row = b.mul(b.add(j0, k.i64(r)), k.i64(kdim))
                            for u in range(unroll):
                                w = b.load(_vector_ptr(k, bt_ptr, b.add(w_row, b.add(p0, k.i64(u * lanes))),
                                                       lanes), align=4)
                                b.store(_fmuladd(k, xs[u], w, b.load(accs[r][u])), accs[r][u])
                for r in range(block):
                    vec = b.load(accs[r][0])
                    for u in range(1, unroll):
                        vec = b.fadd(vec, b.load(accs[r][u]))
                    total = k.variable(horizontal_reduce(k, vec))
                    w_row = b.mul(b.add(j0, k.i64(r)), k.i64(kdim))
                    with k.loop(kdim, start=full_p) as p:
                        prod = b.fmul(k.load(a_ptr, b.add(a_row, p)), k.load(bt_ptr, b.add(w_row, p)))
                        b.store(b.fadd(b.load(total), prod), total)
                    k.store(b.load(total), c_ptr, b.add(b.mul(i, k.i64(n)), b.add(j0, k.i64(r))))


def channel_tile(tile: GemmTile) -> GemmTile:
    """The transposed tile with tile's register budget: nv vectors of
    output channels by mr output pixels.

    >>> channel_tile(GemmTile(16, 6, 4))
    GemmTile(lanes=16, mr=64, nv=4, pixels=6, precision='fp32')
    """
    return GemmTile(tile.lanes, tile.lanes * tile.nv, tile.nv, tile.mr)


def emit_channel_gemm(k: Kernel, tile: GemmTile, m: int, kdim: int, n: int,
                      a_packed: ir.Value, x_ptr: ir.Value, taps: ir.Value, bases: ir.Value,
                      c_ptr: ir.Value, c_base, bias: "ir.Value | None", vector_epilogue: bool,
                      residual: "ir.Value | None" = None, residual_at: int = 0) -> None:
    """C[c_base + i * n + j] = epilogue(bias[i] + sum_p A[i, p] * x_ptr[bases[j] + taps[p]])
    with the register tile transposed against emit_gemm's: a tile holds
    tile.nv vectors of output channels (rows of C) for tile.pixels output
    pixels (columns), and per p it loads nv vectors of A (packed by
    pack_weights(A, tile.mr)) and broadcasts one input value per pixel.

    Every pixel costs the same FMAs whatever n is, so a small output
    wastes nothing: emit_gemm's vectors of pixels run partly empty when a
    row of the output is 7 or 14 wide. Each finished value is stored on
    its own (C is channel-major), which the long reductions of 3x3
    convolutions amortise. Threads split the pixel tiles. bases must rise
    from each pixel to the next (a tile whose bases rise by one each runs
    with one pointer; see _channel_tile_function).
    """
    b = k.builder
    groups, tail_m = -(-m // tile.mr), m % tile.mr
    full_n, tail_n = divmod(n, tile.pixels)
    null = ir.Constant(F32.as_pointer(), None)
    with k.share(full_n + bool(tail_n)) as (lo, hi):
        for g_count, g_first, rows in ((groups - bool(tail_m), 0, tile.mr), (bool(tail_m), groups - 1, tail_m)):
            if not g_count:
                continue
            widths = tuple(_split(rows, tile.lanes))
            with k.loop(g_first + g_count, start=g_first) as g:
                row0 = b.mul(g, k.i64(tile.mr))
                a = b.gep(a_packed, [b.mul(g, k.i64(kdim * tile.mr))])
                bias_row = b.gep(bias, [row0]) if bias is not None else null
                for t_count, t_first, pixels in ((full_n, 0, tile.pixels), (bool(tail_n), full_n, tail_n)):
                    if not t_count:
                        continue
                    fns = [_channel_tile_function(k, tile, pixels, widths, bias is not None, vector_epilogue,
                                                  residual_at if residual is not None else None, contiguous)
                           for contiguous in (False, True)]
                    with k.loop(k.smin(hi, k.i64(t_first + t_count)), start=k.smax(lo, k.i64(t_first))) as t:
                        col0 = b.mul(t, k.i64(tile.pixels))
                        c_offset = b.add(c_base, b.add(b.mul(row0, k.i64(n)), col0))
                        res = b.gep(residual, [c_offset]) if residual is not None else null
                        tile_bases = b.gep(bases, [col0])
                        args = [a, x_ptr, b.gep(c_ptr, [c_offset]), bias_row, res, k.i64(kdim), k.i64(n),
                                taps, tile_bases]
                        # Bases rise pixel by pixel: first + pixels - 1 at the
                        # last means every pixel is its left neighbour's + 1.
                        span = b.sub(k.load(tile_bases, k.i64(pixels - 1)), k.load(tile_bases, k.i64(0)))
                        with b.if_else(b.icmp_signed("==", span, ir.Constant(I32, pixels - 1))) as (then, otherwise):
                            with then:
                                b.call(fns[True], args)
                            with otherwise:
                                b.call(fns[False], args)


def _channel_tile_function(k: Kernel, tile: GemmTile, pixels: int, widths: tuple, has_bias: bool,
                           vector_epilogue: bool, residual_at: "int | None", contiguous: bool = False) -> ir.Function:
    """void(a, x, c, bias, residual, kdim, ldc, taps, bases): one transposed
    register tile (see emit_channel_gemm), shared like _tile_function's.
    With contiguous, pixel j reads x[bases[0] + j + tap]: one pointer and
    constant offsets, where a pointer per pixel (bases read one by one)
    takes more general registers than x86 has past about 10 pixels."""
    key = ("channels", tile.mr, pixels, widths, has_bias, k.epilogue_key if vector_epilogue else None,
           residual_at, contiguous)
    i64 = ir.IntType(64)
    t = _new_tile_kernel(k, key, f"ctile{{}}_{sum(widths)}x{pixels}{'c' if contiguous else ''}", vector_epilogue,
                         residual_at,
                         (i64, i64, I32.as_pointer(), I32.as_pointer()))
    if not isinstance(t, Kernel):
        return t
    a_ptr, x_ptr, c_ptr, bias, res_ptr = t.inputs
    kdim, ldc, taps, bases = t.extra
    b = t.builder
    offsets = [sum(widths[:v]) for v in range(len(widths))]
    if residual_at is not None:  # read after the K loop, one line per channel
        for row in range(sum(widths)):
            prefetch(t, b.gep(res_ptr, [b.mul(t.i64(row), ldc)]))
    if contiguous:
        first = b.gep(x_ptr, [b.sext(t.load(bases, t.i64(0)), i64)])
        sources = [b.gep(first, [t.i64(j)]) for j in range(pixels)]
    else:
        sources = [b.gep(x_ptr, [b.sext(t.load(bases, t.i64(j)), i64)]) for j in range(pixels)]
    accs = [[t.variable(ir.Constant(ir.VectorType(F32, w), [0.0] * w)) for w in widths]
            for _ in range(pixels)]

    def step(p):
        tap = b.sext(t.load(taps, p), i64)
        a_row = b.mul(p, t.i64(tile.mr))
        avecs = [b.load(_vector_ptr(t, a_ptr, b.add(a_row, t.i64(off)), w), align=4)
                 for off, w in zip(offsets, widths)]
        for j in range(pixels):
            x = b.load(b.gep(sources[j], [tap]))
            for v, w in enumerate(widths):
                b.store(_fmuladd(t, splat(t, x, w), avecs[v], b.load(accs[j][v])), accs[j][v])
    _reduction_loop(t, kdim, step)
    i32 = ir.IntType(32)
    for v, (off, w) in enumerate(zip(offsets, widths)):
        start = b.load(_vector_ptr(t, bias, t.i64(off), w), align=4) if has_bias else None
        finished = []
        transposable = w >= 2 and w & (w - 1) == 0 and pixels > 1
        residuals = None
        if residual_at is not None and transposable:
            residuals = _load_transposed(t, res_ptr, ldc, off, w, pixels)
        for j in range(pixels):
            value = b.load(accs[j][v])
            if start is not None:
                value = b.fadd(value, start)
            res = residuals[j] if residuals is not None else None
            if residual_at is not None and residuals is None:
                res = ir.Constant(ir.VectorType(F32, w), ir.Undefined)
                for lane in range(w):
                    at = b.add(b.mul(t.i64(off + lane), ldc), t.i64(j))
                    res = b.insert_element(res, t.load(res_ptr, at), ir.Constant(i32, lane))
            with t.vector_constants(w):
                for pos, fn in enumerate(t.epilogue):
                    if pos == residual_at:
                        value = b.fadd(value, res)
                    value = fn(t, value)
            if residual_at is not None and residual_at >= len(t.epilogue):
                value = b.fadd(value, res)
            finished.append(value)
        if transposable:
            _store_transposed(t, finished, c_ptr, ldc, off)
            continue
        for j, value in enumerate(finished):
            for lane in range(w):
                at = b.add(b.mul(t.i64(off + lane), ldc), t.i64(j))
                t.store(b.extract_element(value, ir.Constant(i32, lane)), c_ptr, at)
    t.finish()
    k.tiles[key] = t.function
    return t.function


def i32_table(k: Kernel, offsets: tuple) -> ir.Value:
    """Offsets (taps, pixel bases) as a constant i32 array of the module."""
    ty = ir.ArrayType(ir.IntType(32), len(offsets))
    gv = ir.GlobalVariable(k.module, ty, name=k.module.get_unique_name("tether.taps"))
    gv.global_constant = True
    gv.linkage = "internal"
    gv.initializer = ir.Constant(ty, list(offsets))
    return k.builder.gep(gv, [k.i64(0), k.i64(0)])


def prefetch(k: Kernel, ptr: ir.Value, write: int = 0) -> None:
    """llvm.prefetch of the cache line holding *ptr (a no-op where the target has no prefetch)."""
    i8p = ir.IntType(8).as_pointer()
    fn = k.module.globals.get("llvm.prefetch.p0i8") or ir.Function(
        k.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), name="llvm.prefetch.p0i8")
    k.builder.call(fn, [k.builder.bitcast(ptr, i8p), ir.Constant(I32, write), ir.Constant(I32, 3),
                        ir.Constant(I32, 1)])
