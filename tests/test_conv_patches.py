"""Convolutions with large strides, read as stride phases of a padded copy
of the input: a ViT-style patch embedding (kernel = stride = 8) and
strided, padded and dilated windows with more than four phases. Each
compiles for the host and the boards and agrees with onnxruntime. The
phases are copied by one loop over them: written out one by one, the 64
phases of stride 8 made LLVM's optimiser take minutes."""
import pytest

import crosscompile
from tests.onnx_models import conv_relu_model, run_host

CASES = {
    "patch8": ((1, 3, 64, 64), (64, 3, 8, 8), {"strides": [8, 8]}),
    "patch4_padded": ((1, 3, 30, 30), (16, 3, 4, 4), {"strides": [4, 4], "pads": [1, 2, 1, 0]}),
    "stride3_3x3": ((1, 8, 20, 17), (12, 8, 3, 3), {"strides": [3, 3], "pads": [1, 1, 1, 1]}),
    "stride3_dilated": ((1, 4, 23, 23), (8, 4, 3, 3), {"strides": [3, 3], "dilations": [2, 2],
                                                       "pads": [2, 2, 2, 2]}),
}


@pytest.mark.parametrize("case", CASES)
def test_strided_convolution_matches_onnxruntime_on_host(tmp_path, case):
    x, w, attrs = CASES[case]
    lib = run_host(conv_relu_model(x, w, attrs), tmp_path)
    assert lib.summary["gemm_convs"] == 1


@pytest.mark.parametrize("preset", ["rasp4b64", "rasp3b"])
def test_patch_embedding_compiles_for_boards(tmp_path, preset):
    x, w, attrs = CASES["patch8"]
    lib = crosscompile.build(conv_relu_model(x, w, attrs), target=preset)
    so = lib.export_library(tmp_path / "patch.so")
    assert open(so, "rb").read(4) == b"\x7fELF"
    assert lib.metadata["gemm_tiles"][0]["shape"] == "x1x3x64x64-w64x3x8x8-s8x8-p0x0x0x0-d1x1-g1"
