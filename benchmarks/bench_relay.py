"""Sessions through the tracker's relay against direct ones, in one run.

    python benchmarks/bench_relay.py [--mib 64] [--repeat 5]

A tracker and two device servers run as processes on loopback: one takes
sessions on its own port, the other (``--relay``) only through the tracker,
as a board behind NAT does. The same transfers and calls run in a session on
each, both sessions open at once and taking each measurement in turn, so
that the machine's load falls on both alike; printed are medians of
``--repeat`` rounds and relayed/direct (1.0 means the relay costs nothing).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remote.cli.localfarm import LocalFarm  # noqa: E402

MIB = 1 << 20
CALLS = 500  # small calls per timed run


def measurements(sess, path: str, array: np.ndarray) -> dict:
    """{name: (amount per run, one run)} of a session: MiB for transfers,
    microseconds per call for the small calls."""
    size = os.path.getsize(path) / MIB
    kept = sess.upload_tensor("kept", array)

    def calls():
        for _ in range(CALLS):
            sess.ping()
    return {
        "upload (MiB/s)": (size, lambda: sess.upload(path, "f.bin")),
        "download (MiB/s)": (size, lambda: sess.download("f.bin")),
        "tensor in (MiB/s)": (array.nbytes / MIB, lambda: sess.upload_tensor("t", array)),
        "tensor out (MiB/s)": (array.nbytes / MIB, kept.numpy),
        "small call round trip (us)": (None, calls),
    }


def alternating(runs: dict, repeat: int) -> dict:
    """{key: figure}: the same measurement of every session, one run of each
    in turn, ``repeat`` rounds after a warm-up round; the median of each."""
    times = {key: [] for key in runs}
    for i in range(repeat + 1):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            if i:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    array = np.random.default_rng(0).random(args.mib * MIB // 4, dtype=np.float32)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp, LocalFarm(keys=["direct"], env=env) as farm:
        path = os.path.join(tmp, "f.bin")
        array.tofile(path)
        farm.add_server("relayed", extra=["--relay"])
        tracker = farm.client()
        with contextlib.ExitStack() as stack:
            each = {}
            for key in ("direct", "relayed"):
                sess = stack.enter_context(tracker.request(key, timeout=60, call_timeout=300))
                assert sess.relayed == (key == "relayed")
                each[key] = measurements(sess, path, array)
            results = {key: {} for key in each}
            for name, (amount, _) in each["direct"].items():
                seconds = alternating({key: runs[name][1] for key, runs in each.items()}, args.repeat)
                for key, t in seconds.items():
                    results[key][name] = amount / t if amount else t / CALLS * 1e6
    print(f"loopback, {args.mib} MiB files/tensors, median of {args.repeat}; {os.cpu_count()} cores")
    print(f"{'measurement':<30} {'direct':>10} {'relayed':>10} {'relayed/direct':>15}")
    for name in results["direct"]:
        d, r = results["direct"][name], results["relayed"][name]
        print(f"{name:<30} {d:>10.1f} {r:>10.1f} {r / d:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
