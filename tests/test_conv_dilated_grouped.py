"""Dilated and grouped convolutions (DeepLabV3's ASPP, RegNet's grouped
3x3s), small. Each compiles for the host and agrees with onnxruntime; a
dilated convolution whose outer taps read only padding runs with those
taps dropped (its weights cropped, its padding shrunk), and one whose
outputs read different taps by position runs region by region, each with
its own taps; the module's tile table shows both."""
import re

import pytest

from tests.onnx_models import conv_relu_model, run_host

DILATED = {
    # Every tap meets the map for some outputs: nothing to drop.
    "d2": ((1, 8, 12, 12), (16, 8, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}, (3, 3)),
    # Dilation past the 6 x 6 map: only the centre tap meets it, a 1x1 convolution.
    "d12": ((1, 8, 6, 6), (16, 8, 3, 3), {"pads": [12, 12, 12, 12], "dilations": [12, 12]}, (1, 1)),
    # Rows: the top tap always reads padding, the bottom one meets the map.
    "d4_uneven": ((1, 4, 5, 9), (8, 4, 3, 3), {"pads": [4, 1, 0, 1], "dilations": [4, 1]}, (2, 3)),
    # A 5x5 kernel with dilation 3 on a 5 x 5 map: its outer ring never meets
    # it, and of the 3 x 3 left, output row (column) 0 reads taps 1-2, row 1
    # tap 1 only and row 2 taps 0-1: nine regions, with 2, 1 and 2 taps a side.
    "k5_d3_strided": ((1, 6, 5, 5), (8, 6, 5, 5), {"pads": [6, 6, 6, 6], "dilations": [3, 3],
                                                   "strides": [2, 2]},
                      [(2, 2), (2, 1), (2, 2), (1, 2), (1, 1), (1, 2), (2, 2), (2, 1), (2, 2)]),
    # DeepLabV3's ASPP at dilation 12 on a 14 x 14 map: rows 0-1 read the
    # centre and bottom tap rows, rows 2-11 the centre one, rows 12-13 the top
    # and centre ones; columns alike. 0.18x the multiplications of 3 x 3.
    "aspp_d12": ((1, 8, 14, 14), (16, 8, 3, 3), {"pads": [12, 12, 12, 12], "dilations": [12, 12]},
                 [(2, 2), (2, 1), (2, 2), (1, 2), (1, 1), (1, 2), (2, 2), (2, 1), (2, 2)]),
}


@pytest.mark.parametrize("case", DILATED)
def test_dilated_convolution_matches_onnxruntime_with_dead_taps_dropped(tmp_path, case):
    x, w, attrs, live = DILATED[case]
    lib = run_host(conv_relu_model(x, w, attrs), tmp_path)
    kernels = [tuple(int(k) for k in re.search(r"-w\d+x\d+x(\d+)x(\d+)-", tile["shape"]).groups())
               for tile in lib.metadata["gemm_tiles"]]
    assert kernels == (live if isinstance(live, list) else [live])


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
