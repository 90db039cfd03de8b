"""ConvTranspose against onnxruntime: 1-D and 2-D, groups, strides,
dilations, pads, output_padding, output_shape, the auto_pad forms and a
fused activation, on the host and on emulated arm64 and armhf."""
import numpy as np
import pytest
from onnx import helper, numpy_helper

import crosscompile
import minirt
from crosscompile.conv_transpose import SCRATCH_FLOATS, column_plan, transpose_geometry
from tests.cross_targets import run_emulated
from tests.onnx_models import ATOL, RTOL, make_model, rand, reference, run_host, sample_input


def conv_transpose_model(x_shape, w_shape, bias=True, relu=False, **attrs):
    """ConvTranspose (and a Relu after it), weights scaled by 1/sqrt(fan-in)."""
    fan_in = w_shape[0] * np.prod(w_shape[2:]) // max(1, attrs.get("group", 1))
    inits = {"w": (rand(*w_shape, seed=1) / np.sqrt(fan_in)).astype(np.float32)}
    names = ["x", "w"]
    if bias:
        inits["b"] = rand(w_shape[1] * attrs.get("group", 1), seed=2)
        names.append("b")
    nodes = [helper.make_node("ConvTranspose", names, ["c" if relu else "y"], name="the_convtranspose", **attrs)]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    return make_model(nodes, {"x": x_shape}, {"y": None}, inits)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 4, 5, 5), (4, 3, 2, 2), {"strides": [2, 2]}),                           # a U-Net's 2x upsampling
    ((2, 3, 4, 6), (3, 5, 3, 3), {}),                                            # stride 1
    ((1, 4, 5, 5), (4, 2, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}),
    ((1, 2, 4, 5), (2, 3, 3, 2), {"strides": [3, 2], "pads": [0, 1, 2, 0]}),     # uneven pads and strides
    ((1, 2, 5, 4), (2, 2, 3, 3), {"dilations": [2, 1], "strides": [1, 2]}),
    ((1, 6, 4, 4), (6, 2, 3, 3), {"group": 3, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 4, 3, 3), (4, 1, 4, 4), {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}),  # depthwise
    ((1, 3, 4, 4), (3, 2, 3, 3), {"strides": [2, 2], "output_shape": [8, 7]}),
    ((1, 3, 4, 4), (3, 2, 3, 3), {"strides": [2, 2], "output_shape": [10, 10]}),  # beyond the input's reach
    ((1, 3, 4, 5), (3, 2, 3, 3), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 3, 4, 5), (3, 2, 3, 4), {"strides": [2, 3], "auto_pad": "SAME_LOWER"}),
    ((1, 3, 4, 5), (3, 2, 3, 3), {"strides": [2, 2], "auto_pad": "VALID"}),
    ((1, 2, 3, 3), (2, 2, 5, 5), {"pads": [2, 2, 2, 2]}),                          # pads as large as the input
    ((1, 3, 5, 29), (3, 2, 3, 4), {"strides": [2, 3], "pads": [1, 1, 0, 2]}),     # 3 phases a row, in vectors
])
def test_conv_transpose_2d(tmp_path, x_shape, w_shape, attrs):
    run_host(conv_transpose_model(x_shape, w_shape, **attrs), tmp_path)


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 4, 16), (4, 3, 4), {"strides": [2], "pads": [1, 1]}),        # an audio decoder's upsampling
    ((2, 2, 7), (2, 4, 3), {"dilations": [3], "output_padding": [2], "strides": [3]}),
    ((1, 4, 9), (4, 1, 5), {"group": 2, "strides": [4], "auto_pad": "SAME_UPPER"}),
])
def test_conv_transpose_1d(tmp_path, x_shape, w_shape, attrs):
    run_host(conv_transpose_model(x_shape, w_shape, **attrs), tmp_path)


def test_conv_transpose_3d_without_bias(tmp_path):
    run_host(conv_transpose_model((1, 2, 3, 4, 3), (2, 3, 2, 3, 2), bias=False, strides=[2, 1, 2]), tmp_path)


def test_conv_transpose_in_runs_of_output_rows(tmp_path):
    # Columns of 32 x 9 taps x 37 floats per input row: the 80 output rows go
    # in runs, each computing the input rows it reads (the 3x3 kernel reaches
    # a row back), the last run starting early enough to compute as many.
    attrs = {"strides": [2, 2], "pads": [1, 0, 1, 1]}
    geometry = transpose_geometry((1, 2, 40, 37), (2, 32, 3, 3), {
        "strides": (2, 2), "pads": (1, 0, 1, 1), "output_padding": None, "auto_pad": "NOTSET",
        "dilations": None, "output_shape": None})
    plan = column_plan(geometry, 2, 32, True)
    assert 1 < plan.lines < 80 and plan.inputs > plan.lines // 2
    assert (32 * 9 + 2) * plan.n <= SCRATCH_FLOATS and plan.starts[-1] == (40 - plan.inputs) * 37
    run_host(conv_transpose_model((1, 2, 40, 37), (2, 32, 3, 3), **attrs), tmp_path)


def test_conv_transpose_runs_a_fused_relu(tmp_path):
    lib = run_host(conv_transpose_model((1, 4, 5, 5), (4, 4, 3, 3), relu=True, strides=[2, 2]), tmp_path)
    assert [step["op"] for step in lib.metadata["steps"]] == ["ConvTranspose"]


@pytest.mark.parametrize("group,bias", [(1, True), (2, False)])
def test_batch_norm_after_conv_transpose_folds_into_its_weights(tmp_path, group, bias):
    # A DCGAN generator's block: ConvTranspose, BatchNormalization, Relu.
    model = conv_transpose_model((1, 4, 5, 5), (4, 3, 4, 4), bias=bias, group=group, strides=[2, 2], pads=[1, 1, 1, 1])
    model.graph.node[0].output[0] = "c"
    channels = 3 * group
    bn = {"scale": rand(channels, seed=3), "shift": rand(channels, seed=4), "mean": rand(channels, seed=5),
          "var": np.abs(rand(channels, seed=6)) + 0.5}
    model.graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in bn.items())
    model.graph.node.extend([helper.make_node("BatchNormalization", ["c", *bn], ["n"]),
                             helper.make_node("Relu", ["n"], ["y"])])
    lib = run_host(model, tmp_path)
    assert lib.summary["folded_into_conv"] == 1 and lib.summary["kernels"] == 1


def test_conv_transpose_weight_that_does_not_fit_is_refused():
    with pytest.raises(crosscompile.BuildError, match="the_convtranspose.*group=2.*do not fit"):
        crosscompile.build(conv_transpose_model((1, 3, 4, 4), (3, 2, 3, 3), group=2))



@pytest.mark.parametrize("preset", ["rasp4b64", "rasp3b"])
@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 16, 13, 19), (16, 8, 2, 2), {"strides": [2, 2]}),                       # a U-Net's, odd sizes
    ((1, 8, 9, 11), (8, 6, 4, 4), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),     # a DCGAN's
    ((1, 6, 7, 9), (6, 4, 3, 3), {"group": 2, "strides": [3, 2], "pads": [1, 0, 2, 1],
                                  "output_padding": [1, 1], "dilations": [1, 2]}),
    ((1, 8, 33), (8, 4, 4), {"strides": [2], "pads": [1, 1]}),
])
def test_conv_transpose_on_emulated_boards(tmp_path, preset, x_shape, w_shape, attrs):
    model = conv_transpose_model(x_shape, w_shape, relu=True, **attrs)
    feeds = sample_input(model)
    (want,) = reference(model, feeds)
    lib = crosscompile.build(model, target=preset)
    got = run_emulated(lib, preset, feeds["x"], want.shape, tmp_path)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("threads", [2, 3])
def test_conv_transpose_split_between_threads(tmp_path, threads):
    # Two images, two groups and several runs of rows each: threads split
    # the copies into panels, the products and the gathered rows.
    model = conv_transpose_model((2, 4, 40, 37), (4, 16, 3, 3), relu=True, group=2, strides=[2, 2],
                                 pads=[1, 0, 1, 1])
    feeds = sample_input(model)
    lib = crosscompile.build(model, target="host")
    module = minirt.load(lib.export_library(tmp_path / "m.so"), threads=threads)
    (got,) = module.run(feeds)
    np.testing.assert_allclose(got, reference(model, feeds)[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("image,block,attrs", [
    ((5, 6), (2, 3), {"strides": [1, 2], "pads": [1, 0, 0, 2], "dilations": [2, 1]}),
    ((4, 3, 5), (2, 2, 3), {"strides": [2, 1, 1], "pads": [0, 1, 1, 1, 0, 0]}),
    ((9,), (3,), {"dilations": [3]}),
])
def test_col2im_matches_the_onnx_reference(tmp_path, image, block, attrs):
    """Col2Im sums overlapping blocks back into the image, with strides,
    pads and dilations in 1-D to 3-D; a Relu after it sees the sums."""
    from onnx import TensorProto
    from onnx.reference import ReferenceEvaluator

    n = len(image)
    strides, dilations = attrs.get("strides", [1] * n), attrs.get("dilations", [1] * n)
    pads = attrs.get("pads", [0] * 2 * n)
    grid = [(image[i] + pads[i] + pads[i + n] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
            for i in range(n)]
    x_shape = (2, 3 * int(np.prod(block)), int(np.prod(grid)))
    nodes = [helper.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs),
             helper.make_node("Relu", ["y"], ["z"])]
    graph = helper.make_graph(nodes, "col2im", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array(image, np.int64), "image"),
                               numpy_helper.from_array(np.array(block, np.int64), "block")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(4).standard_normal(x_shape).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = minirt.load(crosscompile.build(model, "host").export_library(str(tmp_path / "m.so"))).run({"x": x})[0]
    assert got.shape == (2, 3, *image)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
