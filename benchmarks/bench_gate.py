"""The CI gate of `tether bench` on this machine: does it fail a planted 10 %
slowdown and pass an unchanged module, run after run?

    python benchmarks/bench_gate.py [--runs 10] [--rounds 100] [--min-repeat-ms 5] [--busy N]
                                    [--no-stored]

A real tracker and a real board server (key "host") on loopback, and three
modules compiled here from one MLP (batch 64, 784 -> H -> 10): main's build,
an unchanged rebuild of the same model, and a planted one whose hidden layer
is wider, sized so that it is about 10 % slower on the board (measured as the
gate measures, over 300 interleaved rounds; the ratios are printed).

Each run is one `tether bench` command, as a CI job would run it, and the
unchanged and planted runs alternate so that the machine's load falls on
both alike:

- interleaved: `tether bench NEW --baseline-module main.so --repeat ROUNDS
  --max-regression 5%`, both modules timed in turns in one session;
- stored (unless --no-stored): `tether bench NEW --baseline gate=main
  --repeat ROUNDS`, against main's build recorded three times at the start,
  as a CI job on main would have recorded it.

The last lines say, per gate, how many unchanged runs alarmed (false alarms)
and how many planted runs were caught, with each run's ratio and interval.
--busy N runs N spinning processes (tests/competing_load.py) the whole time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import onnx  # noqa: E402

from remote.cli.localfarm import LocalFarm  # noqa: E402
from tests.competing_load import CompetingLoad  # noqa: E402
from tests.onnx_models import mlp  # noqa: E402

BATCH = 64
HIDDEN = 320
PLANTED = 1.10
# Rounds of the measurements that size the planted slowdown and check the rebuild.
CALIBRATION_ROUNDS = 300
EXIT_REGRESSION = 3


def build(folder: str, hidden: int) -> str:
    """The MLP with ``hidden`` units compiled for this host, as folder/net.so."""
    import crosscompile

    os.makedirs(folder, exist_ok=True)
    model = os.path.join(folder, "net.onnx")
    # One seed for every build: the unchanged rebuild is the same model.
    onnx.save(mlp(sizes=(784, hidden, 10), batch=BATCH, seed=1), model)
    path = os.path.join(folder, "net.so")
    crosscompile.build(model, target="host").export_library(path)
    return path


def planted_module(farm, folder: str, base: str) -> tuple:
    """A build about PLANTED times slower than ``base`` on the board (the
    hidden layer widened; tried again, scaled, when it lands off by more than
    2 %): (path, the ratio measured)."""
    hidden = round(HIDDEN * PLANTED / 16) * 16
    for _ in range(4):
        path = build(os.path.join(folder, f"planted-{hidden}"), hidden)
        ratio = board_ratio(farm, path, base, folder)
        print(f"planted: hidden {HIDDEN} -> {hidden}, measured ratio {ratio:.3f}", flush=True)
        if abs(ratio - PLANTED) <= 0.02:
            break
        # The extra time grows with the extra units: scale them to the goal.
        extra = (hidden - HIDDEN) * (PLANTED - 1) / (ratio - 1) if ratio > 1.01 else \
            2 * (hidden - HIDDEN)
        hidden = HIDDEN + max(16, round(extra / 16) * 16)
    return path, ratio


def board_ratio(farm, slow: str, fast: str, folder: str, rounds: int = CALIBRATION_ROUNDS) -> float:
    """The median ratio slow / fast over ``rounds`` interleaved rounds on the
    board, as the gate measures it."""
    found = gate(farm, slow, ["--baseline-module", fast, "--repeat", str(rounds),
                              "--min-repeat-ms", "5", "--no-record"],
                 os.path.join(folder, "calibration.json"))
    return found["ratio"]


def tether(farm, *args) -> subprocess.CompletedProcess:
    host, port = farm.tracker
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "remote.cli", *args, "--tracker",
                           f"{host}:{port}"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def gate(farm, module: str, options: list, out: str) -> dict:
    done = tether(farm, "bench", module, "--key", "host", *options, "--json", out)
    if done.returncode not in (0, EXIT_REGRESSION):
        raise RuntimeError(f"tether bench failed ({done.returncode}): {done.stderr[-2000:]}")
    with open(out) as f:
        (result,) = json.load(f)["results"]
    found = result["baseline"]
    assert found["regression"] == (done.returncode == EXIT_REGRESSION), done.stderr
    return found


def span(comparisons: list) -> str:
    ratios = [c["ratio"] for c in comparisons]
    return f"{min(ratios):.3f}..{max(ratios):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="unchanged and planted runs each")
    parser.add_argument("--rounds", type=int, default=100, help="--repeat of each gate run")
    parser.add_argument("--min-repeat-ms", type=float, default=5.0)
    parser.add_argument("--max-regression", default="5%")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="N spinning processes compete for the cores the whole time")
    parser.add_argument("--no-stored", action="store_true",
                        help="run the interleaved gate only, not the stored-baseline one")
    args = parser.parse_args()

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    gates = {"interleaved": ["--baseline-module"], "stored": ["--baseline", "gate=main"]}
    if args.no_stored:
        del gates["stored"]
    common = ["--repeat", str(args.rounds), "--min-repeat-ms", f"{args.min_repeat_ms:g}",
              "--max-regression", args.max_regression, "--no-record"]
    with tempfile.TemporaryDirectory(prefix="bench-gate-") as folder, \
            CompetingLoad(args.busy), LocalFarm(keys=["host"]) as farm:
        if args.busy:
            print(f"competing load: {args.busy} spinning processes the whole time", flush=True)
        main_so = build(os.path.join(folder, "main"), HIDDEN)
        modules = {"unchanged": build(os.path.join(folder, "unchanged"), HIDDEN)}
        modules["planted"], ratio = planted_module(farm, folder, main_so)
        print(f"measured on the board over {CALIBRATION_ROUNDS} interleaved rounds: unchanged "
              f"rebuild / main {board_ratio(farm, modules['unchanged'], main_so, folder):.3f}, "
              f"planted / main {ratio:.3f}", flush=True)
        gates["interleaved"].append(main_so)
        if "stored" in gates:
            for i in range(3):
                done = tether(farm, "bench", main_so, "--key", "host", "--repeat",
                              str(args.rounds), "--min-repeat-ms", f"{args.min_repeat_ms:g}",
                              "--label", "gate=main")
                if done.returncode != 0:
                    raise RuntimeError(f"recording main's build failed: {done.stderr[-2000:]}")
            print("recorded main's build 3 times as gate=main", flush=True)
        found = {(g, kind): [] for g in gates for kind in modules}
        for run in range(args.runs):
            for kind, module in modules.items():
                for name, options in gates.items():
                    c = gate(farm, module, options + common,
                             os.path.join(folder, f"{name}-{kind}-{run}.json"))
                    found[(name, kind)].append(c)
                    print(f"run {run + 1:2d} {kind:9s} {name:11s}: ratio {c['ratio']:.3f} "
                          f"[{c['ci_low']:.3f}, {c['ci_high']:.3f}] p={c['p_value']:.2g} "
                          f"{'REGRESSION' if c['regression'] else 'pass'}", flush=True)
    print()
    print(f"{'GATE':12s} {'FALSE ALARMS':>14s} {'CAUGHT':>10s}  UNCHANGED RATIOS   PLANTED RATIOS")
    for name in gates:
        same, planted = found[(name, "unchanged")], found[(name, "planted")]
        print(f"{name:12s} {sum(c['regression'] for c in same):>5d} of {len(same):<5d}"
              f" {sum(c['regression'] for c in planted):>3d} of {len(planted):<3d}  "
              f"{span(same):17s}  {span(planted)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
