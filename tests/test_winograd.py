"""Winograd F(2x2, 3x3) and F(4x4, 3x3) (crosscompile/winograd.py): their
transforms compute a 3x3 correlation, a variant is chosen per convolution
where it saves work, and on the boards' targets and on the host a compiled
convolution stays within a stated bound of onnxruntime's result.

The bound: each output differs from onnxruntime's by at most
ERROR_ROUNDINGS[tile] float32 roundings (eps = 2^-23) of the sum of the
magnitudes it adds up, S = sum |w| |x| + |b|. F(2x2, 3x3)'s transforms hold
0, +-1 and +-1/2 only, so its transformed values stay of the size of the
input's; on the host the largest error measured was about 1 eps S, the
direct GEMM's about 2. F(4x4, 3x3)'s hold up to 8 and 1/24: its values
grow several times larger than those they came from, and its largest
error measured on an AVX-512 host (16 - 256 channels) was about 14 eps S.
"""
import re

import numpy as np
import pytest
from onnx import numpy_helper

import crosscompile
import minirt
from crosscompile import winograd
from crosscompile.target import Target, resolve_target
from tests.architectures import resnet
from tests.cross_targets import emulated_tools, run_emulated
from tests.onnx_models import assert_zoo_matches, conv_relu_model, reference, sample_input

ERROR_ROUNDINGS = {2: 4, 4: 24}


class _NumpyOps:
    """The transforms' arithmetic on numpy arrays."""

    @staticmethod
    def add(a, b):
        return a + b

    @staticmethod
    def sub(a, b):
        return a - b

    @staticmethod
    def muladd(c, a, b):
        return c * a + b


def _matrix(rows_of, size: int) -> np.ndarray:
    """The matrix a variant's one-axis transform applies: its columns are
    the transform of the unit vectors."""
    return np.array(rows_of(_NumpyOps, list(np.eye(size)))).reshape(-1, size)


@pytest.mark.parametrize("tile", sorted(winograd.VARIANTS))
def test_transforms_compute_a_3x3_correlation(tile):
    variant = winograd.VARIANTS[tile]
    size = variant.patch
    b_t, a_t = _matrix(variant.input_rows, size), _matrix(variant.output_rows, size)
    assert b_t.shape == (size, size) and a_t.shape == (tile, size)
    rng = np.random.default_rng(0)
    for _ in range(20):
        d, g = rng.standard_normal((size, size)), rng.standard_normal((3, 3))
        got = a_t @ ((variant.g @ g @ variant.g.T) * (b_t @ d @ b_t.T)) @ a_t.T
        want = [[(d[i:i + 3, j:j + 3] * g).sum() for j in range(tile)] for i in range(tile)]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tile", sorted(winograd.VARIANTS))
def test_packed_weights_are_the_transformed_filters(tile):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    mr, g = 4, winograd.VARIANTS[tile].g
    positions = len(g) ** 2
    packed = winograd.transform_weights(weight, mr, tile).reshape(positions, 2, 3, mr)  # 5 rows: 2 blocks of 4
    u = np.einsum("ar,mcrs,bs->abmc", g, weight, g).reshape(positions, 5, 3)
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
                                    Target.parse("x86_64-linux-gnu/znver3/+avx,+avx2,+fma")])
def test_chosen_for_deep_3x3_stride_1_convolutions(target):
    chosen = [winograd.choose(target, _geometry(size), channels, channels, 1)
              for channels, size in ((64, 56), (128, 28), (256, 14), (512, 7))]  # ResNet-18's
    # F(4x4, 3x3) where it has 16 tiles or more per product; at 7 x 7 its
    # four tiles use each of 512 x 512 x 36 transformed weights four
    # times, and streaming them costs more than F(2x2, 3x3)'s products do.
    assert chosen == [4, 4, 4, 2]
    assert not winograd.choose(target, _geometry(56, stride=2), 64, 64, 1)
    assert not winograd.choose(target, _geometry(56, kernel=5), 64, 64, 1)
    assert not winograd.choose(target, _geometry(56, kernel=1), 64, 64, 1)
    assert not winograd.choose(target, _geometry(56), 64, 64, 64)  # depthwise
    assert not winograd.choose(target, _geometry(56), 8, 64, 1)  # transforms cost more than they save


def _magnitude_sums(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """S = sum |w| |x| + |b| of a 3x3 convolution padded by 1, in float64."""
    padded = np.pad(np.abs(x[0]).astype(np.float64), ((0, 0), (1, 1), (1, 1)))
    h, w = x.shape[2:]
    sums = np.zeros((weight.shape[0], h, w)) + np.abs(bias)[:, None, None]
    for i in range(3):
        for j in range(3):
            sums += np.einsum("mc,chw->mhw", np.abs(weight[:, :, i, j]), padded[:, i:i + h, j:j + w])
    return sums[None]


def _assert_within_bound(model, feeds, got, want, tile):
    params = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    bound = ERROR_ROUNDINGS[tile] * np.finfo(np.float32).eps * _magnitude_sums(feeds["x"], params["w"], params["b"])
    assert np.all(np.abs(got - want) <= bound), float((np.abs(got - want) / bound).max())


@pytest.mark.parametrize("preset", ["rasp4b64", "rasp3b"])
@pytest.mark.parametrize("channels,outputs,size,tile", [(64, 64, 28, 4), (32, 48, 15, 4), (64, 64, 6, 2)])
def test_error_within_bound_of_onnxruntime_on_emulated_boards(tmp_path, preset, channels, outputs, size, tile):
    emulated_tools(preset)
    model = conv_relu_model((1, channels, size, size), (outputs, channels, 3, 3), {"pads": [1, 1, 1, 1]})
    lib = crosscompile.build(model, target=preset)
    assert [t["winograd_tile"] for t in lib.metadata["gemm_tiles"]] == [tile]
    feeds = sample_input(model)
    (want,) = reference(model, feeds)
    got = run_emulated(lib, preset, feeds["x"], want.shape, tmp_path)
    _assert_within_bound(model, feeds, got, want, tile)


def test_error_within_bound_of_onnxruntime_on_the_host(tmp_path):
    """Which variant a shape gets depends on the host's vector width; on
    AVX2, AVX-512 and AArch64 hosts alike these cases take both."""
    seen = set()
    for channels, outputs, size in ((64, 64, 28), (32, 48, 15), (16, 64, 13), (64, 64, 10), (64, 64, 6)):
        model = conv_relu_model((1, channels, size, size), (outputs, channels, 3, 3), {"pads": [1, 1, 1, 1]})
        lib = crosscompile.build(model, target="host")
        (tile,) = [t["winograd_tile"] for t in lib.metadata["gemm_tiles"]]
        assert tile in winograd.VARIANTS, (channels, outputs, size)
        seen.add(tile)
        feeds = sample_input(model)
        (want,) = reference(model, feeds)
        (got,) = minirt.load(lib.export_library(str(tmp_path / f"conv{size}.so"))).run(feeds)
        _assert_within_bound(model, feeds, got, want, tile)
    assert seen == set(winograd.VARIANTS)


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
