"""Conv: the op and the ways it runs.

With weights packed at compile time (passes.pack_conv_weights) a
convolution is a GEMM per image and group (gemm.py) whose B is the input
itself (pointwise), windows of a padded copy of it (_direct_plan) or its
im2col. A depthwise convolution has a direct kernel of its own
(emit_depthwise); any other runs as a direct loop nest.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import winograd
from .emit import F32, HALF, Kernel
from .errors import BuildError, ShapeError
from .gemm import divide, emit_channel_gemm, emit_gemm, i32_table, panel_offset, splits_columns
from .op_base import Op, _prod
from .vectors import _fmuladd, _vector_ptr, load_strided, row_pieces, splat, vector_epilogue
from .window import _resolve_window, _valid_range, _window_attributes


class Conv(Op):
    """2-D (and 1-D) convolution, NCHW, with groups, dilation and padding.

    Lowered as a direct loop nest whose innermost loop runs along one output
    row with the weight held in a register: contiguous for stride 1, so LLVM
    vectorises it. Padding never becomes a branch in that loop: the valid
    range of output columns for each kernel column is computed here. A 1x1
    stride-1 convolution runs over the whole plane as one row (a GEMM).
    Bias and fused activations are applied to each finished row.
    """

    op_type = "Conv"

    def attributes(self, raw, constants, opset):
        attrs = _window_attributes(raw)
        attrs["group"] = int(raw.get("group", 1))
        return attrs

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise ShapeError(f"Conv takes X, W and an optional B, got {len(inputs)} inputs")
        x, w = inputs[0], inputs[1]
        if len(x) != len(w) or len(x) < 3:
            raise ShapeError(f"Conv input {x} and weight {w} ranks do not match")
        group = attrs["group"]
        if group < 1 or x[1] % group or w[0] % group or x[1] // group != w[1]:
            raise ShapeError(f"Conv with group={group}: input channels {x[1]} and weight {w} do not fit")
        kernel = attrs["kernel_shape"] or tuple(w[2:])
        if tuple(kernel) != tuple(w[2:]):
            raise ShapeError(f"kernel_shape {kernel} differs from the weight's {tuple(w[2:])}")
        if len(inputs) == 3 and tuple(inputs[2]) != (w[0],):
            raise ShapeError(f"Conv bias of shape {inputs[2]} should be ({w[0]},)")
        *_, out = _resolve_window(x, kernel, attrs, what="convolution")
        out = out[5 - len(x):]
        return [(x[0], w[0], *out)]

    def scratch_bytes(self, inputs, outputs, attrs):
        if attrs.get("padded_planes"):
            hq, wq = attrs["padded_planes"]
            return (2 if attrs.get("precision") == "fp16" else 4) * inputs[0].shape[1] * hq * wq
        if "packed_mr" not in attrs:
            return 0
        x, w = inputs[0].shape, attrs["weight_shape"]
        geometry = _resolve_window(x, tuple(w[2:]), attrs, what="convolution")
        if attrs.get("winograd"):
            return 4 * winograd.plan(geometry, x[1], w[0], attrs["winograd"]).scratch_floats
        if self._pointwise(geometry):
            # An fp16 tile's B: the input converted to halves once (_gemm_group).
            return 2 * x[1] // attrs["group"] * _prod(geometry[-1]) if _halves_b(attrs) else 0
        pixels = getattr(attrs.get("gemm_tile"), "pixels", 0)
        group = attrs["group"]
        direct = _direct_plan(geometry, x[1] // group, w[0] // group, attrs, any_grid=bool(pixels), groups=group)
        if direct is not None:
            return 4 * direct.scratch_floats
        return 4 * _prod(w[1:]) * _prod(geometry[-1])  # one group's im2col

    def parallel(self, attrs):
        return "packed_mr" in attrs or bool(attrs.get("depthwise"))

    @staticmethod
    def _pointwise(geometry) -> bool:
        _, kernel, strides, _, begin, end, _ = geometry
        return set(kernel + strides) == {1} and set(begin + end) == {0}

    def lower(self, k, inputs, outputs, attrs):
        if "packed_mr" in attrs:
            self._lower_gemm(k, inputs, outputs, attrs)
            return
        if attrs.get("depthwise"):
            geometry = _resolve_window(inputs[0].shape, tuple(inputs[1].shape[2:]), attrs, what="convolution")
            epilogue = vector_epilogue(k)
            half = attrs.get("precision") == "fp16"  # crosscompile.precision: then always padded_planes
            lanes = k.target.lanes * (2 if half else 1)
            with k.loop(inputs[0].shape[0]) as image:
                c_n = inputs[0].shape[1]
                volume_in, volume_out = _prod(geometry[0]), _prod(geometry[-1])
                x = k.builder.gep(k.inputs[0], [k.index((image, c_n * volume_in))])
                y = k.builder.gep(k.outputs[0], [k.index((image, c_n * volume_out))])
                bias = k.inputs[2] if len(inputs) == 3 else None
                if attrs.get("padded_planes"):
                    emit_depthwise_padded(k, lanes, c_n, geometry, attrs["padded_planes"], x, y, bias, epilogue,
                                          half, phases=attrs.get("padded_phases", False))
                    if inputs[0].shape[0] > 1:
                        # Before the next image's copy of a channel
                        # overwrites this one's, which another thread may
                        # still be reading.
                        k.barrier()
                else:
                    emit_depthwise(k, lanes, c_n, geometry, x, y, bias, epilogue)
            k.activated = epilogue or not k.epilogue
            return
        x, w = inputs[0].shape, inputs[1].shape
        (dz, h, wd), (kz, kh_n, kw_n), (sz, sh, sw), (ddz, dh, dw), (pz, ph, pw), _, (oz, oh_n, ow_n) = \
            _resolve_window(x, tuple(w[2:]), attrs, what="convolution")
        if (kz, kh_n, kw_n, sz, sh, sw, pz, ph, pw) == (1, 1, 1, 1, 1, 1, 0, 0, 0):
            # pointwise: the whole volume is one row
            dz, h, wd, oz, oh_n, ow_n = 1, 1, dz * h * wd, 1, 1, dz * h * wd
        n_n, c_n, m_n, group = x[0], x[1], w[0], attrs["group"]
        mg, cg = m_n // group, c_n // group
        # Output channels in blocks: each input value loaded feeds `block` rows.
        block = next(b for b in (4, 2, 1) if mg % b == 0)
        volume_in, volume_out, taps = dz * h * wd, oz * oh_n * ow_n, kz * kh_n * kw_n
        bld = k.builder
        X, W, Y = k.inputs[0], k.inputs[1], k.outputs[0]
        bias = k.inputs[2] if len(inputs) == 3 else None
        with k.loop(n_n) as n, k.loop(group) as g, k.loop(mg // block) as mb:
            oc = k.index((g, mg), (mb, block))
            starts = [k.load(bias, bld.add(oc, k.i64(b))) if bias is not None else k.f32(0.0)
                      for b in range(block)]
            with k.loop(oz) as od, k.loop(oh_n) as oh:
                row = k.index((n, m_n * volume_out), (oc, volume_out), (od, oh_n * ow_n), (oh, ow_n))
                rows = [bld.add(row, k.i64(b * volume_out)) for b in range(block)]
                with k.loop(ow_n) as ow:
                    for r, start in zip(rows, starts):
                        k.store(start, Y, bld.add(r, ow))
                with k.loop(cg) as c:
                    plane = k.index((n, c_n * volume_in), (g, cg * volume_in), (c, volume_in))
                    wbase = k.index((oc, cg * taps), (c, taps))
                    with k.loop(kz) as kd:
                        iz = k.index((od, sz), (kd, ddz), (-pz, 1))
                        with bld.if_then(k.in_range(iz, dz)), k.loop(kh_n) as kh:
                            ih = k.index((oh, sh), (kh, dh), (-ph, 1))
                            with bld.if_then(k.in_range(ih, h)):
                                line = k.index((plane, 1), (iz, h * wd), (ih, wd))
                                for kw in range(kw_n):
                                    offset = kw * dw - pw
                                    lo, hi = _valid_range(offset, sw, wd, ow_n)
                                    if lo >= hi:
                                        continue
                                    tap = k.index((wbase, 1), (kd, kh_n * kw_n), (kh, kw_n), (kw, 1))
                                    weights = [k.load(W, bld.add(tap, k.i64(b * cg * taps)))
                                               for b in range(block)]
                                    with k.loop(hi, start=lo) as ow:
                                        src = k.load(X, k.index((line, 1), (ow, sw), (offset, 1)))
                                        for r, weight in zip(rows, weights):
                                            o = bld.add(r, ow)
                                            k.store(bld.fadd(k.load(Y, o), bld.fmul(weight, src)), Y, o)
                if k.epilogue:
                    with k.loop(ow_n) as ow:
                        for r in rows:
                            o = bld.add(r, ow)
                            k.store(k.activate(k.load(Y, o)), Y, o)
        k.activated = True


    def _lower_gemm(self, k, inputs, outputs, attrs):
        """Convolution as C[M, N] = W[M, K] @ B[K, N] per image and group, with W
        packed at compile time (passes.pack_conv_weights) and B the input
        itself for a pointwise convolution, windows of a padded copy of it
        where _direct_plan allows (most 2-D convolutions), otherwise its
        im2col in scratch."""
        x, w = inputs[0].shape, attrs["weight_shape"]
        geometry = _resolve_window(x, tuple(w[2:]), attrs, what="convolution")
        tile = attrs["gemm_tile"]
        group = attrs["group"]
        m, kdim = w[0] // group, _prod(w[1:])
        cg = x[1] // group
        volume_in, n = _prod(geometry[0]), _prod(geometry[-1])
        residual_at = attrs.get("residual_at")
        has_bias = len(inputs) - (residual_at is not None) == 3
        if residual_at is not None:
            # The memory planner may give the output the residual's buffer.
            for arg in (k.inputs[-1], k.outputs[0]):
                arg.attributes.discard("noalias")
        epilogue = vector_epilogue(k)
        bld = k.builder
        a_group = -(-m // tile.mr) * tile.mr * kdim
        # The panel copies' zero fills and row copies would otherwise become
        # memset/memcpy calls, which 32-bit Android names __aeabi_memclr4
        # and __aeabi_memcpy4: symbols its loader does not promise. llvmlite
        # does not know this string attribute, hence the set's own add().
        set.add(k.function.attributes, '"no-builtins"')
        if attrs.get("winograd"):
            plan = winograd.plan(geometry, cg, m, attrs["winograd"])
            with k.loop(x[0]) as image:
                winograd.emit(k, tile, plan, k.index((image, x[1] * volume_in)), k.index((image, w[0] * n)),
                              k.inputs[1], k.inputs[2] if has_bias else None,
                              k.inputs[-1] if residual_at is not None else None, residual_at)
            k.activated = True
            return
        pointwise = self._pointwise(geometry)
        direct = None if pointwise else _direct_plan(geometry, cg, m, attrs, any_grid=bool(tile.pixels),
                                                     groups=group)
        if tile.pixels and not pointwise and direct is None:
            raise BuildError(f"Conv with input {x} and weight {w}: the transposed tile {tile.label} reads "
                             "1-D and 2-D windows in place only; schedule a tile of rows [mr, nv] for it")
        if direct is not None and not tile.pixels:
            # Every group at once: one copy of the input, then the groups'
            # GEMMs one after the other with no barrier between them.
            weights = k.typed(k.inputs[1], tile.dtype)
            with k.loop(x[0]) as image:
                _direct_conv(k, tile, direct, k.index((image, x[1] * volume_in)), weights, a_group,
                             k.inputs[2] if has_bias else None, epilogue, k.index((image, w[0] * n)))
            k.activated = epilogue or not k.epilogue
            return
        residual = k.inputs[-1] if residual_at is not None else None
        if tile.pixels and direct is not None:
            # Every group at once, as above, each group's pixels reading
            # windows of its own planes of the copy.
            taps, bases = i32_table(k, direct.offsets), i32_table(k, direct.pixel_bases)
            with k.loop(x[0]) as image:
                _copy_padded(k, direct, k.index((image, x[1] * volume_in)))
                with k.loop(group) as g:
                    source = bld.gep(k.scratch, [k.index((g, direct.group_floats))])
                    emit_channel_gemm(k, tile, m, kdim, n, bld.gep(k.typed(k.inputs[1], tile.dtype),
                                                                   [k.index((g, a_group))]),
                                      source, taps, bases, k.outputs[0], k.index((image, w[0] * n), (g, m * n)),
                                      bld.gep(k.inputs[2], [k.index((g, m))]) if has_bias else None,
                                      epilogue, residual, residual_at or 0)
                k.barrier()  # before the next image overwrites the copy
            k.activated = epilogue or not k.epilogue
            return
        if tile.pixels:
            taps = i32_table(k, tuple(c * volume_in for c in range(cg)))
            bases = i32_table(k, tuple(range(n)))
        with k.loop(x[0]) as image, k.loop(group) as g:
            x_base = k.index((image, x[1] * volume_in), (g, cg * volume_in))
            y_base = k.index((image, w[0] * n), (g, m * n))
            # Packed weights hold the tile's element type (halves for an fp16 tile).
            a_ptr = bld.gep(k.typed(k.inputs[1], tile.dtype), [k.index((g, a_group))])
            bias = bld.gep(k.inputs[2], [k.index((g, m))]) if has_bias else None
            if tile.pixels:  # pointwise: the input read in place
                emit_channel_gemm(k, tile, m, kdim, n, a_ptr, bld.gep(k.inputs[0], [x_base]), taps, bases,
                                  k.outputs[0], y_base, bias, epilogue, residual, residual_at or 0)
                k.barrier()
            else:
                self._gemm_group(k, tile, geometry, m, kdim, n, cg, pointwise, x_base, y_base,
                                 a_ptr, bias, epilogue, residual_at)
        k.activated = epilogue or not k.epilogue

    @staticmethod
    def _gemm_group(k, tile, geometry, m, kdim, n, cg, pointwise, x_base, y_base,
                    a_ptr, bias, epilogue, residual_at):
        """One image and group: B is the input itself (pointwise) or its im2col."""
        bld = k.builder
        pack = None
        b_half = pointwise and tile.precision == "fp16"
        if b_half:
            # The input converted to halves once, rather than as loaded by
            # every block of rows of the micro-kernel.
            half_b = k.typed(k.scratch, "float16")
            with k.share(cg) as (c_lo, c_hi), k.loop(c_hi, start=c_lo) as c, k.loop(n) as j:
                at = k.index((c, n), (j, 1))
                k.store(bld.fptrunc(k.load(k.inputs[0], bld.add(x_base, at)), HALF), half_b, at)
            k.barrier()  # every thread's GEMM reads all of it
            b_ptr, b_base = k.scratch, k.i64(0)
        elif pointwise:
            b_ptr, b_base = k.inputs[0], x_base
        elif splits_columns(tile, m, n):
            # Each thread fills the panels it multiplies, a chunk at a
            # time, just before using them: the chunk is still in L2
            # then, where a whole-image im2col would have gone out to
            # L3 or memory and back (7 MB for a 3x3 conv of 64 x 56 x 56).
            b_ptr, b_base = k.scratch, k.i64(0)

            def pack(p_lo, p_hi):
                ends = [bld.mul(p, k.i64(tile.nr)) for p in (p_lo, p_hi)]
                _im2col(k, tile, cg, geometry, x_base, (k.i64(0), k.i64(cg)),
                        (ends[0], k.smin(ends[1], k.i64(n))))
        else:
            with k.share(cg) as channels:
                _im2col(k, tile, cg, geometry, x_base, channels, (k.i64(0), k.i64(n)))
            k.barrier()  # every thread's GEMM reads all of im2col
            b_ptr, b_base = k.scratch, k.i64(0)
        emit_gemm(k, tile, m, kdim, n, a_ptr, b_ptr, b_base, n,
                  k.outputs[0], y_base, bias, epilogue,
                  k.inputs[-1] if residual_at is not None else None, residual_at or 0,
                  b_panels=not pointwise, pack=pack, b_half=b_half)
        if not pointwise or b_half:
            # Before the next image or group overwrites im2col (also the
            # packed chunks: the next image's chunks go to other threads).
            k.barrier()


def _halves_b(attrs) -> bool:
    """Whether a pointwise convolution's GEMM reads its input converted to
    halves in scratch: on an fp16 tile of rows."""
    tile = attrs.get("gemm_tile")
    return tile is not None and tile.precision == "fp16" and not tile.pixels and not attrs.get("winograd")


@dataclass(frozen=True)
class _DirectPlan:
    """Geometry of a convolution read in place (_direct_conv).

    The padded input is copied once into `planes` per channel, plane (rh,
    rw) holding the padded positions (y * sh + rh, x * sw + rw): for stride
    1 that is the padded image itself, for stride s its s x s phases. Then
    every tap (c, kh, kw) reads, for output (oh, ow), the element at
    offsets[tap] + oh * wq + ow of that buffer: B of the GEMM is a set of
    windows of one buffer, with columns on a virtual grid of width wq
    (the last wq - ow_n columns of each row are computed and dropped).
    """
    channels: int
    rows: int            # output channels (GEMM rows)
    planes: tuple        # (rh, rw) phases in buffer order, hq x wq each
    hq: int
    wq: int
    offsets: tuple       # per (c, kh, kw) tap, in the weights' K order
    n_virtual: int       # GEMM columns: (oh_n - 1) * wq + ow_n
    buffer_floats: int   # the copied input plus the tail the last windows read
    cbuf_at: int         # where the virtual-grid output starts in scratch
    scratch_floats: int
    geometry: tuple
    groups: int = 1      # groups copied one after the other, each `channels` deep

    @property
    def group_floats(self) -> int:
        """Where group g's planes start in the buffer: g times this."""
        return self.channels * len(self.planes) * self.hq * self.wq

    @property
    def pixel_bases(self) -> tuple:
        """Where each output pixel's windows start: oh * wq + ow."""
        (oh_n, ow_n) = self.geometry[-1][1:]
        return tuple(oh * self.wq + ow for oh in range(oh_n) for ow in range(ow_n))


GRID_COLUMNS_MULTIPLE = 4
# Output channels per group up to which a convolution reads windows of a
# padded copy whatever share of the grid's columns it drops (see
# _direct_plan). RegNetX-400MF's grouped 3x3 (16 channels per group) on
# 7 x 7 counted 2.34 instructions per multiply-add through im2col on an
# emulated Cortex-A72, against 0.4 at 14 x 14 through the padded copy.
IM2COL_MIN_ROWS = 64


def _direct_plan(geometry, channels: int, m: int, attrs, any_grid: bool = False,
                 groups: int = 1) -> "_DirectPlan | None":
    """How to run a 1-D/2-D convolution without im2col, or None where the
    im2col GEMM serves (3-D, a fused residual, grids much wider than the
    output, 1x1 kernels but for a strided one whose grid is its output:
    that copies just the pixels it reads). With any_grid (for
    emit_channel_gemm, which reads each output pixel's window itself and
    writes the output in place) only 3-D is refused. channels and m are
    one group's; with groups, the buffer holds that many groups' copies
    (and virtual-grid outputs) one after the other."""
    (dz, h, wd), (kz, kh_n, kw_n), (sz, sh, sw), (ddz, dh, dw), (pz, ph, pw), (ez, eh, ew), \
        (oz, oh_n, ow_n) = geometry
    if dz != 1 or kz != 1 or (attrs.get("residual_at") is not None and not any_grid):
        return None
    hp, wp = h + ph + eh, wd + pw + ew
    hq, wq = -(-hp // sh), -(-wp // sw)
    if sw == 1:
        # Rows share their padding columns: a window running off the right
        # end of a row reads the next row's left padding, zeros as well.
        wq = wd + max(pw, ew)
    rows = sorted({kh * dh % sh for kh in range(kh_n)})
    cols = sorted({kw * dw % sw for kw in range(kw_n)})
    planes = tuple((rh, rw) for rh in rows for rw in cols)
    plane = hq * wq
    offsets = tuple((c * len(planes) + planes.index((kh * dh % sh, kw * dw % sw))) * plane
                    + kh * dh // sh * wq + kw * dw // sw
                    for c in range(channels) for kh in range(kh_n) for kw in range(kw_n))
    # Whole vectors in the last panel: the extra columns are dropped like
    # the rest of the grid's.
    n_virtual = -(-((oh_n - 1) * wq + ow_n) // GRID_COLUMNS_MULTIPLE) * GRID_COLUMNS_MULTIPLE
    # The dropped columns cost FMAs: on a 7 x 7 output (56 for 49) they cost
    # more than the im2col copy saves; at 14 x 14 (wq 15) less. Not so with
    # few output channels (a grouped convolution's): each im2col value then
    # feeds only those few rows, and the copy costs more than the columns.
    if n_virtual > 1.1 * oh_n * ow_n and not any_grid and m > IM2COL_MIN_ROWS:
        return None
    if kh_n * kw_n == 1 and n_virtual != oh_n * ow_n and not any_grid:
        # A 1x1 kernel reads each input once: im2col copies no more than
        # this path, which then gains only where it writes C in place.
        return None
    group_floats = channels * len(planes) * plane
    buffer_floats = max(groups * group_floats, (groups - 1) * group_floats + max(offsets) + n_virtual)
    if buffer_floats >= 2 ** 31:
        return None
    cbuf_at = -(-buffer_floats // 16) * 16
    scratch = buffer_floats if any_grid else cbuf_at + groups * m * n_virtual
    return _DirectPlan(channels, m, planes, hq, wq, offsets, n_virtual, buffer_floats, cbuf_at,
                       scratch, geometry, groups)


def _direct_conv(k: Kernel, tile, plan: _DirectPlan, x_base, a_packed, a_group: int, bias, epilogue: bool,
                 y_base) -> None:
    """One image of a convolution as a GEMM per group whose B rows are
    windows of the (padded, phase-split) input: one copy of the input in
    place of im2col's kh * kw, then one copy of the output from the virtual
    grid. Threads split the copy's channels, each group's GEMM panels and
    the output's rows, with a barrier between the three: the groups'
    GEMMs follow one another with none between them, so a thread that
    finishes its share of one group goes on to the next (group g's packed
    weights start a_group values into a_packed, its bias g * rows in)."""
    _copy_padded(k, plan, x_base)
    bld, buf = k.builder, k.scratch
    oh_n, ow_n = plan.geometry[-1][1:]
    table = i32_table(k, plan.offsets)
    rows, kdim = plan.rows, len(plan.offsets)
    in_place = plan.n_virtual == oh_n * ow_n  # the grid is the output (e.g. a strided 1x1 convolution)
    cbuf = bld.gep(buf, [k.i64(plan.cbuf_at)])
    with k.loop(plan.groups) as g:
        a_ptr = bld.gep(a_packed, [k.index((g, a_group))])
        group_bias = bld.gep(bias, [k.index((g, rows))]) if bias is not None else None
        b_base = k.index((g, plan.group_floats))
        if in_place:
            emit_gemm(k, tile, rows, kdim, plan.n_virtual, a_ptr, buf, b_base, 0,
                      k.outputs[0], k.index((y_base, 1), (g, rows * oh_n * ow_n)), group_bias, epilogue,
                      b_offsets=table)
        else:
            emit_gemm(k, tile, rows, kdim, plan.n_virtual, a_ptr, buf, b_base, 0,
                      cbuf, k.index((g, rows * plan.n_virtual)), group_bias, epilogue, b_offsets=table)
    if in_place:
        k.barrier()  # before the next image overwrites the buffer
        return
    k.barrier()  # each thread copies out rows other threads computed
    with k.share(plan.groups * rows) as (r_lo, r_hi), k.loop(r_hi, start=r_lo) as r, k.loop(oh_n) as oh:
        src = k.index((r, plan.n_virtual), (oh, plan.wq))
        dst = k.index((y_base, 1), (r, oh_n * ow_n), (oh, ow_n))
        with k.loop(ow_n) as ow:
            k.store(k.load(cbuf, bld.add(src, ow)), k.outputs[0], bld.add(dst, ow))
    k.barrier()  # before the next image overwrites the buffers


def _copy_padded(k: Kernel, plan: _DirectPlan, x_base) -> None:
    """Copy one image and group (all plan.groups) of the input into scratch as the plan's
    padded (phase-split) planes, zero tail included; threads split the
    channels and meet at a barrier after."""
    bld, buf = k.builder, k.scratch
    plane = plan.hq * plan.wq
    n_planes = len(plan.planes)
    with k.share(plan.groups * plan.channels) as channels:
        if n_planes > UNROLLED_PLANES:
            _copy_phases(k, plan, x_base, channels)
        else:
            _copy_planes(k, plan, x_base, channels)
    base = plan.groups * plan.channels * n_planes * plane
    tail = plan.buffer_floats - base
    with k.share(-(-tail // ZERO_BLOCK)) as (lo, hi):
        end = k.smin(bld.mul(hi, k.i64(ZERO_BLOCK)), k.i64(tail))
        with k.loop(end, start=bld.mul(lo, k.i64(ZERO_BLOCK))) as i:
            k.store(k.f32(0.0), buf, bld.add(i, k.i64(base)))
    k.barrier()  # the GEMM's windows cross the channels other threads copied


# Floats of a buffer's zero tail that the threads take at a time.
ZERO_BLOCK = 1024
# Planes (stride phases) whose copy loops are written out one by one, each
# with its valid columns known at compile time: strides up to 2. A patch
# embedding's stride 8 has 64 phases, and O3 took minutes over the 134
# loops of one function that writing them out made; past this count one
# loop runs over the phases and tests each column.
UNROLLED_PLANES = 4


def _copy_planes(k: Kernel, plan: _DirectPlan, x_base, chans) -> None:
    """_copy_padded's copy of channels [chans), a loop nest per plane."""
    (_, h, wd), _, (_, sh, sw), _, (_, ph, pw), _, _ = plan.geometry
    bld, X = k.builder, k.inputs[0]
    buf = k.scratch
    plane = plan.hq * plan.wq
    n_planes = len(plan.planes)
    with k.loop(chans[1], start=chans[0]) as c:
        src_plane = k.index((x_base, 1), (c, h * wd))
        for index, (rh, rw) in enumerate(plan.planes):
            dst_plane = k.index((c, n_planes * plane), (index * plane, 1))
            lo, hi = _valid_range(rw - pw, sw, wd, plan.wq)
            with k.loop(plan.hq) as y:
                iy = k.index((y, sh), (rh - ph, 1))
                inside = k.in_range(iy, h)
                line = bld.select(inside, k.index((src_plane, 1), (iy, wd), (rw - pw, 1)), src_plane)
                dst = k.index((dst_plane, 1), (y, plan.wq))
                for first, last, copy in ((0, lo, False), (lo, hi, True), (max(lo, hi), plan.wq, False)):
                    if first >= last:
                        continue
                    with k.loop(last, start=first) as x:
                        if copy:
                            value = bld.select(inside, k.load(X, bld.select(inside, k.index((line, 1), (x, sw)),
                                                                               src_plane)), k.f32(0.0))
                        else:
                            value = k.f32(0.0)
                        k.store(value, buf, bld.add(dst, x))


def _copy_phases(k: Kernel, plan: _DirectPlan, x_base, chans) -> None:
    """_copy_padded's copy of channels [chans), one loop nest over all
    planes: each plane's phase comes from a table, each column is tested."""
    (_, h, wd), _, (_, sh, sw), _, (_, ph, pw), _, _ = plan.geometry
    bld, X = k.builder, k.inputs[0]
    plane = plan.hq * plan.wq
    phases = [i32_table(k, tuple(phase[axis] for phase in plan.planes)) for axis in (0, 1)]
    with k.loop(chans[1], start=chans[0]) as c, k.loop(len(plan.planes)) as p:
        src_plane = k.index((x_base, 1), (c, h * wd))
        rh, rw = (bld.sext(k.load(table, p), ir.IntType(64)) for table in phases)
        dst_plane = k.index((c, len(plan.planes) * plane), (p, plane))
        with k.loop(plan.hq) as y:
            iy = k.index((y, sh), (rh, 1), (-ph, 1))
            row_inside = k.in_range(iy, h)
            dst = k.index((dst_plane, 1), (y, plan.wq))
            with k.loop(plan.wq) as x:
                ix = k.index((x, sw), (rw, 1), (-pw, 1))
                inside = bld.and_(row_inside, k.in_range(ix, wd))
                src = bld.select(inside, k.index((src_plane, 1), (iy, wd), (ix, 1)), src_plane)
                k.store(bld.select(inside, k.load(X, src), k.f32(0.0)), k.scratch, bld.add(dst, x))


def _im2col(k: Kernel, tile, channels: int, geometry, x_base, chans, cols) -> None:
    """scratch[(c, kd, kh, kw), (od, oh, ow)] = the input value that tap
    meets at that output position, 0 in the padding, for input channels
    c in chans = (lo, hi) and output positions (flattened) in cols =
    (start, end), written in the GEMM's column-panel layout (gemm.panel_offset)."""
    (dz, h, wd), (kz, kh_n, kw_n), (sz, sh, sw), (ddz, dh, dw), (pz, ph, pw), _, (oz, oh_n, ow_n) = geometry
    n = oz * oh_n * ow_n
    kdim = channels * kz * kh_n * kw_n
    bld, X = k.builder, k.inputs[0]
    start, end = cols
    r_lo = divide(k, start, ow_n)
    r_hi = bld.add(divide(k, bld.sub(end, k.i64(1)), ow_n), k.i64(1))
    with k.loop(chans[1], start=chans[0]) as c, k.loop(kz) as kd, k.loop(kh_n) as kh:
        plane = k.index((x_base, 1), (c, dz * h * wd))
        for kw in range(kw_n):
            row = k.index((c, kz * kh_n * kw_n), (kd, kh_n * kw_n), (kh, kw_n), (kw, 1))
            offset = kw * dw - pw
            lo, hi = _valid_range(offset, sw, wd, ow_n)
            with k.loop(r_hi, start=r_lo) as r:  # output rows (od, oh) the columns cross
                od = divide(k, r, oh_n) if oz > 1 else k.i64(0)
                oh = bld.sub(r, bld.mul(od, k.i64(oh_n)))
                iz = k.index((od, sz), (kd, ddz), (-pz, 1))
                ih = k.index((oh, sh), (kh, dh), (-ph, 1))
                inside = bld.and_(k.in_range(iz, dz), k.in_range(ih, h))
                # Out-of-range rows read a valid row and select 0 instead, so
                # the copy loop has no branch and vectorises.
                line = bld.select(inside, k.index((plane, 1), (iz, h * wd), (ih, wd), (offset, 1)), plane)
                col0 = bld.mul(r, k.i64(ow_n))
                first = k.smax(bld.sub(start, col0), k.i64(0))
                last = k.smin(bld.sub(end, col0), k.i64(ow_n))

                def copy(ow, line=line, inside=inside):
                    src = bld.select(inside, k.index((line, 1), (ow, sw)), plane)
                    return bld.select(inside, k.load(X, src), k.f32(0.0))
                segments = []
                if lo > 0:
                    segments.append((first, k.smin(last, k.i64(lo)), None))
                if lo < hi:
                    segments.append((k.smax(first, k.i64(lo)), k.smin(last, k.i64(hi)), copy))
                if max(hi, lo) < ow_n:
                    segments.append((k.smax(first, k.i64(max(hi, lo))), last, None))
                for seg_first, seg_last, value in segments:
                    _panel_row(k, tile, kdim, n, row, col0, seg_first, seg_last, value)


def _panel_row(k: Kernel, tile, kdim: int, n: int, row, col0, first, last, value) -> None:
    """scratch[row, col0 + j] = value(j) (0 when value is None) for j in
    [first, last), in column-panel layout: one contiguous loop per panel
    the columns cross."""
    bld = k.builder
    start, end = bld.add(col0, first), bld.add(col0, last)
    p_lo = divide(k, start, tile.nr)
    p_hi = bld.add(divide(k, bld.sub(end, k.i64(1)), tile.nr), k.i64(1))
    with k.loop(p_hi, start=p_lo) as panel:
        base = panel_offset(k, tile, kdim, n, row, panel)
        panel_col = bld.mul(panel, k.i64(tile.nr))
        lo = k.smax(start, panel_col)
        hi = k.smin(end, bld.add(panel_col, k.i64(tile.nr)))
        with k.loop(hi, start=lo) as col:
            v = k.f32(0.0) if value is None else value(bld.sub(col, col0))
            k.store(v, k.scratch, bld.add(base, col))


def emit_depthwise(k: Kernel, lanes: int, channels: int, geometry, X: ir.Value, Y: ir.Value,
                   bias: "ir.Value | None", vector_epilogue: bool) -> None:
    """Depthwise 2-D convolution (one filter per channel), direct: per output
    row, a vector of output columns accumulates all kh x kw taps in a
    register from contiguous input loads (strides 1 and 2). Rows whose
    window crosses the top or bottom padding use zero weights for those
    taps; columns whose window crosses the left or right padding take a
    scalar path with bounds checks. Channels are split between threads.
    """
    (_, h, wd), (_, kh_n, kw_n), (_, sh, sw), (_, dh, dw), (_, ph, pw), _, (_, oh_n, ow_n) = geometry
    b = k.builder
    W = k.inputs[1]
    # Columns where every tap is inside the row: the vector path.
    lo = max(-(-(pw - kw * dw) // sw) if pw > kw * dw else 0 for kw in range(kw_n))
    hi = min((wd - 1 - kw * dw + pw) // sw + 1 for kw in range(kw_n))
    hi = max(lo, min(hi, ow_n))
    pieces, vec_end = row_pieces(lo, hi, lanes, sw)
    with k.share(channels) as (c_lo, c_hi), k.loop(c_hi, start=c_lo) as c:
        taps = [[k.load(W, k.index((c, kh_n * kw_n), (kh * kw_n + kw, 1))) for kw in range(kw_n)]
                for kh in range(kh_n)]
        start = k.load(bias, c) if bias is not None else k.f32(0.0)
        plane = k.index((c, h * wd))
        with k.loop(oh_n) as oh:
            rows = []
            for kh in range(kh_n):
                ih = k.index((oh, sh), (kh * dh - ph, 1))
                inside = k.in_range(ih, h)
                rows.append((inside, b.select(inside, k.index((plane, 1), (ih, wd)), plane)))
            out_row = k.index((c, oh_n * ow_n), (oh, ow_n))
            zero_taps = [[b.select(inside, w, k.f32(0.0)) for w in row_taps]
                         for (inside, _), row_taps in zip(rows, taps)]
            for first, width in pieces:
                acc = splat(k, start, width)
                for (inside, line), row_taps in zip(rows, zero_taps):
                    for kw, weight in enumerate(row_taps):
                        x = load_strided(k, X, b.add(line, k.i64(first * sw + kw * dw - pw)), width, sw)
                        acc = _fmuladd(k, x, splat(k, weight, width), acc)
                if vector_epilogue:
                    with k.vector_constants(width):
                        acc = k.activate(acc)
                b.store(acc, _vector_ptr(k, Y, b.add(out_row, k.i64(first)), width), align=4)
            for first, last in ((0, lo), (vec_end, ow_n)):
                if first >= last:
                    continue
                with k.loop(last, start=first) as ow:
                    acc = start
                    for (inside, line), row_taps in zip(rows, taps):
                        for kw, weight in enumerate(row_taps):
                            iw = k.index((ow, sw), (kw * dw - pw, 1))
                            ok = b.and_(inside, k.in_range(iw, wd))
                            value = k.load(X, b.select(ok, b.add(line, iw), line))
                            acc = b.fadd(acc, b.fmul(b.select(ok, value, k.f32(0.0)), weight))
                    if vector_epilogue:
                        acc = k.activate(acc)
                    k.store(acc, Y, b.add(out_row, ow))


def depthwise_pieces(count: int, lanes: int) -> list:
    """(first, width, stored) vectors covering output columns [0, count):
    whole vectors of `lanes`; then, for more than half a vector left, one
    more whole vector, else halves down to 4 and one vector of 4 (or
    `lanes` if fewer); of the last only the first `stored` lanes are kept.
    Each vector costs one FMA per tap whatever its width.

    >>> depthwise_pieces(14, 8)
    [(0, 8, 8), (8, 8, 6)]
    >>> depthwise_pieces(14, 4)
    [(0, 4, 4), (4, 4, 4), (8, 4, 4), (12, 4, 2)]
    """
    full = count // lanes
    pieces = [(v * lanes, lanes, lanes) for v in range(full)]
    if 2 * (count - full * lanes) > lanes:
        return pieces + [(full * lanes, lanes, count - full * lanes)]
    at, width = full * lanes, lanes // 2
    while width >= min(4, lanes):
        while count - at >= width:
            pieces.append((at, width, width))
            at += width
        width //= 2
    if at < count:
        pieces.append((at, min(4, lanes), count - at))
    return pieces


def depthwise_planes(geometry, lanes: int, half: bool = False) -> "tuple | None":
    """(rows, columns) of the zero-padded copy of one channel a depthwise
    convolution reads with emit_depthwise_padded (`lanes` float32 lanes a
    vector; with `half`, a copy in halves, always made: it converts each
    input value once rather than once per tap), or None where
    emit_depthwise reads the input in place at no more cost: there every
    column whose window crosses the left or right padding takes a scalar
    path testing each tap, which for a 7x7 kernel on 14 columns is 6 of
    them, for a 3x3 kernel on 7 columns 3. The copy (a plane's worth of
    loads and stores) pays once more than one column in 16 is such.

    >>> from crosscompile.window import _resolve_window, _window_attributes
    >>> attrs = _window_attributes({"pads": (3, 3, 3, 3)})
    >>> depthwise_planes(_resolve_window((1, 32, 14, 14), (7, 7), attrs), 8)
    (20, 22)
    """
    (_, h, wd), (_, kh_n, kw_n), (_, sh, sw), (_, dh, dw), (_, ph, pw), _, (_, oh_n, ow_n) = geometry
    if sw > 2 or kw_n * kh_n == 1:
        return None
    if half:
        lanes *= 2
    lo = max(-(-(pw - kw * dw) // sw) if pw > kw * dw else 0 for kw in range(kw_n))
    hi = max(lo, min(min((wd - 1 - kw * dw + pw) // sw + 1 for kw in range(kw_n)), ow_n))
    _, vec_end = row_pieces(lo, hi, lanes, sw)
    if 16 * (lo + ow_n - vec_end) <= ow_n and not half:
        return None
    first, width, _ = depthwise_pieces(ow_n, lanes)[-1]
    return (oh_n - 1) * sh + (kh_n - 1) * dh + 1, (first + width) * sw + (kw_n - 1) * dw


def split_phases(target, attrs: dict, half: bool) -> bool:
    """Whether a depthwise convolution's zero-padded copy holds each row's
    even columns, then its odd ones, so that its stride-2 taps load whole
    vectors from one phase: float32 on x86, where a strided load is two
    loads and two shuffles per tap (AArch64 gets both phases from one ld2,
    and an fp16 copy always keeps its columns in order)."""
    strides = attrs.get("strides") or (1,)
    return not half and target.arch in ("x86_64", "i386") and tuple(strides)[-1] == 2


def emit_depthwise_padded(k: Kernel, lanes: int, channels: int, geometry, planes: tuple, X: ir.Value,
                          Y: ir.Value, bias: "ir.Value | None", vector_epilogue: bool,
                          half: bool = False, phases: bool = False) -> None:
    """Depthwise convolution over a zero-padded copy of each channel (in
    scratch, planes = (rows, columns) of it, see depthwise_planes): every
    output row is whole vectors of columns accumulating all kh x kw taps
    (depthwise_pieces; the last vector's extra lanes are not stored), with
    no padding tests left. Channels are split between threads, each
    copying the channels it computes. With `half` the copy, weights, bias
    and accumulators are halves (`lanes` of them a vector), widened to
    float32 for the epilogue and the store. With `phases` (stride 2, an
    even number of columns) each row of the copy holds the even columns
    of the padded row, then the odd ones (split_phases)."""
    (_, h, wd), (_, kh_n, kw_n), (_, sh, sw), (_, dh, dw), (_, ph, pw), _, (_, oh_n, ow_n) = geometry
    hq, wq = planes
    b = k.builder
    W = k.inputs[1]
    narrow = (lambda v: b.fptrunc(v, HALF)) if half else (lambda v: v)
    scratch = k.typed(k.scratch, "float16" if half else "float32")
    with k.share(channels) as (c_lo, c_hi), k.loop(c_hi, start=c_lo) as c:
        buf = k.index((c, hq * wq))
        src_plane = k.index((c, h * wd))
        lo, hi = pw, min(pw + wd, wq)
        with k.loop(hq) as y:
            iy = b.sub(y, k.i64(ph))
            inside = k.in_range(iy, h)
            line = b.select(inside, k.index((src_plane, 1), (iy, wd), (-pw, 1)), src_plane)
            dst = k.index((buf, 1), (y, wq))
            if phases:
                _copy_row_phases(k, X, scratch, line, src_plane, inside, dst, lo, hi, wq, lanes)
            for first, last, copy in () if phases else ((0, lo, False), (lo, hi, True), (hi, wq, False)):
                if first >= last:
                    continue
                with k.loop(last, start=first) as x:
                    if copy:
                        value = b.select(inside, k.load(X, b.select(inside, b.add(line, x), src_plane)), k.f32(0.0))
                    else:
                        value = k.f32(0.0)
                    k.store(narrow(value), scratch, b.add(dst, x))
        taps = [[narrow(k.load(W, k.index((c, kh_n * kw_n), (kh * kw_n + kw, 1)))) for kw in range(kw_n)]
                for kh in range(kh_n)]
        start = narrow(k.load(bias, c) if bias is not None else k.f32(0.0))
        pieces = depthwise_pieces(ow_n, lanes)
        # Several output rows at once when a row has few vectors: more
        # independent chains of FMAs (one vector's 49 taps of a 7x7 kernel
        # would each wait for the one before), and a row of input loaded
        # once for every output row of the group that reads it.
        rows_per = max(1, min(oh_n, DEPTHWISE_CHAINS // len(pieces)))
        groups = [pieces[at:at + DEPTHWISE_CHAINS] for at in range(0, len(pieces), DEPTHWISE_CHAINS)]
        full, tail = divmod(oh_n, rows_per)
        for count, first_row, height in ((full, 0, rows_per), (tail, full * rows_per, 1)):
            if not count:
                continue
            with k.loop(count) as q:
                oh = k.index((q, height), (first_row, 1))
                top = k.index((buf, 1), (oh, sh * wq))
                for group in groups:
                    _depthwise_rows(k, Y, scratch, k.index((c, oh_n * ow_n), (oh, ow_n)), top, group, height,
                                    taps, start, geometry, wq, vector_epilogue, phases)


def _depthwise_rows(k: Kernel, Y, plane, out_row, top, group, height: int, taps, start, geometry, wq: int,
                    vector_epilogue: bool, phases: bool = False) -> None:
    """`height` output rows from out_row on, the vectors of `group` of
    each (see emit_depthwise_padded), their windows starting at row `top`
    of the padded plane (float32 or halves; with `phases` its rows split
    into even and odd columns): tap by tap, every accumulator at once,
    widened to float32 before the epilogue."""
    (_, _, _), (_, kh_n, kw_n), (_, sh, sw), (_, dh, dw), _, _, (_, _, ow_n) = geometry
    b = k.builder
    i32 = ir.IntType(32)
    accs = [[splat(k, start, width) for _, width, _ in group] for _ in range(height)]
    loaded = {}
    for kh, row_taps in enumerate(taps):
        for kw, weight in enumerate(row_taps):
            weights = {}
            for r in range(height):
                line = (r * sh + kh * dh) * wq  # rows of the group share the input rows they read
                for i, (first, width, _) in enumerate(group):
                    key = (line, first * sw + kw * dw, width)
                    if key not in loaded and sw == 2 and plane.type.pointee == HALF and k.target.arch == "aarch64":
                        # Both phases of one load (ld2): a generic wide load
                        # and shuffle, overlapping the next tap's, gets
                        # rebuilt a lane at a time.
                        both = _deinterleaved(k, plane, b.add(top, k.i64(key[0] + key[1])), width)
                        loaded[key], loaded[key[0], key[1] + 1, width] = both
                    if key not in loaded and phases:
                        column = key[1] % 2 * (wq // 2) + key[1] // 2
                        loaded[key] = load_strided(k, plane, b.add(top, k.i64(key[0] + column)), width, 1)
                    if key not in loaded:
                        loaded[key] = load_strided(k, plane, b.add(top, k.i64(key[0] + key[1])), width, sw,
                                                   spare=sw - 1)
                    if width not in weights:
                        weights[width] = splat(k, weight, width)
                    accs[r][i] = _fmuladd(k, loaded[key], weights[width], accs[r][i])
    for r in range(height):
        for acc, (first, width, stored) in zip(accs[r], group):
            if acc.type.element != F32:
                acc = b.fpext(acc, ir.VectorType(F32, width))
            if vector_epilogue:
                with k.vector_constants(width):
                    acc = k.activate(acc)
            if stored < width:
                acc = b.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(i32, stored), list(range(stored))))
            b.store(acc, _vector_ptr(k, Y, b.add(out_row, k.i64(r * ow_n + first)), stored), align=4)


def _copy_row_phases(k: Kernel, X, scratch, line, src_plane, inside, dst, lo: int, hi: int, wq: int,
                 lanes: int) -> None:
    """One row of a depthwise convolution's padded copy split by column
    parity: padded column x (input column x - lo, zero outside [lo, hi) or
    when the row is not `inside`) goes to dst + (x % 2) * wq / 2 + x // 2.
    Within [lo, hi) whole vectors of one phase are strided loads."""
    b = k.builder
    half = wq // 2
    for phase in (0, 1):
        # Columns 2j + phase inside [lo, hi): j in [j_lo, j_hi).
        j_lo, j_hi = -(-(lo - phase) // 2), -(-(hi - phase) // 2)
        vectors = (j_hi - j_lo) // lanes
        out = b.add(dst, k.i64(phase * half))
        zero = k.f32(0.0)
        for first, last in ((0, j_lo), (j_lo + vectors * lanes, j_hi), (j_hi, half)):
            if first >= last:
                continue
            copy = first >= j_lo and last <= j_hi
            with k.loop(last, start=first) as j:
                value = zero
                if copy:
                    at = b.select(inside, k.index((line, 1), (j, 2), (phase, 1)), src_plane)
                    value = b.select(inside, k.load(X, at), zero)
                k.store(value, scratch, b.add(out, j))
        if vectors:
            with k.loop(vectors) as v:
                j = k.index((v, lanes), (j_lo, 1))
                at = b.select(inside, k.index((line, 1), (j, 2), (phase, 1)), src_plane)
                vector = load_strided(k, X, at, lanes, 2)
                vector = b.select(inside, vector, ir.Constant(vector.type, [0.0] * lanes))
                b.store(vector, _vector_ptr(k, scratch, b.add(out, j), lanes), align=4)


def _deinterleaved(k: Kernel, ptr: ir.Value, offset: ir.Value, width: int) -> list:
    """[ptr[offset + 2i], ptr[offset + 2i + 1]] for i < width: two vectors
    from one AArch64 ld2."""
    b = k.builder
    vector = ir.VectorType(ptr.type.pointee, width)
    element = "f16" if ptr.type.pointee == HALF else str(ptr.type.pointee)
    name = f"llvm.aarch64.neon.ld2.v{width}{element}.p0v{width}{element}"
    fn = k.module.globals.get(name)
    if fn is None:
        fn = ir.Function(k.module, ir.FunctionType(ir.LiteralStructType([vector, vector]), [vector.as_pointer()]),
                         name=name)
    pair = b.call(fn, [_vector_ptr(k, ptr, offset, width)])
    return [b.extract_value(pair, 0), b.extract_value(pair, 1)]


# Vectors a depthwise convolution accumulates at once (of one output row,
# or of several rows when a row has fewer): half of x86's 16 vector registers.
DEPTHWISE_CHAINS = 8
