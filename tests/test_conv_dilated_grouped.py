"""Dilated and grouped convolutions (DeepLabV3's ASPP, RegNet's grouped
3x3s), small. Each compiles for the host and agrees with onnxruntime; a
dilated convolution whose outer taps read only padding runs with those
taps dropped (its weights cropped, its padding shrunk), which the module's
tile table shows."""
import pytest

from tests.onnx_models import conv_relu_model, run_host

DILATED = {
    # Every tap meets the map for some outputs: nothing to drop.
    "d2": ((1, 8, 12, 12), (16, 8, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}, (3, 3)),
    # Dilation past the 6 x 6 map: only the centre tap meets it, a 1x1 convolution.
    "d12": ((1, 8, 6, 6), (16, 8, 3, 3), {"pads": [12, 12, 12, 12], "dilations": [12, 12]}, (1, 1)),
    # Rows: the top tap always reads padding, the bottom one meets the map.
    "d4_uneven": ((1, 4, 5, 9), (8, 4, 3, 3), {"pads": [4, 1, 0, 1], "dilations": [4, 1]}, (2, 3)),
    # A 5x5 kernel with dilation 3 on a 5 x 5 map: its outer ring never meets it.
    "k5_d3_strided": ((1, 6, 5, 5), (8, 6, 5, 5), {"pads": [6, 6, 6, 6], "dilations": [3, 3],
                                                   "strides": [2, 2]}, (3, 3)),
}


@pytest.mark.parametrize("case", DILATED)
def test_dilated_convolution_matches_onnxruntime_with_dead_taps_dropped(tmp_path, case):
    x, w, attrs, live = DILATED[case]
    lib = run_host(conv_relu_model(x, w, attrs), tmp_path)
    (tile,) = lib.metadata["gemm_tiles"]
    assert f"-w{w[0]}x{w[1]}x{live[0]}x{live[1]}-" in tile["shape"]


GROUPED = {
    f"width{width}_stride{stride}": ((1, width * groups, 10, 10), (width * groups, width, 3, 3),
                                     {"pads": [1, 1, 1, 1], "strides": [stride, stride], "group": groups})
    for width, groups in ((16, 3), (24, 2)) for stride in (1, 2)
}


@pytest.mark.parametrize("case", GROUPED)
def test_grouped_convolution_matches_onnxruntime(tmp_path, case):
    x, w, attrs = GROUPED[case]
    lib = run_host(conv_relu_model(x, w, attrs), tmp_path)
    assert lib.summary["gemm_convs"] == 1
