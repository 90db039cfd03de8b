"""Resize (opsets 10 to 19) and Upsample: nearest, n-linear and n-cubic
interpolation with constant scales or sizes.

The geometry is known at compile time, so for each resized axis the
source positions of every output position (and, for linear and cubic, the
two or four neighbours and their weights) are computed here and written
into the module as small constant tables; the kernel walks the
output and reads them. Axes that keep their size read straight through.

GridSample samples at points read at run time: each point's neighbours
and weights along every axis are computed in the kernel, then summed over
the channels.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir

from .emit import F32, I64, Kernel
from .errors import BuildError, ShapeError
from .op_base import Op, _axis, _c_strides, _check_choice, _const_ints

COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "tf_crop_and_resize")
ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def source_coordinates(out_size: int, in_size: int, scale: float, mode: str, roi=(0.0, 1.0)) -> np.ndarray:
    """Where each output position samples the input along one axis
    (ONNX Resize's coordinate_transformation_mode; roi is the axis's
    (start, end) for tf_crop_and_resize). Computed in float32, as
    onnxruntime does: a sample that lands on a tie there (4.5) must round
    the same way here, where float64 would see 4.49999986."""
    f = np.float32
    x, scale, half = np.arange(out_size, dtype=f), f(scale), f(0.5)
    if mode == "tf_crop_and_resize":
        start, end = (float(v) for v in roi)
        if out_size == 1:
            return np.full(1, (end - start) * (in_size - 1) / 2 + start * (in_size - 1))
        return np.arange(out_size) * (end - start) * (in_size - 1) / (out_size - 1) + start * (in_size - 1)
    if mode in ("half_pixel", "pytorch_half_pixel"):
        if mode == "pytorch_half_pixel" and out_size == 1:
            return np.zeros(1, f)
        return (x + half) / scale - half
    if mode == "half_pixel_symmetric":
        offset = f(in_size) / f(2) * (f(1) - f(out_size) / (scale * f(in_size)))
        return offset + (x + half) / scale - half
    if mode == "align_corners":
        # The whole output length, as onnxruntime and torch take it (the ONNX
        # reference takes in_size * scale unrounded: 2.4 for 4 by 0.6).
        return x * f(in_size - 1) / f(out_size - 1) if out_size > 1 else np.zeros(out_size, f)
    return x / scale  # asymmetric


def nearest_indices(coords: np.ndarray, in_size: int, mode: str) -> np.ndarray:
    """The input position nearest to each coordinate under nearest_mode."""
    floor = np.floor(coords)
    frac = coords - floor
    if mode == "floor":
        index = floor
    elif mode == "ceil":
        index = np.ceil(coords)
    elif mode == "round_prefer_floor":
        index = np.where(frac <= 0.5, floor, floor + 1)
    else:
        index = np.where(frac < 0.5, floor, floor + 1)
    return np.clip(index, 0, in_size - 1).astype(np.int64)


def linear_neighbours(coords: np.ndarray, in_size: int):
    """(lower index, upper index, weight of the upper) for each coordinate,
    clamped to the input as the edge-padded interpolation of ONNX gives."""
    coords = np.clip(coords, 0, in_size - 1)
    lower = np.floor(coords).astype(np.int64)
    upper = np.minimum(lower + 1, in_size - 1)
    return lower, upper, (coords - lower).astype(np.float32)


def cubic_neighbours(coords: np.ndarray, in_size: int, a: float, exclude_outside: bool):
    """The four neighbours floor(x) - 1 .. floor(x) + 2 of each coordinate
    x and their weights, from Keys' cubic kernel with coefficient a (ONNX's
    cubic_coeff_a): neighbours outside the input take the edge's value,
    or with exclude_outside weigh nothing, the others' weights scaled to
    sum to 1. Returns ([index arrays], [weight arrays])."""
    x = coords.astype(np.float64)
    base = np.floor(x)
    ratio = x - base
    taps = [base + offset for offset in (-1, 0, 1, 2)]
    weights = [keys_weight(ratio - offset, a) for offset in (-1, 0, 1, 2)]
    if exclude_outside:
        weights = [np.where((t >= 0) & (t < in_size), w, 0.0) for t, w in zip(taps, weights)]
        total = sum(weights)
        weights = [w / total for w in weights]
    indices = [np.clip(t, 0, in_size - 1).astype(np.int64) for t in taps]
    return indices, [w.astype(np.float32) for w in weights]


def keys_weight(t: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with coefficient a at distances t."""
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def antialias_taps(coords: np.ndarray, in_size: int, scale: float, mode: str, a: float, exclude_outside: bool):
    """The taps of an antialiased (linear or cubic) downsampling along one
    axis: the kernel is widened by 1 / scale, so each output position
    averages over the input it covers, with weights scaled to sum to 1.
    Returns ([index arrays], [weight arrays]) as cubic_neighbours does."""
    scale = min(scale, 1.0)
    x = np.asarray(coords, np.float64)
    base = np.floor(x)
    ratio = np.where(x == base, 1.0, x - base)  # ONNX prefers the point left of an exact integer
    reach = 1 if mode == "linear" else 2  # the kernel's support, in input points
    first = int(np.floor(-reach / scale) + 1)
    offsets = np.arange(first, 2 - first)
    n = len(offsets)
    t = np.abs((offsets[None, :] - ratio[:, None]) * scale)
    weights = np.clip(1 - t, 0, 1) if mode == "linear" else keys_weight(t, a)
    weights = weights / weights.sum(axis=1, keepdims=True)
    # The n points nearest x, ties to the smaller: as onnx's reference
    # places its window in the edge-padded input.
    pad = int(np.ceil(n / 2))
    padded = x + pad
    p = np.floor(padded).astype(np.int64)
    frac = padded - p
    if n % 2 == 0:
        start = p + np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        start = p + np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    taps = start[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        weights = np.where((taps < 0) | (taps >= in_size), 0.0, weights)
        weights = weights / np.where(weights.sum(axis=1, keepdims=True) == 0, 1.0, weights.sum(axis=1, keepdims=True))
    indices = np.clip(taps, 0, in_size - 1)
    return [indices[:, i] for i in range(n)], [weights[:, i].astype(np.float32) for i in range(n)]


def _table(k: Kernel, tag: str, values: np.ndarray, element) -> ir.Value:
    """A constant array of the kernel's module, as a pointer to its first element."""
    ty = ir.ArrayType(element, len(values))
    gv = ir.GlobalVariable(k.module, ty, name=f"{k.function.name}.{tag}")
    gv.global_constant = True
    gv.linkage = "internal"
    cast = float if element is F32 else int
    gv.initializer = ir.Constant(ty, [cast(v) for v in values])
    return k.builder.gep(gv, [ir.Constant(I64, 0), ir.Constant(I64, 0)])


class Resize(Op):
    """Resize by constant scales or sizes (optionally over `axes`, opset 18).
    Modes nearest, linear and cubic (cubic_coeff_a, exclude_outside,
    antialias), every coordinate_transformation_mode (tf_crop_and_resize
    with a constant roi and its extrapolation_value) and every
    keep_aspect_ratio_policy."""

    op_type = "Resize"
    compile_time_inputs = (1, 2, 3)

    def attributes(self, raw, constants, opset):
        mode = raw.get("mode", "nearest")
        _check_choice("mode", mode, ("nearest", "linear") + (("cubic",) if opset >= 11 else ()))
        if opset < 11:
            scales = constants.get(1)
            attrs = {"mode": mode, "coordinates": "asymmetric", "nearest": "floor", "legacy": True,
                     "scales": None if scales is None else tuple(float(s) for s in np.asarray(scales).reshape(-1)),
                     "sizes": None, "axes": None}
        else:
            coordinates = raw.get("coordinate_transformation_mode", "half_pixel")
            _check_choice("coordinate_transformation_mode", coordinates, COORDINATE_MODES)
            nearest = raw.get("nearest_mode", "round_prefer_floor")
            _check_choice("nearest_mode", nearest, NEAREST_MODES)
            antialias = bool(int(raw.get("antialias", 0)))
            if antialias and mode == "nearest":
                raise BuildError("Resize with antialias=1 takes mode 'linear' or 'cubic', not 'nearest'")
            policy = raw.get("keep_aspect_ratio_policy", "stretch")
            _check_choice("keep_aspect_ratio_policy", policy, ASPECT_POLICIES)
            roi = constants.get(1)
            if coordinates == "tf_crop_and_resize" and (roi is None or np.asarray(roi).size == 0):
                raise BuildError("Resize with coordinate_transformation_mode='tf_crop_and_resize' needs a constant roi")
            scales = constants.get(2)
            attrs = {"mode": mode, "coordinates": coordinates, "nearest": nearest, "legacy": False,
                     "scales": (None if scales is None or np.asarray(scales).size == 0
                                else tuple(float(s) for s in np.asarray(scales).reshape(-1))),
                     "sizes": _const_ints(constants, 3), "axes": _ints_or_none(raw.get("axes")),
                     "cubic_coeff_a": float(raw.get("cubic_coeff_a", -0.75)),
                     "exclude_outside": bool(int(raw.get("exclude_outside", 0))), "antialias": antialias,
                     "policy": policy, "extrapolation_value": float(raw.get("extrapolation_value", 0.0)),
                     "roi": (None if coordinates != "tf_crop_and_resize"
                             else tuple(float(v) for v in np.asarray(roi).reshape(-1)))}
        if attrs["scales"] is None and attrs["sizes"] is None:
            raise BuildError("Resize needs constant scales or sizes")
        return attrs

    @staticmethod
    def _geometry(x, attrs):
        """(output shape, per-axis scale) of the resize of a tensor of shape x."""
        rank = len(x)
        axes = [_axis(a, rank) for a in attrs["axes"]] if attrs["axes"] else list(range(rank))
        given = attrs["sizes"] if attrs["sizes"] is not None else attrs["scales"]
        if len(given) != len(axes):
            raise ShapeError(f"Resize {'sizes' if attrs['sizes'] is not None else 'scales'} {tuple(given)} "
                             f"do not have one entry per resized axis of {tuple(x)}")
        out, scales = list(x), [1.0] * rank
        policy = attrs.get("policy", "stretch")
        if attrs["sizes"] is not None and policy != "stretch":
            # One scale for every resized axis, the smallest (not_larger) or
            # largest (not_smaller) that sizes asks for; sizes rounded from it.
            ratios = [int(value) / x[axis] for axis, value in zip(axes, given)]
            scale = min(ratios) if policy == "not_larger" else max(ratios)
            for axis in axes:
                out[axis], scales[axis] = int(scale * x[axis] + 0.5), scale
            return tuple(out), scales
        for axis, value in zip(axes, given):
            if attrs["sizes"] is not None:
                out[axis], scales[axis] = int(value), float(np.float32(int(value)) / np.float32(x[axis]))
            else:
                if value <= 0:
                    raise ShapeError(f"Resize scale {value} must be positive")
                out[axis], scales[axis] = int(math.floor(x[axis] * value)), float(value)
        return tuple(out), scales

    def infer(self, inputs, attrs):
        out, scales = self._geometry(inputs[0], attrs)
        if attrs["legacy"] and attrs["mode"] == "nearest" and min(scales) < 1:
            raise BuildError(f"nearest downsampling (scales {tuple(scales)}) is not supported before opset 11; "
                             "export at opset 11 or later")
        return [out]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        out, scales = self._geometry(x, attrs)
        strides = _c_strides(x)
        roi = self._roi(len(x), attrs)
        resized = [d for d in range(len(x)) if out[d] != x[d] or scales[d] != 1.0 or roi[d] != (0.0, 1.0)]
        tables, outside = {}, {}
        for d in resized:
            coords = source_coordinates(out[d], x[d], scales[d], attrs["coordinates"], roi[d])
            if attrs["coordinates"] == "tf_crop_and_resize":
                flags = (coords < 0) | (coords > x[d] - 1)
                if flags.any():
                    outside[d] = _table(k, f"out{d}", flags.astype(np.float32), F32)
            if attrs.get("antialias") and scales[d] < 1:
                indices, weights = antialias_taps(coords, x[d], scales[d], attrs["mode"], attrs["cubic_coeff_a"],
                                                  attrs["exclude_outside"])
                tables[d] = [(_table(k, f"at{d}_{t}", index * strides[d], I64), _table(k, f"w{d}_{t}", weight, F32))
                             for t, (index, weight) in enumerate(zip(indices, weights))]
                continue
            if attrs["mode"] == "nearest":
                tables[d] = (_table(k, f"at{d}", nearest_indices(coords, x[d], attrs["nearest"]) * strides[d], I64),)
                continue
            if attrs["mode"] == "linear":
                lower, upper, weight = linear_neighbours(coords, x[d])
                indices, weights = [lower, upper], [1 - weight, weight]
            else:
                indices, weights = cubic_neighbours(coords, x[d], attrs["cubic_coeff_a"], attrs["exclude_outside"])
            tables[d] = [(_table(k, f"at{d}_{t}", index * strides[d], I64), _table(k, f"w{d}_{t}", weight, F32))
                         for t, (index, weight) in enumerate(zip(indices, weights))]
        bld, X = k.builder, k.inputs[0]
        out_strides = _c_strides(out)
        with k.nested_loops(out) as idx:
            fixed = k.index(*((i, strides[d]) for d, i in enumerate(idx) if d not in tables))
            if attrs["mode"] == "nearest":
                offset = fixed
                for d, (at,) in tables.items():
                    offset = bld.add(offset, k.load(at, idx[d]))
                value = k.load(X, offset)
            else:
                # Sum over the taps' product: 2 (linear) or 4 (cubic) per resized axis.
                corners = [(fixed, k.f32(1.0))]
                for d, taps in tables.items():
                    steps = [(k.load(at, idx[d]), k.load(w, idx[d])) for at, w in taps]
                    corners = [(bld.add(offset, step), bld.fmul(scale, part))
                               for offset, scale in corners for step, part in steps]
                value = None
                for offset, scale in corners:
                    term = bld.fmul(k.load(X, offset), scale)
                    value = term if value is None else bld.fadd(value, term)
            if outside:
                # tf_crop_and_resize: a sample outside the input on any axis
                # is extrapolation_value.
                flag = None
                for d, table in outside.items():
                    here = k.load(table, idx[d])
                    flag = here if flag is None else bld.fadd(flag, here)
                value = bld.select(bld.fcmp_ordered(">", flag, k.f32(0.0)), k.f32(attrs["extrapolation_value"]),
                                   value)
            k.store(k.activate(value), k.outputs[0], k.index(*zip(idx, out_strides)))

    @staticmethod
    def _roi(rank: int, attrs) -> list:
        """The (start, end) of every axis that tf_crop_and_resize crops to;
        (0, 1) elsewhere."""
        roi = [(0.0, 1.0)] * rank
        if attrs.get("roi") is None:
            return roi
        axes = [_axis(a, rank) for a in attrs["axes"]] if attrs["axes"] else list(range(rank))
        values = attrs["roi"]
        if len(values) != 2 * len(axes):
            raise ShapeError(f"Resize roi {values} does not have a start and an end for each resized axis")
        for i, axis in enumerate(axes):
            roi[axis] = (values[i], values[len(axes) + i])
        return roi


def _ints_or_none(value):
    return None if value is None else tuple(int(v) for v in value)


class Upsample(Resize):
    """Upsample (opsets 7 to 9): Resize with asymmetric coordinates, scales
    as an attribute (7) or a constant input (9)."""

    op_type = "Upsample"
    compile_time_inputs = (1,)

    def attributes(self, raw, constants, opset):
        mode = raw.get("mode", "nearest")
        _check_choice("mode", mode, ("nearest", "linear", "bilinear"))
        scales = raw.get("scales") if opset < 9 else constants.get(1)
        if scales is None:
            raise BuildError("Upsample needs constant scales")
        return {"mode": "nearest" if mode == "nearest" else "linear", "coordinates": "asymmetric",
                "nearest": "floor", "legacy": True, "sizes": None, "axes": None,
                "scales": tuple(float(s) for s in np.asarray(scales).reshape(-1))}


GRID_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic", "nearest": "nearest"}
# Keys' cubic kernel coefficient GridSample uses (torch's bicubic).
GRID_CUBIC_A = -0.75


class GridSample(Op):
    """X (N, C, *spatial) sampled at the points of grid (N, *out, rank),
    each point's coordinates normalised to [-1, 1] and given from the last
    spatial axis (x, then y, ...): nearest (ties to even), linear or cubic
    (bilinear, bicubic before opset 20) interpolation; a point or tap
    outside the input reads zeros, the border, or the input reflected at
    its edges (padding_mode); align_corners puts -1 and 1 on the centres
    of the corner elements instead of their outer edges."""

    op_type = "GridSample"

    def attributes(self, raw, constants, opset):
        mode = raw.get("mode", "bilinear" if opset < 20 else "linear")
        _check_choice("mode", mode, tuple(GRID_MODES))
        padding = raw.get("padding_mode", "zeros")
        _check_choice("padding_mode", padding, ("zeros", "border", "reflection"))
        return {"mode": GRID_MODES[mode], "padding": padding, "align_corners": bool(int(raw.get("align_corners", 0)))}

    def infer(self, inputs, attrs):
        x, grid = inputs
        rank = len(x) - 2
        if rank < 1 or len(grid) != rank + 2 or grid[0] != x[0] or grid[-1] != rank:
            raise ShapeError(f"GridSample grid {grid} does not fit input {x}: it must be (N, *out, {rank})")
        return [(x[0], x[1], *grid[1:-1])]

    def lower(self, k, inputs, outputs, attrs):
        x, grid = inputs[0].shape, inputs[1].shape
        dims, out = x[2:], grid[1:-1]
        rank, points, plane = len(dims), _prod_of(out), _prod_of(dims)
        bld, X, G, Y = k.builder, k.inputs[0], k.inputs[1], k.outputs[0]
        strides = _c_strides(dims)
        with k.loop(x[0]) as n, k.loop(points) as p:
            taps = []  # per spatial axis: [(offset, weight, inside)]
            for axis, size in enumerate(dims):
                g = k.load(G, k.index((n, points * rank), (p, rank), (rank - 1 - axis, 1)))
                taps.append([(bld.mul(i, k.i64(strides[axis])), w, ok)
                             for i, w, ok in self._axis_taps(k, g, size, attrs)])
            corners = [(k.i64(0), k.f32(1.0), None)]
            for axis_taps in taps:
                corners = [(bld.add(o, o2), bld.fmul(w, w2), ok2 if ok is None else bld.and_(ok, ok2))
                           for o, w, ok in corners for o2, w2, ok2 in axis_taps]
            with k.loop(x[1]) as c:
                base = k.index((n, x[1] * plane), (c, plane))
                value = None
                for offset, weight, ok in corners:
                    read = k.load(X, bld.add(base, offset))
                    if ok is not None:
                        read = bld.select(ok, read, k.f32(0.0))
                    term = bld.fmul(read, weight)
                    value = term if value is None else bld.fadd(value, term)
                k.store(k.activate(value), Y, k.index((n, x[1] * points), (c, points), (p, 1)))

    @staticmethod
    def _axis_taps(k, g, size, attrs):
        """[(index in [0, size), weight, inside or None)] of one axis for the
        normalised coordinate g."""
        bld = k.builder
        align, padding = attrs["align_corners"], attrs["padding"]
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        one = k.f32(1.0)
        if align:
            coord = bld.fmul(bld.fmul(bld.fadd(g, one), k.f32(0.5)), k.f32(size - 1))
        else:
            coord = bld.fmul(bld.fsub(bld.fmul(bld.fadd(g, one), k.f32(size)), one), k.f32(0.5))
        if attrs["mode"] == "nearest":
            coord = _intrinsic(k, "llvm.rint", coord)
        outside = bld.or_(bld.fcmp_ordered("<", coord, k.f32(lo)), bld.fcmp_ordered(">", coord, k.f32(hi)))
        if padding == "border":
            coord = bld.select(outside, k.minimum(k.maximum(coord, k.f32(0.0)), k.f32(size - 1)), coord)
        elif padding == "reflection":
            coord = _reflect(k, coord, lo, hi)

        def place(index):  # an integer position (i64) as padding_mode reads it
            if padding == "zeros":
                inside = k.in_range(index, size)
                return bld.select(inside, index, k.i64(0)), inside
            if padding == "border":
                return k.smin(k.smax(index, k.i64(0)), k.i64(size - 1)), None
            reflected = bld.fptosi(_reflect(k, bld.sitofp(index, F32), lo, hi), I64)
            return k.smin(k.smax(reflected, k.i64(0)), k.i64(size - 1)), None

        if attrs["mode"] == "nearest":
            index, inside = place(bld.fptosi(coord, I64))
            return [(index, one, inside)]
        floor = _intrinsic(k, "llvm.floor", coord)
        t = bld.fsub(coord, floor)
        base = bld.fptosi(floor, I64)
        if attrs["mode"] == "linear":
            weights = [bld.fsub(one, t), t]
            offsets = (0, 1)
        else:
            weights = [_keys(k, bld.fsub(t, k.f32(o))) for o in (-1, 0, 1, 2)]
            offsets = (-1, 0, 1, 2)
        result = []
        for o, w in zip(offsets, weights):
            index, inside = place(bld.add(base, k.i64(o)))
            result.append((index, w, inside))
        return result


def _prod_of(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _intrinsic(k, name, value):
    fn = k.module.declare_intrinsic(name, [value.type])
    return k.builder.call(fn, [value])


def _keys(k, t):
    """Keys' cubic kernel with a = GRID_CUBIC_A at distance t."""
    bld, a = k.builder, GRID_CUBIC_A
    t = k.maximum(t, bld.fsub(k.f32(0.0), t))
    near = bld.fadd(bld.fmul(bld.fmul(bld.fsub(bld.fmul(k.f32(a + 2), t), k.f32(a + 3)), t), t), k.f32(1.0))
    far = bld.fsub(bld.fmul(bld.fadd(bld.fmul(bld.fsub(bld.fmul(k.f32(a), t), k.f32(5 * a)), t), k.f32(8 * a)), t),
                   k.f32(4 * a))
    return bld.select(bld.fcmp_ordered("<=", t, k.f32(1.0)), near,
                      bld.select(bld.fcmp_ordered("<", t, k.f32(2.0)), far, k.f32(0.0)))


def _reflect(k, v, lo: float, hi: float):
    """v reflected at lo and hi until it lies between them."""
    bld = k.builder
    span = hi - lo
    below, above = bld.fcmp_ordered("<", v, k.f32(lo)), bld.fcmp_ordered(">", v, k.f32(hi))
    dx = bld.select(below, bld.fsub(k.f32(lo), v), bld.fsub(v, k.f32(hi)))
    turns = bld.fptosi(bld.fdiv(dx, k.f32(span)), I64) if span > 0 else k.i64(0)
    r = bld.fsub(dx, bld.fmul(bld.sitofp(turns, F32), k.f32(span)))
    even = bld.icmp_signed("==", bld.and_(turns, k.i64(1)), k.i64(0))
    from_lo, from_hi = bld.fadd(k.f32(lo), r), bld.fsub(k.f32(hi), r)
    moved = bld.select(below, bld.select(even, from_lo, from_hi), bld.select(even, from_hi, from_lo))
    return bld.select(bld.or_(below, above), moved, v)
