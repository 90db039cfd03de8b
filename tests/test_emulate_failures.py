"""Emulated boards that cannot come up say why, at once: a server that exits while
starting, and a Debian mirror that serves a broken index."""
import glob
import http.server
import os
import threading

import pytest

from deploy_recipes import emulate
from remote.defaults import cache_dir
from tests.cli_processes import skip_without_emulation_tools


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_a_server_that_exits_while_starting_is_reported_at_once_with_its_log():
    skip_without_emulation_tools("arm64", "bookworm")
    emulate.build_rootfs("bookworm", "arm64")
    board = emulate.EmulatedBoard("bookworm", "arm64")
    with pytest.raises(emulate.EmulationError) as failure:
        board.start(extra=["--no-such-option"])
    message = str(failure.value)
    # Not the startup timeout: the exit was noticed.
    assert "exited with code 2 before it was listening" in message
    assert "unrecognized arguments: --no-such-option" in message
    # The log is kept for the reader of the error, and named there.
    assert board.log_path in message and os.path.isfile(board.log_path)
    os.unlink(board.log_path)
    os.rmdir(os.path.dirname(board.log_path))


def _signed_index(release):
    """A Release index signed by Debian, from this host's apt lists or a root filesystem
    built before; None when there is none."""
    pattern = f"var/lib/apt/lists/*_debian_dists_{release}_InRelease"
    found = sorted(glob.glob("/" + pattern) + glob.glob(os.path.join(
        cache_dir(), "rootfs", f"{release}-*", pattern)))
    return found[0] if found else None


class BrokenMirror(http.server.ThreadingHTTPServer):
    """A Debian mirror on 127.0.0.1 serving ``index`` as dists/RELEASE/InRelease and
    garbage for every other file; counts the index requests."""

    def __init__(self, index: bytes):
        self.index = index
        self.index_requests = 0
        super().__init__(("127.0.0.1", 0), _BrokenMirrorHandler)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/debian"


class _BrokenMirrorHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.endswith("/InRelease"):
            self.server.index_requests += 1
            body = self.server.index
        else:
            body = b"not what the index promised\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("index", ["empty", "signed, with corrupt Packages"])
def test_a_broken_mirror_is_retried_then_named_with_the_way_to_choose_another(
        index, tmp_path, monkeypatch):
    missing = [pkg for pkg in emulate.missing_tools("arm64", "bookworm")
               if pkg in ("debootstrap", "fakeroot")]
    if missing:
        pytest.skip(f"building root filesystems needs: apt-get install {' '.join(missing)}")
    if index == "empty":
        served = b""
    else:
        signed = _signed_index("bookworm")
        if signed is None:
            pytest.skip("no Debian-signed bookworm InRelease on this host (apt lists or a "
                        "built root filesystem) to serve next to corrupt Packages files")
        with open(signed, "rb") as f:
            served = f.read()
    mirror = BrokenMirror(served)
    thread = threading.Thread(target=mirror.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    monkeypatch.setenv("TETHER_DEBIAN_MIRROR", mirror.url)
    said = []
    try:
        with pytest.raises(emulate.MirrorError) as failure:
            emulate.build_rootfs("bookworm", "arm64", progress=said.append, retry_delay_s=0.05)
    finally:
        mirror.shutdown()
        mirror.server_close()
    message = str(failure.value)
    assert mirror.url in message and "TETHER_DEBIAN_MIRROR" in message
    if index != "empty":
        assert "was corrupt" in message
    assert mirror.index_requests == emulate.MIRROR_ATTEMPTS > 1
    assert sum("trying again" in line for line in said) == emulate.MIRROR_ATTEMPTS - 1
    # Every attempt's partial download is gone; only the build lock remains.
    assert os.listdir(tmp_path / "rootfs") == ["bookworm-arm64.lock"]


def test_a_long_download_reports_its_progress(tmp_path, monkeypatch):
    """debootstrap is silent for a minute or more; the packages in its cache are counted."""
    archives = tmp_path / "var" / "cache" / "apt" / "archives"
    archives.mkdir(parents=True)
    (archives / "a.deb").write_bytes(b"x" * (3 << 20))
    (archives / "b.deb").write_bytes(b"x" * (1 << 20))
    said = []
    emulate._report_download(str(tmp_path), said.append)
    assert said == ["  downloaded 2 packages, 4.0 MiB"]
    # A command that runs for a while gets the callback meanwhile, and its output back.
    monkeypatch.setattr(emulate, "PROGRESS_EVERY_S", 0.05)
    ticks = []
    out = emulate._run(["sh", "-c", "sleep 0.5; echo done"], "a wait",
                       every=lambda: ticks.append(1))
    assert out.strip() == "done" and len(ticks) >= 2


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_a_killed_tether_emulate_takes_its_board_server_with_it():
    import signal
    import sys
    from tests.cli_processes import ROOT, descendants, running, start_emulate
    from tests.test_tracker import HANG_S, key_status, local_farm, wait_until
    skip_without_emulation_tools("arm64", "bookworm")
    with local_farm(keys=[]) as farm:
        env = {**os.environ, "PYTHONPATH": ROOT}
        proc, _ = start_emulate([sys.executable, "-m", "remote.cli"], farm, "emu-killed", env)
        below = descendants(proc.pid)
        assert below, "tether emulate started no board server"
        proc.send_signal(signal.SIGKILL)   # no cleanup of its own can run
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        wait_until(lambda: not any(running(p) for p in below),
                   f"the end of the board server processes {below} of a killed tether emulate")
        tracker = farm.client()
        wait_until(lambda: key_status(tracker, "emu-killed")["total"] == 0,
                   "the killed board leaving the tracker", timeout=HANG_S)


def test_what_an_emulated_board_is_started_with_ends_when_its_starter_is_killed():
    # The mechanism behind the test above, without a root filesystem: a child
    # started the way EmulatedBoard.start(end_with_caller=True) starts its server.
    import signal
    import subprocess
    import sys
    from tests.cli_processes import ROOT, running
    from tests.test_tracker import wait_until
    starter = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        "from deploy_recipes.emulate import ends_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                         preexec_fn=ends_with_parent(os.getpid()))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, universal_newlines=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT})
    try:
        child = int(starter.stdout.readline())
        assert running(child)
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        wait_until(lambda: not running(child), f"the end of process {child} whose starter was killed")
    finally:
        if starter.poll() is None:
            starter.kill()
        starter.wait()
        starter.stdout.close()
