"""`tether bench` recording into the farm database, `tether history` and the
`--baseline` gate, as commands against a real tracker and a real board server,
with real modules: a small MLP and the same network made wide (many times the
work) under the same file name, standing in for a change that made it slower."""
import json
import os
import subprocess
import sys

import onnx
import pytest

from remote.cli.localfarm import LocalFarm
from tests.onnx_models import mlp
from tests.test_tracker import HANG_S, child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_REGRESSION = 3

pytest.importorskip("sqlalchemy")


@pytest.fixture(scope="module")
def farm():
    with LocalFarm(keys=["host"], env=child_env()) as running:
        yield running


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """{"fast": path, "slow": path}: two builds named net.so of the same interface."""
    import crosscompile

    out = {}
    for name, sizes in (("fast", (784, 32, 10)), ("slow", (784, 2048, 2048, 10))):
        folder = tmp_path_factory.mktemp(name)
        model = str(folder / "net.onnx")
        onnx.save(mlp(sizes=sizes), model)
        crosscompile.build(model, target="host").export_library(str(folder / "net.so"))
        out[name] = str(folder / "net.so")
    return out


def tether(farm, *args):
    host, port = farm.tracker
    return subprocess.run([sys.executable, "-m", "remote.cli", *args, "--tracker",
                           f"{host}:{port}"], env=child_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=HANG_S)


def bench(farm, module, *extra):
    return tether(farm, "bench", module, "--key", "host", "--number", "5", "--repeat", "12",
                  *extra)


def history(farm, *args):
    done = tether(farm, "history", *args)
    assert done.returncode == 0, done.stderr
    return done


def test_bench_records_with_labels_unless_told_not_to_and_history_shows_them(farm, modules,
                                                                            tmp_path):
    done = bench(farm, modules["fast"], "--label", "commit=aaa", "--label", "branch=main")
    assert done.returncode == 0, done.stderr
    assert "recorded in the farm database sqlite:///" in done.stderr
    assert "with commit=aaa, branch=main" in done.stderr
    done = bench(farm, modules["fast"], "--no-record", "--label", "commit=unkept")
    assert done.returncode == 0 and "recorded" not in done.stderr, done.stderr
    (record,) = json.loads(history(farm, modules["fast"], "--key", "host",
                                  "--label", "commit=aaa", "--json").stdout)
    assert record["labels"] == {"commit": "aaa", "branch": "main"}
    assert len(record["samples_s"]) == 12 and record["model_name"] == "net.so"
    assert record["conditions"]["number"] == 5 and record["regression"] is None
    assert record["target"]["name"] == "host" and record["compiler_version"]
    assert json.loads(history(farm, "--label", "commit=unkept", "--json").stdout) == []
    table = history(farm, "net.so", "--key", "host").stdout
    assert "net.so on key host:" in table and "branch=main commit=aaa" in table
    with pytest.raises(AssertionError, match="must look like NAME=VALUE"):
        history(farm, "--label", "nolabel")


def test_the_baseline_gate_fails_a_slower_module_and_passes_a_faster_one(farm, modules,
                                                                         tmp_path):
    done = bench(farm, modules["fast"], "--label", "commit=before")
    assert done.returncode == 0, done.stderr
    slower = bench(farm, modules["slow"], "--label", "commit=after", "--baseline",
                   "commit=before", "--json", str(tmp_path / "slow.json"))
    assert slower.returncode == EXIT_REGRESSION, slower.stderr
    assert "SLOWER by more than 5%" in slower.stderr and "95% CI" in slower.stderr
    with open(tmp_path / "slow.json") as f:
        (result,) = json.load(f)["results"]
    assert result["baseline"]["regression"] and result["baseline"]["ratio"] > 1.5
    # Against a file too, and the other way round: faster is no regression.
    faster = bench(farm, modules["fast"], "--baseline", str(tmp_path / "slow.json"),
                   "--no-record")
    assert faster.returncode == 0, faster.stderr
    assert "within 5%" in faster.stderr
    missing = bench(farm, modules["fast"], "--baseline", "commit=never", "--no-record")
    assert missing.returncode == 1
    assert "has no benchmark of net.so on key 'host' labelled commit=never" in missing.stderr
    # The history marks the slow run against the fast one before it on the same board.
    records = json.loads(history(farm, "net.so", "--key", "host", "--json").stdout)
    # (Earlier runs of the same module, before this test's, may be marked too when
    # the machine was busier for one of them: only this test's pair is known.)
    marked = {r["labels"].get("commit") for r in records if r["regression"]}
    assert "after" in marked
    assert "REGRESSION" in history(farm, "net.so", "--key", "host").stdout


def test_a_report_goes_one_board_per_call_and_leaves_out_a_profile_too_big_for_one():
    from remote.cli.recording import MAX_REQUEST_BYTES, _per_board

    result = {"key": "host", "device_id": "host-1", "samples_s": [0.001] * 20,
              "profile": [{"op": "Conv", "name": "x" * 200}] * (MAX_REQUEST_BYTES // 200)}
    report = {"model": {"path": "net.so"}, "results": [result, {**result, "device_id": "h-2"}]}
    parts = _per_board(report)
    assert [p["results"][0]["device_id"] for p in parts] == ["host-1", "h-2"]
    assert all("profile" not in p["results"][0] for p in parts)
    assert parts[0]["results"][0]["samples_s"] == [0.001] * 20
    huge = {"model": {"path": "net.so"}, "results": [
        {"key": "host", "device_id": "host-1", "samples_s": [0.0012345678] * 10000}]}
    with pytest.raises(ValueError, match="the result of board host-1 is .* bytes, more than"):
        _per_board(huge)


def test_the_interleaved_gate_passes_a_module_against_itself_and_catches_a_slower_one(
        farm, modules, tmp_path):
    """--baseline-module: both modules on one board in one session, in turns. The
    same module against itself passes a 100 % threshold, which only a median
    round ratio above 2 with the copy slower in 11 of the 12 rounds would fail;
    the wide network, many times the work, is caught at 5 %. Both are recorded
    with their comparison."""
    model = os.path.join(os.path.dirname(modules["fast"]), "net.onnx")  # compiled on the spot
    same = bench(farm, modules["fast"], "--baseline-module", model,
                 "--max-regression", "100%", "--label", "gate=self", "--json",
                 str(tmp_path / "self.json"))
    assert same.returncode == 0, same.stderr
    assert "against net.onnx interleaved: median per-round ratio" in same.stderr
    assert "(12 interleaved rounds): within 100%" in same.stderr
    assert "BASELINE" in same.stdout and "RATIO" in same.stdout
    with open(tmp_path / "self.json") as f:
        report = json.load(f)
    (result,) = report["results"]
    gate = result["baseline"]
    assert len(result["samples_s"]) == len(gate["samples_s"]) == 12
    assert gate["method"] == "interleaved" and not gate["regression"]
    assert gate["module"]["kind"] == "onnx" and gate["module"]["path"] == model
    assert gate["ci_low"] <= gate["ratio"] <= gate["ci_high"]

    slower = bench(farm, modules["slow"], "--baseline-module", modules["fast"],
                   "--label", "gate=slow")
    assert slower.returncode == EXIT_REGRESSION, slower.stderr
    assert "(12 interleaved rounds): SLOWER by more than 5%" in slower.stderr
    (recorded,) = json.loads(history(farm, "net.so", "--key", "host", "--label", "gate=slow",
                                     "--json").stdout)
    assert recorded["comparison"]["regression"] and recorded["comparison"]["ratio"] > 1.5
    assert len(recorded["comparison"]["samples_s"]) == 12

    both = bench(farm, modules["fast"], "--baseline-module", modules["fast"], "--baseline",
                 "gate=self")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr, both.stderr
    missing = bench(farm, modules["fast"], "--baseline-module", str(tmp_path / "main.so"))
    assert missing.returncode == 1, missing.stderr
    assert "--baseline-module: " in missing.stderr, missing.stderr
    assert "main.so': no such file" in missing.stderr, missing.stderr
