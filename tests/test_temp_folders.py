"""Commands remove the temporary folders they make and stop the processes they
start, whether they finish or are interrupted with Ctrl-C."""
import os
import subprocess
import sys

import pytest

from remote import rpc
from tests.cli_processes import (ROOT, command_line, descendants, ended, interrupt, running,
                                 skip_without_emulation_tools, start_emulate, wait_for_line)
from tests.emulated_boards import local_farm

TETHER = [sys.executable, "-m", "remote.cli"]
# onnxruntime (the demo's reference check) keeps one file of its own in the
# temporary folder, the same one every run; it is not ours to remove.
NOT_OURS = {".ses"}


def _env(tmpdir):
    return {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmpdir)}


def _left_in(tmpdir):
    return sorted(set(os.listdir(tmpdir)) - NOT_OURS)


def test_demo_leaves_no_temporary_folders(tmp_path):
    result = subprocess.run(TETHER + ["demo", "--runs", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, universal_newlines=True, timeout=300,
                            cwd=ROOT, env=_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "demo finished" in result.stdout
    assert _left_in(tmp_path) == []


def test_demo_interrupted_stops_its_farm_and_leaves_no_temporary_folders(tmp_path):
    proc = subprocess.Popen(TETHER + ["demo", "--runs", "1000000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, universal_newlines=True, cwd=ROOT,
                            env=_env(tmp_path))
    with ended(proc):
        # Leased, uploaded, now timing runs. The demo's stdout is a pipe here, as
        # under any program that watches it: the line must come as it is printed.
        wait_for_line(proc, lambda line: line.startswith("5. output"), 120, "the demo's output line")
        children = descendants(proc.pid)
        assert len(children) >= 2, "the demo runs a tracker and a device server"
        code, err = interrupt(proc)
    assert code == 130, err
    assert "interrupted" in err
    assert [pid for pid in children if running(pid)] == []
    assert _left_in(tmp_path) == []


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_emulate_interrupted_stops_qemu_and_removes_its_log_folder(tmp_path):
    skip_without_emulation_tools("arm64", "bookworm")
    with local_farm() as farm:
        proc, line = start_emulate(TETHER, farm, "emu-interrupted", _env(tmp_path))
        with ended(proc):
            log_path = line.rsplit("; log ", 1)[1].rstrip(")\n")
            assert log_path.startswith(str(tmp_path)) and os.path.isfile(log_path)
            with rpc.connect_tracker(*farm.tracker).request("emu-interrupted", timeout=60) as sess:
                assert sess.device_info()["machine"] == "aarch64"
            qemus = [pid for pid in descendants(proc.pid) if "qemu-aarch64" in command_line(pid)]
            assert qemus, "the board runs under qemu"
            code, err = interrupt(proc)
    assert code == 0, err
    assert [pid for pid in qemus if running(pid)] == []
    assert not os.path.exists(log_path)
    assert _left_in(tmp_path) == []
