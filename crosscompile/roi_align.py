"""RoiAlign: a detector's second stage, pooling each region of interest of
a feature map into a fixed grid by bilinear sampling.

Each output cell averages (or takes the largest of) a grid of samples in
its bin; the grid's size comes from sampling_ratio, or, when that is 0,
from the region's size, which is only known at run time, so the sample
loops run to counts computed per region.
"""
from __future__ import annotations

from llvmlite import ir

from .emit import I64, Kernel
from .errors import BuildError, ShapeError
from .op_base import Op, _check_choice


def _ceil(k: Kernel, x: ir.Value) -> ir.Value:
    """ceil(x) of a float as an i64, without a libm call (32-bit ARM has
    no rounding instruction)."""
    bld = k.builder
    t = bld.fptosi(x, I64)
    below = bld.fcmp_ordered("<", bld.sitofp(t, x.type), x)
    return bld.select(below, bld.add(t, k.i64(1)), t)


class RoiAlign(Op):
    """ONNX RoiAlign, opsets 10 and 16: X [N, C, H, W], rois [R, 4] as
    (x1, y1, x2, y2), batch_indices [R] -> [R, C, output_height,
    output_width]. coordinate_transformation_mode half_pixel (opset 16's
    default) shifts the region by half a pixel; output_half_pixel (opset
    10's behaviour) does not and makes regions at least one pixel wide.
    mode avg averages each bin's samples, max takes the largest weighted
    corner of any sample, as onnxruntime does."""

    op_type = "RoiAlign"

    def attributes(self, raw, constants, opset):
        mode = raw.get("mode", b"avg")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        _check_choice("mode", mode, ("avg", "max"))
        transform = raw.get("coordinate_transformation_mode", b"half_pixel" if opset >= 16 else b"output_half_pixel")
        transform = transform.decode() if isinstance(transform, bytes) else transform
        _check_choice("coordinate_transformation_mode", transform, ("half_pixel", "output_half_pixel"))
        return {"mode": mode, "half_pixel": transform == "half_pixel",
                "output_height": int(raw.get("output_height", 1)), "output_width": int(raw.get("output_width", 1)),
                "sampling_ratio": int(raw.get("sampling_ratio", 0)),
                "spatial_scale": float(raw.get("spatial_scale", 1.0))}

    def infer(self, inputs, attrs):
        if len(inputs) != 3:
            raise ShapeError(f"RoiAlign takes X, rois and batch_indices at run time, got {len(inputs)} inputs")
        x, rois, indices = inputs
        if len(x) != 4 or len(rois) != 2 or rois[1] != 4 or tuple(indices) != (rois[0],):
            raise ShapeError(f"RoiAlign needs X [N, C, H, W], rois [R, 4] and batch_indices [R], "
                             f"got {x}, {rois} and {indices}")
        if attrs["output_height"] < 1 or attrs["output_width"] < 1 or attrs["sampling_ratio"] < 0:
            raise ShapeError("RoiAlign needs output_height and output_width of at least 1 and a sampling_ratio "
                             "of at least 0")
        return [(rois[0], x[1], attrs["output_height"], attrs["output_width"])]

    def output_dtype(self, inputs, attrs):
        x, rois, indices = inputs
        if x.dtype != "float32" or rois.dtype != "float32" or indices.dtype not in ("int64", "int32"):
            raise BuildError(f"RoiAlign takes float32 X and rois and int64 or int32 batch_indices, got "
                             f"{x.dtype}, {rois.dtype} and {indices.dtype}")
        return "float32"

    def lower(self, k, inputs, outputs, attrs):
        bld = k.builder
        _, channels, height, width = inputs[0].shape
        regions = inputs[1].shape[0]
        out_h, out_w = attrs["output_height"], attrs["output_width"]
        data, rois = k.inputs[0], k.inputs[1]
        indices = k.typed(k.inputs[2], inputs[2].dtype)
        f = k.f32
        shift = f(0.5 if attrs["half_pixel"] else 0.0)
        with k.loop(regions) as n:
            batch = k.load(indices, n)
            batch = bld.sext(batch, I64) if batch.type != I64 else batch
            corner = [bld.fsub(bld.fmul(k.load(rois, k.index((n, 4), (i, 1))), f(attrs["spatial_scale"])), shift)
                      for i in range(4)]
            start_w, start_h = corner[0], corner[1]
            roi_w, roi_h = bld.fsub(corner[2], start_w), bld.fsub(corner[3], start_h)
            if not attrs["half_pixel"]:
                roi_w, roi_h = k.maximum(roi_w, f(1.0)), k.maximum(roi_h, f(1.0))
            bin_h, bin_w = bld.fdiv(roi_h, f(out_h)), bld.fdiv(roi_w, f(out_w))
            if attrs["sampling_ratio"]:
                grid_h = grid_w = k.i64(attrs["sampling_ratio"])
            else:
                grid_h, grid_w = _ceil(k, bld.fdiv(roi_h, f(out_h))), _ceil(k, bld.fdiv(roi_w, f(out_w)))
            samples = bld.sitofp(k.smax(bld.mul(grid_h, grid_w), k.i64(1)), ir.FloatType())
            grid_hf, grid_wf = bld.sitofp(grid_h, ir.FloatType()), bld.sitofp(grid_w, ir.FloatType())
            with k.loop(channels) as c, k.loop(out_h) as ph, k.loop(out_w) as pw:
                base = k.index((batch, channels * height * width), (c, height * width))
                total = k.variable(f(0.0))
                first = k.variable(ir.Constant(ir.IntType(1), 1))
                with k.loop(grid_h) as iy:
                    y = bld.fadd(bld.fadd(start_h, bld.fmul(bld.sitofp(ph, ir.FloatType()), bin_h)),
                                 bld.fdiv(bld.fmul(bld.fadd(bld.sitofp(iy, ir.FloatType()), f(0.5)), bin_h), grid_hf))
                    with k.loop(grid_w) as ix:
                        x = bld.fadd(bld.fadd(start_w, bld.fmul(bld.sitofp(pw, ir.FloatType()), bin_w)),
                                     bld.fdiv(bld.fmul(bld.fadd(bld.sitofp(ix, ir.FloatType()), f(0.5)), bin_w),
                                              grid_wf))
                        value = self._sample(k, data, base, y, x, height, width, attrs["mode"])
                        if attrs["mode"] == "avg":
                            bld.store(bld.fadd(bld.load(total), value), total)
                        else:
                            bld.store(bld.select(bld.load(first), value, k.maximum(bld.load(total), value)), total)
                            bld.store(ir.Constant(ir.IntType(1), 0), first)
                result = bld.load(total)
                if attrs["mode"] == "avg":
                    result = bld.fdiv(result, samples)
                place = k.index((n, channels * out_h * out_w), (c, out_h * out_w), (ph, out_w), (pw, 1))
                k.store(k.activate(result), k.outputs[0], place)

    @staticmethod
    def _sample(k: Kernel, data, base, y, x, height: int, width: int, mode: str) -> ir.Value:
        """One bilinear sample at (y, x): the weighted sum of its four
        pixels (avg) or the largest weighted pixel (max); 0 outside the map
        by more than a pixel."""
        bld, f = k.builder, k.f32
        outside = bld.or_(bld.or_(bld.fcmp_ordered("<", y, f(-1.0)), bld.fcmp_ordered(">", y, f(float(height)))),
                          bld.or_(bld.fcmp_ordered("<", x, f(-1.0)), bld.fcmp_ordered(">", x, f(float(width)))))
        # Outside, sample (0, 0) with zero weight instead, so nothing is read out of bounds.
        y = bld.select(outside, f(0.0), k.maximum(y, f(0.0)))
        x = bld.select(outside, f(0.0), k.maximum(x, f(0.0)))
        corners = []
        for value, size in ((y, height), (x, width)):
            low = bld.fptosi(value, I64)
            last = bld.icmp_signed(">=", low, k.i64(size - 1))
            low = bld.select(last, k.i64(size - 1), low)
            high = bld.select(last, low, bld.add(low, k.i64(1)))
            value = bld.select(last, bld.sitofp(low, ir.FloatType()), value)
            frac = bld.fsub(value, bld.sitofp(low, ir.FloatType()))
            corners.append((low, high, frac, bld.fsub(f(1.0), frac)))
        (y_low, y_high, ly, hy), (x_low, x_high, lx, hx) = corners
        terms = []
        for row, wy in ((y_low, hy), (y_high, ly)):
            for col, wx in ((x_low, hx), (x_high, lx)):
                pixel = k.load(data, k.index((base, 1), (row, width), (col, 1)))
                terms.append(bld.fmul(bld.fmul(wy, wx), pixel))
        if mode == "avg":
            value = bld.fadd(bld.fadd(bld.fadd(terms[0], terms[1]), terms[2]), terms[3])
        else:
            value = k.maximum(k.maximum(k.maximum(terms[0], terms[1]), terms[2]), terms[3])
        return bld.select(outside, f(0.0), value)
