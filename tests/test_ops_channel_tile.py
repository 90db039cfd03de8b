"""The transposed register tile (gemm.emit_channel_gemm): vectors of output
channels by output pixels, one broadcast per pixel, each tile moved
between its vectors and the channel-major output by in-register
transposes. Shapes give partial channel vectors (13, 40 = 16 + 16 + 8 and
35 = 16 + 16 + 3 channels), partial pixel tiles, 1x1 and 3x3 kernels, a
fused residual add (the residual loaded through the same transpose) and
groups; each tile size is compared with onnxruntime on 1, 2 and 3 threads."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from crosscompile.gemm import GemmTile, channel_tile, tile_for
from crosscompile.target import resolve_target
from crosscompile.tuning import conv_shapes
from tests.onnx_models import make_model, reference
from tests.test_crosscompile import rand

HOST = resolve_target("host")
LANES = tile_for(HOST).lanes
# 6 pixels x 4 vectors (the default), 14 x 2, 9 x 3, 1 vector x 16 and
# x 24 pixels (more pixels than lanes: a row's run spans two vectors).
TILES = [channel_tile(tile_for(HOST))] + [GemmTile(LANES, LANES * nv, nv, pixels)
                                          for pixels, nv in ((14, 2), (9, 3), (16, 1), (24, 1))]


def residual_model(x_shape, cout, kernel, group=1, residual=True):
    """y = Relu(Conv(x) + r) (or Relu(Conv(x))), r an input shaped like the conv's output."""
    cin = x_shape[1]
    w = (rand(cout, cin // group, kernel, kernel, seed=2) / np.sqrt(cin * kernel * kernel)).astype(np.float32)
    pads = [kernel // 2] * 4
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=pads, group=group)]
    if residual:
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
    nodes.append(helper.make_node("Relu", ["s" if residual else "c"], ["y"]))
    out = (x_shape[0], cout, *x_shape[2:])
    inputs = {"x": x_shape, **({"r": out} if residual else {})}
    return make_model(nodes, inputs, {"y": None}, {"w": w, "b": rand(cout, seed=4)})


CASES = [
    ((1, 24, 9, 11), 40, 3, 1, True),     # 3x3 with a fused residual, 99 pixels
    ((1, 64, 7, 7), 35, 1, 1, True),      # 1x1, 49 pixels, channels 16 + 16 + 3
    ((2, 20, 5, 13), 13, 3, 1, False),    # batch 2, one partial channel vector
    ((1, 16, 10, 10), 48, 3, 2, True),    # two groups of 24 channels
    ((1, 32, 3, 3), 64, 1, 1, True),      # fewer pixels than one tile
]


@pytest.mark.parametrize("tile", TILES, ids=lambda t: t.label)
@pytest.mark.parametrize("x_shape,cout,kernel,group,residual", CASES)
def test_channel_tiles_match_onnxruntime_on_1_2_3_threads(tmp_path, x_shape, cout, kernel, group, residual,
                                                           tile):
    model = residual_model(x_shape, cout, kernel, group, residual)
    (shape,) = conv_shapes(model)
    lib = crosscompile.build(model, target="host", schedules={shape.key: tile.spec})
    assert [t["tile"] for t in lib.metadata["gemm_tiles"]] == [tile.spec]
    assert lib.summary["fused_kernels"] == 1
    feeds = {"x": rand(*x_shape, seed=3)}
    if residual:
        feeds["r"] = rand(x_shape[0], cout, *x_shape[2:], seed=5)
    want = reference(model, feeds)[0]
    module = minirt.load(lib.export_library(tmp_path / "m.so"))
    for threads in (1, 2, 3):
        module.set_threads(threads)
        for _ in range(2):
            np.testing.assert_allclose(module.run(feeds)[0], want, rtol=1e-4, atol=1e-5)
    module.close()


def test_a_transposed_tile_scheduled_for_a_3d_convolution_is_refused_with_the_fix():
    from crosscompile import BuildError
    from tests.onnx_models import conv_relu_model
    model = conv_relu_model((1, 4, 5, 6, 7), (8, 4, 3, 3, 3), {"pads": [1] * 6})
    (shape,) = conv_shapes(model)
    with pytest.raises(BuildError, match=r"transposed tile 16x1x16 .* schedule a tile of rows"):
        crosscompile.build(model, target="host", schedules={shape.key: [16, 1, 16]})
    # The default tile for it (rows) builds.
    assert crosscompile.build(model, target="host").metadata["gemm_tiles"][0]["tile"] == tile_for(HOST).spec
