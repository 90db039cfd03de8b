"""Dilated 3x3 convolutions as Winograd over phase planes
(crosscompile/winograd.py, WinogradPlan): DeepLabV3's backbone dilates
its last stages' 3x3 convolutions by 2 and 4 with padding to match. Each
compiles for the host (and one for an emulated board), runs as Winograd,
and stays within the variant's bound of onnxruntime's result, for sizes
whose phases differ in size and channel counts that are not whole
vectors."""
import numpy as np
import pytest
from onnx import numpy_helper

import crosscompile
import minirt
from crosscompile import winograd
from crosscompile.target import resolve_target
from tests.cross_targets import emulated_tools, run_emulated
from tests.onnx_models import conv_relu_model, reference, sample_input
from tests.test_winograd import ERROR_ROUNDINGS

# (input channels, output channels, size, dilation): 15 / 2 gives phases
# of 8 and 7 rows, 22 / 4 phases of 6 and 5.
CASES = [(64, 64, 28, 2), (36, 40, 15, 2), (64, 64, 28, 4), (20, 52, 22, 4)]


def _magnitude_sums(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, dilation: int) -> np.ndarray:
    """S = sum |w| |x| + |b| of a 3x3 convolution dilated and padded by `dilation`, in float64."""
    d = dilation
    padded = np.pad(np.abs(x[0]).astype(np.float64), ((0, 0), (d, d), (d, d)))
    h, w = x.shape[2:]
    sums = np.zeros((weight.shape[0], h, w)) + np.abs(bias)[:, None, None]
    for i in range(3):
        for j in range(3):
            window = padded[:, i * d:i * d + h, j * d:j * d + w]
            sums += np.einsum("mc,chw->mhw", np.abs(weight[:, :, i, j]), window)
    return sums[None]


def _model(channels, outputs, size, dilation):
    return conv_relu_model((1, channels, size, size), (outputs, channels, 3, 3),
                           {"pads": [dilation] * 4, "dilations": [dilation, dilation]})


def _assert_within_bound(model, feeds, got, want, tile, dilation):
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    sums = _magnitude_sums(feeds["x"], params["w"], params["b"], dilation)
    bound = ERROR_ROUNDINGS[tile] * np.finfo(np.float32).eps * sums
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= bound), float((np.abs(got - want) / bound).max())


@pytest.mark.parametrize("channels,outputs,size,dilation", CASES)
def test_dilated_convolution_runs_as_winograd_on_the_host(tmp_path, channels, outputs, size, dilation):
    model = _model(channels, outputs, size, dilation)
    lib = crosscompile.build(model, target="host")
    (tile,) = [t["winograd_tile"] for t in lib.metadata["gemm_tiles"]]
    assert tile in winograd.VARIANTS
    feeds = sample_input(model)
    (want,) = reference(model, feeds)
    (got,) = minirt.load(lib.export_library(str(tmp_path / "conv.so"))).run(feeds)
    _assert_within_bound(model, feeds, got, want, tile, dilation)


def test_dilated_convolution_on_an_emulated_board(tmp_path):
    emulated_tools("rasp4b64")
    model = _model(36, 40, 22, 4)
    lib = crosscompile.build(model, target="rasp4b64")
    (tile,) = [t["winograd_tile"] for t in lib.metadata["gemm_tiles"]]
    assert tile in winograd.VARIANTS
    feeds = sample_input(model)
    (want,) = reference(model, feeds)
    got = run_emulated(lib, "rasp4b64", feeds["x"], want.shape, tmp_path)
    _assert_within_bound(model, feeds, got, want, tile, 4)


def test_plan_splits_a_dilated_convolution_into_phases():
    geometry = ((1, 28, 28), (1, 3, 3), (1, 1, 1), (1, 4, 4), (0, 4, 4), (0, 4, 4), (1, 28, 28))
    p = winograd.plan(geometry, 512, 512, 2)
    # 16 phases of 7 x 7 outputs, each 4 x 4 tiles of 2 x 2.
    assert (p.phases, p.th, p.tw, p.tiles, p.hp, p.wp) == (16, 4, 4, 256, 10, 10)
    uneven = ((1, 28, 28), (1, 3, 3), (1, 1, 1), (1, 2, 4), (0, 2, 4), (0, 2, 4), (1, 28, 28))
    assert winograd.plan(uneven, 64, 64) is None


@pytest.mark.parametrize("preset", ["rasp4b64", "rasp3b"])
def test_chosen_where_phases_hold_whole_tiles(preset):
    target = resolve_target(preset)
    backbone = ((1, 28, 28), (1, 3, 3), (1, 1, 1), (1, 4, 4), (0, 4, 4), (0, 4, 4), (1, 28, 28))
    assert winograd.choose(target, backbone, 512, 512, 1)
    # ASPP's dilation 12 on a 14 x 14 map: 144 phases of one or two
    # outputs a side, each a whole tile of products for a pixel or four.
    aspp = ((1, 14, 14), (1, 3, 3), (1, 1, 1), (1, 12, 12), (0, 12, 12), (0, 12, 12), (1, 14, 14))
    assert not winograd.choose(target, aspp, 960, 256, 1)
