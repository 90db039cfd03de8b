"""Emulated ARM boards for tests: a device server under qemu behind a real tracker.

Shared by tests/test_emulate.py and tests/test_zoo_emulated.py:

    skip_without_tools()
    with running_board(farm, "bookworm", "arm64", "emu-bookworm-arm64") as board:
        with rpc.connect_tracker(*farm.tracker).request(board.key, timeout=60) as sess:
            ...
"""
import contextlib
import os
import time

import pytest

from deploy_recipes import emulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The compiler preset whose code each emulated architecture runs.
TARGET_FOR_ARCH = {"arm64": "rasp4b64", "armhf": "rasp3b"}


def skip_without_tools():
    """Skip the calling test when qemu-user/debootstrap/... are not installed."""
    missing = sorted({pkg for arch in emulate.ARCHES for pkg in emulate.missing_tools(arch)})
    if missing:
        pytest.skip(f"emulated ARM boards need Debian packages: apt-get install {' '.join(missing)}")


HANG_S = 600.0


def _wait_registered(farm, board, key):
    deadline = time.monotonic() + HANG_S
    with farm.client() as client:
        while not any(k["key"] == key and k["total"] for k in client.summary()["keys"]):
            if board.proc.poll() is not None:
                raise AssertionError(f"the emulated board {key} exited with code {board.proc.returncode} "
                                     f"before registering; its log ends:\n{board.log_tail()}")
            assert time.monotonic() < deadline, f"the emulated board {key} did not register (hung?)"
            time.sleep(0.1)


def local_farm(keys=(), **options):
    """A LocalFarm (real tracker process, by default no device servers) whose children
    import this tree; ``options`` go to LocalFarm (server_command=..., server_args=...)."""
    from remote.cli.localfarm import LocalFarm
    return LocalFarm(keys=list(keys), env={**os.environ, "PYTHONPATH": ROOT}, **options)


@contextlib.contextmanager
def running_board(farm, release: str, arch: str, key: str, extra=()):
    """An EmulatedBoard registered with ``farm``'s tracker under ``key``, stopped on exit.

    The root filesystem must already be built (emulate.build_rootfs). The
    board's ``key`` attribute is set to ``key``; its server log is in the
    farm's log directory as KEY.log.
    """
    b = emulate.EmulatedBoard(release, arch)
    b.key = key
    # Limits that only catch a hang: an emulated board on a loaded machine can
    # take minutes to start, and one that dies is noticed at once.
    b.start(tracker=f"127.0.0.1:{farm.tracker[1]}", key=key, extra=extra,
            log_path=os.path.join(farm.log_dir, f"{key}.log"), timeout=HANG_S)
    try:
        _wait_registered(farm, b, key)
        yield b
    finally:
        b.stop()
