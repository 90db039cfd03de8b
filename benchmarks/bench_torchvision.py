"""Every torchvision model exported by benchmarks/export_torchvision.py:
compile time, outputs and one-thread time, ours against onnxruntime.

    python benchmarks/bench_torchvision.py DIR [model ...] [--repeat N] [--cpu-time]
        [--avx2] [--compile-target rasp4b64] [--json FILE]

For each DIR/NAME.onnx (or the models named): the time `crosscompile.build`
takes for the host (and, with --compile-target, for that preset too: the
cross-compile a user waits for), then ours and onnxruntime on one thread,
run interleaved in blocks (bench_models.interleaved_medians), medians in ms
and their ratio (> 1: we are slower). --cpu-time reads the calling
thread's CPU time around each run instead of the wall clock, which is what
a one-thread run costs whatever else the machine runs. "rel" is the
largest difference of our output from onnxruntime's over the largest
magnitude of onnxruntime's; a model whose rel exceeds 1e-3 is marked
WRONG (its time counts a wrong computation). A model that does not
compile is listed with the first line of its error, and the sweep goes on.
The summary counts models over the issue's goals (time ratio > 1.0,
compile > 15 s). Counts on an emulated Cortex-A72 are bench_arm.py's:
`python benchmarks/bench_arm.py DIR/NAME.onnx`.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
import minirt  # noqa: E402
from benchmarks.bench_models import host_target_and_peer, interleaved_medians, machine_description, ort_session  # noqa: E402
from tests.onnx_models import sample_input  # noqa: E402

WRONG_REL = 1e-3


def relative_difference(got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got - want| over the largest |want|."""
    scale = float(np.abs(want).max()) or 1.0
    return float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max()) / scale


def measure(path: str, target: str, compile_target: "str | None", repeat: int, cpu_time: bool,
            tmp: str) -> dict:
    """One model's row: compile seconds, ours and onnxruntime's medians, rel."""
    name = os.path.splitext(os.path.basename(path))[0]
    model = onnx.load(path)
    row = {"model": name, "nodes": len(model.graph.node)}
    started = time.perf_counter()
    try:
        lib = crosscompile.build(model, target=target)
    except Exception as error:  # noqa: BLE001 - a refusal is a row of the sweep
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:240]}"
        return row
    row["compile_s"] = time.perf_counter() - started
    if compile_target:
        started = time.perf_counter()
        crosscompile.build(model, target=compile_target)
        row["cross_compile_s"] = time.perf_counter() - started
    feeds = sample_input(model)
    module = minirt.load(lib.export_library(os.path.join(tmp, f"{name}.so")), threads=1)
    session = ort_session(model, 1)
    try:
        got, want = module.run(feeds)[0], session.run(None, feeds)[0]
        row["rel"] = relative_difference(got, want)
        ours, peer = interleaved_medians([lambda: module.run(feeds), lambda: session.run(None, feeds)],
                                         repeat, clock=time.thread_time if cpu_time else time.perf_counter)
    finally:
        module.close()
    row.update(ours_ms=ours * 1e3, ort_ms=peer * 1e3, ratio=ours / peer)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the folder export_torchvision.py wrote")
    parser.add_argument("models", nargs="*", help="default: every NAME.onnx in the folder")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--cpu-time", action="store_true", help="time the calling thread's CPU time")
    parser.add_argument("--avx2", action="store_true",
                        help="AVX2 against AVX2 on an AVX-512 machine (see bench_models.py --avx2)")
    parser.add_argument("--compile-target", help="also time the compile for this preset (e.g. rasp4b64)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    paths = [os.path.join(args.folder, f"{name}.onnx") for name in args.models] or \
        sorted(glob.glob(os.path.join(args.folder, "*.onnx")))
    for path in paths:
        if not os.path.exists(path):
            parser.error(f"no model {path}; export it with benchmarks/export_torchvision.py")
    target, peer = host_target_and_peer(parser, args.avx2)
    print(f"machine: {machine_description()}; ours compiled for {target}; {peer}; "
          f"{'CPU' if args.cpu_time else 'wall'} time, 1 thread")
    cross = f" {args.compile_target + ' s':>12}" if args.compile_target else ""
    print(f"{'model':30} {'nodes':>5} {'compile s':>9}{cross} {'ours ms':>9} {'ort ms':>9} {'ours/ort':>8} {'rel':>8}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        for path in paths:
            row = measure(path, target, args.compile_target, args.repeat, args.cpu_time, tmp)
            rows.append(row)
            if "error" in row:
                print(f"{row['model']:30} {row['nodes']:5} refused: {row['error']}", flush=True)
                continue
            cross = f" {row['cross_compile_s']:12.1f}" if args.compile_target else ""
            wrong = "  WRONG" if row["rel"] > WRONG_REL else ""
            print(f"{row['model']:30} {row['nodes']:5} {row['compile_s']:9.1f}{cross} {row['ours_ms']:9.2f} "
                  f"{row['ort_ms']:9.2f} {row['ratio']:8.2f} {row['rel']:8.1e}{wrong}  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    done = [row for row in rows if "error" not in row]
    slow = [row["model"] for row in done if row["ratio"] > 1.0]
    long = [row["model"] for row in done if max(row["compile_s"], row.get("cross_compile_s", 0)) > 15]
    wrong = [row["model"] for row in done if row["rel"] > WRONG_REL]
    print(f"\n{len(done)} of {len(rows)} compiled; slower than onnxruntime: {len(slow)} {slow}; "
          f"compile over 15 s: {len(long)} {long}; wrong: {len(wrong)} {wrong}")
    if done:
        ratios = np.array([row["ratio"] for row in done])
        print(f"ours/ort: median {np.median(ratios):.2f}, geometric mean {np.exp(np.log(ratios).mean()):.2f}, "
              f"worst {ratios.max():.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
