"""Resize and Upsample against onnxruntime: nearest with each coordinate
and rounding mode, linear (bilinear, trilinear), cubic (its coefficient,
exclude_outside), scales and sizes forms,
axes (opset 18), upsampling and downsampling; antialias,
tf_crop_and_resize and keep_aspect_ratio_policy against onnx's reference."""
import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import crosscompile
import minirt
from tests.onnx_models import make_model, rand, run_host

EMPTY = np.array([], np.float32)


def resize_model(x_shape, scales=None, sizes=None, opset=19, **attrs):
    inits = {"roi": EMPTY, "scales": np.array(scales, np.float32) if scales is not None else EMPTY}
    names = ["x", "roi", "scales"]
    if sizes is not None:
        inits["sizes"] = np.array(sizes, np.int64)
        names.append("sizes")
    node = helper.make_node("Resize", names, ["y"], name="the_resize", **attrs)
    return make_model([node], {"x": x_shape}, {"y": None}, inits, opset=opset)


@pytest.mark.parametrize("coordinates", ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"])
@pytest.mark.parametrize("nearest", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 0.6, 1.7]])
def test_resize_nearest(tmp_path, coordinates, nearest, scales):
    model = resize_model((1, 3, 5, 7), scales, coordinate_transformation_mode=coordinates, nearest_mode=nearest)
    run_host(model, tmp_path)


@pytest.mark.parametrize("coordinates", ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"])
@pytest.mark.parametrize("x_shape,scales,sizes", [
    ((1, 4, 6, 5), [1, 1, 2, 2], None),          # a U-Net decoder's bilinear upsampling
    ((2, 3, 9, 8), [1, 1, 0.5, 0.75], None),     # downsampling
    ((1, 2, 5, 6), None, [1, 2, 13, 4]),          # sizes
    ((1, 2, 3, 4, 5), [1, 1, 2, 1.5, 0.8], None),  # trilinear
    ((1, 1, 2, 4), [1, 1, 0.6, 0.6], None),         # a scale that does not give a whole size
])
def test_resize_linear(tmp_path, coordinates, x_shape, scales, sizes):
    model = resize_model(x_shape, scales, sizes, mode="linear", coordinate_transformation_mode=coordinates)
    run_host(model, tmp_path)


def _matches_the_onnx_reference(model, x_shape, tmp_path):
    x = rand(*x_shape)
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run({"x": x})[0]
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,scales,sizes,exclude", [
    ("linear", [1, 1, 0.6, 0.3], None, 0),     # 4 and 8 taps per output along the two axes
    ("cubic", None, [1, 2, 4, 9], 0),          # downsampling one axis, upsampling the other
    ("cubic", [1, 1, 0.5, 0.45], None, 1),     # exclude_outside renormalises the widened taps
])
def test_resize_antialias_matches_the_onnx_reference(tmp_path, mode, scales, sizes, exclude):
    model = resize_model((1, 2, 7, 12), scales, sizes, mode=mode, antialias=1, exclude_outside=exclude)
    _matches_the_onnx_reference(model, (1, 2, 7, 12), tmp_path)


@pytest.mark.parametrize("mode,axes,roi,sizes", [
    ("linear", None, [0, 0, 0.2, 0.1, 1, 1, 0.9, 1.3], [1, 2, 5, 6]),    # partly outside: extrapolated
    ("nearest", [3, 2], [0.3, -0.2, 0.8, 0.7], [4, 3]),                 # axes in another order
    ("cubic", [2, 3], [0.1, 0.1, 0.9, 0.6], [1, 1]),                     # one sample per axis
])
def test_resize_tf_crop_and_resize_matches_the_onnx_reference(tmp_path, mode, axes, roi, sizes):
    node = helper.make_node("Resize", ["x", "roi", "", "sizes"], ["y"], mode=mode, extrapolation_value=-3.0,
                            coordinate_transformation_mode="tf_crop_and_resize",
                            **({"axes": axes} if axes else {}))
    model = make_model([node], {"x": (1, 2, 6, 7)}, {"y": None},
                       {"roi": np.array(roi, np.float32), "sizes": np.array(sizes, np.int64)}, opset=19)
    _matches_the_onnx_reference(model, (1, 2, 6, 7), tmp_path)


@pytest.mark.parametrize("policy", ["not_larger", "not_smaller"])
def test_resize_keep_aspect_ratio_policy_matches_the_onnx_reference(tmp_path, policy):
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear", keep_aspect_ratio_policy=policy,
                            axes=[2, 3])
    model = make_model([node], {"x": (1, 2, 6, 9)}, {"y": None}, {"sizes": np.array([4, 5], np.int64)}, opset=19)
    _matches_the_onnx_reference(model, (1, 2, 6, 9), tmp_path)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_half_pixel_symmetric(tmp_path, mode):
    # onnxruntime 1.32 rounds a sample of this mode that lands within an ulp
    # of a whole position the other way from the ONNX reference (5 -> 3 by
    # 0.6 takes rows 0, 1, 3 there, 0, 2, 3 in the reference); the compiled
    # module follows the reference.
    model = resize_model((1, 2, 5, 7), [1, 1, 0.6, 1.7], mode=mode,
                         coordinate_transformation_mode="half_pixel_symmetric")
    x = rand(1, 2, 5, 7)
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run({"x": x})[0]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_resize_sizes_over_axes_at_opset_18(tmp_path):
    model = resize_model((1, 3, 6, 6), sizes=[9, 4], opset=18, axes=[2, 3], mode="linear")
    run_host(model, tmp_path)


def test_resize_opset_10_nearest_upsampling(tmp_path):
    node = helper.make_node("Resize", ["x", "scales"], ["y"])
    model = make_model([node], {"x": (1, 2, 3, 4)}, {"y": None},
                       {"scales": np.array([1, 1, 2, 3], np.float32)}, opset=10)
    run_host(model, tmp_path)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_opset_9(tmp_path, mode):
    node = helper.make_node("Upsample", ["x", "scales"], ["y"], mode=mode)
    model = make_model([node], {"x": (1, 2, 3, 4)}, {"y": None},
                       {"scales": np.array([1, 1, 2, 2], np.float32)}, opset=9)
    run_host(model, tmp_path, feeds={"x": rand(1, 2, 3, 4)})


@pytest.mark.parametrize("attrs,pattern", [
    ({"mode": "cubic"}, r"node 'the_resize' \(Resize\): attribute mode='cubic' is not supported"),  # opset 10
    ({"antialias": 1}, r"node 'the_resize' \(Resize\): Resize with antialias=1 takes mode 'linear' or 'cubic', "
                       "not 'nearest'"),
    ({"coordinate_transformation_mode": "tf_crop_and_resize"},
     r"node 'the_resize' \(Resize\): Resize with coordinate_transformation_mode='tf_crop_and_resize' needs a "
     "constant roi"),
])
def test_resize_unsupported_forms_are_refused_by_name(attrs, pattern):
    with pytest.raises(crosscompile.BuildError, match=pattern):
        crosscompile.build(resize_model((1, 1, 4, 4), [1, 1, 2, 2], opset=10 if attrs.get("mode") else 19,
                                        **attrs))


@pytest.mark.parametrize("coordinates", ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"])
@pytest.mark.parametrize("x_shape,scales,sizes,attrs", [
    ((1, 3, 6, 5), [1, 1, 2, 2], None, {}),                                         # bicubic upsampling
    ((2, 2, 9, 8), [1, 1, 0.5, 0.75], None, {"exclude_outside": 1}),
    ((1, 2, 5, 6), None, [1, 2, 13, 4], {"cubic_coeff_a": -0.5, "exclude_outside": 1}),  # torch's a
    ((1, 1, 3, 7), [1, 1, 1.5, 0.6], None, {"cubic_coeff_a": -0.5}),
])
def test_resize_cubic(tmp_path, coordinates, x_shape, scales, sizes, attrs):
    model = resize_model(x_shape, scales, sizes, mode="cubic", coordinate_transformation_mode=coordinates, **attrs)
    run_host(model, tmp_path)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding,align_corners", [("zeros", 0), ("border", 1), ("reflection", 0), ("reflection", 1)])
def test_grid_sample_matches_onnxruntime(tmp_path, mode, padding, align_corners):
    """GridSample (opset 16) at points inside and well outside [-1, 1],
    and at the exact centres of elements (nearest's ties). bicubic with
    border padding is checked against the onnx reference: it moves a point
    outside the input to the border before taking the 4 x 4 taps (as the
    node suite's cases expect), onnxruntime only clamps each tap."""
    model = make_model([helper.make_node("GridSample", ["x", "grid"], ["y"], mode=mode, padding_mode=padding,
                                         align_corners=align_corners)],
                       {"x": (2, 3, 5, 6), "grid": (2, 4, 7, 2)}, {"y": None}, {}, opset=16)
    rng = np.random.default_rng(11)
    grid = rng.uniform(-2.6, 2.6, (2, 4, 7, 2)).astype(np.float32)
    grid[0, 0, :, 0] = np.linspace(-1, 1, 7)  # on element edges or centres
    feeds = {"x": rand(2, 3, 5, 6, seed=2), "grid": grid}
    if (mode, padding) != ("bicubic", "border"):
        run_host(model, tmp_path, feeds=feeds)
        return
    module = minirt.load(crosscompile.build(model, "host").export_library(str(tmp_path / "m.so")))
    renamed = make_model([helper.make_node("GridSample", ["x", "grid"], ["y"], mode="cubic", padding_mode=padding,
                                           align_corners=align_corners)],  # the reference's (opset 20) name
                         {"x": (2, 3, 5, 6), "grid": (2, 4, 7, 2)}, {"y": None}, {}, opset=20)
    np.testing.assert_allclose(module.run(feeds)[0], ReferenceEvaluator(renamed).run(None, feeds)[0], rtol=1e-5,
                               atol=1e-5)


def test_grid_sample_3d_matches_the_onnx_reference(tmp_path):
    """Volumetric GridSample (opset 20's linear and cubic names) against
    the onnx reference (onnxruntime samples 2-D grids only)."""
    for mode, padding in (("linear", "reflection"), ("cubic", "border"), ("nearest", "zeros")):
        model = make_model([helper.make_node("GridSample", ["x", "grid"], ["y"], mode=mode, padding_mode=padding)],
                           {"x": (1, 2, 3, 4, 5), "grid": (1, 2, 3, 2, 3)}, {"y": None}, {}, opset=20)
        feeds = {"x": rand(1, 2, 3, 4, 5, seed=3),
                 "grid": np.random.default_rng(12).uniform(-1.8, 1.8, (1, 2, 3, 2, 3)).astype(np.float32)}
        want = ReferenceEvaluator(model).run(None, feeds)[0]
        module = minirt.load(crosscompile.build(model, "host").export_library(str(tmp_path / f"{mode}.so")))
        np.testing.assert_allclose(module.run(feeds)[0], want, rtol=1e-5, atol=1e-5, err_msg=mode)
