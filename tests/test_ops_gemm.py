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
