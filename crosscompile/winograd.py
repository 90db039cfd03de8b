"""Winograd F(2x2, 3x3): dense 3x3 stride-1 convolutions in fewer multiplications.

Each 2 x 2 block of output pixels (a tile) of one output channel is
A^T [sum_c (G g_c G^T) * (B^T d_c B)] A, with g_c the channel's 3x3 filter,
d_c the 4 x 4 input patch the tile reads and * the element-wise product.
So a convolution becomes 16 independent matrix products, one per position
i of the 4 x 4 transformed patch:

    M_i[m, t] = sum_c U_i[m, c] V_i[c, t],   U = G g G^T (at compile time),
                                             V = B^T d B (per input tile t)

16 * C * M FMAs per tile of 4 pixels where the direct convolution spends
9 * 4 * C * M: 2.25 times fewer, for an input transform per channel and
tile and an output transform per output channel and tile. The matrices
hold 0, +-1 and +-1/2 only, so the transforms are additions and the
result differs from the direct sum by a few float32 roundings of the
magnitudes summed (bound tested in tests/test_winograd.py).

Plain functions: `pays` decides per convolution (schedule.assign_tiles
writes the choice into the graph), `transform_weights` runs at compile
time (passes.pack_conv_weights), `emit` lowers one convolution.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from .emit import Kernel
from .gemm import GemmTile, emit_gemm, pack_weights, tile_for
from .vectors import _vector_ptr, load_strided, splat, vector_epilogue, vector_runs

# F(2x2, 3x3): output tile 2 x 2, input tile 4 x 4.
TILE, PATCH = 2, 4
G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
# Rows of B^T and A^T as (sign, index) terms: the transforms are sums.
B_T = (((1, 0), (-1, 2)), ((1, 1), (1, 2)), ((-1, 1), (1, 2)), ((1, 1), (-1, 3)))
A_T = (((1, 0), (1, 1), (1, 2)), ((1, 1), (-1, 2), (-1, 3)))

# Instructions per transformed value, per vector of tiles, counted from the
# emitted code on AArch64: the input transform loads 16 values and makes
# 16 from 32 additions; the output transform reads 16 products and makes
# 4 outputs from 24 additions, its bias and epilogue. Used to weigh the
# transforms against the FMAs they save (see pays).
INPUT_TRANSFORM_COST = 4.5
OUTPUT_TRANSFORM_COST = 14.0
# Input and output channels below which the transforms cost more than the
# products save, whatever the image size.
MIN_CHANNELS = 16


@dataclass(frozen=True)
class WinogradPlan:
    """Sizes of one image's Winograd convolution and its scratch layout:
    the padded input (channels x hp x wp), V (16 x channels x tiles, the
    16 v_stride apart) and M (16 x rows x tiles, m_stride apart), one after
    the other."""
    channels: int
    rows: int          # output channels
    oh: int
    ow: int
    pad_top: int
    pad_left: int
    h: int
    w: int

    @property
    def th(self) -> int:
        return -(-self.oh // TILE)

    @property
    def tw(self) -> int:
        return -(-self.ow // TILE)

    @property
    def tiles(self) -> int:
        return self.th * self.tw

    @property
    def hp(self) -> int:
        return TILE * self.th + PATCH - TILE

    @property
    def wp(self) -> int:
        return TILE * self.tw + PATCH - TILE

    @property
    def v_at(self) -> int:
        return _aligned(self.channels * self.hp * self.wp)

    @property
    def v_stride(self) -> int:
        """Floats from one position's V to the next's."""
        return _skewed(self.channels * self.tiles)

    @property
    def m_stride(self) -> int:
        return _skewed(self.rows * self.tiles)

    @property
    def m_at(self) -> int:
        return self.v_at + _aligned(PATCH * PATCH * self.v_stride)

    @property
    def scratch_floats(self) -> int:
        return self.m_at + PATCH * PATCH * self.m_stride


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


def plan(geometry, channels: int, rows: int) -> "WinogradPlan | None":
    """The plan of a convolution (window geometry as window._resolve_window
    gives it) if Winograd F(2x2, 3x3) computes it: a 2-D 3x3 kernel, stride
    1, no dilation."""
    (dz, h, w), kernel, strides, dilations, (_, pt, pl), _, (oz, oh, ow) = geometry
    if dz != 1 or tuple(kernel) != (1, 3, 3) or set(strides) != {1} or set(dilations) != {1}:
        return None
    return WinogradPlan(channels, rows, oh, ow, pt, pl, h, w)


def pays(target, geometry, channels: int, rows: int, group: int) -> bool:
    """Whether F(2x2, 3x3) costs fewer instructions than the direct GEMM:
    where the target allows it (Target.winograd), for one group, channels
    and output channels both at least MIN_CHANNELS, when the FMAs saved
    outweigh the transforms (the products' columns counted in whole panels
    of the target's tile of rows).

    >>> from crosscompile.target import resolve_target
    >>> geometry = ((1, 56, 56), (1, 3, 3), (1, 1, 1), (1, 1, 1), (0, 1, 1), (0, 1, 1), (1, 56, 56))
    >>> pays(resolve_target("rasp4b64"), geometry, 64, 64, 1)
    True
    """
    p = plan(geometry, channels, rows)
    if p is None or group != 1 or not target.winograd or min(channels, rows) < MIN_CHANNELS:
        return False
    lanes, nr = target.lanes, tile_for(target).nr
    direct = 9 * channels * rows * p.oh * (p.w + 2) / lanes
    panels = -(-p.tiles // nr) * nr  # columns of whole micro-kernel panels
    products = PATCH * PATCH * channels * rows * panels / lanes
    transforms = p.tiles / lanes * (channels * INPUT_TRANSFORM_COST * PATCH
                                    + rows * OUTPUT_TRANSFORM_COST)
    return products + transforms < direct


def transform_weights(weight: np.ndarray, mr: int) -> np.ndarray:
    """[M, C, 3, 3] -> U = G g G^T as 16 matrices [M, C], each packed for
    the micro-kernel (gemm.pack_weights), one after the other.

    >>> transform_weights(np.ones((1, 1, 3, 3), np.float32), 1).ravel().tolist()[:4]
    [1.0, 1.5, 0.5, 1.0]
    """
    u = np.einsum("ar,mcrs,bs->abmc", G, weight.astype(np.float64), G).astype(np.float32)
    return np.concatenate([pack_weights(u[a, b], mr).ravel()
                           for a in range(PATCH) for b in range(PATCH)])


def emit(k: Kernel, tile: GemmTile, p: WinogradPlan, x_base, y_base, u_packed, bias,
         residual, residual_at: "int | None") -> None:
    """One image: pad, transform the input, 16 products, transform the
    output (with bias, epilogue and residual) into Y. Threads split the
    channels of the copy and input transform, each product's panels or
    row blocks, and the output channels of the output transform."""
    bld = k.builder
    padded = k.scratch
    v = bld.gep(k.scratch, [k.i64(p.v_at)])
    m = bld.gep(k.scratch, [k.i64(p.m_at)])
    _transform_input(k, p, x_base, padded, v)
    k.barrier()
    u_size = -(-p.rows // tile.mr) * tile.mr * p.channels
    with k.loop(PATCH * PATCH) as i:
        emit_gemm(k, tile, p.rows, p.channels, p.tiles, bld.gep(u_packed, [bld.mul(i, k.i64(u_size))]),
                  v, bld.mul(i, k.i64(p.v_stride)), p.tiles,
                  m, bld.mul(i, k.i64(p.m_stride)), None, False)
    k.barrier()
    _transform_output(k, p, m, y_base, bias, residual, residual_at)
    k.barrier()  # before the next image overwrites the scratch


def _transform_input(k: Kernel, p: WinogradPlan, x_base, padded, v) -> None:
    """padded = this thread's channels of the input, zero-padded to whole
    tiles; V[i, c, t] = (B^T d B)[i] for each tile t of those channels."""
    bld, X = k.builder, k.inputs[0]
    c_lo, c_hi = k.part(p.channels)
    with k.loop(c_hi, start=c_lo) as c:
        src_plane = k.index((x_base, 1), (c, p.h * p.w))
        dst_plane = k.index((c, p.hp * p.wp))
        with k.loop(p.hp) as y:
            iy = k.index((y, 1), (-p.pad_top, 1))
            row_inside = k.in_range(iy, p.h)
            dst = k.index((dst_plane, 1), (y, p.wp))
            with k.loop(p.wp) as x:
                ix = k.index((x, 1), (-p.pad_left, 1))
                inside = bld.and_(row_inside, k.in_range(ix, p.w))
                src = bld.select(inside, k.index((src_plane, 1), (iy, p.w), (ix, 1)), src_plane)
                k.store(bld.select(inside, k.load(X, src), k.f32(0.0)), padded, bld.add(dst, x))
        with k.loop(p.th) as ty:
            for first, count, width in vector_runs(p.tw, k.target.lanes):
                with k.loop(first + count, start=first) as group:
                    tx = bld.mul(group, k.i64(width)) if width > 1 else group
                    corner = k.index((dst_plane, 1), (ty, TILE * p.wp), (tx, TILE))
                    # Tile j of the vector reads corner + 2j: a stride-2 load.
                    d = [[load_strided(k, padded, bld.add(corner, k.i64(r * p.wp + s)), width, TILE, spare=1)
                          if width > 1 else k.load(padded, bld.add(corner, k.i64(r * p.wp + s)))
                          for s in range(PATCH)] for r in range(PATCH)]
                    rows = [[_combine(k, [(sign, d[r][s]) for sign, r in terms]) for s in range(PATCH)]
                            for terms in B_T]
                    t = k.index((ty, p.tw), (tx, 1))
                    for a in range(PATCH):
                        for b, terms in enumerate(B_T):
                            value = _combine(k, [(sign, rows[a][s]) for sign, s in terms])
                            at = k.index((t, 1), (c, p.tiles), ((a * PATCH + b) * p.v_stride, 1))
                            if width > 1:
                                bld.store(value, _vector_ptr(k, v, at, width), align=4)
                            else:
                                k.store(value, v, at)


def _transform_output(k: Kernel, p: WinogradPlan, m, y_base, bias, residual, residual_at) -> None:
    """Y = A^T M A + bias per tile, epilogue and residual applied, for this
    thread's output channels: vectors of whole tiles (each output row of
    them one store of their two columns interleaved) where the epilogue has
    a vector form, then one tile at a time; a last row or column of tiles
    of an odd-sized output writes only the pixels inside it."""
    bld, Y = k.builder, k.outputs[0]
    lanes = k.target.lanes if vector_epilogue(k) or not k.epilogue else 1
    r_lo, r_hi = k.part(p.rows)
    with k.loop(r_hi, start=r_lo) as r:
        start = k.load(bias, r) if bias is not None else k.f32(0.0)
        for ty_first, ty_count, out_rows in _tile_runs(p.oh):
            with k.loop(ty_first + ty_count, start=ty_first) as ty:
                runs = vector_runs(p.ow // TILE, lanes)
                if p.ow % TILE:
                    runs.append((p.ow // TILE, 1, 0))  # the last tile, one column
                for first, count, width in runs:
                    with k.loop(first + count, start=first) as group:
                        tx = bld.mul(group, k.i64(width)) if width > 1 else group
                        t = k.index((ty, p.tw), (tx, 1))
                        mv = [[_load(k, m, k.index((t, 1), (r, p.tiles), ((a * PATCH + b) * p.m_stride, 1)),
                                     max(width, 1)) for b in range(PATCH)] for a in range(PATCH)]
                        cols = [[_combine(k, [(sign, mv[a][b]) for sign, a in terms]) for b in range(PATCH)]
                                for terms in A_T[:out_rows]]
                        for a in range(out_rows):
                            out = k.index((y_base, 1), (r, p.oh * p.ow), (ty, TILE * p.ow), (a * p.ow, 1),
                                          (tx, TILE))
                            pixels = [_combine(k, [(sign, cols[a][s]) for sign, s in terms])
                                      for terms in A_T[:TILE if width else 1]]
                            if width > 1:
                                _store_row(k, _interleave(k, pixels, width), start, residual, residual_at, out)
                            else:
                                for b, value in enumerate(pixels):
                                    at = bld.add(out, k.i64(b))
                                    value = _epilogue(k, bld.fadd(start, value), residual, residual_at, at)
                                    k.store(value, Y, at)


def _load(k: Kernel, ptr, at, width: int):
    return k.builder.load(_vector_ptr(k, ptr, at, width), align=4) if width > 1 else k.load(ptr, at)


def _interleave(k: Kernel, pixels: list, width: int):
    """One vector of a row of `width` tiles' outputs from its two columns:
    [a0, b0, a1, b1, ...]."""
    mask = ir.Constant(ir.VectorType(ir.IntType(32), TILE * width),
                       [j + b * width for j in range(width) for b in range(TILE)])
    return k.builder.shuffle_vector(pixels[0], pixels[1], mask)


def _store_row(k: Kernel, value, start, residual, residual_at, out) -> None:
    """Bias, epilogue and residual on a vector of output pixels, stored at out."""
    bld, width = k.builder, value.type.count
    value = bld.fadd(value, splat(k, start, width))
    with k.vector_constants(width):
        for pos, fn in enumerate(k.epilogue):
            if pos == residual_at:
                value = bld.fadd(value, _load(k, residual, out, width))
            value = fn(k, value)
    if residual is not None and residual_at >= len(k.epilogue):
        value = bld.fadd(value, _load(k, residual, out, width))
    bld.store(value, _vector_ptr(k, k.outputs[0], out, width), align=4)


def _tile_runs(size: int) -> list:
    """(first tile, tiles, outputs per tile) along an axis of `size` outputs:
    whole tiles, then a last tile of one output when size is odd."""
    runs = [(0, size // TILE, TILE)] if size >= TILE else []
    if size % TILE:
        runs.append((size // TILE, 1, size % TILE))
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


def _combine(k: Kernel, terms) -> ir.Value:
    """The sum of (sign, value) terms, as additions and subtractions."""
    bld = k.builder
    (sign, total), *rest = sorted(terms, key=lambda term: -term[0])
    if sign < 0:
        total = bld.fneg(total)
    for sign, value in rest:
        total = bld.fadd(total, value) if sign > 0 else bld.fsub(total, value)
    return total
