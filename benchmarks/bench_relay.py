"""Sessions through the tracker's relay against direct ones, in one run.

    python benchmarks/bench_relay.py [--mib 64] [--repeat 5]

A tracker and two device servers run as processes on loopback: one takes
sessions on its own port, the other (``--relay``) only through the tracker,
as a board behind NAT does. The same transfers and calls run in a session on
each; printed are medians of ``--repeat`` runs and relayed/direct (1.0 means
the relay costs nothing).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remote.cli.localfarm import LocalFarm  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_transfer import median_time  # noqa: E402  (the same timing as the direct figures)

MIB = 1 << 20


def figures(sess, path: str, array: np.ndarray, repeat: int) -> dict:
    size = os.path.getsize(path) / MIB
    kept = sess.upload_tensor("kept", array)
    out = {
        "upload (MiB/s)": size / median_time(lambda: sess.upload(path, "f.bin"), repeat),
        "download (MiB/s)": size / median_time(lambda: sess.download("f.bin"), repeat),
        "tensor in (MiB/s)": array.nbytes / MIB / median_time(
            lambda: sess.upload_tensor("t", array), repeat),
        "tensor out (MiB/s)": array.nbytes / MIB / median_time(kept.numpy, repeat),
    }

    def calls():
        for _ in range(500):
            sess.ping()
    out["small call round trip (us)"] = median_time(calls, repeat) / 500 * 1e6
    return out


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
        results = {}
        for key in ("direct", "relayed"):
            with tracker.request(key, timeout=60, call_timeout=300) as sess:
                assert sess.relayed == (key == "relayed")
                results[key] = figures(sess, path, array, args.repeat)
    print(f"loopback, {args.mib} MiB files/tensors, median of {args.repeat}; {os.cpu_count()} cores")
    print(f"{'measurement':<30} {'direct':>10} {'relayed':>10} {'relayed/direct':>15}")
    for name in results["direct"]:
        d, r = results["direct"][name], results["relayed"][name]
        print(f"{name:<30} {d:>10.1f} {r:>10.1f} {r / d:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
