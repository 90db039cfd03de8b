"""Winograd F(2x2, 3x3) and F(4x4, 3x3): dense 3x3 stride-1 convolutions
(dilated ones as planes of their phases, see WinogradPlan) in fewer
multiplications.

Each m x m block of output pixels (a tile) of one output channel is
A^T [sum_c (G g_c G^T) * (B^T d_c B)] A, with g_c the channel's 3x3 filter,
d_c the (m + 2) x (m + 2) input patch the tile reads and * the element-wise
product. So a convolution becomes (m + 2)^2 independent matrix products,
one per position i of the transformed patch:

    M_i[m, t] = sum_c U_i[m, c] V_i[c, t],   U = G g G^T (at compile time),
                                             V = B^T d B (per input tile t)

F(2x2, 3x3) spends 16 * C * M FMAs per tile of 4 pixels where the direct
convolution spends 9 * 4 * C * M: 2.25 times fewer. F(4x4, 3x3) spends
36 per tile of 16: 4 times fewer, for larger transforms, tiles that cover
more of the padding at the image's edge, and larger rounding errors
(its matrices hold 4, 5 and 8; G holds 1/6 and 1/24). The transforms are
additions and multiplications by those constants; both variants' results
stay within a bound of the direct sum tested in tests/test_winograd.py.

Plain functions: `choose` decides per convolution (schedule.assign_tiles
writes the choice into the graph), `transform_weights` runs at compile
time (passes.pack_conv_weights), `emit` lowers one convolution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from llvmlite import ir

from .emit import F32, Kernel
from .gemm import (GemmTile, channel_tile, divide, emit_channel_gemm, emit_gemm, i32_table, pack_weights,
                   tile_for)
from .vectors import _fmuladd, _vector_ptr, interleave, load_strided, splat, vector_epilogue


def _f2_input(ops, d):
    """B^T d along one axis of F(2x2, 3x3)'s 4 x 4 patch."""
    return [ops.sub(d[0], d[2]), ops.add(d[1], d[2]), ops.sub(d[2], d[1]), ops.sub(d[1], d[3])]


def _f2_output(ops, m):
    """A^T m along one axis: 4 products to 2 outputs."""
    return [ops.add(ops.add(m[0], m[1]), m[2]), ops.sub(ops.sub(m[1], m[2]), m[3])]


def _f4_input(ops, d):
    """B^T d along one axis of F(4x4, 3x3)'s 6 x 6 patch, its rows
    4 0 -5 0 1 0 / 0 -4 -4 1 1 0 / 0 4 -4 -1 1 0 / 0 -2 -1 2 1 0 /
    0 2 -1 -2 1 0 / 0 4 0 -5 0 1, sharing the terms rows 1 - 4 have in common."""
    a = ops.muladd(-4.0, d[2], d[4])
    b = ops.muladd(-4.0, d[1], d[3])
    c = ops.sub(d[4], d[2])
    e = ops.sub(d[3], d[1])
    return [ops.muladd(4.0, d[0], ops.muladd(-5.0, d[2], d[4])), ops.add(a, b), ops.sub(a, b),
            ops.muladd(2.0, e, c), ops.muladd(-2.0, e, c), ops.muladd(4.0, d[1], ops.muladd(-5.0, d[3], d[5]))]


def _f4_output(ops, m):
    """A^T m along one axis, rows 1 1 1 1 1 0 / 0 1 -1 2 -2 0 / 0 1 1 4 4 0 /
    0 1 -1 8 -8 1: 6 products to 4 outputs."""
    s, d = ops.add(m[1], m[2]), ops.sub(m[1], m[2])
    s2, d2 = ops.add(m[3], m[4]), ops.sub(m[3], m[4])
    return [ops.add(ops.add(m[0], s), s2), ops.muladd(2.0, d2, d), ops.muladd(4.0, s2, s),
            ops.add(ops.muladd(8.0, d2, d), m[5])]


@dataclass(frozen=True)
class Variant:
    """F(tile x tile, 3x3): G (patch x 3), and B^T and A^T along one axis
    as functions of an ops object (add, sub, muladd(c, a, b) = c a + b),
    applied to the LLVM values of a kernel or, in tests, to numpy arrays.
    input_cost and output_cost weigh the transforms against the FMAs a
    variant saves (see _cost): instructions per vector of tiles, per
    input channel and patch row, and per output channel."""
    tile: int
    g: np.ndarray
    input_rows: Callable
    output_rows: Callable
    input_cost: float
    output_cost: float

    @property
    def patch(self) -> int:
        return self.tile + 2


F2 = Variant(2, np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]]),
             _f2_input, _f2_output, 4.5, 14.0)
F4 = Variant(4, np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                          [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]),
             _f4_input, _f4_output, 9.0, 46.0)
VARIANTS = {2: F2, 4: F4}
# Input and output channels below which the transforms cost more than the
# products save, whatever the image size.
MIN_CHANNELS = 16


@dataclass(frozen=True)
class WinogradPlan:
    """Sizes of one image's Winograd convolution and its scratch layout:
    the padded input (channels x hp x wp), V (patch^2 x channels x tiles,
    the positions v_stride apart) and M (patch^2 x rows x tiles, m_stride
    apart), one after the other. tile: the variant's output tile (2 or 4).

    A convolution dilated by d (both axes) is d x d undilated ones: the
    outputs (a + d y, b + d x) of phase (a, b) read only the inputs
    (a + d u, b + d v) of the padded image, as a 3x3 kernel with no
    dilation. The padded copy then holds d x d phase planes per channel
    (hp x wp each, for ceil(oh / d) x ceil(ow / d) outputs), the tiles of
    every phase are the columns of the products, and the output transform
    writes each phase's pixels d apart. Deeplab's backbones (dilation 2 and
    4 at 28 x 28) thus run as fast as undilated 3x3 convolutions.
    """
    tile: int
    channels: int
    rows: int          # output channels
    oh: int
    ow: int
    pad_top: int
    pad_left: int
    h: int
    w: int
    dilation: int = 1

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.tile]

    @property
    def positions(self) -> int:
        """Transformed values per tile: patch x patch products."""
        return self.variant.patch ** 2

    @property
    def phases(self) -> int:
        """Phase planes per channel: dilation squared."""
        return self.dilation ** 2

    @property
    def th(self) -> int:
        """Rows of tiles of one phase."""
        return -(-self.oh // (self.tile * self.dilation))

    @property
    def tw(self) -> int:
        return -(-self.ow // (self.tile * self.dilation))

    @property
    def phase_tiles(self) -> int:
        return self.th * self.tw

    @property
    def tiles(self) -> int:
        return self.phases * self.phase_tiles

    @property
    def hp(self) -> int:
        return self.tile * self.th + 2

    @property
    def wp(self) -> int:
        return self.tile * self.tw + 2

    @property
    def v_at(self) -> int:
        return _aligned(self.channels * self.phases * self.hp * self.wp)

    @property
    def v_stride(self) -> int:
        """Floats from one position's V to the next's."""
        return _skewed(self.channels * self.tiles)

    @property
    def m_stride(self) -> int:
        return _skewed(self.rows * self.tiles)

    @property
    def m_at(self) -> int:
        return self.v_at + _aligned(self.positions * self.v_stride)

    @property
    def scratch_floats(self) -> int:
        return self.m_at + self.positions * self.m_stride


def _aligned(floats: int) -> int:
    return -(-floats // 16) * 16


def _skewed(floats: int) -> int:
    """A stride between the 16 positions' matrices of V (or M) that is a
    whole number of 64-byte lines, and an odd one: the input transform
    writes all 16 per tile and the output transform reads all 16, and at a
    multiple of 4 KB apart (64 channels of 784 tiles: 49 x 4 KB) the 16
    streams share one set of a 12-way L1 and evict each other. On AMD Zen 5
    (AVX-512, one thread, against onnxruntime in the same run) that took
    64 channels at 56 x 56 from 1.41 to 0.75, DenseNet's 128 -> 32 at
    56 x 56 from 2.2 - 3.0 to 0.80 and 64 -> 192 at 56 x 56 from 0.87 to
    0.57 (the direct GEMM: 1.00 - 1.02).

    >>> _skewed(64 * 784), _skewed(100)
    (50192, 112)
    """
    lines = -(-floats // 16)
    return (lines | 1) * 16


def plan(geometry, channels: int, rows: int, tile: int = 2) -> "WinogradPlan | None":
    """The plan of a convolution (window geometry as window._resolve_window
    gives it) if Winograd F(tile x tile, 3x3) computes it: a 2-D 3x3
    kernel, stride 1, the same dilation on both axes (see WinogradPlan)."""
    (dz, h, w), kernel, strides, (_, dh, dw), (_, pt, pl), _, (oz, oh, ow) = geometry
    if dz != 1 or tuple(kernel) != (1, 3, 3) or set(strides) != {1} or dh != dw:
        return None
    return WinogradPlan(tile, channels, rows, oh, ow, pt, pl, h, w, dh)


def product_tile(target, p: WinogradPlan, precision: str = "fp32") -> GemmTile:
    """The register tile of a plan's products M_i = U_i V_i: the target's
    tile of rows (vectors of tiles), or on targets that broadcast from
    memory (x86) the transposed tile (vectors of output channels by
    tiles) where they do not fill one panel of the tile of rows: its
    vectors of tiles would run partly empty, its last ones with too few
    FMAs to hide their latency. Measured on AMD Zen 5 (AVX-512, 64-column
    panels), against onnxruntime's time, rows / transposed:
    F(4x4, 3x3) of 256 channels at 14 x 14 (16 tiles) 0.49 / 0.39,
    128 at 28 x 28 (49) 0.40 / 0.37, 64 at 56 x 56 (196) 0.44 / 0.47;
    F(2x2, 3x3) of 512 at 7 x 7 (16) 0.79 / 0.61, 64 at 56 x 56 (784)
    0.59 / 0.66. In fp16 the products take the fp16 tile of rows (the
    transforms stay float32: they add and subtract, a small share)."""
    rows_tile = tile_for(target, precision)
    if target.multiplies_by_lane or p.tiles >= rows_tile.nr or precision == "fp16":
        return rows_tile
    return channel_tile(rows_tile)


def _product_columns(tile: GemmTile, p: WinogradPlan) -> int:
    """Output values a product computes with `tile`, padding included:
    whole pixel tiles by whole vectors of channels for a transposed tile,
    whole column panels by rows for a tile of rows."""
    if tile.pixels:
        return -(-p.tiles // tile.pixels) * tile.pixels * -(-p.rows // tile.mr) * tile.mr
    return -(-p.tiles // tile.nr) * tile.nr * p.rows


# What streaming one vector of weights costs, in FMAs: the transformed
# weights are positions / 9 times the direct convolution's (4 times with
# F(4x4, 3x3)), and where few tiles use each of them (F(4x4, 3x3) of 512
# channels at 7 x 7: 38 MB of weights for 4 tiles) their loads from memory
# outweigh the FMAs saved. Measured on AMD Zen 5, 512 channels at 7 x 7:
# F(2x2, 3x3) 0.62 of onnxruntime's time, F(4x4, 3x3) 0.95, direct 1.05.
WEIGHT_VECTOR_COST = 4.0


def _cost(target, p: WinogradPlan) -> float:
    """Estimated vector instructions of a plan: its products' FMAs (whole
    vectors of the tile product_tile gives it), their weights' loads and
    its transforms."""
    lanes, variant = target.lanes, p.variant
    products = _product_columns(product_tile(target, p), p)
    weights = p.rows * WEIGHT_VECTOR_COST
    transforms = p.tiles / lanes * (p.channels * variant.input_cost * variant.patch
                                    + p.rows * variant.output_cost)
    return p.positions * p.channels * (products + weights) / lanes + transforms


def choose(target, geometry, channels: int, rows: int, group: int) -> int:
    """The output tile (2 or 4) of the Winograd variant with the fewest
    estimated instructions, or 0 where the direct GEMM costs fewer: where
    the target allows it (Target.winograd), for one group, channels and
    output channels both at least MIN_CHANNELS.

    >>> from crosscompile.target import resolve_target
    >>> geometry = ((1, 56, 56), (1, 3, 3), (1, 1, 1), (1, 1, 1), (0, 1, 1), (0, 1, 1), (1, 56, 56))
    >>> choose(resolve_target("rasp4b64"), geometry, 64, 64, 1) > 0
    True
    """
    p = plan(geometry, channels, rows)
    if p is None or group != 1 or not target.winograd or min(channels, rows) < MIN_CHANNELS:
        return 0
    # The direct GEMM's columns: a grid as wide as the padded rows (undilated),
    # or the output itself (a dilated one: im2col or the transposed tile).
    columns = p.oh * (p.w + 2) if p.dilation == 1 else p.oh * p.ow
    direct = 9 * channels * rows * (columns + WEIGHT_VECTOR_COST) / target.lanes
    costs = {tile: _cost(target, plan(geometry, channels, rows, tile)) for tile in target.winograd_tiles}
    best = min(costs, key=costs.get, default=0)
    return best if best and costs[best] < direct else 0


def transform_weights(weight: np.ndarray, mr: int, tile: int = 2, dtype: str = "float32") -> np.ndarray:
    """[M, C, 3, 3] -> U = G g G^T as patch^2 matrices [M, C], each packed
    for the micro-kernel (gemm.pack_weights, as dtype), one after the other.

    >>> transform_weights(np.ones((1, 1, 3, 3), np.float32), 1).ravel().tolist()[:4]
    [1.0, 1.5, 0.5, 1.0]
    """
    g = VARIANTS[tile].g
    # G w G^T as two matrix products (an unoptimised einsum over all four
    # indices took seconds on VGG-19's weights).
    rows = np.tensordot(g, weight.astype(np.float64), axes=([1], [2]))  # [a, m, c, s]
    u = np.tensordot(rows, g, axes=([3], [1])).transpose(0, 3, 1, 2).astype(np.float32)  # [a, b, m, c]
    return np.concatenate([pack_weights(u[a, b], mr, dtype).ravel() for a in range(len(g)) for b in range(len(g))])


def emit(k: Kernel, tile: GemmTile, p: WinogradPlan, x_base, y_base, u_packed, bias,
         residual, residual_at: "int | None") -> None:
    """One image: pad, transform the input, the products, transform the
    output (with bias, epilogue and residual) into Y. Threads split the
    channels of the copy and input transform, each product's panels,
    row blocks or tiles, and the output channels of the output transform."""
    bld = k.builder
    padded = k.scratch
    v = bld.gep(k.scratch, [k.i64(p.v_at)])
    m = bld.gep(k.scratch, [k.i64(p.m_at)])
    _transform_input(k, p, x_base, padded, v)
    k.barrier()
    u_size = -(-p.rows // tile.mr) * tile.mr * p.channels
    if tile.pixels:
        taps = i32_table(k, tuple(c * p.tiles for c in range(p.channels)))
        bases = i32_table(k, tuple(range(p.tiles)))
    u_packed = k.typed(u_packed, tile.dtype)  # halves for an fp16 tile
    with k.loop(p.positions) as i:
        u_i = bld.gep(u_packed, [bld.mul(i, k.i64(u_size))])
        if tile.pixels:
            emit_channel_gemm(k, tile, p.rows, p.channels, p.tiles, u_i, bld.gep(v, [bld.mul(i, k.i64(p.v_stride))]),
                              taps, bases, m, bld.mul(i, k.i64(p.m_stride)), None, False)
        else:
            emit_gemm(k, tile, p.rows, p.channels, p.tiles, u_i, v, bld.mul(i, k.i64(p.v_stride)), p.tiles,
                      m, bld.mul(i, k.i64(p.m_stride)), None, False)
    k.barrier()
    _transform_output(k, p, m, y_base, bias, residual, residual_at)
    k.barrier()  # before the next image overwrites the scratch


class _Ops:
    """The transforms' arithmetic on a kernel's values (scalars or vectors)."""

    def __init__(self, k: Kernel):
        self.k = k

    def add(self, a, b):
        return self.k.builder.fadd(a, b)

    def sub(self, a, b):
        return self.k.builder.fsub(a, b)

    def muladd(self, c: float, a, b):
        """c a + b for a constant c."""
        if isinstance(a.type, ir.VectorType):
            return _fmuladd(self.k, ir.Constant(a.type, [c] * a.type.count), a, b)
        fn = self.k.module.globals.get("llvm.fmuladd.f32") or ir.Function(
            self.k.module, ir.FunctionType(F32, [F32] * 3), name="llvm.fmuladd.f32")
        return self.k.builder.call(fn, [ir.Constant(F32, c), a, b])


def _tile_vectors(count: int, lanes: int) -> list:
    """(first item, groups, items per group) covering `count` tiles side by
    side: whole vectors of `lanes` tiles, then the rest as one narrower
    vector, or one at a time when a vector would hold one tile or the
    target has none.

    >>> _tile_vectors(14, 16), _tile_vectors(37, 16), _tile_vectors(5, 4)
    ([(0, 1, 14)], [(0, 2, 16), (32, 1, 5)], [(0, 1, 4), (4, 1, 1)])
    """
    whole = count // lanes if lanes > 1 else 0
    runs = [(0, whole, lanes)] if whole else []
    rest = count - whole * lanes
    if rest > 1 and lanes > 1:
        runs.append((whole * lanes, 1, rest))
    elif rest:
        runs.append((whole * lanes, rest, 1))
    return runs


def _transform_input(k: Kernel, p: WinogradPlan, x_base, padded, v) -> None:
    """padded = this thread's channels of the input, zero-padded to whole
    tiles; V[i, c, t] = (B^T d B)[i] for each tile t of those channels."""
    bld, X = k.builder, k.inputs[0]
    variant, ops, step = p.variant, _Ops(k), p.tile
    size = variant.patch
    dilation = p.dilation
    with k.share(p.channels) as (c_lo, c_hi), k.loop(c_hi, start=c_lo) as c, k.loop(p.phases) as phase:
        src_plane = k.index((x_base, 1), (c, p.h * p.w))
        dst_plane = k.index((c, p.phases * p.hp * p.wp), (phase, p.hp * p.wp))
        # Row y, column x of phase (a, b) is the padded input's (a + d y, b + d x).
        phase_row, phase_col = (0, 0) if dilation == 1 else _phase(k, phase, dilation)
        with k.loop(p.hp) as y:
            iy = k.index((y, dilation), (phase_row, 1), (-p.pad_top, 1))
            row_inside = k.in_range(iy, p.h)
            dst = k.index((dst_plane, 1), (y, p.wp))
            with k.loop(p.wp) as x:
                ix = k.index((x, dilation), (phase_col, 1), (-p.pad_left, 1))
                inside = bld.and_(row_inside, k.in_range(ix, p.w))
                src = bld.select(inside, k.index((src_plane, 1), (iy, p.w), (ix, 1)), src_plane)
                k.store(bld.select(inside, k.load(X, src), k.f32(0.0)), padded, bld.add(dst, x))
        with k.loop(p.th) as ty:
            for first, count, width in _tile_vectors(p.tw, k.target.lanes):
                with k.loop(count) as group:
                    tx = k.index((group, width), (first, 1))
                    corner = k.index((dst_plane, 1), (ty, step * p.wp), (tx, step))
                    # Tile j of the vector reads corner + step j: a strided
                    # load. Its last reads run past the row into the next
                    # one (or into V, after the last plane): values dropped.
                    d = [[load_strided(k, padded, bld.add(corner, k.i64(r * p.wp + s)), width, step,
                                       spare=step - 1)
                          if width > 1 else k.load(padded, bld.add(corner, k.i64(r * p.wp + s)))
                          for s in range(size)] for r in range(size)]
                    columns = [variant.input_rows(ops, [d[r][s] for r in range(size)]) for s in range(size)]
                    t = k.index((phase, p.phase_tiles), (ty, p.tw), (tx, 1))
                    for a in range(size):
                        for b, value in enumerate(variant.input_rows(ops, [columns[s][a] for s in range(size)])):
                            at = k.index((t, 1), (c, p.tiles), ((a * size + b) * p.v_stride, 1))
                            if width > 1:
                                bld.store(value, _vector_ptr(k, v, at, width), align=4)
                            else:
                                k.store(value, v, at)


def _output_runs(p: WinogradPlan, lanes: int) -> list:
    """(first tile, groups, tiles per group, outputs stored per row of a
    group or None for all) along a row of tiles: _tile_vectors' runs, the
    last tile of an output whose width is not a whole number of tiles in
    a group of its own that stores only the columns inside the output."""
    runs = [(first, count, width, None) for first, count, width in _tile_vectors(p.tw, lanes)]
    if p.ow % p.tile:
        first, count, width, _ = runs.pop()
        if count > 1:
            runs.append((first, count - 1, width, None))
        last = first + (count - 1) * width
        runs.append((last, 1, width, p.ow - last * p.tile))
    return runs


def _transform_output(k: Kernel, p: WinogradPlan, m, y_base, bias, residual, residual_at) -> None:
    """Y = A^T M A + bias per tile, epilogue and residual applied, for this
    thread's output channels: vectors of whole tiles (each output row of
    them one store of their columns interleaved) where the epilogue has a
    vector form, then one tile at a time; a last row or column of tiles of
    an output whose size is not a whole number of tiles writes only the
    pixels inside it."""
    if p.dilation > 1:
        _transform_output_phases(k, p, m, y_base, bias, residual, residual_at)
        return
    bld, Y = k.builder, k.outputs[0]
    variant, ops, step = p.variant, _Ops(k), p.tile
    size = variant.patch
    lanes = k.target.lanes if vector_epilogue(k) or not k.epilogue else 1
    with k.share(p.rows) as (r_lo, r_hi), k.loop(r_hi, start=r_lo) as r:
        start = k.load(bias, r) if bias is not None else k.f32(0.0)
        for ty_first, ty_count, out_rows in _tile_runs(p.oh, step):
            with k.loop(ty_first + ty_count, start=ty_first) as ty:
                for first, count, width, stored in _output_runs(p, lanes):
                    with k.loop(count) as group:
                        tx = k.index((group, width), (first, 1))
                        t = k.index((ty, p.tw), (tx, 1))
                        mv = [[_load(k, m, k.index((t, 1), (r, p.tiles), ((a * size + b) * p.m_stride, 1)), width)
                               for b in range(size)] for a in range(size)]
                        columns = [variant.output_rows(ops, [mv[a][b] for a in range(size)]) for b in range(size)]
                        for i in range(out_rows):
                            out = k.index((y_base, 1), (r, p.oh * p.ow), (ty, step * p.ow), (i * p.ow, 1),
                                          (tx, step))
                            pixels = variant.output_rows(ops, [columns[b][i] for b in range(size)])
                            if width > 1:
                                _store_row(k, interleave(k, pixels), stored, start, residual, residual_at, out)
                                continue
                            for j, value in enumerate(pixels[:stored or step]):
                                at = bld.add(out, k.i64(j))
                                value = _epilogue(k, bld.fadd(start, value), residual, residual_at, at)
                                k.store(value, Y, at)


def _transform_output_phases(k: Kernel, p: WinogradPlan, m, y_base, bias, residual, residual_at) -> None:
    """_transform_output of a dilated plan: tile by tile, each phase's
    pixels d apart in both axes, those past the output's edge (phases of
    fewer rows or columns than others, tiles past a phase's) not stored."""
    bld = k.builder
    variant, ops, step, d = p.variant, _Ops(k), p.tile, p.dilation
    size = variant.patch
    with k.share(p.rows) as (r_lo, r_hi), k.loop(r_hi, start=r_lo) as r:
        start = k.load(bias, r) if bias is not None else k.f32(0.0)
        with k.loop(p.phases) as phase, k.loop(p.th) as ty, k.loop(p.tw) as tx:
            a, b = _phase(k, phase, d)
            t = k.index((phase, p.phase_tiles), (ty, p.tw), (tx, 1))
            mv = [[k.load(m, k.index((t, 1), (r, p.tiles), ((i * size + j) * p.m_stride, 1))) for j in range(size)]
                  for i in range(size)]
            columns = [variant.output_rows(ops, [mv[i][j] for i in range(size)]) for j in range(size)]
            for i in range(step):
                y = k.index((a, 1), (ty, step * d), (i * d, 1))
                pixels = variant.output_rows(ops, [columns[j][i] for j in range(size)])
                for j, value in enumerate(pixels):
                    x = k.index((b, 1), (tx, step * d), (j * d, 1))
                    with bld.if_then(bld.and_(bld.icmp_signed("<", y, k.i64(p.oh)),
                                              bld.icmp_signed("<", x, k.i64(p.ow)))):
                        at = k.index((y_base, 1), (r, p.oh * p.ow), (y, p.ow), (x, 1))
                        k.store(_epilogue(k, bld.fadd(start, value), residual, residual_at, at), k.outputs[0], at)


def _phase(k: Kernel, phase, dilation: int) -> tuple:
    """(a, b): the row and column offsets of phase plane a * dilation + b."""
    a = divide(k, phase, dilation)
    return a, k.builder.sub(phase, k.builder.mul(a, k.i64(dilation)))


def _load(k: Kernel, ptr, at, width: int):
    return k.builder.load(_vector_ptr(k, ptr, at, width), align=4) if width > 1 else k.load(ptr, at)


def _store_row(k: Kernel, value, stored: "int | None", start, residual, residual_at, out) -> None:
    """Bias, epilogue and residual on a vector of output pixels, its first
    `stored` (all with None) stored at out."""
    bld = k.builder
    if stored is not None and stored < value.type.count:
        value = bld.shuffle_vector(value, ir.Constant(value.type, ir.Undefined),
                                   ir.Constant(ir.VectorType(ir.IntType(32), stored), list(range(stored))))
    width = value.type.count
    value = bld.fadd(value, splat(k, start, width))
    with k.vector_constants(width):
        for pos, fn in enumerate(k.epilogue):
            if pos == residual_at:
                value = bld.fadd(value, _load(k, residual, out, width))
            value = fn(k, value)
    if residual is not None and residual_at >= len(k.epilogue):
        value = bld.fadd(value, _load(k, residual, out, width))
    bld.store(value, _vector_ptr(k, k.outputs[0], out, width), align=4)


def _tile_runs(size: int, step: int) -> list:
    """(first tile, tiles, outputs per tile) along an axis of `size` outputs:
    whole tiles of `step`, then a last tile of the rest."""
    runs = [(0, size // step, step)] if size >= step else []
    if size % step:
        runs.append((size // step, 1, size % step))
    return runs


def _epilogue(k: Kernel, value, residual, residual_at, out):
    """The kernel's fused element-wise ops, the residual added after the
    first residual_at of them (as the GEMM micro-kernel does)."""
    for pos, fn in enumerate(k.epilogue):
        if pos == residual_at:
            value = k.builder.fadd(value, k.load(residual, out))
        value = fn(k, value)
    if residual is not None and residual_at >= len(k.epilogue):
        value = k.builder.fadd(value, k.load(residual, out))
    return value
