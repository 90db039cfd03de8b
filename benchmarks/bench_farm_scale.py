"""How far one tracker goes: 100, 1,000 and 10,000 board links at once.

    python benchmarks/bench_farm_scale.py [--boards 100 1000 10000] [--seconds 10] [--threads 16]

For each farm size a tracker process starts on loopback and a simulator
process (benchmarks/board_sim.py) registers that many boards over the real
board-link protocol, each pinging at the rate the tracker asks for (a link
silent for 2.5 s is dropped; every board pings once a second). Then
``--threads`` client threads lease a board and release it, over the
tracker's gRPC service as users do, for ``--seconds``. Printed per size: the
tracker's resident memory and CPU use while the clients run, leases per
second, and the request latency (RequestDevice until the lease arrives) at
the median and the 99th percentile.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remote.cli.localfarm import Child, python_argv  # noqa: E402
from remote.client.tracker import TrackerClient  # noqa: E402

KEY = "sim"
TICKS = os.sysconf("SC_CLK_TCK")


def env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def measure(boards: int, seconds: float, threads: int, log_dir: str) -> dict:
    # The farm database as a tracker keeps it by default, in the run's own folder.
    tracker = Child(f"tracker-{boards}", python_argv(
        "remote.tracker", "--host", "127.0.0.1", "--port", "0",
        "--db", f"sqlite:///{os.path.join(log_dir, f'farm-{boards}.sqlite')}"), log_dir, env())
    sim = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "board_sim.py"),
                            "--tracker", f"127.0.0.1:{tracker.port}", "--boards", str(boards),
                            "--key", KEY], stdout=subprocess.PIPE, text=True, env=env())
    try:
        line = sim.stdout.readline()
        if not line.startswith("registered"):
            raise RuntimeError(f"the simulator did not register its boards: {line!r}")
        client = TrackerClient("127.0.0.1", tracker.port, timeout=60)
        total = len(client.summary()["devices"])
        assert total == boards, f"the tracker lists {total} boards, not {boards}"
        idle_rss = rss_mib(tracker.proc.pid)
        stop = threading.Event()
        latencies, lock = [], threading.Lock()

        def lease_and_release():
            mine = []
            with TrackerClient("127.0.0.1", tracker.port, timeout=60) as own:
                while not stop.is_set():
                    start = time.perf_counter()
                    lease = own.lease(KEY, timeout=30)
                    mine.append(time.perf_counter() - start)
                    own.release(lease)
            with lock:
                latencies.extend(mine)

        # This process has just read a summary of every board: out of the
        # collector's full passes while the latencies are taken.
        gc.collect()
        gc.freeze()
        workers = [threading.Thread(target=lease_and_release) for _ in range(threads)]
        cpu0, t0 = cpu_seconds(tracker.proc.pid), time.monotonic()
        for w in workers:
            w.start()
        time.sleep(seconds)
        stop.set()
        for w in workers:
            w.join(60)
        elapsed = time.monotonic() - t0
        cpu = (cpu_seconds(tracker.proc.pid) - cpu0) / elapsed
        busy_rss = rss_mib(tracker.proc.pid)
        still = len(client.summary()["devices"])
        client.close()
        ms = sorted(x * 1e3 for x in latencies)
        return {"boards": boards, "still_registered": still, "idle_rss_mib": idle_rss,
                "rss_mib": busy_rss, "cpu": cpu, "leases_per_s": len(ms) / elapsed,
                "p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))]}
    finally:
        sim.terminate()
        sim.wait(30)
        tracker.stop()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boards", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args(argv)
    print(f"one tracker, N simulated boards pinging every second, {args.threads} client "
          f"threads leasing and releasing for {args.seconds:g} s; {os.cpu_count()} cores")
    print(f"{'boards':>8} {'RSS idle':>9} {'RSS busy':>9} {'CPU':>6} {'leases/s':>9} "
          f"{'p50 ms':>8} {'p99 ms':>8}  still registered")
    with tempfile.TemporaryDirectory(prefix="tether-scale-") as log_dir:
        for boards in args.boards:
            r = measure(boards, args.seconds, args.threads, log_dir)
            print(f"{r['boards']:>8} {r['idle_rss_mib']:>8.0f}M {r['rss_mib']:>8.0f}M "
                  f"{r['cpu']:>5.0%} {r['leases_per_s']:>9.0f} {r['p50_ms']:>8.2f} "
                  f"{r['p99_ms']:>8.2f}  {r['still_registered']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
