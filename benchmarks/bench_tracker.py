"""Tether's tracker against Apache TVM's RPC tracker, side by side in one run.

    python benchmarks/bench_tracker.py [--sessions 100] [--devices 100] [--seconds 5]
    python benchmarks/bench_tracker.py --database [--rounds 3]   # what the farm database costs
    python benchmarks/bench_tracker.py --sandbox [--sessions 100]  # what the session sandbox costs

1. request -> session -> close: from ``request(key)`` to a connected session
   on a free device and until that session is closed again, with a real
   tracker and a real device server as processes on loopback (ours:
   ``with tracker.request(key): pass``, once with the native C++ board server
   and once with the Python one behind the same tracker; TVM:
   ``connect_tracker(...).request(key)`` returning an ``RPCSession``, then
   dropped, which ends TVM's session, with ``python -m tvm.exec.rpc_server``,
   the only TVM server that registers with a tracker: each session's socket
   is served by libtvm_runtime's C++ ``RPCServerLoop`` in a forked process).
   All of them are up at once and take one session each in turn per
   round. TVM is timed twice: as shipped, and with TCP_NODELAY set on its
   tracker client's socket (it writes each message in two sends, and Nagle's
   algorithm holds the second back for the tracker's delayed ACK). Beside
   them, the loopback limit: two bare connections (tracker, board) with one
   small round trip each.
2. leases/s: many client threads lease devices from a tracker process that has
   ``--devices`` devices registered and give them back. For us the devices
   are a simulator process (benchmarks/board_sim.py) keeping one real board
   link each, and the clients lease and release over gRPC; for TVM a light
   registrar in this process announces each device with PUT and announces it
   again with a new match key once a lease was handed out, as TVM's server
   does after a session.

Needs ``pip install apache-tvm`` for the TVM half; without it only ours runs.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remote import rpc  # noqa: E402
from remote.cli.localfarm import Child, LocalFarm, python_argv  # noqa: E402
from remote.cli.native import build_native  # noqa: E402

KEY = "bench"


def env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(samples):
    ms = sorted(x * 1e3 for x in samples)
    return statistics.median(ms), ms[int(len(ms) * 0.9)]


# ------------------------------------------------------ request-to-session --

def ours_request_to_session(sessions: int, server_command, db_args=("--db", "none")):
    with LocalFarm(keys=[KEY], env=env(), server_command=server_command,
                   tracker_args=list(db_args)) as farm:
        tracker = rpc.connect_tracker(*farm.tracker)
        samples = []
        for i in range(sessions + 5):
            start = time.perf_counter()
            with tracker.request(KEY, timeout=30):
                pass
            elapsed = time.perf_counter() - start
            if i >= 5:  # warm-up: first channels, imports, thread pools
                samples.append(elapsed)
        return samples


def sandbox_run_speed(tracker, so_path: str, rounds: int = 5):
    """The median time of a module's run on the two boards of ``sandbox_cost``,
    measured on the board, in turns."""
    medians = {KEY: [], KEY + "-open": []}
    for _ in range(rounds):
        for key, kept in medians.items():
            with tracker.request(key, timeout=30) as sess:
                sess.upload(so_path, target="model.so")
                kept.append(sess.load_module("model.so").benchmark(number=20, repeat=5).median)
    return statistics.median(medians[KEY]), statistics.median(medians[KEY + "-open"])


def sandbox_cost(sessions: int, server_command, so_path: str):
    """request -> session -> close on two boards of one farm, taken in turn: one
    whose sessions run in the default sandbox (the PID, mount and network
    namespaces and, as root, a user of their own, as far as the kernel allows)
    and one started with ``--no-sandbox``."""
    with LocalFarm(keys=[], env=env(), server_command=server_command) as farm:
        farm.add_server(KEY)
        farm.add_server(KEY + "-open", extra=["--no-sandbox"])
        tracker = rpc.connect_tracker(*farm.tracker)
        (sandboxed,) = [d for d in tracker.summary()["devices"] if d["key"] == KEY]
        samples = {KEY: [], KEY + "-open": []}
        for i in range(sessions + 5):
            for key, kept in samples.items():
                start = time.perf_counter()
                with tracker.request(key, timeout=30):
                    pass
                if i >= 5:
                    kept.append(time.perf_counter() - start)
        runs = sandbox_run_speed(tracker, so_path)
        return (sandboxed["attributes"].get("isolation", "?"), samples[KEY], samples[KEY + "-open"],
                runs)


class TvmFarm:
    """TVM's tracker and one TVM RPC server, as ``python -m tvm.exec...`` processes."""

    def __init__(self):
        self.port = free_port()
        self.log_dir = os.path.join("/tmp", f"tvm-bench-{os.getpid()}")
        os.makedirs(self.log_dir, exist_ok=True)
        self.procs = []

    def spawn(self, name, *argv):
        log = open(os.path.join(self.log_dir, name + ".log"), "wb")
        self.procs.append(subprocess.Popen([sys.executable, "-m", *argv], stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def start_tracker(self):
        self.spawn("tracker", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                   "--port", str(self.port), "--port-end", str(self.port + 1))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"TVM tracker did not start; see {self.log_dir}")

    def wait_free(self, tracker, count=1, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = tracker.summary()["queue_info"].get(KEY, {})
            if info.get("free", 0) >= count:
                return
            time.sleep(0.005)
        raise RuntimeError(f"TVM device did not become free; see {self.log_dir}")

    def stop(self):
        """Each process with what it started (TVM's server keeps a pool of
        popen workers): their process groups."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


@contextlib.contextmanager
def tvm_board():
    """TVM's tracker with one TVM RPC server registered under KEY."""
    farm = TvmFarm()
    try:
        farm.start_tracker()
        port = free_port()
        farm.spawn("server", "tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(port),
                   "--port-end", str(port + 1), "--tracker", f"127.0.0.1:{farm.port}", "--key", KEY)
        yield farm
    finally:
        farm.stop()


def tvm_tracker_client(port: int, nodelay: bool):
    """TVM's Python tracker client. It writes each message as two sends (its
    length, then its JSON); with ``nodelay`` its socket has TCP_NODELAY set,
    so that Nagle's algorithm does not hold the second send back for the
    tracker's delayed acknowledgement."""
    from tvm import rpc as tvm_rpc
    from tvm.rpc import base

    connect = base.connect_with_retry

    def connect_without_delay(*args, **kwargs):
        sock = connect(*args, **kwargs)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    base.connect_with_retry = connect_without_delay if nodelay else connect
    try:
        return tvm_rpc.connect_tracker("127.0.0.1", port)
    finally:
        base.connect_with_retry = connect


def tvm_once(farm, tracker) -> float:
    farm.wait_free(tracker)  # the same starting point as ours: a free device
    start = time.perf_counter()
    sess = tracker.request(KEY)
    del sess  # TVM ends the session when the handle goes away
    return time.perf_counter() - start


def ours_once(tracker) -> float:
    start = time.perf_counter()
    with tracker.request(KEY, timeout=30):
        pass
    return time.perf_counter() - start


ECHO_SERVER = """
import socket, sys
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(64)
print(listener.getsockname()[1], flush=True)
while True:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(64)
        if not data:
            break
        conn.sendall(data)
    conn.close()
"""


@contextlib.contextmanager
def echo_servers():
    """Two bare echo processes (a tracker and a board at their simplest)."""
    procs = [subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        yield [int(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def loopback_once(ports) -> float:
    """The least a lease can take: a connection to the tracker and one to the
    board, one small request and reply on each, both closed."""
    start = time.perf_counter()
    for port in ports:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"x" * 32)
            got = 0
            while got < 32:
                got += len(sock.recv(64))
    return time.perf_counter() - start


def request_to_session(sessions: int, commands, have_tvm: bool) -> dict:
    """{contender: samples}: one request -> session -> close of each contender
    in turn per round (ours behind each board server, TVM with and without
    TCP_NODELAY on its tracker client, the bare loopback limit), so that the
    machine's load at any moment falls on all of them alike."""
    with contextlib.ExitStack() as stack:
        contenders = {}
        for kind, command in commands.items():
            farm = stack.enter_context(LocalFarm(keys=[KEY], env=env(), server_command=command,
                                                 tracker_args=["--db", "none"]))
            contenders[f"tether {kind}"] = functools.partial(ours_once, rpc.connect_tracker(*farm.tracker))
        if have_tvm:
            farm = stack.enter_context(tvm_board())
            for name, nodelay in (("tvm", False), ("tvm TCP_NODELAY", True)):
                contenders[name] = functools.partial(tvm_once, farm, tvm_tracker_client(farm.port, nodelay))
        contenders["loopback limit"] = functools.partial(loopback_once, stack.enter_context(echo_servers()))
        samples = {name: [] for name in contenders}
        for i in range(sessions + 5):
            for name, once in contenders.items():
                elapsed = once()
                if i >= 5:  # warm-up: first channels, imports, thread pools
                    samples[name].append(elapsed)
        return samples


# --------------------------------------------------------------- leases/s --

def ours_leases_per_s(devices: int, seconds: float, threads: int, db_args=("--db", "none")):
    tracker_proc = Child("tracker", [sys.executable, "-m", "remote.tracker", "--host",
                                     "127.0.0.1", "--port", "0", *db_args], "/tmp", env())
    sim = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "board_sim.py"),
                            "--tracker", f"127.0.0.1:{tracker_proc.port}", "--boards",
                            str(devices), "--key", KEY], stdout=subprocess.PIPE, text=True,
                           env=env())
    stop = threading.Event()
    try:
        if not sim.stdout.readline().startswith("registered"):
            raise RuntimeError("the board simulator did not register its boards")
        count = [0]
        lock = threading.Lock()

        def client():
            mine = 0
            with rpc.connect_tracker("127.0.0.1", tracker_proc.port) as tracker:
                while not stop.is_set():
                    tracker.release(tracker.lease(KEY, timeout=30, client="bench"))
                    mine += 1
            with lock:
                count[0] += mine

        return run_for(seconds, [client] * threads, stop, count)
    finally:
        stop.set()
        sim.terminate()
        sim.wait(30)
        tracker_proc.stop()


def run_for(seconds, targets, stop, count):
    workers = [threading.Thread(target=t, daemon=True) for t in targets]
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join(30)
    return count[0] / seconds


def tvm_leases_per_s(devices: int, seconds: float, threads: int):
    from tvm.rpc import base

    farm = TvmFarm()
    stop = threading.Event()
    try:
        farm.start_tracker()

        def tracker_socket():
            sock = socket.create_connection(("127.0.0.1", farm.port))
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            assert struct.unpack("<i", base.recvall(sock, 4))[0] == base.RPC_TRACKER_MAGIC
            return sock

        # One tracker connection per device, as each TVM server keeps one.
        device_socks, device_locks = {}, {}
        for i in range(devices):
            port = 20000 + i
            sock = tracker_socket()
            base.sendjson(sock, [base.TrackerCode.UPDATE_INFO,
                                 {"key": "server:" + KEY, "addr": ["127.0.0.1", port]}])
            assert base.recvjson(sock) == base.TrackerCode.SUCCESS
            device_socks[port], device_locks[port] = sock, threading.Lock()
            put(base, sock, port)
        count = [0]
        lock = threading.Lock()

        def client():
            sock = tracker_socket()
            mine = 0
            while not stop.is_set():
                base.sendjson(sock, [base.TrackerCode.REQUEST, KEY, "", 1])
                code, (_, port, _) = base.recvjson(sock)
                assert code == base.TrackerCode.SUCCESS
                with device_locks[port]:  # the server, its session over, offers itself again
                    put(base, device_socks[port], port)
                mine += 1
            sock.close()
            with lock:
                count[0] += mine

        return run_for(seconds, [client] * threads, stop, count)
    finally:
        stop.set()
        farm.stop()


def put(base, sock, port):
    base.sendjson(sock, [base.TrackerCode.PUT, KEY, [port, base.random_key(KEY + ":")], None])
    assert base.recvjson(sock) == base.TrackerCode.SUCCESS


# ------------------------------------------------------- farm database --

def database_cost(args) -> dict:
    """The same tracker without a database and with one (SQLite in a temporary
    folder: every ended session is written by its writer thread), in turns."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="tether-bench-db-")
    from remote.tracker.farmdb import FarmDatabase

    db = FarmDatabase(f"sqlite:///{folder}/writer.sqlite")
    calls = 20000
    start = time.perf_counter()
    for n in range(calls):
        db.record_session(KEY, "bench-1", "bench@host", 0.01, "given back by the client")
    queued = time.perf_counter() - start
    db.flush(120)
    drained = time.perf_counter() - start
    db.close()
    print(f"farm database, in this process: what an ended session costs the lease path "
          f"{queued / calls * 1e6:.2f} µs (queue put, {calls} calls); the writer kept "
          f"{calls / drained:,.0f} sessions/s (SQLite, batched)")
    print(f"farm database: the tracker with --db none and with SQLite, in turns "
          f"({args.rounds} rounds); request -> session -> close ({args.sessions} sessions, "
          f"python board server), then leases/s ({args.devices} devices, {args.threads} "
          f"threads, {args.seconds:g} s)")
    figures = {"none": {"ms": [], "rate": []}, "sqlite": {"ms": [], "rate": []}}
    try:
        for round_ in range(args.rounds):
            # Each first in every other round, so that neither always runs second.
            for name in (("none", "sqlite") if round_ % 2 == 0 else ("sqlite", "none")):
                db_args = ("--db", "none" if name == "none" else
                           f"sqlite:///{folder}/farm-{round_}.sqlite")
                median, _ = describe(ours_request_to_session(
                    args.sessions, python_argv("remote.server"), db_args))
                rate = ours_leases_per_s(args.devices, args.seconds, args.threads, db_args)
                figures[name]["ms"].append(median)
                figures[name]["rate"].append(rate)
                print(f"  round {round_ + 1} {name:<7} median {median:7.2f} ms   "
                      f"{rate:6.0f} leases/s", flush=True)
    finally:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
    ms = {n: statistics.median(f["ms"]) for n, f in figures.items()}
    rate = {n: statistics.median(f["rate"]) for n, f in figures.items()}
    # Each round's sqlite / none, its two halves timed back to back: the
    # machine's drift between rounds cancels from these.
    paired = {what: sorted(s / n for s, n in zip(figures["sqlite"][what], figures["none"][what]))
              for what in ("ms", "rate")}
    print(f"  sqlite/none per round: request->session median {statistics.median(paired['ms']):.3f}"
          f" ({paired['ms'][0]:.3f} to {paired['ms'][-1]:.3f}; above 1 is slower with the "
          f"database), leases/s median {statistics.median(paired['rate']):.3f} "
          f"({paired['rate'][0]:.3f} to {paired['rate'][-1]:.3f}; below 1 is slower)")
    return {"db_request_to_session_ms": ms, "db_leases_per_s": rate,
            "db_per_round_ratios": paired}


# ------------------------------------------------------------------ main --

def server_commands():
    return {"native": [build_native(platform.machine())], "python": python_argv("remote.server")}


def sandbox_figures(sessions: int, commands) -> dict:
    print("session sandbox set-up: request -> session -> close on a board with the default "
          "sandbox and on one started with --no-sandbox, in turn")
    import tempfile
    from bench_transfer import inference_model
    so_path = inference_model(tempfile.mkdtemp(prefix="tether-bench-sandbox-"))
    figures = {}
    for kind, command in commands.items():
        level, kept, open_, (run_kept, run_open) = sandbox_cost(sessions, command, so_path)
        (kept_ms, _), (open_ms, _) = describe(kept), describe(open_)
        print(f"  tether {kind:<7} isolation={level}: median {kept_ms:7.2f} ms, with "
              f"--no-sandbox {open_ms:7.2f} ms, sandbox costs {kept_ms - open_ms:+.2f} ms")
        print(f"  {'':14} a run of a 1x3x224x224 -> 1000 model: {run_kept * 1e3:.3f} ms, with "
              f"--no-sandbox {run_open * 1e3:.3f} ms (sandboxed/open = {run_kept / run_open:.2f})")
        figures[f"{kind}_sandbox_ms"] = kept_ms - open_ms
        figures[f"{kind}_sandbox_run_ratio"] = run_kept / run_open
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100, help="timed request-to-session runs")
    parser.add_argument("--devices", type=int, default=100, help="registered devices for leases/s")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each leases/s run")
    parser.add_argument("--threads", type=int, default=16, help="client threads for leases/s")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--database", action="store_true",
                        help="measure only what the farm database costs the tracker: "
                             "--db none against SQLite, in turns")
    parser.add_argument("--rounds", type=int, default=3, help="turns of --database")
    parser.add_argument("--sandbox", action="store_true",
                        help="measure only what the session sandbox adds to opening a session")
    args = parser.parse_args(argv)
    if args.database or args.sandbox:
        figures = (database_cost(args) if args.database
                   else sandbox_figures(args.sessions, server_commands()))
        if args.json:
            print(json.dumps(figures))
        return 0
    try:
        import tvm  # noqa: F401
        have_tvm = True
    except ImportError:
        have_tvm = False
        print("apache-tvm is not installed (pip install apache-tvm): measuring ours only")
    figures = {}

    print(f"request -> session -> close, {args.sessions} sessions, loopback, real tracker and "
          "device server processes, one session of each in turn per round")
    commands = server_commands()
    medians = {}
    for name, samples in request_to_session(args.sessions, commands, have_tvm).items():
        medians[name], p90 = describe(samples)
        print(f"  {name:<16} median {medians[name]:7.2f} ms   p90 {p90:7.2f} ms")
        figures[name.replace(" ", "_").lower() + "_request_to_session_ms"] = medians[name]
    native, limit = medians["tether native"], medians["loopback limit"]
    print(f"  native/python = {native / medians['tether python']:.2f}, native/loopback limit = "
          f"{native / limit:.1f} (median; below 1 is native faster)")
    if have_tvm:
        for name in ("tvm", "tvm TCP_NODELAY"):
            print(f"  {name}/native = {medians[name] / native:.1f}, {name}/python = "
                  f"{medians[name] / medians['tether python']:.1f} (how many times ours is faster)")
    figures.update(sandbox_figures(args.sessions, commands))

    print(f"leases/s, {args.devices} registered devices speaking each tracker's protocol, "
          f"{args.threads} client threads, {args.seconds:g} s")
    ours_rate = ours_leases_per_s(args.devices, args.seconds, args.threads)
    print(f"  tether  {ours_rate:8.0f} leases/s  (request + release; the devices keep real links)")
    figures["ours_leases_per_s"] = ours_rate
    if have_tvm:
        tvm_rate = tvm_leases_per_s(args.devices, args.seconds, args.threads)
        print(f"  tvm     {tvm_rate:8.0f} leases/s  (request + device offers itself again)")
        print(f"  tether/tvm = {ours_rate / tvm_rate:.2f}")
        figures["tvm_leases_per_s"] = tvm_rate
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
