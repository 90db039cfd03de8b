"""Emulated ARM boards: Debian's own Python stacks under qemu, behind a real tracker.

Each system (arm64/armhf x bullseye/bookworm/trixie) carries a mark so it can
be picked alone:  pytest -m bookworm_arm64 tests/test_emulate.py
The default run covers each release and each architecture: bookworm on both,
bullseye on armhf (the oldest Python and numpy on a 32-bit board) and trixie
on arm64 (the newest). The other two systems carry the more_systems mark too:
    pytest -m more_systems tests/test_emulate.py
Root filesystems are cached in $TETHER_CACHE (default ~/.cache/tether).
"""
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from deploy_recipes import emulate
from remote import errors, rpc
from tests.cli_processes import wait_for_line
from tests.emulated_boards import (ROOT, TARGET_FOR_ARCH, local_farm, running_board,
                                   skip_without_tools)

# What each Debian release ships: (Python, numpy) major.minor of its own packages.
RELEASE_STACKS = {
    "bullseye": ("3.9", "1.19"),
    "bookworm": ("3.11", "1.24"),
    "trixie": ("3.13", "2.2"),
}
SYSTEMS = [(release, arch) for release in emulate.RELEASES for arch in emulate.ARCHES]
# Left out of the default run: their release and their architecture are each
# covered by another system there.
MORE_SYSTEMS = {("bullseye", "arm64"), ("trixie", "armhf")}
# Everything on an emulated board runs many times slower than on the host, and
# slower again when the host is busy: waits and calls get this long, which only
# a hung board outlasts. Speed is never judged here.
HANG_S = 600.0


def _system_param(release, arch):
    marks = [pytest.mark.emulated, getattr(pytest.mark, f"{release}_{arch}")]
    if (release, arch) in MORE_SYSTEMS:
        marks.append(pytest.mark.more_systems)
    return pytest.param((release, arch), id=f"{release}-{arch}", marks=marks)


SYSTEM_PARAMS = [_system_param(r, a) for r, a in SYSTEMS]


@pytest.fixture(scope="session")
def rootfs_builds(request):
    """Builds of every root filesystem the selected tests use, started at once in parallel."""
    skip_without_tools()
    wanted = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        system = callspec.params.get("system") if callspec else None
        if system and system not in wanted:
            wanted.append(system)
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {system: pool.submit(emulate.build_rootfs, *system) for system in wanted}
    yield futures
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def tracker():
    with local_farm() as farm:
        yield farm


@pytest.fixture(scope="session")
def arm_modules(tmp_path_factory):
    """{target preset: .so path} of the test MLP, plus the model path under "onnx"."""
    import onnx

    import crosscompile
    from tests.onnx_models import mlp
    folder = tmp_path_factory.mktemp("arm-mlp")
    model_path = str(folder / "mlp.onnx")
    onnx.save(mlp(), model_path)
    out = {"onnx": model_path}
    for target in sorted(set(TARGET_FOR_ARCH.values())):
        out[target] = str(folder / f"mlp-{target}.so")
        crosscompile.build(model_path, target=target).export_library(out[target])
    return out


@pytest.fixture(scope="module", params=SYSTEM_PARAMS)
def system(request):
    return request.param


@pytest.fixture(scope="module")
def board(system, rootfs_builds, tracker):
    """A device server in the emulated system, registered under key emu-RELEASE-ARCH."""
    release, arch = system
    rootfs_builds[system].result()
    key = f"emu-{release}-{arch}"
    with running_board(tracker, release, arch, key) as b:
        yield key, b


def test_emulated_board_reports_its_arm_system(system, board, tracker):
    release, arch = system
    key, _ = board
    python, numpy_version = RELEASE_STACKS[release]
    with rpc.connect_tracker(*tracker.tracker).request(key, timeout=HANG_S,
                                                       call_timeout=HANG_S) as sess:
        info = sess.device_info()
    assert info["machine"] == emulate.ARCHES[arch].machine
    assert info["triple"].startswith("aarch64-" if arch == "arm64" else "armv7l-")
    assert info["python"].startswith(python + ".")
    assert info["numpy"].startswith(numpy_version + ".")
    assert info["protobuf"]  # boards need no grpcio (protocol v2)
    assert "Debian" in info["os"]
    assert info["emulated"].startswith(emulate.ARCHES[arch].qemu) and release in info["emulated"]
    from crosscompile.target import target_for_board
    assert target_for_board(info) == ("rasp4b64" if arch == "arm64" else "rasp3b")


def test_model_compiled_for_the_board_matches_onnxruntime(system, board, tracker, arm_modules):
    import onnxruntime as ort
    release, arch = system
    key, _ = board
    target = TARGET_FOR_ARCH[arch]
    x = np.random.default_rng(7).standard_normal((1, 1, 28, 28)).astype(np.float32)
    with rpc.connect_tracker(*tracker.tracker).request(key, timeout=HANG_S,
                                                       call_timeout=HANG_S) as sess:
        sess.upload(arm_modules[target], target="mlp.so")
        mod = sess.load_module("mlp.so")
        (out,) = mod.run({"input": x})
        with pytest.raises(errors.InputError, match="float32"):
            mod.run({"input": x.astype(np.float64)})
    ref = ort.InferenceSession(arm_modules["onnx"], providers=["CPUExecutionProvider"]) \
        .run(None, {"input": x})[0]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_host_module_is_refused_by_the_arm_board(tracker, mlp_module, rootfs_builds):
    """A module built for the wrong machine gets a load error naming the mismatch."""
    _, so_path = mlp_module
    emulate.build_rootfs("bookworm", "arm64")
    with emulate.EmulatedBoard("bookworm", "arm64") as b:
        b.start(tracker=f"127.0.0.1:{tracker.tracker[1]}", key="emu-wrong-arch", timeout=HANG_S)
        tracker.wait_for_devices("emu-wrong-arch", 1, timeout=HANG_S)
        with rpc.connect_tracker(*tracker.tracker).request("emu-wrong-arch", timeout=HANG_S,
                                                           call_timeout=HANG_S) as sess:
            sess.upload(so_path, target="host.so")
            with pytest.raises(errors.ModuleLoadError, match="host.so"):
                sess.load_module("host.so")


@pytest.mark.emulated
@pytest.mark.bookworm_armhf
def test_child_pythons_of_the_board_run_emulated_too(rootfs_builds):
    """sys.executable inside the board starts the guest Python again, without binfmt_misc."""
    emulate.build_rootfs("bookworm", "armhf")
    board = emulate.EmulatedBoard("bookworm", "armhf")
    code = ("import platform, subprocess, sys; print(platform.machine()); sys.stdout.flush(); "
            "subprocess.check_call([sys.executable, '-c', "
            "'import platform, numpy; print(platform.machine(), numpy.__version__)'])")
    out = subprocess.run(board.command(["-c", code]), env=board.environment(),
                         stdout=subprocess.PIPE, universal_newlines=True, timeout=HANG_S,
                         check=True)
    parent, child = out.stdout.split("\n")[:2]
    assert parent == "armv7l"
    assert child.startswith("armv7l 1.24.")


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_tether_emulate_command_serves_until_stopped(tracker, rootfs_builds):
    emulate.build_rootfs("bookworm", "arm64")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote.cli", "emulate", "--arch", "arm64", "--release", "bookworm",
         "--tracker", f"127.0.0.1:{tracker.tracker[1]}", "--key", "emu-cli"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, universal_newlines=True)
    try:
        line = wait_for_line(proc, lambda _line: True, HANG_S, "tether emulate's first line")
        assert "emulated bookworm arm64 board listening on 127.0.0.1:" in line, proc.stderr.read()
        # Said as the server found it: registered, or still trying (never claimed early).
        assert re.search(rf"\((registered|not yet registered) with 127\.0\.0\.1:{tracker.tracker[1]}",
                         line), line
        tracker.wait_for_devices("emu-cli", 1, timeout=HANG_S)
        with rpc.connect_tracker(*tracker.tracker).request("emu-cli", timeout=HANG_S,
                                                           call_timeout=HANG_S) as sess:
            assert sess.device_info()["machine"] == "aarch64"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        keys = {k["key"]: k["total"] for k in rpc.connect_tracker(*tracker.tracker).summary()["keys"]}
        if not keys.get("emu-cli"):
            break
        time.sleep(0.5)
    assert not keys.get("emu-cli"), "the stopped board must leave the tracker"


def test_emulate_rejects_unknown_release_naming_the_choices():
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "remote.cli", "emulate", "--release", "buster",
                           "--tracker", "127.0.0.1:1"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env, universal_newlines=True)
    assert proc.returncode == 2
    assert "buster" in proc.stderr and "bookworm" in proc.stderr
    with pytest.raises(ValueError, match="'mips'.*arm64"):
        emulate.EmulatedBoard("bookworm", "mips")
