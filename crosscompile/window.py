"""Sliding-window geometry shared by Conv and the pools: their window
attributes, output sizes and padding, and the output positions whose
window stays inside the input."""
from __future__ import annotations

from .errors import BuildError, ShapeError
from .op_base import _check_choice, _ints


def _window(in_dims, kernel, strides, dilations, pads, auto_pad, ceil_mode=False):
    """Output sizes and (begin, end) pads of a sliding window over in_dims."""
    n = len(in_dims)
    out, begin, end = [], [], []
    for i in range(n):
        size, k, s, d = in_dims[i], kernel[i], strides[i], dilations[i]
        extent = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-size // s)
            total = max(0, (o - 1) * s + extent - size)
            small = total // 2
            pb, pe = (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)
        else:
            pb, pe = (0, 0) if auto_pad == "VALID" else (pads[i], pads[i + n])
            span = size + pb + pe - extent
            if span < 0:
                raise ShapeError(f"window of extent {extent} (kernel {k}, dilation {d}) is larger "
                                 f"than the padded input ({size} + {pb} + {pe})")
            o = (-(-span // s) if ceil_mode else span // s) + 1
            # ceil_mode: a window must start inside the input or the begin padding.
            if ceil_mode and (o - 1) * s >= size + pb:
                o -= 1
        out.append(o)
        begin.append(pb)
        end.append(pe)
    return tuple(out), tuple(begin), tuple(end)


def _window_attributes(raw) -> dict:
    auto_pad = raw.get("auto_pad", "NOTSET")
    _check_choice("auto_pad", auto_pad, ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"))
    return {"kernel_shape": _ints(raw, "kernel_shape"), "strides": _ints(raw, "strides"),
            "pads": _ints(raw, "pads"), "auto_pad": auto_pad, "dilations": _ints(raw, "dilations")}


def _resolve_window(x_shape, kernel, attrs, ceil_mode=False, what="window"):
    """Spatial geometry as 3-D (depth, height, width); 1-D and 2-D inputs get
    unit leading dimensions, so one lowering serves all three ranks."""
    spatial = tuple(x_shape[2:])
    n = len(spatial)
    if n not in (1, 2, 3):
        raise ShapeError(f"only 1-D, 2-D and 3-D {what}s are supported, input has shape {tuple(x_shape)}")
    if len(kernel) != n:
        raise ShapeError(f"kernel_shape {kernel} does not fit input {tuple(x_shape)}")
    strides = attrs["strides"] or (1,) * n
    dilations = attrs.get("dilations") or (1,) * n
    pads = attrs["pads"] or (0,) * (2 * n)
    if len(strides) != n or len(dilations) != n or len(pads) != 2 * n:
        raise ShapeError(f"strides {strides}, dilations {dilations} or pads {pads} do not fit "
                         f"a {n}-D {what}")
    if min(strides) < 1 or min(dilations) < 1 or min(kernel) < 1:
        raise BuildError(f"strides {strides}, dilations {dilations} and kernel {kernel} must be >= 1")
    out, begin, end = _window(spatial, kernel, strides, dilations, pads, attrs["auto_pad"], ceil_mode)
    ones, zeros = (1,) * (3 - n), (0,) * (3 - n)
    return (ones + spatial, ones + tuple(kernel), ones + tuple(strides), ones + tuple(dilations),
            zeros + tuple(begin), zeros + tuple(end), ones + tuple(out))


def _valid_range(offset: int, stride: int, size: int, count: int) -> tuple[int, int]:
    """Output positions o in [0, count) with 0 <= o * stride + offset < size."""
    lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
    last = size - 1 - offset
    hi = 0 if last < 0 else min(count, last // stride + 1)
    return lo, max(lo, hi)
