"""Every model of the onnx package's light zoo, compiled for the host and for
emulated boards, against onnxruntime on the same input.

Tolerance: rtol 1e-4 plus atol 1e-5 x the largest reference value. The
models are deep (up to 121 convolutions) and float32 sums taken in a
different order than onnxruntime's differ by about 1e-6 of the magnitude of
the numbers summed; outputs that nearly cancel (logits close to 0 next to
logits of 1e4) therefore need an absolute floor scaled to the output.
"""
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

import crosscompile
import minirt
from tests.onnx_models import ZOO, reference, zoo_input, zoo_model
from tests.test_crosscompile import DRIVER_C, EMULATED

RTOL, ATOL_SCALE = 1e-4, 1e-5


def assert_matches(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL_SCALE * float(np.abs(w).max()))


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_matches_onnxruntime_on_host(tmp_path, name):
    model = zoo_model(name)
    feeds = zoo_input(model)
    started = time.perf_counter()
    lib = crosscompile.build(model, target="host")
    seconds = time.perf_counter() - started
    module = minirt.load(lib.export_library(tmp_path / f"{name}.so"))
    got, want = module.run(feeds), reference(model, feeds)
    assert_matches(got, want)
    # The predicted class agrees, not just the numbers within tolerance.
    assert got[0][0].argmax() == want[0][0].argmax()
    print(f"{name}: compiled in {seconds:.1f} s, {lib.summary}")


@pytest.mark.parametrize("preset", ["rasp4b64", "rasp3b"])
def test_squeezenet_runs_on_emulated_boards(tmp_path, preset):
    qemu, gcc, sysroot = EMULATED[preset]
    if not (shutil.which(qemu) and shutil.which(gcc) and os.path.isdir(sysroot)):
        pytest.skip(f"needs {qemu}, {gcc} and {sysroot}: "
                    "apt-get install qemu-user gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf")
    model = zoo_model("squeezenet", logits=False)
    feeds = zoo_input(model)
    (x,) = feeds.values()
    want = reference(model, feeds)[0]
    lib = crosscompile.build(model, target=preset)
    so = lib.export_library(tmp_path / "squeezenet.so")
    (tmp_path / "driver.c").write_text(DRIVER_C)
    subprocess.run([gcc, "-O1", "-o", str(tmp_path / "driver"), str(tmp_path / "driver.c"), "-ldl"],
                   check=True, capture_output=True)
    x.tofile(tmp_path / "in.bin")
    proc = subprocess.run([qemu, "-L", sysroot, str(tmp_path / "driver"), so,
                           str(lib.metadata["workspace_bytes"]), str(tmp_path / "in.bin"),
                           str(x.size), str(tmp_path / "out.bin"), str(want.size)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(want.shape)
    assert_matches([got], [want])
