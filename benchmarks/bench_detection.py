"""A detection model compiled with crosscompile against onnxruntime: its
outputs (boxes, scores, labels) compared on one random image, its compile
time for the host (and --arm's boards), and its 1-thread latency, ours and
onnxruntime's interleaved.

    python benchmarks/bench_detection.py [model.onnx] [--arm] [--emulated] [--repeat N] [--seed S]

Without a file, the small detection head of tests/detection_models.py
(on its test features, standard normal). An
SSDlite320-MobileNetV3-Large export is made by benchmarks/export_ssdlite.py
(which needs torch and torchvision, in a separate environment). Outputs
are compared by position: the largest absolute difference of each float
output, and whether each integer output (labels) is equal; outputs of
different shapes (a different number of kept boxes) are reported as such.
Latencies are medians in ms, the ratio ours / onnxruntime (> 1: we are
slower). --emulated also compares the outputs of the rasp4b64 module run
by the native board server under qemu-aarch64 (needs qemu-user and the
server's build, as the emulated tests do).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_models import interleaved_medians, ort_session  # noqa: E402
from tests.onnx_models import sample_input  # noqa: E402


def compare(got: list, want: list, names: list) -> bool:
    """Print each output's agreement; True when every one matches."""
    matched = True
    for name, g, w in zip(names, got, want):
        if g.shape != w.shape:
            print(f"  {name}: shape {g.shape}, onnxruntime {w.shape}")
            matched = False
        elif w.dtype.kind == "f":
            diff = float(np.max(np.abs(g.astype(np.float64) - w))) if w.size else 0.0
            print(f"  {name}: {w.shape}, max abs diff {diff:.3g}")
            matched = matched and diff <= 1e-3 * max(1.0, float(np.abs(w).max()) if w.size else 1.0)
        else:
            equal = bool(np.array_equal(g, w))
            print(f"  {name}: {w.shape}, {'equal' if equal else 'DIFFERENT'}")
            matched = matched and equal
    return matched


def main(argv=None) -> int:
    import crosscompile
    import minirt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="an ONNX detection model (default: the test head)")
    parser.add_argument("--arm", action="store_true", help="also time compiling for rasp4b64")
    parser.add_argument("--emulated", action="store_true",
                        help="also run the rasp4b64 module on the native board server under qemu-aarch64 "
                             "and compare its outputs")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs of each (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="the random image's seed")
    args = parser.parse_args(argv)
    if args.model:
        model = onnx.load(args.model)
        feeds = sample_input(model, args.seed, uniform=True)
    else:
        from tests.detection_models import detection_head, detection_input
        model = detection_head()
        feeds = {"features": detection_input(args.seed)}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        try:
            lib = crosscompile.build(model, target="host")
        except crosscompile.BuildError as exc:
            text = str(exc)
            more = f" ... ({len(text) - 600} more characters)" if len(text) > 600 else ""
            print(f"refused after {time.perf_counter() - started:.1f} s: {text[:600]}{more}")
            return 2
        print(f"compile for host: {time.perf_counter() - started:.1f} s")
        if args.arm or args.emulated:
            started = time.perf_counter()
            arm = crosscompile.build(model, target="rasp4b64").export_library(os.path.join(tmp, "arm.so"))
            print(f"compile for rasp4b64: {time.perf_counter() - started:.1f} s")
        module = minirt.load(lib.export_library(os.path.join(tmp, "net.so")), threads=1)
        session = ort_session(model, threads=1)
        got, want = module.run(feeds), session.run(None, feeds)
        names = [o.name for o in model.graph.output]
        print("outputs against onnxruntime:")
        matched = compare(got, want, names)
        if args.emulated:
            from tests.onnx_node_suite import board_runner, board_server
            with board_server("native-aarch64", tmp) as child:
                started = time.perf_counter()
                on_board = board_runner(child.port)(arm, feeds)
                print(f"rasp4b64 module on the native board server under qemu-aarch64 "
                      f"({time.perf_counter() - started:.1f} s, emulated), against onnxruntime:")
            matched = compare(on_board, want, names) and matched
        ours, peer = interleaved_medians([lambda: module.run(feeds), lambda: session.run(None, feeds)],
                                         args.repeat)
    print(f"1 thread: ours {ours * 1e3:.3f} ms, onnxruntime {peer * 1e3:.3f} ms, ratio {ours / peer:.2f}")
    return 0 if matched else 1


if __name__ == "__main__":
    sys.exit(main())
