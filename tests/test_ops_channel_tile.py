"""The transposed register tile (gemm.emit_channel_gemm): vectors of output
channels by output pixels, one broadcast per pixel, each tile moved
between its vectors and the channel-major output by in-register
transposes. Shapes give partial channel vectors (13 and 35 channels leave
one at 4, 8 and 16 lanes), partial pixel tiles, 1x1 and 3x3 kernels, a
fused residual add (the residual loaded through the same transpose) and
groups. Tiles are taken from the lanes and registers of the target they
are built for: on the host each is compared with onnxruntime on 1, 2 and
3 threads; for an AVX-512 x86-64 and an aarch64 target, which this host
may not run, each is compiled into an ELF for that machine."""
import re

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile
from onnx import helper

import crosscompile
import minirt
from crosscompile import BuildError
from crosscompile.gemm import GemmTile, channel_tile, tile_for
from crosscompile.schedule import default_tile, fits, most_rows
from crosscompile.target import resolve_target
from crosscompile.tuning import conv_shapes
from tests.onnx_models import make_model, rand, reference

HOST = resolve_target("host")
# Targets compiled for but not run: name -> (target, ELF machine). The
# features name AVX-512 explicitly, since the width kernels assume comes
# from them, not from the CPU name.
AVX512 = "x86_64-unknown-linux-gnu/skylake-avx512/+avx512f"
CROSS = {"avx512": (AVX512, "EM_X86_64"), "rasp4b64": ("rasp4b64", "EM_AARCH64")}


def channel_tiles(target) -> list:
    """Transposed tiles for a target: its default; 2, 3 and 4 vectors of
    channels by as many pixels as its registers hold; one vector by as
    many pixels as lanes, and by half as many again (each channel's run of
    pixels then spans two vectors)."""
    lanes = target.lanes
    tiles = [channel_tile(tile_for(target))]
    tiles += [GemmTile(lanes, lanes * nv, nv, most_rows(target, nv)) for nv in (2, 3, 4)]
    tiles += [GemmTile(lanes, lanes, 1, pixels) for pixels in (lanes, lanes + lanes // 2)]
    return [t for i, t in enumerate(tiles) if t not in tiles[:i] and fits(target, t.pixels, t.nv)]


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
    ((1, 64, 7, 7), 35, 1, 1, True),      # 1x1, 49 pixels, 35 channels: 32 + 3
    ((2, 20, 5, 13), 13, 3, 1, False),    # batch 2, one partial channel vector
    ((1, 16, 10, 10), 48, 3, 2, True),    # two groups of 24 channels
    ((1, 32, 3, 3), 64, 1, 1, True),      # 9 pixels, fewer than the larger tiles hold
]


def build_with_tile(model, target, tile):
    """model built for target with its one convolution scheduled on tile,
    fused with its Relu (and residual Add)."""
    (shape,) = conv_shapes(model)
    lib = crosscompile.build(model, target=target, schedules={shape.key: tile.spec})
    assert [t["tile"] for t in lib.metadata["gemm_tiles"]] == [tile.spec]
    assert lib.summary["fused_kernels"] == 1
    return lib


@pytest.mark.parametrize("tile", channel_tiles(HOST), ids=lambda t: t.label)
@pytest.mark.parametrize("x_shape,cout,kernel,group,residual", CASES)
def test_channel_tiles_match_onnxruntime_on_1_2_3_threads(tmp_path, x_shape, cout, kernel, group, residual,
                                                           tile):
    model = residual_model(x_shape, cout, kernel, group, residual)
    lib = build_with_tile(model, "host", tile)
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


@pytest.mark.parametrize("name,tile", [(name, tile) for name, (target, _) in CROSS.items()
                                       for tile in channel_tiles(resolve_target(target))],
                         ids=lambda v: v if isinstance(v, str) else v.label)
def test_channel_tiles_compile_for_avx512_and_aarch64(tmp_path, name, tile):
    target, machine = CROSS[name]
    for index, (x_shape, cout, kernel, group, residual) in enumerate(CASES):
        lib = build_with_tile(residual_model(x_shape, cout, kernel, group, residual), target, tile)
        with open(lib.export_library(tmp_path / f"m{index}.so"), "rb") as f:
            header = ELFFile(f).header
        assert (header["e_machine"], header["e_type"]) == (machine, "ET_DYN")


@pytest.mark.parametrize("target", ["host", *(target for target, _ in CROSS.values())])
def test_tile_lists_cover_the_shapes_meant(target):
    """Whatever the target, the tiles tried include every count of vectors
    from 1 to 4, more pixels than lanes, and a default; every case leaves a
    partial channel vector or group somewhere."""
    target = resolve_target(target)
    tiles = channel_tiles(target)
    assert tiles[0] == channel_tile(tile_for(target)) and len(tiles) >= 5
    assert {t.nv for t in tiles} == {1, 2, 3, 4}
    assert any(t.pixels > t.lanes for t in tiles)
    assert any(cout % target.lanes for _, cout, *_ in CASES)


def test_the_cross_targets_have_the_lanes_and_registers_the_tiles_assume():
    avx512, arm = resolve_target(AVX512), resolve_target("rasp4b64")
    assert (avx512.lanes, avx512.vector_registers) == (16, 32)
    assert (arm.lanes, arm.vector_registers) == (4, 32)


def test_a_tile_made_for_another_target_is_refused_naming_one_that_fits():
    """A schedule written for a target with more lanes, or more registers,
    is a BuildError naming the convolution and the target's default, and
    that default builds."""
    model = residual_model(*CASES[2])
    (shape,) = conv_shapes(model)
    arm = resolve_target("rasp4b64")
    default = default_tile(arm, shape)
    wide = channel_tile(tile_for(resolve_target(AVX512)))
    with pytest.raises(BuildError, match=rf"{shape.key}.*mr = nv x 4 lanes = {4 * wide.nv}") as info:
        crosscompile.build(model, target=arm, schedules={shape.key: wide.spec})
    assert f"e.g. its default {default.spec}" in str(info.value)
    too_long = GemmTile(arm.lanes, arm.lanes, 1, most_rows(arm, 1) + 1)
    with pytest.raises(BuildError, match=rf"does not fit the {arm.vector_registers} vector registers"):
        crosscompile.build(model, target=arm, schedules={shape.key: too_long.spec})
    build_with_tile(model, arm, default)


def test_a_transposed_tile_scheduled_for_a_3d_convolution_is_refused_with_the_fix():
    from tests.onnx_models import conv_relu_model
    model = conv_relu_model((1, 4, 5, 6, 7), (8, 4, 3, 3, 3), {"pads": [1] * 6})
    (shape,) = conv_shapes(model)
    square = GemmTile(HOST.lanes, HOST.lanes, 1, HOST.lanes)
    with pytest.raises(BuildError, match=rf"transposed tile {re.escape(square.label)} .* schedule a tile of rows"):
        crosscompile.build(model, target="host", schedules={shape.key: square.spec})
    # The default tile for it (rows) builds.
    assert crosscompile.build(model, target="host").metadata["gemm_tiles"][0]["tile"] == tile_for(HOST).spec
