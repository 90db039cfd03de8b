"""Winograd F(2x2, 3x3) (crosscompile/winograd.py): its transforms compute
a 3x3 correlation, it is chosen per convolution where it saves work, and on
the boards' targets and on the host a compiled convolution stays within a
stated bound of onnxruntime's result.

The bound: each output differs from onnxruntime's by at most
ERROR_ROUNDINGS float32 roundings (eps = 2^-23) of the sum of the
magnitudes it adds up, S = sum |w| |x| + |b|. The transforms' entries are
0, +-1 and +-1/2, so the transformed values stay of the size of the
input's; on the host the largest error measured was about 1 eps S, the
direct GEMM's about 2.
"""
import re

import numpy as np
import pytest
from onnx import numpy_helper

import crosscompile
import minirt
from crosscompile import winograd
from crosscompile.gemm import tile_for
from crosscompile.target import Target, resolve_target
from tests.architectures import resnet
from tests.cross_targets import emulated_tools, run_emulated
from tests.onnx_models import assert_zoo_matches, conv_relu_model, reference, sample_input

ERROR_ROUNDINGS = 4


def _matrix(terms_by_row, columns: int) -> np.ndarray:
    matrix = np.zeros((len(terms_by_row), columns))
    for row, terms in enumerate(terms_by_row):
        for sign, column in terms:
            matrix[row, column] = sign
    return matrix


def test_transforms_compute_a_3x3_correlation():
    rng = np.random.default_rng(0)
    b_t, a_t = _matrix(winograd.B_T, 4), _matrix(winograd.A_T, 4)
    for _ in range(20):
        d, g = rng.standard_normal((4, 4)), rng.standard_normal((3, 3))
        got = a_t @ ((winograd.G @ g @ winograd.G.T) * (b_t @ d @ b_t.T)) @ a_t.T
        want = [[(d[i:i + 3, j:j + 3] * g).sum() for j in range(2)] for i in range(2)]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_packed_weights_are_the_transformed_filters():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    mr = 4
    packed = winograd.transform_weights(weight, mr).reshape(16, 2, 3, mr)  # 5 rows: 2 blocks of 4
    u = np.einsum("ar,mcrs,bs->abmc", winograd.G, weight, winograd.G).reshape(16, 5, 3)
    np.testing.assert_allclose(packed[:, 0].transpose(0, 2, 1), u[:, :4], rtol=1e-6)
    np.testing.assert_allclose(packed[:, 1, :, 0], u[:, 4], rtol=1e-6)
    assert not packed[:, 1, :, 1:].any()  # padding rows of the last block


def _geometry(size: int, stride: int = 1, kernel: int = 3):
    out = (size + 2 * (kernel // 2) - kernel) // stride + 1
    pad = kernel // 2
    return ((1, size, size), (1, kernel, kernel), (1, stride, stride), (1, 1, 1), (0, pad, pad),
            (0, pad, pad), (1, out, out))


@pytest.mark.parametrize("target", [resolve_target("rasp4b64"), resolve_target("rasp3b"),
                                    Target.parse("x86_64-linux-gnu/skylake-avx512/+avx512f"),
                                    Target.parse("x86_64-linux-gnu/znver3/+avx2,+fma")])
def test_chosen_for_deep_3x3_stride_1_convolutions(target):
    for channels, size in ((64, 56), (128, 28), (256, 14), (512, 7)):  # ResNet-18's
        # At 7 x 7 the 16 tiles fill a quarter of AVX-512's 64-column
        # panel: the estimate keeps the direct GEMM there.
        chosen = size > 7 or tile_for(target).nr < 4 * 16
        assert winograd.pays(target, _geometry(size), channels, channels, 1) == chosen
    assert not winograd.pays(target, _geometry(56, stride=2), 64, 64, 1)
    assert not winograd.pays(target, _geometry(56, kernel=5), 64, 64, 1)
    assert not winograd.pays(target, _geometry(56, kernel=1), 64, 64, 1)
    assert not winograd.pays(target, _geometry(56), 64, 64, 64)  # depthwise
    assert not winograd.pays(target, _geometry(56), 8, 64, 1)  # transforms cost more than they save


def _magnitude_sums(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """S = sum |w| |x| + |b| of a 3x3 convolution padded by 1, in float64."""
    padded = np.pad(np.abs(x[0]).astype(np.float64), ((0, 0), (1, 1), (1, 1)))
    h, w = x.shape[2:]
    sums = np.zeros((weight.shape[0], h, w)) + np.abs(bias)[:, None, None]
    for i in range(3):
        for j in range(3):
            sums += np.einsum("mc,chw->mhw", np.abs(weight[:, :, i, j]), padded[:, i:i + h, j:j + w])
    return sums[None]


@pytest.mark.parametrize("preset", ["rasp4b64", "rasp3b"])
@pytest.mark.parametrize("channels,outputs,size", [(64, 64, 28), (32, 48, 15)])
def test_error_within_bound_of_onnxruntime_on_emulated_boards(tmp_path, preset, channels, outputs, size):
    emulated_tools(preset)
    model = conv_relu_model((1, channels, size, size), (outputs, channels, 3, 3), {"pads": [1, 1, 1, 1]})
    lib = crosscompile.build(model, target=preset)
    assert [t["winograd"] for t in lib.metadata["gemm_tiles"]] == [True]
    feeds = sample_input(model)
    (want,) = reference(model, feeds)
    got = run_emulated(lib, preset, feeds["x"], want.shape, tmp_path)
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    bound = ERROR_ROUNDINGS * np.finfo(np.float32).eps * _magnitude_sums(feeds["x"], params["w"], params["b"])
    assert np.all(np.abs(got - want) <= bound), float((np.abs(got - want) / bound).max())


@pytest.mark.parametrize("channels,outputs,size", [(64, 64, 28), (32, 48, 15), (16, 64, 13)])
def test_error_within_bound_of_onnxruntime_on_the_host(tmp_path, channels, outputs, size):
    model = conv_relu_model((1, channels, size, size), (outputs, channels, 3, 3), {"pads": [1, 1, 1, 1]})
    lib = crosscompile.build(model, target="host")
    assert [t["winograd"] for t in lib.metadata["gemm_tiles"]] == [True]
    feeds = sample_input(model)
    (want,) = reference(model, feeds)
    (got,) = minirt.load(lib.export_library(str(tmp_path / "conv.so"))).run(feeds)
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    bound = ERROR_ROUNDINGS * np.finfo(np.float32).eps * _magnitude_sums(feeds["x"], params["w"], params["b"])
    assert np.all(np.abs(got - want) <= bound), float((np.abs(got - want) / bound).max())


def test_resnet18_on_the_host_matches_onnxruntime(tmp_path):
    """Which of ResNet-18's 3x3 convolutions pay depends on the host's
    vector width (at 4 x 4, 512 channels do with AVX2's 8 lanes and not
    with AVX-512's 16): those of 64 and 128 channels pay on every x86 and
    ARM host, and run as Winograd here."""
    model = resnet(18, size=112)
    lib = crosscompile.build(model, target="host")
    dense_3x3 = [t for t in lib.metadata["gemm_tiles"]
                 if re.search(r"x3x3-s1x1-p1x1x1x1-d1x1-g1$", t["shape"])]
    narrow = [t for t in dense_3x3 if int(re.match(r"x1x(\d+)x", t["shape"]).group(1)) <= 128]
    assert len(narrow) == 7 and all(t["winograd"] for t in narrow), narrow
    feeds = sample_input(model)
    got = minirt.load(lib.export_library(str(tmp_path / "resnet18.so")), threads=2).run(feeds)
    assert_zoo_matches(got, reference(model, feeds))


def test_resnet18_on_an_emulated_board_matches_onnxruntime(tmp_path):
    """Odd sizes (7 x 7), residual Adds fused into the products' output
    transform, and ReLU after them."""
    emulated_tools("rasp4b64")
    model = resnet(18, size=112)
    lib = crosscompile.build(model, target="rasp4b64")
    assert sum(t["winograd"] for t in lib.metadata["gemm_tiles"]) >= 8
    feeds = sample_input(model)
    want = reference(model, feeds)
    got = run_emulated(lib, "rasp4b64", feeds["input"], want[0].shape, tmp_path)
    assert_zoo_matches([got], want)
