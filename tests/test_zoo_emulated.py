"""Every model of the onnx package's light zoo, compiled for rasp4b64 and rasp3b,
run on emulated boards through a real tracker, against onnxruntime on the host.

One emulated Debian bookworm board per architecture (arm64 for rasp4b64,
armhf for rasp3b) is started once for the session and registered with one
tracker. For each model, one worker per board compiles it once for that
board's target, leases the board, uploads, loads and runs it; the test then
checks the outputs against onnxruntime with test_zoo.py's tolerance and class
check (tests.onnx_models.assert_zoo_matches). Uploads go up to 575 MB
(VGG-19), under the server's default --max-upload-bytes of 1 GiB, which the
tests check against the limit the board reports.

Run time: qemu runs this code about 100x slower than the host. Measured on
2 shared cores (board run, arm64 / armhf): VGG-19 233 / 203 s, ResNet-50
77 / 66 s, Inception v2 34 / 23 s, DenseNet-121 33 / 27 s, Inception v1
19 / 18 s, ZFNet-512 14 / 15 s, SqueezeNet 5 / 9 s, AlexNet 5 / 5 s,
ShuffleNet 2 / 4 s; the whole file about 9 minutes, as the two boards run
at once (see zoo_runs). Runs get generous timeouts; the marks let one
architecture be picked alone:

    pytest -m bookworm_arm64 tests/test_zoo_emulated.py

The default run keeps one representative model (REPRESENTATIVE) per
architecture; the others are marked full_zoo and run with --full-zoo:

    bash tests/run.sh --full-zoo tests/test_zoo_emulated.py

The same models also run on the native C++ server (remote/server/native), built
for aarch64 and 32-bit ARM and run under qemu-aarch64 / qemu-arm with no root
filesystem at all, each behind its own real tracker; they are compiled for
rasp4b64 and rasp4b, the boards those binaries stand for. Measured on the
same 2 shared cores (board run, aarch64 / armv7): VGG-19 268 / 323 s,
ResNet-50 41 / 61 s, DenseNet-121 34 / 54 s, Inception v2 21 / 31 s,
Inception v1 25 / 25 s, ZFNet-512 30 / 18 s, AlexNet 19 / 20 s, SqueezeNet
2 / 3 s, ShuffleNet 2 / 1 s; the full set about 12 minutes. The default run
takes SqueezeNet on both (NATIVE_REPRESENTATIVE): the server's part, upload,
load and run, is the same for every model, and Inception v1's kernels already
run on the emulated Debian boards above. Pick them alone with

    pytest -k native tests/test_zoo_emulated.py
"""
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

from deploy_recipes import emulate
from remote import rpc
from tests import board_servers
from tests.emulated_boards import TARGET_FOR_ARCH, local_farm, running_board, skip_without_tools
from tests.onnx_models import ZOO, assert_zoo_matches, reference, zoo_input, zoo_model

RELEASE = "bookworm"
ARCHES = ["arm64", "armhf"]
# Convolutions of several widths, 1x1 and 5x5 windows, LRN, max and average
# pools and concats in about 20 s per board: the most of the zoo's op kinds in
# the least emulated time.
REPRESENTATIVE = "inception_v1"
NATIVE_REPRESENTATIVE = "squeezenet"
# Seconds a run may take on an emulated board; far above what was measured
# (the slowest, VGG-19, takes a few minutes) so that a slow CI machine does
# not fail, while a hung module still ends the test.
RUN_TIMEOUT_S = 1800.0
# Transfers of up to ~575 MB (VGG-19's parameters) into the emulated server.
UPLOAD_TIMEOUT_S = 600.0
# The native server under qemu-user, and the preset of the board each one stands for.
NATIVE_TARGET_FOR_KIND = {"native-aarch64": "rasp4b64", "native-armv7": "rasp4b"}


@pytest.fixture(scope="session")
def zoo_farm():
    """One tracker plus one emulated bookworm board per architecture, for the session."""
    skip_without_tools()
    for arch in ARCHES:
        emulate.build_rootfs(RELEASE, arch)
    with local_farm() as farm:
        with running_board(farm, RELEASE, ARCHES[0], f"zoo-{RELEASE}-{ARCHES[0]}") as first, \
                running_board(farm, RELEASE, ARCHES[1], f"zoo-{RELEASE}-{ARCHES[1]}") as second:
            keys = {ARCHES[0]: first.key, ARCHES[1]: second.key}
            yield farm, keys


@pytest.fixture(scope="session")
def native_zoo_farms():
    """{kind: (LocalFarm, key)}: per kind of NATIVE_TARGET_FOR_KIND, a real tracker with
    the native server under qemu-user registered to it, for the session."""
    commands = {kind: board_servers.command(kind) for kind in NATIVE_TARGET_FOR_KIND}
    with contextlib.ExitStack() as stack:
        farms = {}
        for kind, command in commands.items():
            key = f"zoo-{kind}"
            farms[kind] = stack.enter_context(local_farm(keys=[key], server_command=command)), key
        yield farms


TEST_NAME = "test_zoo_model_matches_onnxruntime_on_emulated_board"
NATIVE_TEST_NAME = "test_zoo_model_matches_onnxruntime_on_native_server_under_qemu"


class BoardRun(NamedTuple):
    outputs: list
    device_s: float     # the run on the board
    total_s: float      # lease, upload, load and run
    upload_bytes: int


def _compile(folder, name, model, target):
    import crosscompile
    path = os.path.join(folder, f"{name}-{target}.so")
    crosscompile.build(model, target=target).export_library(path)
    return path


def _run_on_board(farm, key, so_path, name, feeds):
    started = time.perf_counter()
    with rpc.connect_tracker(*farm.tracker).request(key, timeout=120) as sess:
        size = os.path.getsize(so_path)
        assert size <= sess.max_upload_bytes, \
            f"{so_path} is {size} bytes, over the board's --max-upload-bytes {sess.max_upload_bytes}"
        sess.upload(so_path, target=f"{name}.so", timeout=UPLOAD_TIMEOUT_S)
        module = sess.load_module(f"{name}.so", timeout=UPLOAD_TIMEOUT_S)
        outputs = module.run(feeds, timeout=RUN_TIMEOUT_S)
        return BoardRun(outputs, module.last_run_s, time.perf_counter() - started, size)


@contextlib.contextmanager
def _board_runs(request, test_name, board_param, boards, folder):
    """{(model, board): Future of BoardRun} for the selected tests of ``test_name``,
    whose parameter ``board_param`` names a board of ``boards``
    ({board: (farm, key, target)}).

    The boards are separate single-threaded qemu processes: one worker per
    board compiles each model for its target (once) and runs it on its board,
    so the boards are busy at once and compiling the next model overlaps the
    current run. The tests wait for their own result.
    """
    wanted = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "originalname", "") == test_name and callspec:
            wanted.append((callspec.params["name"], callspec.params[board_param]))

    def job(name, board):
        farm, key, target = boards[board]
        model = zoo_model(name)
        so_path = _compile(folder, name, model, target)
        try:
            return _run_on_board(farm, key, so_path, name, zoo_input(model))
        finally:
            os.unlink(so_path)  # up to 575 MB each

    pools = {board: ThreadPoolExecutor(max_workers=1) for board in boards}
    futures = {(name, board): pools[board].submit(job, name, board) for name, board in wanted}
    try:
        yield futures
    finally:
        for future in futures.values():
            future.cancel()
        for pool in pools.values():
            pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def zoo_runs(request, zoo_farm, tmp_path_factory):
    """{(model, arch): Future of BoardRun} on the emulated Debian boards."""
    farm, keys = zoo_farm
    boards = {arch: (farm, keys[arch], TARGET_FOR_ARCH[arch]) for arch in ARCHES}
    with _board_runs(request, TEST_NAME, "arch", boards,
                     str(tmp_path_factory.mktemp("zoo-arm"))) as futures:
        yield futures


@pytest.fixture(scope="session")
def native_zoo_runs(request, native_zoo_farms, tmp_path_factory):
    """{(model, kind): Future of BoardRun} on the native server under qemu-user."""
    boards = {kind: (farm, key, NATIVE_TARGET_FOR_KIND[kind])
              for kind, (farm, key) in native_zoo_farms.items()}
    with _board_runs(request, NATIVE_TEST_NAME, "kind", boards,
                     str(tmp_path_factory.mktemp("zoo-native"))) as futures:
        yield futures


def _arch_param(arch):
    return pytest.param(arch, id=f"{RELEASE}-{arch}",
                        marks=[pytest.mark.emulated, getattr(pytest.mark, f"{RELEASE}_{arch}")])


def _model_param(name, representative=REPRESENTATIVE):
    return pytest.param(name, id=name, marks=[] if name == representative else [pytest.mark.full_zoo])


def _check_run(future, name, board):
    """The board's outputs match onnxruntime's; its times go to the test's output."""
    model = zoo_model(name)
    feeds = zoo_input(model)
    run = future.result()
    assert_zoo_matches(run.outputs, reference(model, feeds))
    print(f"{name} on {board}: run {run.device_s:.1f} s on the board, {run.total_s:.1f} s "
          f"with the upload of {run.upload_bytes / 1e6:.0f} MB")


@pytest.mark.parametrize("arch", [_arch_param(a) for a in ARCHES])
@pytest.mark.parametrize("name", [_model_param(n) for n in ZOO])
def test_zoo_model_matches_onnxruntime_on_emulated_board(zoo_runs, name, arch):
    _check_run(zoo_runs[name, arch], name, f"emulated {RELEASE} {arch} ({TARGET_FOR_ARCH[arch]})")


@pytest.mark.emulated
@pytest.mark.parametrize("kind", list(NATIVE_TARGET_FOR_KIND))
@pytest.mark.parametrize("name", [_model_param(n, NATIVE_REPRESENTATIVE) for n in ZOO])
def test_zoo_model_matches_onnxruntime_on_native_server_under_qemu(native_zoo_runs, name, kind):
    _check_run(native_zoo_runs[name, kind], name,
               f"the {kind} server ({NATIVE_TARGET_FOR_KIND[kind]})")
