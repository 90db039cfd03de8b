"""Resize (opsets 10 to 19) and Upsample: nearest, n-linear and n-cubic
interpolation with constant scales or sizes.

The geometry is known at compile time, so for each resized axis the
source positions of every output position (and, for linear and cubic, the
two or four neighbours and their weights) are computed here and written
into the module as small constant tables; the kernel walks the
output and reads them. Axes that keep their size read straight through.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir

from .emit import F32, I64, Kernel
from .errors import BuildError, ShapeError
from .op_base import Op, _axis, _c_strides, _check_choice, _const_ints

COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def source_coordinates(out_size: int, in_size: int, scale: float, mode: str) -> np.ndarray:
    """Where each output position samples the input along one axis
    (ONNX Resize's coordinate_transformation_mode). Computed in float32, as
    onnxruntime does: a sample that lands on a tie there (4.5) must round
    the same way here, where float64 would see 4.49999986."""
    f = np.float32
    x, scale, half = np.arange(out_size, dtype=f), f(scale), f(0.5)
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

    def kernel(t):
        t = np.abs(t)
        near = ((a + 2) * t - (a + 3)) * t * t + 1
        far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
        return np.where(t <= 1, near, np.where(t < 2, far, 0.0))

    taps = [base + offset for offset in (-1, 0, 1, 2)]
    weights = [kernel(ratio - offset) for offset in (-1, 0, 1, 2)]
    if exclude_outside:
        weights = [np.where((t >= 0) & (t < in_size), w, 0.0) for t, w in zip(taps, weights)]
        total = sum(weights)
        weights = [w / total for w in weights]
    indices = [np.clip(t, 0, in_size - 1).astype(np.int64) for t in taps]
    return indices, [w.astype(np.float32) for w in weights]


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
    Modes nearest, linear and cubic (cubic_coeff_a, exclude_outside);
    antialias, tf_crop_and_resize and a keep_aspect_ratio_policy other
    than stretch are refused by name."""

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
            if int(raw.get("antialias", 0)):
                raise BuildError("Resize with antialias=1 is not supported")
            _check_choice("keep_aspect_ratio_policy", raw.get("keep_aspect_ratio_policy", "stretch"), ("stretch",))
            scales = constants.get(2)
            attrs = {"mode": mode, "coordinates": coordinates, "nearest": nearest, "legacy": False,
                     "scales": (None if scales is None or np.asarray(scales).size == 0
                                else tuple(float(s) for s in np.asarray(scales).reshape(-1))),
                     "sizes": _const_ints(constants, 3), "axes": _ints_or_none(raw.get("axes")),
                     "cubic_coeff_a": float(raw.get("cubic_coeff_a", -0.75)),
                     "exclude_outside": bool(int(raw.get("exclude_outside", 0)))}
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
        resized = [d for d in range(len(x)) if out[d] != x[d] or scales[d] != 1.0]
        tables = {}
        for d in resized:
            coords = source_coordinates(out[d], x[d], scales[d], attrs["coordinates"])
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
            k.store(k.activate(value), k.outputs[0], k.index(*zip(idx, out_strides)))


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
