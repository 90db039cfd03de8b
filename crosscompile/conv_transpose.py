"""ConvTranspose: the gradient of a convolution with respect to its input,
which decoders (U-Net, FCN heads, audio upsamplers) use to upsample.

Each input value is scattered into the output: output position
o = i * stride + k * dilation - pad_begin along every spatial axis. Per
image and group, a run of input rows is first multiplied by the weights,
columns[(output channel, tap), pixel] = W^T . X, a matrix product whose
innermost loop runs along the pixels; then every column row is added into
the output along input rows (col2im). The output columns an input row
reaches for each kernel column are known at compile time, so padding and
the output's edges never become a branch in the innermost loop. The runs
of rows are as long as keeps the columns within SCRATCH_FLOATS.
"""
from __future__ import annotations

from .errors import BuildError, ShapeError
from .gemm import divide
from .matmul import strided_matmul
from .op_base import Op, _ints
from .window import _valid_range, _window_attributes

# Floats of the columns of one run of input rows (256 KiB: an L2 share).
SCRATCH_FLOATS = 64 * 1024


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

    def _plan(self, inputs, attrs):
        """(geometry, group, input channels and output channels per group,
        taps, input rows per run) of a lowering."""
        x, w = inputs[0].shape, inputs[1].shape
        geometry = transpose_geometry(x, w, attrs)
        (dz, h, wd), kernel = geometry[0], geometry[1]
        group = attrs["group"]
        taps = kernel[0] * kernel[1] * kernel[2]
        rows = max(1, min(dz * h, SCRATCH_FLOATS // (w[1] * taps * wd)))
        return geometry, group, x[1] // group, w[1], taps, rows

    def scratch_bytes(self, inputs, outputs, attrs):
        geometry, _, _, mg, taps, rows = self._plan(inputs, attrs)
        return 4 * mg * taps * rows * geometry[0][2]

    def lower(self, k, inputs, outputs, attrs):
        geometry, group, cg, mg, taps, rows = self._plan(inputs, attrs)
        (dz, h, wd), (kz, kh_n, kw_n), (sz, sh, sw), (ddz, dh, dw), (pz, ph, pw), (oz, oh_n, ow_n) = geometry
        n_n, c_n, m_n = inputs[0].shape[0], inputs[0].shape[1], mg * group
        volume_in, volume_out = dz * h * wd, oz * oh_n * ow_n
        lines = dz * h  # input rows of one plane, depth and height together
        bld = k.builder
        X, W, Y, cols = k.inputs[0], k.inputs[1], k.outputs[0], k.scratch
        bias = k.inputs[2] if len(inputs) == 3 else None
        with k.loop(n_n) as n, k.loop(group) as g:
            out_base = k.index((n, m_n * volume_out), (g, mg * volume_out))
            with k.loop(mg) as m:
                start = k.load(bias, k.index((g, mg), (m, 1))) if bias is not None else k.f32(0.0)
                with k.loop(volume_out) as o:
                    k.store(start, Y, k.index((out_base, 1), (m, volume_out), (o, 1)))
            with k.loop(-(-lines // rows)) as run:
                first = bld.mul(run, k.i64(rows))
                count = k.smin(k.i64(rows), bld.sub(k.i64(lines), first))
                pixels = rows * wd
                # columns[m * taps + tap, p] = sum_c W[g * cg + c, m, tap] * X[n, g * cg + c, first row + p]
                x_base = k.index((n, c_n * volume_in), (g, cg * volume_in), (first, wd))
                strided_matmul(k, mg * taps, cg, pixels, (1, mg * taps), (volume_in, 1),
                               (k.index((g, cg * mg * taps)), x_base, 0), operands=(W, X, cols))
                with k.loop(count) as r:
                    line = bld.add(first, r)
                    iz = line if h == 1 else divide(k, line, h)
                    iy = bld.sub(line, bld.mul(iz, k.i64(h)))
                    self._add_columns(k, cols, Y, out_base, k.index((r, wd)), iz, iy, geometry, mg, pixels)
            if k.epilogue:
                with k.loop(mg * volume_out) as o:
                    at = k.index((out_base, 1), (o, 1))
                    k.store(k.activate(k.load(Y, at)), Y, at)
        k.activated = True

    @staticmethod
    def _add_columns(k, cols, Y, out_base, pixel0, iz, iy, geometry, mg, pixels):
        """Add the columns of one input row (pixels from pixel0 of each
        column row) into the output positions it reaches."""
        bld = k.builder
        (_, _, wd), (kz, kh_n, kw_n), (sz, sh, sw), (ddz, dh, dw), (pz, ph, pw), (oz, oh_n, ow_n) = geometry
        taps = kz * kh_n * kw_n
        with k.loop(kz) as kd:
            z = k.index((iz, sz), (kd, ddz), (-pz, 1))
            with bld.if_then(k.in_range(z, oz)), k.loop(kh_n) as ky:
                y = k.index((iy, sh), (ky, dh), (-ph, 1))
                with bld.if_then(k.in_range(y, oh_n)), k.loop(mg) as m:
                    out_line = k.index((out_base, 1), (m, oz * oh_n * ow_n), (z, oh_n * ow_n), (y, ow_n))
                    row = k.index((m, taps), (kd, kh_n * kw_n), (ky, kw_n))
                    for kx in range(kw_n):
                        offset = kx * dw - pw
                        lo, hi = _valid_range(offset, sw, ow_n, wd)
                        if lo >= hi:
                            continue
                        src = k.index((row, pixels), (kx, pixels), (pixel0, 1))
                        with k.loop(hi, start=lo) as ix:
                            at = k.index((out_line, 1), (ix, sw), (offset, 1))
                            value = k.load(cols, bld.add(src, ix))
                            k.store(bld.fadd(k.load(Y, at), value), Y, at)

