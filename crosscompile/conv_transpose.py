"""ConvTranspose: the gradient of a convolution with respect to its input,
which decoders (U-Net, FCN heads, audio upsamplers) use to upsample.

Each input value is scattered into the output: output position
o = i * stride + k * dilation - pad_begin along every spatial axis. Per
image and group, in runs of output rows (column_plan), the input rows a
run reads are first multiplied by the weights,
columns[(output channel, tap), pixel] = W^T . X: with constant weights on
the GEMM micro-kernel (gemm.emit_gemm; the weights packed at compile time
by passes.pack_conv_weights, the input rows copied into the kernel's
column panels), else as a plain product. Then every output value is
gathered once from the columns that reach it (col2im turned around): the
bias, the column values and the fused epilogue in registers, one store
per output, no pass over the output to clear it or to activate it. Along
the width, output column q * stride + r takes the taps of phase r, which
read their columns at q plus a shift known at compile time: a vector of
q per phase, the phases interleaved in registers, is a run of
stride x lanes outputs. Which rows of columns an output row reads comes
from a table made at compile time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from .errors import BuildError, ShapeError
from .gemm import divide, emit_gemm, i32_table, pack_weights, splits_columns
from .matmul import strided_matmul
from .op_base import Op, _c_strides, _ints, _prod
from .vectors import _vector_ptr, interleave, row_pieces, splat, vector_epilogue
from .window import _window_attributes

# Floats of the columns and panels of one run of output rows: 512 KiB, a core's L2
# on the AVX2 host. Measured there: with half, a DCGAN's 4 x 4 kernel (64 -> 32
# channels, 16 x 16) ran in runs that computed many input rows twice, 325-440 us
# against 250-335; with twice, 128 -> 64 channels at 64 x 64 took 4.0-4.2 ms
# against 3.8-3.9.
SCRATCH_FLOATS = 128 * 1024


def transpose_geometry(x_shape, w_shape, attrs):
    """(input dims, kernel, strides, dilations, begin pads, output dims),
    each as 3-D (depth, height, width) with unit leading dimensions for 1-D
    and 2-D inputs.

    >>> transpose_geometry((1, 4, 5, 5), (4, 2, 3, 3), {"strides": (2, 2), "pads": (1, 1, 1, 1),
    ...     "output_padding": (1, 1), "auto_pad": "NOTSET", "dilations": None, "output_shape": None,
    ...     "kernel_shape": None})[-1]
    (1, 10, 10)
    """
    spatial = tuple(x_shape[2:])
    n = len(spatial)
    if n not in (1, 2, 3):
        raise ShapeError(f"only 1-D, 2-D and 3-D transposed convolutions are supported, "
                         f"input has shape {tuple(x_shape)}")
    kernel = tuple(w_shape[2:])
    strides = attrs["strides"] or (1,) * n
    dilations = attrs["dilations"] or (1,) * n
    out_padding = attrs["output_padding"] or (0,) * n
    pads = attrs["pads"] or (0,) * (2 * n)
    if len(strides) != n or len(dilations) != n or len(out_padding) != n or len(pads) != 2 * n:
        raise ShapeError(f"strides {strides}, dilations {dilations}, output_padding {out_padding} or "
                         f"pads {pads} do not fit a {n}-D transposed convolution")
    if min(strides) < 1 or min(dilations) < 1:
        raise BuildError(f"strides {strides} and dilations {dilations} must be >= 1")
    # The output length before padding is cut from either end.
    full = [s * (d - 1) + p + (k - 1) * dl + 1
            for d, k, s, dl, p in zip(spatial, kernel, strides, dilations, out_padding)]
    requested = attrs["output_shape"]
    if requested is not None and len(requested) == n + 2:
        requested = requested[2:]
    auto_pad = attrs["auto_pad"]
    if requested is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        requested = tuple(d * s for d, s in zip(spatial, strides))
    if requested is not None:
        if len(requested) != n:
            raise ShapeError(f"output_shape {attrs['output_shape']} does not fit a {n}-D transposed convolution")
        # A negative total (an output_shape beyond the input's reach) adds
        # outputs only the bias reaches, at the end as at the start.
        totals = [f - r for f, r in zip(full, requested)]
        # SAME_UPPER puts the odd element of padding at the end (ONNX's rule
        # for a given output_shape, which onnxruntime follows for auto_pad too).
        upper = auto_pad == "SAME_UPPER"
        begin = [t // 2 if upper else t - t // 2 for t in totals]
        out = tuple(requested)
    else:
        if auto_pad == "VALID":
            pads = (0,) * (2 * n)
        begin = list(pads[:n])
        out = tuple(f - b - e for f, b, e in zip(full, pads[:n], pads[n:]))
    if min(out) < 1:
        raise ShapeError(f"pads {pads} leave no output of the transposed convolution of {tuple(x_shape)}")
    ones, zeros = (1,) * (3 - n), (0,) * (3 - n)
    return (ones + spatial, ones + kernel, ones + tuple(strides), ones + tuple(dilations),
            zeros + tuple(begin), ones + out)


class ConvTranspose(Op):
    """1-D, 2-D and 3-D transposed convolution, NCHW, with groups, strides,
    dilations, pads, output_padding, output_shape and every auto_pad form.
    W has shape (C, M / group, *kernel); the bias (M,) starts each output."""

    op_type = "ConvTranspose"

    def attributes(self, raw, constants, opset):
        attrs = _window_attributes(raw)
        attrs.update(group=int(raw.get("group", 1)), output_padding=_ints(raw, "output_padding"),
                     output_shape=_ints(raw, "output_shape"))
        return attrs

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise ShapeError(f"ConvTranspose takes X, W and an optional B, got {len(inputs)} inputs")
        x, w = inputs[0], inputs[1]
        if len(x) != len(w) or len(x) < 3:
            raise ShapeError(f"ConvTranspose input {x} and weight {w} ranks do not match")
        group = attrs["group"]
        if group < 1 or x[1] % group or w[0] != x[1]:
            raise ShapeError(f"ConvTranspose with group={group}: input channels {x[1]} and weight {w} do not fit "
                             "(the weight is (input channels, output channels / group, *kernel))")
        kernel = attrs["kernel_shape"]
        if kernel is not None and tuple(kernel) != tuple(w[2:]):
            raise ShapeError(f"kernel_shape {kernel} differs from the weight's {tuple(w[2:])}")
        if len(inputs) == 3 and tuple(inputs[2]) != (w[1] * group,):
            raise ShapeError(f"ConvTranspose bias of shape {inputs[2]} should be ({w[1] * group},)")
        out = transpose_geometry(x, w, attrs)[-1]
        return [(x[0], w[1] * group, *out[5 - len(x):])]

    def _plan(self, inputs, attrs) -> "ColumnPlan":
        x = inputs[0].shape
        w = attrs.get("weight_shape") or inputs[1].shape
        return column_plan(transpose_geometry(x, w, attrs), x[1] // attrs["group"], w[1], "packed_mr" in attrs)

    def scratch_bytes(self, inputs, outputs, attrs):
        return 4 * self._plan(inputs, attrs).scratch_floats

    def parallel(self, attrs):
        return "packed_mr" in attrs

    def lower(self, k, inputs, outputs, attrs):
        plan = self._plan(inputs, attrs)
        x = inputs[0].shape
        (dz, h, wd), kernel, _, _, _, (oz, oh_n, ow_n) = plan.geometry
        group, mg, cg = attrs["group"], plan.channels, plan.depth
        taps = _prod(kernel)
        volume_in, volume_out, n = dz * h * wd, oz * oh_n * ow_n, plan.n
        bld = k.builder
        X, W = k.inputs[0], k.inputs[1]
        bias = k.inputs[2] if len(inputs) == 3 else None
        tile = attrs.get("columns_tile") if plan.panels else None
        # The zero row would otherwise become a memset call (see Conv._lower_gemm).
        set.add(k.function.attributes, '"no-builtins"')
        epilogue = vector_epilogue(k)
        sources = i32_table(k, plan.sources)
        starts = i32_table(k, plan.starts)
        columns = bld.gep(k.scratch, [k.i64(plan.columns_at)])
        with k.share(wd) as (lo, hi), k.loop(hi, start=lo) as i:  # what a missing row of columns reads
            k.store(k.f32(0.0), k.scratch, k.index((i, 1), (plan.zero_at, 1)))
        with k.loop(x[0]) as image, k.loop(group) as g:
            x_base = k.index((image, x[1] * volume_in), (g, cg * volume_in))
            y_base = k.index((image, mg * group * volume_out), (g, mg * volume_out))
            for count, first, lines in _runs(oz * oh_n, plan.lines):
                with k.loop(count) as j:
                    run = k.index((j, 1), (first // plan.lines, 1))
                    if first or count > 1:
                        # Every thread has gathered the last run's columns
                        # before they are overwritten.
                        with bld.if_then(bld.icmp_signed(">", run, k.i64(0))):
                            k.barrier()
                    b_base = bld.add(x_base, bld.sext(k.load(starts, run), ir.IntType(64)))
                    if tile is not None:
                        _multiply_panels(k, tile, plan, bld.gep(W, [k.index((g, plan.weight_floats(tile)))]),
                                         b_base, columns)
                    else:
                        # columns[m * taps + tap, p] = sum_c W[g * cg + c, m, tap] * X[image, g * cg + c, p]
                        strided_matmul(k, mg * taps, cg, n, (1, mg * taps), (volume_in, 1),
                                       (k.index((g, cg * mg * taps)), b_base, 0), operands=(W, X, columns))
                    k.barrier()  # threads gather columns other threads computed
                    _gather(k, plan, sources, k.index((run, plan.lines)), lines, k.index((g, mg)), y_base,
                            bias, epilogue)
            if x[0] * group > 1:
                k.barrier()  # before the next image or group overwrites the columns
        k.activated = epilogue or not k.epilogue


@dataclass(frozen=True)
class ColumnPlan:
    """How a transposed convolution computes and gathers its columns: in
    runs of `lines` output lines (depth and row together), each run
    computing the columns of `inputs` input lines from its start on
    (starts: element offsets in a plane) for all output channels of a
    group, n = inputs x width of them per row of columns. sources holds,
    for each output line, `most` offsets within one output channel's
    columns of the rows of columns it adds up (-1: none). Scratch holds
    the input's lines in the GEMM's column panels (with packed weights),
    the columns from columns_at, and a row of zeros at zero_at."""
    geometry: tuple
    depth: int       # input channels per group, the GEMM's K
    channels: int    # output channels per group
    panels: bool
    lines: int
    inputs: int
    starts: tuple
    most: int
    sources: tuple
    columns_at: int
    zero_at: int

    @property
    def n(self) -> int:
        return self.inputs * self.geometry[0][2]

    @property
    def scratch_floats(self) -> int:
        return self.zero_at + self.geometry[0][2]

    def weight_floats(self, tile) -> int:
        """Floats of one group's weights packed for tile (pack_column_weights)."""
        return _packed_floats(self.channels * _prod(self.geometry[1]), self.depth, tile.mr)


def column_plan(geometry, depth: int, channels: int, panels: bool) -> ColumnPlan:
    """The ColumnPlan of a transposed convolution: runs as long as keep
    the columns (and the panels, with packed weights) within
    SCRATCH_FLOATS, one output line at least.

    >>> geometry = transpose_geometry((1, 64, 32, 32), (64, 32, 2, 2), {"strides": (2, 2), "pads": None,
    ...     "output_padding": None, "auto_pad": "NOTSET", "dilations": None, "output_shape": None})
    >>> plan = column_plan(geometry, 64, 32, True)
    >>> plan.lines, plan.inputs, plan.starts[:3]
    (16, 8, (0, 256, 512))
    """
    (dz, h, wd), (kz, kh_n, kw_n), (_, sh, _), _, _, (oz, _, _) = geometry
    reached = _line_inputs(geometry)
    rows = channels * kz * kh_n * kw_n + (depth if panels else 0)  # floats per input pixel

    # The first and last input line each output line reads (none: an empty range).
    low = np.array([min((line for _, line in reads), default=dz * h) for reads in reached])
    high = np.array([max((line for _, line in reads), default=-1) for reads in reached])

    def spans(lines):
        """The first input line each run of `lines` output lines reads, and the most any run reads."""
        pad = -len(reached) % lines
        firsts = np.append(low, [dz * h] * pad).reshape(-1, lines).min(axis=1)
        lasts = np.append(high, [-1] * pad).reshape(-1, lines).max(axis=1)
        firsts = np.where(lasts >= firsts, firsts, 0)
        return [int(f) for f in firsts], int(max(1, (lasts - firsts).max() + 1))

    def fits(lines):
        return rows * spans(lines)[1] * wd <= SCRATCH_FLOATS
    total = len(reached)
    longest = 1
    while longest < total and fits(longest + 1):
        longest += 1
    # Runs of even length, a whole number of strides where that fits.
    lines = longest
    for count in range(-(-total // longest), total + 1):
        even = -(-total // count)
        aligned = min(total, -(-even // sh) * sh) if oz == 1 else even
        if aligned <= longest and fits(aligned):
            lines = aligned
            break
    firsts, inputs = spans(lines)
    # A run near the end starts early enough to read `inputs` whole lines.
    firsts = [min(first, dz * h - inputs) for first in firsts]
    n = inputs * wd
    most = max(1, max(len(reads) for reads in reached))
    sources = []
    for index, reads in enumerate(reached):
        first = firsts[index // lines]
        offsets = [tap_line * kw_n * n + (line - first) * wd for tap_line, line in reads]
        sources += offsets + [-1] * (most - len(offsets))
    columns_at = _aligned(depth * n) if panels else 0
    zero_at = _aligned(columns_at + channels * kz * kh_n * kw_n * n)
    return ColumnPlan(geometry, depth, channels, panels, lines, inputs, tuple(f * wd for f in firsts), most,
                      tuple(sources), columns_at, zero_at)


def _aligned(floats: int) -> int:
    return -(-floats // 16) * 16


def _runs(total: int, size: int) -> list:
    """(count, first, size) of the full runs of `size` in range(total),
    then of the shorter last one if any.

    >>> _runs(10, 4)
    [(2, 0, 4), (1, 8, 2)]
    """
    full, tail = divmod(total, size)
    return [c for c in ((full, 0, size), (1, full * size, tail)) if c[0] and c[2]]


def _packed_floats(rows: int, kdim: int, mr: int) -> int:
    """Floats of pack_weights of a rows x kdim matrix: whole blocks of mr rows."""
    return -(-rows // mr) * mr * kdim


def pack_column_weights(weight: np.ndarray, group: int, mr: int) -> np.ndarray:
    """The weights (C, M / group, *kernel) as the lowering multiplies them:
    per group, the matrix A[(output channel, tap), input channel] packed by
    gemm.pack_weights(A, mr), one group after the other.

    >>> pack_column_weights(np.arange(8, dtype=np.float32).reshape(2, 2, 2), 1, 2).tolist()
    [0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0]
    """
    channels = weight.shape[0]
    return np.concatenate([pack_weights(rows.T, mr).reshape(-1)
                           for rows in np.split(weight.reshape(channels, -1), group)])


def _multiply_panels(k, tile, plan: ColumnPlan, weights, base, columns) -> None:
    """The columns of one run: the run's input lines (from X[base] on, a
    plane apart per input channel) copied into emit_gemm's column panels
    in scratch, then multiplied by the packed weights. Each panel is one
    contiguous block, where rows of the input a plane apart would map to
    the same few sets of the L1 cache. Where threads split the panels,
    each copies its own just before multiplying them; else they split
    the copy's rows and meet at a barrier."""
    kdim, n = plan.depth, plan.n
    (dz, h, wd) = plan.geometry[0]
    rows = plan.channels * _prod(plan.geometry[1])

    def pack(first, end, p_lo=k.i64(0), p_hi=k.i64(kdim)):
        _pack_panels(k, tile, kdim, n, base, dz * h * wd, (first, end), (p_lo, p_hi))
    if splits_columns(tile, rows, n):
        emit_gemm(k, tile, rows, kdim, n, weights, k.scratch, k.i64(0), n, columns, k.i64(0), None, False,
                  b_panels=True, pack=pack)
        return
    with k.share(kdim) as depth:
        pack(k.i64(0), k.i64(-(-n // tile.nr)), *depth)
    k.barrier()  # the GEMM's panels hold rows other threads copied
    emit_gemm(k, tile, rows, kdim, n, weights, k.scratch, k.i64(0), n, columns, k.i64(0), None, False,
              b_panels=True)


def _pack_panels(k, tile, kdim: int, n: int, base, ld: int, panels, rows) -> None:
    """Panels [panels) of B (kdim x n, row p at X[base + p * ld]), rows
    [rows) of them, into scratch in emit_gemm's column-panel layout
    (gemm.panel_offset)."""
    bld = k.builder
    full, tail = divmod(n, tile.nr)
    first, end = panels
    with k.loop(rows[1], start=rows[0]) as p:
        row = bld.add(base, bld.mul(p, k.i64(ld)))
        with k.loop(k.smin(end, k.i64(full)), start=first) as q:
            src, dst = bld.add(row, bld.mul(q, k.i64(tile.nr))), k.index((q, kdim * tile.nr), (p, tile.nr))
            for v in range(tile.nv):
                value = bld.load(_vector_ptr(k, k.inputs[0], bld.add(src, k.i64(v * tile.lanes)), tile.lanes),
                                 align=4)
                bld.store(value, _vector_ptr(k, k.scratch, bld.add(dst, k.i64(v * tile.lanes)), tile.lanes),
                          align=4)
        if tail:
            with bld.if_then(bld.icmp_signed(">", end, k.i64(full))), k.loop(tail) as j:
                value = k.load(k.inputs[0], k.index((row, 1), (j, 1), (full * tile.nr, 1)))
                k.store(value, k.scratch, k.index((p, tail), (j, 1), (full * kdim * tile.nr, 1)))


def _phases(stride: int, kernel: int, dilation: int, pad: int) -> list:
    """Per output phase r < stride, the taps k whose outputs
    o = i * stride + k * dilation - pad fall at o = q * stride + r, each
    with its shift s: it reads input i = q + s there.

    >>> _phases(2, 4, 1, 1)
    [[(1, 0), (3, -1)], [(0, 1), (2, 0)]]
    """
    phases = [[] for _ in range(stride)]
    for tap in range(kernel):
        offset = tap * dilation - pad
        phases[offset % stride].append((tap, (offset % stride - offset) // stride))
    return phases


def _line_inputs(geometry) -> list:
    """For each output line (depth and row, in order), the (tap line,
    input line) pairs reaching it, tap line kd * kh + ky, input line
    iz * h + iy.

    >>> _line_inputs(transpose_geometry((1, 1, 2, 3), (1, 1, 2, 2), {"strides": (2, 2), "pads": None,
    ...     "output_padding": None, "auto_pad": "NOTSET", "dilations": None, "output_shape": None}))
    [[(0, 0)], [(1, 0)], [(0, 1)], [(1, 1)]]
    """
    (dz, h, _), (kz, kh_n, _), (sz, sh, _), (ddz, dh, _), (pz, ph, _), (oz, oh_n, _) = geometry
    lines = []
    for z in range(oz):
        depths = [(kd, iz) for kd in range(kz) for iz, rest in [divmod(z + pz - kd * ddz, sz)]
                  if not rest and 0 <= iz < dz]
        for y in range(oh_n):
            rows = [(ky, iy) for ky in range(kh_n) for iy, rest in [divmod(y + ph - ky * dh, sh)]
                    if not rest and 0 <= iy < h]
            lines.append([(kd * kh_n + ky, iz * h + iy) for kd, iz in depths for ky, iy in rows])
    return lines


def _gather(k, plan: ColumnPlan, sources, first_line, lines: int, bias_at, y_base, bias, epilogue: bool) -> None:
    """Output lines [first_line, first_line + lines) of every output
    channel of a group (from y_base on), gathered from the run's columns:
    bias[bias_at + m] plus the column values reaching each output, the
    epilogue applied where it has a vector form. Threads split the
    (channel, output line) pairs."""
    bld = k.builder
    (dz, h, wd), (kz, kh_n, kw_n), _, _, _, (oz, oh_n, ow_n) = plan.geometry
    taps, n = kz * kh_n * kw_n, plan.n
    with k.share(plan.channels * lines) as (lo, hi), k.loop(hi, start=lo) as pair:
        m = divide(k, pair, lines)
        line = bld.add(first_line, bld.sub(pair, bld.mul(m, k.i64(lines))))
        start = k.load(bias, bld.add(bias_at, m)) if bias is not None else k.f32(0.0)
        column = k.index((m, taps * n), (plan.columns_at, 1))
        rows = []  # per source, per kx: where its row of columns starts in scratch
        for source in range(plan.most):
            offset = bld.sext(k.load(sources, k.index((line, plan.most), (source, 1))), ir.IntType(64))
            valid = bld.icmp_signed(">=", offset, k.i64(0))
            rows.append([bld.select(valid, k.index((column, 1), (offset, 1), (kx * n, 1)), k.i64(plan.zero_at))
                         for kx in range(kw_n)])
        _gather_row(k, plan.geometry, rows, start, k.index((y_base, 1), (m, oz * oh_n * ow_n), (line, ow_n)),
                    epilogue)


def _gather_row(k, geometry, rows, start, out_row, epilogue: bool) -> None:
    """One output row at out_row: output column q * sw + r is start plus
    scratch[rows[source][kx] + q + shift] over the sources and the taps
    (kx, shift) of phase r (_phases). Where every tap reads inside its row
    and every phase's column is in the output, a vector of q per phase,
    interleaved into one run of outputs; elsewhere one output at a time,
    a tap reading outside its row adding 0."""
    bld = k.builder
    (_, _, wd), (_, _, kw_n), (_, _, sw), (_, _, dw), (_, _, pw), (_, _, ow_n) = geometry
    phases = _phases(sw, kw_n, dw, pw)
    shifts = [shift for phase in phases for _, shift in phase]
    lo = max([0] + [-s for s in shifts])
    hi = max(lo, min([ow_n // sw] + [wd - s for s in shifts]))
    lanes = k.target.lanes

    def vector(q, width):
        runs = []
        for phase in phases:
            acc = splat(k, start, width)
            for taps in rows:
                for kx, shift in phase:
                    at = bld.add(taps[kx], bld.add(q, k.i64(shift)))
                    acc = bld.fadd(acc, bld.load(_vector_ptr(k, k.scratch, at, width), align=4))
            if epilogue:
                with k.vector_constants(width):
                    acc = k.activate(acc)
            runs.append(acc)
        value = interleave(k, runs)
        dest = bld.gep(k.outputs[0], [bld.add(out_row, bld.mul(q, k.i64(sw)))])
        bld.store(value, bld.bitcast(dest, value.type.as_pointer()), align=4)

    full = (hi - lo) // lanes
    if full:
        with k.loop(full) as block:
            vector(k.index((block, lanes), (lo, 1)), lanes)
    pieces, end = row_pieces(lo + full * lanes, hi, lanes, 1)
    for first, width in pieces:
        vector(k.i64(first), width)
    count = -(-ow_n // sw)  # values of q
    for first, last in ((0, min(lo, count)), (end, count)):
        if first >= last:
            continue
        with k.loop(last, start=first) as q:
            for r, phase in enumerate(phases):
                limit = -(-(ow_n - r) // sw)  # q past it puts this phase beyond the output
                if first >= limit:
                    continue
                acc = start
                for taps in rows:
                    for kx, shift in phase:
                        ix = bld.add(q, k.i64(shift))
                        inside = k.in_range(ix, wd)
                        value = k.load(k.scratch, bld.add(taps[kx], bld.select(inside, ix, k.i64(0))))
                        acc = bld.fadd(acc, bld.select(inside, value, k.f32(0.0)))
                if epilogue:
                    acc = k.activate(acc)
                at = bld.add(out_row, k.index((q, sw), (r, 1)))
                if last > limit:
                    with bld.if_then(bld.icmp_signed("<", q, k.i64(limit))):
                        k.store(acc, k.outputs[0], at)
                else:
                    k.store(acc, k.outputs[0], at)


class Col2Im(Op):
    """The columns of an im2col (N, C x prod(block_shape), L) summed back
    into the image (N, C, *image_shape): the value of tap t of sliding
    block l lands at l * stride + t * dilation - pad_begin along each axis,
    if inside the image (image_shape and block_shape constant inputs)."""

    op_type = "Col2Im"
    compile_time_inputs = (1, 2)

    def attributes(self, raw, constants, opset):
        image, block = (tuple(int(v) for v in np.asarray(constants[pos]).reshape(-1)) for pos in (1, 2))
        n = len(image)
        if len(block) != n:
            raise BuildError(f"Col2Im image_shape {image} and block_shape {block} differ in length")
        strides, dilations = _ints(raw, "strides") or (1,) * n, _ints(raw, "dilations") or (1,) * n
        pads = _ints(raw, "pads") or (0,) * (2 * n)
        if len(strides) != n or len(dilations) != n or len(pads) != 2 * n:
            raise BuildError(f"Col2Im strides {strides}, dilations {dilations} or pads {pads} do not fit "
                             f"a {n}-D image")
        if min(strides + dilations + block) < 1 or min(pads, default=0) < 0:
            raise BuildError(f"Col2Im strides {strides}, dilations {dilations} and block_shape {block} must be "
                             f">= 1 and pads {pads} >= 0")
        grid = tuple((size + pads[i] + pads[i + n] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
                     for i, size in enumerate(image))
        return {"image": image, "block": block, "strides": strides, "dilations": dilations,
                "begin": pads[:n], "grid": grid}

    def infer(self, inputs, attrs):
        x, block, grid = inputs[0], attrs["block"], attrs["grid"]
        if len(x) != 3 or x[1] % _prod(block) or x[2] != _prod(grid) or min(grid) < 1:
            raise ShapeError(f"Col2Im input {x} must be (N, C x {_prod(block)} taps of block {block}, "
                             f"{_prod(grid)} blocks over {grid})")
        return [(x[0], x[1] // _prod(block), *attrs["image"])]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        image, block, grid = attrs["image"], attrs["block"], attrs["grid"]
        taps, blocks, plane = _prod(block), _prod(grid), _prod(image)
        bld, X, Y = k.builder, k.inputs[0], k.outputs[0]
        with k.loop(x[0] * x[1] // taps) as nc:
            with k.loop(plane) as i:
                k.store(k.f32(0.0), Y, k.index((nc, plane), (i, 1)))
            with k.nested_loops(block) as tpos, k.nested_loops(grid) as lpos:
                ipos = [k.index((l, s), (t, d), (-b, 1))
                        for l, t, s, d, b in zip(lpos, tpos, attrs["strides"], attrs["dilations"], attrs["begin"])]
                inside = None
                for i, size in zip(ipos, image):
                    ok = k.in_range(i, size)
                    inside = ok if inside is None else bld.and_(inside, ok)
                with bld.if_then(inside):
                    source = k.index((nc, taps * blocks), *zip(tpos, [s * blocks for s in _c_strides(block)]),
                                     *zip(lpos, _c_strides(grid)))
                    target = k.index((nc, plane), *zip(ipos, _c_strides(image)))
                    k.store(bld.fadd(k.load(Y, target), k.load(X, source)), Y, target)
