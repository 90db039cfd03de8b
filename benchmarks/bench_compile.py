"""Compile time per zoo model and host latency against onnxruntime (1 thread).

    python benchmarks/bench_compile.py [model ...] [--repeat N] [--jobs N]

For each model of the onnx package's light zoo (with random parameters, as
in tests/test_zoo.py) prints the compile time, the module's code and
parameter sizes, the median latency of the compiled module (loaded with
minirt) and of onnxruntime on one thread, and their ratio (>1: we are slower).
--jobs is build()'s: the processes LLVM runs in (0: every usable core).
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
from tests.onnx_models import ZOO, zoo_input, zoo_model  # noqa: E402


def median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=ZOO, help=f"default: all of {', '.join(ZOO)}")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=None, help="build()'s jobs (default: its default)")
    args = parser.parse_args()

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    print(f"{'model':14} {'compile s':>9} {'code KB':>8} {'params MB':>9} "
          f"{'ours ms':>9} {'ort ms':>8} {'ours/ort':>8}")
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        for name in args.models:
            model = zoo_model(name, logits=False)
            feeds = zoo_input(model)
            started = time.perf_counter()
            lib = crosscompile.build(model, target="host", jobs=args.jobs)
            compile_s = time.perf_counter() - started
            module = minirt.load(lib.export_library(os.path.join(tmp, f"{name}.so")))
            ours = median_seconds(lambda: module.run(feeds), args.repeat)
            session = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
            peer = median_seconds(lambda: session.run(None, feeds), args.repeat)
            s = lib.summary
            print(f"{name:14} {compile_s:9.1f} {s['code_bytes'] / 1024:8.0f} "
                  f"{s['param_bytes'] / 2**20:9.1f} {ours * 1e3:9.1f} {peer * 1e3:8.1f} "
                  f"{ours / peer:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
