"""Tuned register tiles against the default ones and onnxruntime.

    python benchmarks/bench_tuning.py [model ...] [--rounds N] [--threads T] [--cache DIR]

For each model (default: SqueezeNet and ResNet-50 of the onnx package's
light zoo, random parameters, one 1x3x224x224 image), every GEMM
convolution shape is tuned on a host board of a local farm (a real tracker
and device server; `remote.client.tuning.tune` through a Session), then the
whole model is timed three ways in this process: built with the default
tiles, built with the tuned ones, and onnxruntime, on each of --threads.
The three run in turn, one call each per turn, so that load from other work
on the machine falls on all of them alike. Latencies are medians in ms;
ratios below 1 mean the first is faster.

--cache DIR keeps the tuning results there (a second run skips the
measured shapes); by default a fresh temporary directory is used.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
import minirt  # noqa: E402
from crosscompile.tuning import TuningCache  # noqa: E402
from remote import rpc  # noqa: E402
from remote.client import tuning  # noqa: E402
from remote.cli.localfarm import LocalFarm  # noqa: E402
from tests.onnx_models import zoo_input, zoo_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ort_session(model, threads: int):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def load(lib, folder: str, name: str, threads: int):
    return minirt.load(lib.export_library(os.path.join(folder, name)), threads=threads)


def interleaved(runners: dict, rounds: int) -> dict:
    """Median seconds per runner, one call of each in turn per round."""
    for fn in runners.values():
        fn()  # warm-up
    samples = {name: [] for name in runners}
    for _ in range(rounds):
        for name, fn in runners.items():
            started = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["squeezenet", "resnet50"])
    parser.add_argument("--rounds", type=int, default=15, help="timed calls of each (default 15)")
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated thread counts of ours and onnxruntime (default 1,2; "
                             "the board tunes with all its cores)")
    parser.add_argument("--number", type=int, default=3, help="tuning: runs per sample")
    parser.add_argument("--repeat", type=int, default=5, help="tuning: samples per candidate")
    parser.add_argument("--cache", default=None, help="tuning cache directory to use and keep")
    args = parser.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]

    cache_dir = args.cache or tempfile.mkdtemp(prefix="tether-bench-tuning-")
    cache = TuningCache(cache_dir)
    env = {**os.environ, "PYTHONPATH": ROOT}
    folder = tempfile.mkdtemp(prefix="tether-bench-tuning-")
    results = []
    with LocalFarm(keys=["host"], env=env) as farm:
        for name in args.models:
            model = zoo_model(name)
            feeds = zoo_input(model)
            started = time.perf_counter()
            with rpc.connect_tracker(*farm.tracker).request("host", timeout=60) as sess:
                result = tuning.tune(model, "host", sess, cache=cache, number=args.number,
                                     repeat=args.repeat, timeout=600)
            tune_s = time.perf_counter() - started
            changed = [s for s in result.shapes if s.best != s.default]
            print(f"{name}: {len(result.shapes)} conv shapes tuned on the host board in "
                  f"{tune_s:.0f} s; {len(changed)} changed tile")
            for s in result.shapes:
                print(f"  {s.shape.key:48s} gemm {'x'.join(map(str, s.shape.gemm)):16s} "
                      f"{'x'.join(map(str, s.default))} -> {'x'.join(map(str, s.best)):5s} "
                      f"{s.default_s * 1e3:9.3f} -> {s.best_s * 1e3:9.3f} ms  {s.speedup:.2f}x")
            default_lib = crosscompile.build(model, "host")
            tuned_lib = crosscompile.build(model, "host", schedules=cache)
            for threads in thread_counts:
                default = load(default_lib, folder, f"{name}-default-{threads}.so", threads)
                tuned = load(tuned_lib, folder, f"{name}-tuned-{threads}.so", threads)
                ort = ort_session(model, threads)
                medians = interleaved({"default": lambda: default.run(feeds),
                                       "tuned": lambda: tuned.run(feeds),
                                       "onnxruntime": lambda: ort.run(None, feeds)}, args.rounds)
                default.close()
                tuned.close()
                results.append((name, threads, medians))
    print()
    print(f"model latency, median of {args.rounds} interleaved runs (ms)")
    print(f"{'model':12s} {'threads':>7s} {'default':>9s} {'tuned':>9s} {'ort':>9s} "
          f"{'tuned/default':>14s} {'default/ort':>12s} {'tuned/ort':>10s}")
    for name, threads, m in results:
        d, t, o = m["default"], m["tuned"], m["onnxruntime"]
        print(f"{name:12s} {threads:7d} {d * 1e3:9.2f} {t * 1e3:9.2f} {o * 1e3:9.2f} "
              f"{t / d:14.3f} {d / o:12.3f} {t / o:10.3f}")
    print(f"tuning cache: {cache.path_for('host')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
