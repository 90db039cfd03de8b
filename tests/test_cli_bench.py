"""`tether bench` and `tether run` end to end: the commands run as subprocesses
against a real tracker and two real device servers, with the test MLP really
compiled; their printed output and JSON are parsed and checked."""
import csv
import hashlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest

from remote.cli.extras import install_command
from remote.cli.localfarm import LocalFarm
from tests import board_servers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
STATS = ("mean", "median", "p90", "p99", "std", "min", "max")
# Only a hang takes this long: every wait below ends as soon as its state is seen.
HANG_S = 600.0


@pytest.fixture(scope="module", params=board_servers.KINDS)
def farm2(request):
    """Two boards of key 'host' of each server kind. A test of what only the
    command itself decides (its errors, its printing) takes one kind:
    ONE_KIND below."""
    with LocalFarm(keys=["host", "host"], env=ENV,
                   server_command=board_servers.command(request.param)) as running:
        yield running


def tether(farm, *args, timeout=HANG_S):
    host, port = farm.tracker
    return subprocess.run([sys.executable, "-m", "remote.cli", *args, "--tracker",
                           f"{host}:{port}"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def device_states(farm):
    done = tether(farm, "status", "--json")
    assert done.returncode == 0, done.stderr
    return {d["device_id"]: (d["state"], d["holder"]) for d in json.loads(done.stdout)["devices"]}


def wait_all_free(farm):
    deadline = time.monotonic() + HANG_S
    while True:
        states = device_states(farm)
        if all(state == "free" for state, _ in states.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"boards still held after the interrupt: {states}")
        time.sleep(0.2)


# For a test of the command alone: the board server's kind changes nothing there.
ONE_KIND = pytest.mark.parametrize("farm2", board_servers.KINDS[:1], indirect=True)


def printed_tables(stdout):
    """{device_id: {statistic: [cells...]}} from the per-board tables."""
    tables, current = {}, None
    for line in stdout.splitlines():
        match = re.match(r"device (\S+) at (\S+) \(key (\S+)\)", line)
        if match:
            current = tables.setdefault(match.group(1), {})
            continue
        if current is not None and line.startswith("  ") and line.strip():
            cells = re.split(r"\s{2,}", line.strip())
            current[cells[0]] = cells[1:]
    return tables


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory):
    from tests.onnx_models import mlp
    path = str(tmp_path_factory.mktemp("bench") / "mlp.onnx")
    onnx.save(mlp(), path)
    return path


@pytest.fixture(scope="module")
def first_run(farm2, onnx_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("first")
    out_json, out_csv = str(folder / "a.json"), str(folder / "a.csv")
    done = tether(farm2, "bench", onnx_path, "--target", "host", "--key", "host",
                  "--number", "3", "--repeat", "4", "--json", out_json, "--csv", out_csv)
    assert done.returncode == 0, done.stderr
    return done, out_json, out_csv


def test_bench_prints_a_table_and_writes_reproducible_json(first_run, onnx_path):
    done, out_json, out_csv = first_run
    assert "compiling mlp.onnx for host" in done.stderr      # progress of the compile step
    assert re.search(r"upload mlp\.so .*MiB", done.stderr)   # and of the upload
    tables = printed_tables(done.stdout)
    assert len(tables) == 1
    (table,) = tables.values()
    for name in STATS + ("cold load", "warm load"):
        assert re.fullmatch(r"[\d.]+ (µs|ms|s)", table[name][0]), (name, table[name])
    assert re.fullmatch(r"[\d.]+ (KiB|MiB|GiB)", table["peak memory"][0])
    assert table["runs"] == ["4 x 3"]
    # Timed as run() runs it on the board: one thread per core of the (local) board.
    assert table["threads"] == [str(os.cpu_count() or 1)]

    with open(out_json) as f:
        report = json.load(f)
    assert report["schema"] == "tether.bench/1"
    assert isinstance(report["tool"]["version"], str) and report["tool"]["name"] == "tether"
    assert isinstance(report["created"], str)
    with open(onnx_path, "rb") as f:
        assert report["model"]["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert report["model"]["kind"] == "onnx" and report["model"]["module_bytes"] > 0
    assert report["target"]["name"] == "host" and report["target"]["triple"]
    assert report["options"] == {"key": "host", "devices": "1", "number": 3, "repeat": 4,
                                 "min_repeat_ms": 0.0, "cooldown_ms": 0.0, "target": "host",
                                 "precision": "fp32"}
    assert [t["name"] for t in report["module"]["inputs"]] == ["input"]
    assert report["failures"] == []
    (result,) = report["results"]
    assert result["device_id"] in table_ids(done.stdout)
    assert len(result["samples_s"]) == 4 and all(isinstance(s, float) and s > 0
                                                 for s in result["samples_s"])
    assert result["number"] == 3 and result["repeat"] == 4
    assert result["threads"] == (os.cpu_count() or 1)
    stats = result["stats_s"]
    assert set(stats) == set(STATS)
    assert stats["min"] == min(result["samples_s"]) and stats["max"] == max(result["samples_s"])
    assert stats["min"] <= stats["median"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert result["cold_load_s"] > 0 and result["warm_load_s"] > 0
    # The worker process on the board holds at least the module and numpy.
    assert isinstance(result["peak_rss_bytes"], int) and result["peak_rss_bytes"] > 1 << 20
    device = result["device"]
    assert device["cores"] >= 1 and device["triple"] and "server_version" in device

    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["device_id"] == result["device_id"]
    assert float(rows[0]["median_ms"]) == pytest.approx(stats["median"] * 1e3, rel=1e-5)


def table_ids(stdout):
    return set(printed_tables(stdout))


def test_two_boards_in_parallel_with_ratios_against_an_earlier_run(farm2, first_run, tmp_path,
                                                                  mlp_module):
    _, old_json, _ = first_run
    new_json, plot = str(tmp_path / "b.json"), str(tmp_path / "latency.png")
    # A module built before (`tether compile`) goes to the boards as it is.
    done = tether(farm2, "bench", mlp_module[1], "--key", "host", "--devices", "2",
                  "--repeat", "5", "--vs", old_json, "--json", new_json, "--plot", plot)
    try:
        import matplotlib  # noqa: F401
        has_matplotlib = True
    except ImportError:
        has_matplotlib = False
    if not has_matplotlib:
        assert done.returncode == 1
        assert "--plot needs matplotlib" in done.stderr
        assert install_command("plot", "matplotlib>=3.3") in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        done = tether(farm2, "bench", mlp_module[1], "--key", "host", "--devices", "2",
                      "--repeat", "5", "--vs", old_json, "--json", new_json)
    assert done.returncode == 0, done.stderr
    with open(old_json) as f:
        old = json.load(f)
    with open(new_json) as f:
        new = json.load(f)
    assert new["model"]["kind"] == "module"
    assert len({r["device_id"] for r in new["results"]}) == 2   # two different boards
    assert len(set(r["address"] for r in new["results"])) == 2
    tables = printed_tables(done.stdout)
    assert set(tables) == {r["device_id"] for r in new["results"]}
    (before,) = old["results"]
    for result in new["results"]:
        table = tables[result["device_id"]]
        if result["device_id"] == before["device_id"]:
            ratio = float(table["median"][2].rstrip("x"))
            assert ratio == pytest.approx(result["stats_s"]["median"]
                                          / before["stats_s"]["median"], abs=1e-3)
            ratio = float(table["cold load"][2].rstrip("x"))
            assert ratio == pytest.approx(result["cold_load_s"] / before["cold_load_s"], abs=1e-3)
        assert len(table["mean"]) == 3   # value, before, ratio
    if has_matplotlib:
        with open(plot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@ONE_KIND
def test_vs_rejects_a_file_that_is_not_a_bench_result(farm2, onnx_path, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    done = tether(farm2, "bench", onnx_path, "--key", "host", "--vs", str(other))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a `tether bench --json` result" in lines[0]


@ONE_KIND
def test_errors_are_one_line_and_debug_shows_the_traceback(farm2, onnx_path):
    done = tether(farm2, "bench", onnx_path, "--key", "no-such-board")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "no device registered under key 'no-such-board'; registered keys: host" in done.stderr
    done = tether(farm2, "bench", onnx_path, "--key", "host", "--devices", "3")
    assert "key 'host' has only 2 board(s); use --devices 2 or --devices all" in done.stderr
    done = tether(farm2, "run", "missing.onnx", "--key", "host", "--random")
    assert done.returncode == 1 and "'missing.onnx': no such file" in done.stderr
    assert "Traceback" not in done.stderr
    done = tether(farm2, "run", onnx_path, "--key", "host")
    assert "give the inputs: --input x.npy" in done.stderr
    host, port = farm2.tracker
    debug = subprocess.run([sys.executable, "-m", "remote.cli", "--debug", "bench", onnx_path,
                            "--key", "no-such-board", "--tracker", f"{host}:{port}"],
                           env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "NoSuchKey" in debug.stderr


@pytest.mark.parametrize("command", ["bench", "run", "status", "compile", "demo"])
def test_every_command_help_has_an_example(command):
    done = subprocess.run([sys.executable, "-m", "remote.cli", command, "--help"], env=ENV,
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0
    assert re.search(r"examples?:\s+tether " + command, done.stdout), done.stdout


def test_profile_prints_the_slowest_layers_and_keeps_every_row(farm2, mlp_module, tmp_path):
    report = str(tmp_path / "profile.json")
    done = tether(farm2, "bench", mlp_module[1], "--key", "host", "--repeat", "2", "--profile",
                  "--json", report)
    assert done.returncode == 0, done.stderr
    with open(report) as f:
        (record,) = json.load(f)["results"]
    rows = record["profile"]
    assert [(r["op"], r["name"]) for r in sorted(rows, key=lambda r: r["name"])] == [
        ("Gemm", "fc0"), ("Gemm", "fc1"), ("Gemm", "fc2"), ("Softmax", "softmax")]
    assert all(r["mean_s"] > 0 for r in rows)
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-9
    assert [r["mean_s"] for r in rows] == sorted((r["mean_s"] for r in rows), reverse=True)
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "slowest 4 of 4 layers" in line)
    assert lines[start + 1].split() == ["OP", "NAME", "FUSED", "INPUTS", "OUTPUTS", "TIME", "SHARE"]
    printed = [re.split(r"\s{2,}", line.strip()) for line in lines[start + 2:start + 6]]
    assert [(c[0], c[1]) for c in printed] == [(r["op"], r["name"]) for r in rows]
    assert [c[-1] for c in printed] == [f"{r['share'] * 100:.1f}%" for r in rows]
    assert ("Gemm", "fc0", "Relu", "1x784", "1x128") == tuple(
        next(c for c in printed if c[1] == "fc0")[:5])


def test_profile_of_a_module_without_the_export_says_to_rebuild(farm2, tmp_path):
    from tests import session_modules
    report = str(tmp_path / "old.json")
    done = tether(farm2, "bench", session_modules.build(str(tmp_path)), "--key", "host",
                  "--repeat", "2", "--profile", "--json", report)
    assert done.returncode == 0, done.stderr
    assert "per-layer profile unavailable" in done.stdout
    assert "rebuild it with this crosscompile" in done.stderr
    with open(report) as f:
        (record,) = json.load(f)["results"]
    assert "rebuild it with this crosscompile" in record["profile_error"]


@ONE_KIND
def test_run_random_prints_top_k_like_onnxruntime(farm2, onnx_path):
    from remote.cli.run import random_inputs
    from tests.onnx_models import mlp, reference
    done = tether(farm2, "run", onnx_path, "--key", "host", "--random", "--top-k", "3",
                  "--seed", "5")
    assert done.returncode == 0, done.stderr
    ranked = re.findall(r"#(\d)\s+class (\d+)\s+(\S+)", done.stdout)
    assert [int(r[0]) for r in ranked] == [1, 2, 3]
    x = random_inputs([{"name": "input", "dtype": "float32", "shape": [1, 1, 28, 28]}], 5)
    (ref,) = reference(mlp(), x)
    expected = np.argsort(ref[0])[::-1][:3]
    assert [int(r[1]) for r in ranked] == list(expected)
    for (_, index, score) in ranked:
        assert float(score) == pytest.approx(float(ref[0][int(index)]), rel=1e-4, abs=1e-6)
    assert re.search(r"latency: [\d.]+ (µs|ms|s) on the board, [\d.]+ (µs|ms|s) round trip "
                     r"\(one cold run",
                     done.stdout)


class Command:
    """A `tether` command running in the background; its stderr is read line by line
    so that the test can act on what the command reports."""

    def __init__(self, farm, *args):
        host, port = farm.tracker
        self.proc = subprocess.Popen([sys.executable, "-m", "remote.cli", *args, "--tracker",
                                      f"{host}:{port}"], env=ENV, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.seen = []
        self._lines = queue.Queue()
        threading.Thread(target=self._read, name="stderr", daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self._lines.put(line)
        self._lines.put(None)  # the command closed its stderr: it is ending

    def _next_line(self):
        try:
            return self._lines.get(timeout=HANG_S)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"the command hung; stderr so far: {''.join(self.seen)}")

    def wait_for(self, pattern):
        """Read stderr up to the first line that matches ``pattern``; returns that line."""
        while True:
            line = self._next_line()
            if line is None:
                raise AssertionError(f"never saw {pattern!r}; stderr: {''.join(self.seen)}")
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def interrupt(self):
        """Ctrl-C; returns the exit code and the whole of stderr."""
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after Ctrl-C; stderr: {''.join(self.seen)}")
        while True:
            line = self._next_line()
            if line is None:
                return code, "".join(self.seen)
            self.seen.append(line)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def started_processes(server):
    """The processes a device server has started itself, once they are
    ready: the one that forks the process of each session. Frozen while
    still starting, it would keep the server from serving at all."""
    pids = worker_processes(server)
    if any(b"remote.server.worker" in _cmdline(pid) for pid in pids):
        deadline = time.monotonic() + HANG_S
        while not re.search(r"session process starter \(pid \d+\) is ready", server.log_text()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the session process starter never became ready: "
                                     f"{server.log_text()}")
            time.sleep(0.05)
    return pids


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def worker_processes(server):
    """The processes a device server has started itself: the one that forks
    the process of each session."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # not a process, or it ended while being looked at
        if parent == server.proc.pid:
            pids.append(int(entry))
    return pids


def test_ctrl_c_during_upload_returns_the_board(farm2, tmp_path):
    # A sparse file: nothing is written here. Far more than the socket buffers
    # between here and the board hold, so the sender really waits on the board.
    big = tmp_path / "big.so"
    with open(big, "wb") as f:
        f.truncate(64 << 20)
    # Each server has one process that forks the process of each session.
    # Frozen, it takes the session's connection and starts nothing to read
    # it: the upload begins but cannot finish, on a fast machine as on a
    # loaded one.
    frozen = [pid for server in farm2.servers for pid in started_processes(server)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    command = Command(farm2, "bench", str(big), "--key", "host", "--timeout", str(HANG_S))
    try:
        command.wait_for(r"upload big\.so \[\.+\] 0\.0/64\.0 MiB$")   # the upload has begun
        logs = "".join(server.log_text() for server in farm2.servers)
        assert len(re.findall(rf"opened by \S+:{command.proc.pid}$", logs, re.M)) == 1, logs
        code, err = command.interrupt()
    finally:
        command.stop()
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert code == 130, err
    assert "interrupted: closed the sessions and returned 1 board(s)" in err
    assert not re.search(r"upload big\.so .* in [\d.]+ s", err)  # stopped part way
    assert "Traceback" not in err
    wait_all_free(farm2)


def test_ctrl_c_during_benchmark_returns_every_board(farm2, onnx_path):
    # An hour of samples on each board: nothing but Ctrl-C ends them while the test runs.
    command = Command(farm2, "bench", onnx_path, "--key", "host", "--devices", "2",
                      "--repeat", "3600", "--min-repeat-ms", "1000", "--timeout", str(HANG_S))
    try:
        command.wait_for(r"benchmarking: 3600 samples")
        command.wait_for(r"benchmarking: 3600 samples")
        held = device_states(farm2)
        assert all(state == "in_use" for state, _ in held.values()), held
        code, err = command.interrupt()
    finally:
        command.stop()
    assert code == 130, err
    assert "interrupted: closed the sessions and returned 2 board(s)" in err
    assert "Traceback" not in err
    wait_all_free(farm2)


def test_top_k_reads_a_convolutional_heads_scores_and_says_when_it_does_not_apply():
    from remote.cli.run import describe_output
    # SqueezeNet's head ends in a global pool: its scores are shaped (1, classes, 1, 1).
    scores = np.arange(10, dtype=np.float32).reshape(1, 10, 1, 1)
    assert re.findall(r"#\d\s+class (\d+)", describe_output("prob", scores, 3)) == ["9", "8", "7"]
    image = np.zeros((1, 3, 4, 4), np.float32)
    assert "(--top-k 3 skipped: [1, 3, 4, 4] is not one row of class scores)" in \
        describe_output("y", image, 3)
    assert "skipped" not in describe_output("y", image, None)  # not asked for: nothing to say


def test_a_missing_input_is_named_with_the_names_given(tmp_path):
    from remote.cli.run import read_inputs
    np.save(tmp_path / "x.npy", np.zeros((1, 3), np.float32))
    spec = [{"name": "data_0", "dtype": "float32", "shape": [1, 3]},
            {"name": "scale", "dtype": "float32", "shape": [1, 3]}]
    with pytest.raises(ValueError, match=re.escape(
            "no value for input(s) ['data_0', 'scale']; the values given are for ['input']")):
        read_inputs([f"input={tmp_path / 'x.npy'}"], spec)


def test_latencies_print_in_the_unit_a_person_reads_without_an_exponent():
    from remote.client import display
    assert display.ms(10.17) == "10.17 s"
    assert display.ms(1.5) == "1500 ms"
    assert display.ms(1.234e-5) == "12.34 µs"
    assert display.ms(12345.0) == "12345 s"
