"""What a new user meets in the first hour: long steps that say what they do on a
terminal and stay quiet in logs, install hints that work, one rule for the
tracker's address, boards described as they are, and servers that stop cleanly."""
import io
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time

import onnx
import pytest

from remote.cli import extras
from remote.cli.main import build_parser
from remote.cli.progress import Steps, Ticker
from remote.client.display import board_cpu
from remote.defaults import TRACKER_HELP
from tests.cli_processes import ROOT, wait_for_line
from tests.emulated_boards import local_farm
from tests.onnx_models import mlp

TETHER = [sys.executable, "-m", "remote.cli"]
DEADLINE_S = 300.0


def _clean_env(**extra):
    """The environment of a new user's shell: no PYTHONUNBUFFERED, no TETHER_*."""
    keep = ("PATH", "HOME", "LANG")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    return {**env, "PYTHONPATH": ROOT, **extra}


def _on_a_terminal(argv, env, timeout=DEADLINE_S):
    """Run ``argv`` with stdout and stderr on a pseudo-terminal; (exit code, all it wrote)."""
    main, child = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=child, stderr=child,
                            env=env, cwd=ROOT)
    os.close(child)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.5)
            if ready:
                try:
                    data = os.read(main, 65536)
                except OSError:  # EIO: the child side is closed, the program ended
                    break
                if not data:
                    break
                chunks.append(data)
        else:
            proc.kill()
            pytest.fail(f"{argv} still running after {timeout:g} s; it wrote:\n"
                        + b"".join(chunks).decode(errors="replace"))
    finally:
        os.close(main)
    return proc.wait(DEADLINE_S), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "mlp.onnx"
    onnx.save(mlp(), str(path))
    return str(path)


def test_compile_ticks_on_a_terminal_and_writes_two_lines_when_piped(model_path, tmp_path):
    argv = TETHER + ["compile", model_path, "--target", "host", "--no-tuning"]
    code, shown = _on_a_terminal(argv + ["-o", str(tmp_path / "a.so")], _clean_env())
    assert code == 0, shown
    # Redrawn in place with what it is doing: the step, its count, the seconds so far.
    assert re.search(r"\rcompiling mlp\.onnx for host: generating kernels \d+/\d+ \[\d+ s\]",
                     shown), shown
    assert "compiling mlp.onnx for host: done in" in shown

    piped = subprocess.run(argv + ["-o", str(tmp_path / "b.so")], capture_output=True, text=True,
                           env=_clean_env(), cwd=ROOT, timeout=DEADLINE_S)
    assert piped.returncode == 0, piped.stderr
    assert "\r" not in piped.stderr and "\x1b" not in piped.stderr
    assert [line.split(": done in")[0] for line in piped.stderr.splitlines()] == \
        ["compiling mlp.onnx for host ...", "compiling mlp.onnx for host"], piped.stderr
    assert piped.stdout.startswith("compiled ")


def test_counted_steps_redraw_one_line_live_and_write_first_and_last_when_piped():
    piped = io.StringIO()
    steps = Steps(piped, live=False)
    steps("downloading packages")
    for done in range(1, 118):
        steps(f"unpacking packages {done}/117")
    steps("root filesystem ready")
    assert piped.getvalue().splitlines() == [
        "downloading packages", "unpacking packages 1/117", "unpacking packages 117/117",
        "root filesystem ready"]

    live = io.StringIO()
    steps = Steps(live, live=True)
    steps("unpacking packages 1/3")
    steps("unpacking packages 3/3")
    time.sleep(Ticker.INTERVAL_S * 3)  # the ticker draws the newest count in its next beat
    steps.close()
    text = live.getvalue()
    assert text.startswith("\runpacking packages: 1/3 [0 s]"), text
    assert "\runpacking packages: 3/3" in text
    assert "unpacking packages: done in" in text


def test_plot_without_matplotlib_says_the_install_command_for_this_copy(model_path, tmp_path):
    # matplotlib may well be installed here: hide it from the command, as on a new machine.
    code = ("import sys; sys.modules['matplotlib'] = None; from remote.cli.main import main; "
            f"sys.exit(main(['bench', {model_path!r}, '--key', 'k', '--plot', 'p.png', "
            "'--tracker', '127.0.0.1:1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_clean_env(), cwd=str(tmp_path), timeout=DEADLINE_S)
    assert done.returncode == 1
    assert "tether[plot]" not in done.stderr
    assert "--plot needs matplotlib, which is not installed; install it with: " \
        + extras.install_command("plot", "matplotlib>=3.3") in done.stderr, done.stderr


def test_install_command_uses_the_checkouts_script_from_its_own_venv(monkeypatch):
    monkeypatch.setattr(sys, "prefix", os.path.join(ROOT, ".venv"))
    assert extras.install_command("plot", "matplotlib>=3.3") == \
        f"bash {os.path.join(ROOT, 'deploy_recipes', 'venv.sh')} plot"
    monkeypatch.setattr(sys, "prefix", "/somewhere/else")
    assert extras.install_command("plot", "matplotlib>=3.3") == \
        f"{sys.executable} -m pip install 'matplotlib>=3.3'"


@pytest.mark.parametrize("command", ["status", "run", "bench", "tune", "emulate", "server"])
def test_every_command_states_the_same_tracker_rule(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    tracker = next(a for a in sub._actions if "--tracker" in a.option_strings)
    assert tracker.help.startswith(TRACKER_HELP), tracker.help
    assert tracker.default is None  # resolved when used, by remote.defaults.default_tracker


def test_a_refused_tracker_says_to_start_one_and_gives_no_tls_hint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        done = subprocess.run(TETHER + ["status"], capture_output=True, text=True,
                              env=_clean_env(TETHER_TRACKER=f"127.0.0.1:{port}"), cwd=ROOT,
                              timeout=DEADLINE_S)
    assert done.returncode == 1
    assert f"cannot reach tracker 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Start one with `tether tracker`" in done.stderr
    assert "TLS" not in done.stderr


def test_an_emulated_board_is_described_by_its_emulated_core():
    info = {"machine": "aarch64", "cpu_model": "Intel(R) Xeon(R) Processor",
            "emulated": "qemu-aarch64 -cpu cortex-a72, Debian bookworm arm64"}
    assert board_cpu(info) == "emulated by qemu-aarch64 -cpu cortex-a72, Debian bookworm arm64"
    assert board_cpu({"cpu_model": "Cortex-A76", "emulated": ""}) == "Cortex-A76"


def test_a_board_server_stops_on_sigterm_with_one_line():
    with local_farm() as farm:
        proc = subprocess.Popen(
            [sys.executable, "-m", "remote.server", "--host", "127.0.0.1", "--port", "0",
             "--tracker", f"127.0.0.1:{farm.tracker[1]}", "--key", "stopping"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env(), cwd=ROOT)
        try:
            wait_for_line(proc, lambda line: "registered with" in line, DEADLINE_S,
                          "the server's listening line")
            farm.wait_for_devices("stopping", 1, timeout=DEADLINE_S)
            with farm.client().request("stopping", timeout=DEADLINE_S) as sess:
                assert sess.device_info()["machine"]
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    assert "Exception ignored" not in err and "Bad file descriptor" not in err, err
    assert "Traceback" not in err, err
    after_session = err.split("closed by the client", 1)[1].strip().splitlines()
    assert len(after_session) == 1 and "stopped" in after_session[0], err


def test_the_readme_names_what_the_test_command_installs():
    with open(os.path.join(ROOT, "tests", "run.sh")) as f:
        packages = re.search(r"^debian_packages=\((.*)\)$", f.read(), re.M).group(1).split()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    # Those a reader would not guess from "the test suite": the browser and the tools
    # that build an emulated board (compilers and fonts go without saying).
    for package in ("qemu-user", "debootstrap", "fakeroot", "openssh-server", "chromium"):
        assert package in packages
        assert f"`{package}`" in readme, f"README.md does not say the test command installs {package}"
