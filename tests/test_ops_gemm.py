"""Convolutions through the GEMM micro-kernel with im2col packed in column
panels: packed a chunk of panels at a time by each thread (many output
columns), or whole before the GEMM (few columns, the threads split the
rows). Shapes give partial panels, panels crossing output rows and padding,
several chunks, and threads without a share; every result is compared with
onnxruntime for 1, 2 and 3 threads."""
import numpy as np
import pytest

import crosscompile
import minirt
from crosscompile.gemm import PACK_CHUNK_BYTES, splits_columns, tile_for
from crosscompile.target import resolve_target
from crosscompile.tuning import conv_shapes
from tests.onnx_models import conv_relu_model, rand, reference

HOST = resolve_target("host")
CASES = [
    # (input, weight, attrs): many columns, so the threads pack their own panels
    ((1, 17, 37, 41), (20, 17, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 3, 61, 59), (13, 3, 7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),  # stem-like, strided
    ((1, 40, 23, 29), (70, 40, 3, 3), {"pads": [0, 2, 1, 0], "dilations": [1, 2]}),
    ((1, 8, 6, 9, 10), (9, 8, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1]}),  # 3-D: columns cross planes
    # few columns and many rows: whole im2col, threads split the row blocks
    ((1, 64, 5, 6), (100, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 6, 4, 4), (26, 3, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
def test_packed_im2col_conv_matches_onnxruntime_on_1_2_3_threads(tmp_path, x_shape, w_shape, attrs):
    model = conv_relu_model(x_shape, w_shape, attrs)
    x = rand(*x_shape, seed=3)
    want = reference(model, {"x": x})[0]
    # The register tile of rows: convolutions reading windows default to the
    # transposed tile, which reads them in place (tests/test_ops_direct.py).
    (shape,) = conv_shapes(model)
    lib = crosscompile.build(model, target="host", schedules={shape.key: tile_for(HOST).spec})
    module = minirt.load(lib.export_library(tmp_path / "m.so"))
    for threads in (1, 2, 3):
        module.set_threads(threads)
        for _ in range(3):  # a race between packing and multiplying would show as differing runs
            got = module.run({"x": x})[0]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    module.close()


def test_cases_cover_both_packing_paths_and_several_chunks():
    """The shapes above reach what they are meant to on this host's tile:
    per-thread packing over more than one chunk, and the whole-im2col path."""
    tile = tile_for(HOST)
    columns, rows = [], []
    for x_shape, w_shape, attrs in CASES:
        model = conv_relu_model(x_shape, w_shape, attrs)
        n = int(np.prod(reference(model, {"x": rand(*x_shape)})[0].shape[2:]))
        m = w_shape[0] // attrs.get("group", 1)
        kdim = int(np.prod(w_shape[1:]))
        (columns if splits_columns(tile, m, n) else rows).append((kdim, n))
    chunk_columns = [PACK_CHUNK_BYTES // (4 * kdim * tile.nr) * tile.nr for kdim, _ in columns]
    assert any(n > 2 * c for (_, n), c in zip(columns, chunk_columns))
    assert rows


AVX2 = "x86_64-unknown-linux-gnu/haswell/+avx,+avx2,+fma"
HOST_RUNS_AVX2 = HOST.arch == "x86_64" and {"+avx2", "+fma"} <= set(HOST.features.split(","))


@pytest.mark.skipif(not HOST_RUNS_AVX2, reason="this host cannot run AVX2 code natively")
@pytest.mark.parametrize("depth", [1, 3, 4, 6, 27, 67])
@pytest.mark.parametrize("tile", [[6, 2], [16, 2, 6]])
def test_avx2_reduction_loops_in_fours_and_their_remainders(tmp_path, depth, tile):
    """AVX2 micro-kernels take four reduction steps per trip
    (Target.reduction_unroll), then the remaining ones singly: depths below,
    at and past four, with every remainder, on both kinds of tile, match
    onnxruntime whatever this host's own vector width."""
    target = resolve_target(AVX2)
    assert target.reduction_unroll == 4
    x_shape, w_shape = (1, depth, 9, 11), (16, depth, 1, 1)
    model = conv_relu_model(x_shape, w_shape, {})
    x = rand(*x_shape, seed=5)
    (shape,) = conv_shapes(model)
    lib = crosscompile.build(model, target=AVX2, schedules={shape.key: tile})
    assert lib.metadata["gemm_tiles"][0]["tile"] == tile
    module = minirt.load(lib.export_library(tmp_path / "m.so"), threads=1)
    np.testing.assert_allclose(module.run({"x": x})[0], reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    module.close()
