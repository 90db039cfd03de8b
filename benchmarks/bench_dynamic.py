"""A module compiled once with a dynamic batch against modules compiled for
each fixed batch size, on this machine.

    python benchmarks/bench_dynamic.py [--sizes 1,4,16] [--max 16] [--repeat 30] [--threads 1]

For each model (a small conv net, an MLP and an attention block from
tests/dynamic_models.py and tests/onnx_models.py, each with a symbolic
batch "N"), one module is built with dynamic={"N": (1, max)} and one per
size with that size fixed. At every size the two run interleaved, one run
of each in turn, so that load from other processes hits both alike; the
table gives median and fastest milliseconds of each and their ratios
dynamic / fixed (> 1: the dynamic module is slower; on a shared machine
the fastest run is the one least disturbed). Both are checked to give the
same outputs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
import minirt  # noqa: E402
from minirt.timing import bound_call  # noqa: E402
from tests.dynamic_models import attention_block, conv_net  # noqa: E402
from tests.onnx_models import mlp  # noqa: E402

MODELS = {
    "conv": lambda: conv_net(size=32, channels=32, classes=10),
    "mlp": lambda: mlp(sizes=(256, 512, 512, 10), batch="N"),
    "attention": lambda: attention_block(tokens=16, width=64, heads=4),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--sizes", default="1,4,16", help="batch sizes to time (default 1,4,16)")
    parser.add_argument("--max", type=int, default=16, help="the dynamic module's upper bound (default 16)")
    parser.add_argument("--repeat", type=int, default=200, help="timed runs of each module per size")
    parser.add_argument("--threads", type=int, default=1, help="threads per run (default 1)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"dynamic N=1:{args.max} vs fixed N, host, {args.threads} thread(s), median of {args.repeat} "
          "interleaved runs")
    print(f"{'model':10} {'N':>4} {'dynamic ms':>11} {'fixed ms':>9} {'ratio':>6}   "
          f"{'fastest: dynamic':>16} {'fixed':>7} {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="bench-dynamic-") as folder:
        for name in args.models:
            model = MODELS[name]()
            feed = model.graph.input[0].name
            rest = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:]]
            start = time.perf_counter()
            lib = crosscompile.build(model, "host", dynamic={"N": (1, args.max)})
            build_s = time.perf_counter() - start
            dynamic = minirt.load(lib.export_library(os.path.join(folder, f"{name}.so")), threads=args.threads)
            for size in sizes:
                shapes = {feed: (size, *rest)}
                fixed = minirt.load(crosscompile.build(model, "host", input_shapes=shapes).export_library(
                    os.path.join(folder, f"{name}_{size}.so")), threads=args.threads)
                x = {feed: np.random.default_rng(size).standard_normal((size, *rest)).astype(np.float32)}
                np.testing.assert_allclose(dynamic.run(x)[0], fixed.run(x)[0], rtol=1e-4, atol=1e-5)
                calls = [bound_call(dynamic, x), bound_call(fixed, x)]
                times = [[], []]
                for _ in range(args.repeat):
                    for side, call in enumerate(calls):
                        t = time.perf_counter()
                        call()
                        times[side].append(time.perf_counter() - t)
                ours, theirs = (statistics.median(t) * 1e3 for t in times)
                best, their_best = (min(t) * 1e3 for t in times)
                print(f"{name:10} {size:>4} {ours:>11.3f} {theirs:>9.3f} {ours / theirs:>6.2f}   "
                      f"{best:>16.3f} {their_best:>7.3f} {best / their_best:>6.2f}", flush=True)
            print(f"{'':10} (built in {build_s:.1f} s, {len(lib.so_bytes)} bytes, parameters "
                  f"{lib.metadata['param_bytes']} bytes, workspace {lib.metadata['workspace_bytes']} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
