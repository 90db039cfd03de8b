"""Grouped convolutions of few channels per group (RegNet's 3x3s: 8 to 64
output channels per group) on the tile of rows: every group's input copied
once into padded (phase-split) planes, the groups' GEMMs run one after
another with no barrier between them, then every group's rows copied out of
the virtual grid (conv._direct_conv). Outputs as small as 7 x 7 take this
path too, where the grid drops 7 of every 56 columns (conv.IM2COL_MIN_ROWS).
The transposed tile (vectors of channels by pixels, the host's default
for these) copies every group's input once too and runs the groups one
after another. Each shape is compared with onnxruntime on the host (each
tile forced) on 1 and 2 threads, and on an emulated rasp4b64 board,
whose default tile is the tile of rows, on 1 and 2 threads."""
import subprocess

import numpy as np
import pytest

import crosscompile
import minirt
from crosscompile.conv import IM2COL_MIN_ROWS, _direct_plan
from crosscompile.gemm import channel_tile, tile_for
from crosscompile.target import resolve_target
from crosscompile.tuning import conv_shapes
from crosscompile.window import _resolve_window
from tests.cross_targets import emulated_tools, run_emulated
from tests.onnx_models import conv_relu_model, rand, reference
from tests.test_threads import PARALLEL_DRIVER_C

# name: (input shape, weight shape, attributes); the weight's first axis is
# groups x output channels per group.
CASES = {
    "w16_7x7": ((1, 64, 7, 7), (64, 16, 3, 3), {"pads": [1, 1, 1, 1], "group": 4}),
    "w16_stride2_to_7x7": ((1, 48, 14, 14), (48, 16, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2],
                                                             "group": 3}),
    "w8_uneven_pads": ((2, 40, 11, 13), (40, 8, 3, 3), {"pads": [0, 2, 1, 1], "group": 5}),
    "w24_dilated": ((1, 48, 12, 10), (48, 24, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2],
                                                       "group": 2}),
    "w64_stride2": ((1, 128, 9, 9), (128, 64, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2],
                                                         "group": 2}),
    "w32_rows_of_5": ((1, 96, 9, 9), (96, 32, 5, 5), {"pads": [2, 2, 2, 2], "group": 3}),
}
ARM_CASES = ["w16_stride2_to_7x7", "w8_uneven_pads", "w24_dilated"]
HOST = resolve_target("host")
RTOL, ATOL = 1e-4, 1e-5


def full_attrs(attrs: dict) -> dict:
    return dict({"strides": None, "pads": None, "dilations": None, "auto_pad": "NOTSET", "group": 1}, **attrs)


@pytest.mark.parametrize("case", CASES)
def test_cases_read_windows_of_every_group_at_once(case):
    x_shape, w_shape, attrs = CASES[case]
    full = full_attrs(attrs)
    group = full["group"]
    assert w_shape[0] // group <= IM2COL_MIN_ROWS
    geometry = _resolve_window(x_shape, tuple(w_shape[2:]), full)
    plan = _direct_plan(geometry, x_shape[1] // group, w_shape[0] // group, full, groups=group)
    assert plan is not None and plan.groups == group
    # The buffer holds every group's planes, each group's windows inside it.
    assert plan.buffer_floats >= (group - 1) * plan.group_floats + max(plan.offsets) + plan.n_virtual


def case_model(case: str, seed: int):
    """(model, input, onnxruntime's output) of CASES[case]."""
    x_shape, w_shape, attrs = CASES[case]
    model = conv_relu_model(x_shape, w_shape, attrs)
    x = rand(*x_shape, seed=seed)
    return model, x, reference(model, {"x": x})[0]


@pytest.mark.parametrize("tile", ["rows", "channels"])
@pytest.mark.parametrize("case", CASES)
def test_grouped_conv_matches_onnxruntime_on_host_threads(tmp_path, case, tile):
    model, x, want = case_model(case, seed=4)
    (shape,) = conv_shapes(model)
    forced = channel_tile(tile_for(HOST)) if tile == "channels" else tile_for(HOST)
    lib = crosscompile.build(model, target="host", schedules={shape.key: forced.spec})
    assert [t["tile"] for t in lib.metadata["gemm_tiles"]] == [list(forced.spec)]
    module = minirt.load(lib.export_library(tmp_path / "m.so"))
    for threads in (1, 2):
        module.set_threads(threads)
        for _ in range(2):  # a race between copying in, multiplying and copying out would show
            np.testing.assert_allclose(module.run({"x": x})[0], want, rtol=RTOL, atol=ATOL)
    module.close()


def run_parallel_emulated(lib, preset: str, x: np.ndarray, out_shape, threads: int, folder) -> np.ndarray:
    """The module's output run through tether_run_parallel on `threads`
    threads under qemu (tests/test_threads.py's driver)."""
    qemu, gcc, sysroot = emulated_tools(preset)
    so = lib.export_library(folder / "m.so")
    (folder / "driver.c").write_text(PARALLEL_DRIVER_C)
    subprocess.run([gcc, "-O1", "-pthread", "-o", str(folder / "driver"), str(folder / "driver.c"), "-ldl"],
                   check=True, capture_output=True)
    np.ascontiguousarray(x, np.float32).tofile(folder / "in.bin")
    size = int(np.prod(out_shape))
    proc = subprocess.run([qemu, "-L", sysroot, str(folder / "driver"), str(so), str(lib.metadata["workspace_bytes"]),
                           str(folder / "in.bin"), str(x.size), str(folder / "out.bin"), str(size), str(threads)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return np.fromfile(folder / "out.bin", dtype=np.float32).reshape(out_shape)


@pytest.mark.parametrize("case", ARM_CASES)
def test_grouped_conv_matches_onnxruntime_on_emulated_rasp4b64(tmp_path, case):
    model, x, want = case_model(case, seed=5)
    lib = crosscompile.build(model, target="rasp4b64")
    (tile,) = lib.metadata["gemm_tiles"]
    assert tile["tile"] == list(tile_for(resolve_target("rasp4b64")).spec)
    np.testing.assert_allclose(run_emulated(lib, "rasp4b64", x, want.shape, tmp_path), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(run_parallel_emulated(lib, "rasp4b64", x, want.shape, 2, tmp_path), want,
                               rtol=RTOL, atol=ATOL)
