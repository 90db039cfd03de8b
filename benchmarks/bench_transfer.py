"""Session transfers and calls: Tether's two board servers against Apache TVM RPC.

Three servers run as separate processes on loopback, next to the raw limit of
a Python socket between two processes on the same machine:

- native: Tether's C++ board server (remote/server/native), the static musl
  executable ``build_native`` makes for this machine;
- python: Tether's Python board server (``python -m remote.server``);
- tvm: Apache TVM's RPC server with no Python in it. The apache-tvm wheel
  ships no ``tvm_rpc`` program (apps/cpp_rpc), so benchmarks/tvm_cpp_server.cpp,
  compiled here with the C++ compiler against the wheel's libtvm_runtime.so,
  answers TVM's handshake, forks a process per session and runs the
  runtime's own ``RPCServerLoop`` on its socket -- the loop
  ``python -m tvm.exec.rpc_server`` also hands each session's socket to
  (tvm/rpc/server.py, ``_serve_loop``). The two functions the Python server
  registers in Python (``tvm.rpc.server.workpath``, ``rpc.test.addone``) are
  registered there in C++, so every call and byte of a TVM session is served
  by C++. Without a C++ compiler ``python -m tvm.exec.rpc_server`` is the
  peer (said in the output): the same loop, but the small call and each
  upload's path lookup then call back into Python.

The client is Python for all three (Tether's client and TVM's). One line per
measurement; the ratio columns divide native's figure by the other's, so for
MiB/s above 1 means native is faster and for microseconds below 1 does. Then
the resident memory (VmRSS) of each server's processes, after start and after
one session, and the size of the native executable per architecture.

    pip install apache-tvm        # the peer; without it its column is skipped
    python benchmarks/bench_transfer.py [--mib 64] [--repeat 5] [--busy N]

--busy N runs N spinning processes (a busy board's other work) during the
measurements.

Numbers are medians of --repeat runs; this machine is shared and noisy, so
compare the ratios of one run rather than absolute figures across runs.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remote import rpc  # noqa: E402
from remote.cli.localfarm import Child, python_argv  # noqa: E402
from remote.cli.native import TRIPLE_FLAGS, build_native  # noqa: E402
from tests.competing_load import CompetingLoad  # noqa: E402
from remote.defaults import cache_dir  # noqa: E402

MIB = 1 << 20


def median_time(fn, repeat: int) -> float:
    fn()  # warm up (page cache, allocators, connections)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_call(fn, calls: int, repeat: int) -> float:
    def many():
        for _ in range(calls):
            fn()
    return median_time(many, repeat) / calls


def alternating_per_call(fns: list, calls: int, rounds: int) -> list:
    """Median seconds per call of each callable, timed in blocks of ``calls``
    calls, the callables taking turns for ``rounds`` rounds."""
    samples = [[] for _ in fns]
    for fn in fns:
        fn()  # warm up
    for _ in range(rounds):
        for fn, times in zip(fns, samples):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls)
    return [statistics.median(times) for times in samples]


# ------------------------------------------------------------------ raw --
def _sink(port_queue):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = memoryview(bytearray(MIB))
    while True:
        # Each message: 8 bytes of length, then that many bytes; answered with 8 bytes.
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        left = int.from_bytes(head, "little")
        while left:
            n = conn.recv_into(buffer[:min(left, MIB)])
            if not n:
                return
            left -= n
        conn.sendall(b"ok" * 4)


def raw_limits(total_mib: int, repeat: int):
    """(MiB/s one way, seconds per 16-byte round trip) of a plain socket."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_sink, args=(queue,), daemon=True)
    proc.start()
    sock = socket.create_connection(("127.0.0.1", queue.get(timeout=30)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    block = os.urandom(MIB)

    def stream():
        sock.sendall((total_mib * MIB).to_bytes(8, "little"))
        for _ in range(total_mib):
            sock.sendall(block)
        sock.recv(8, socket.MSG_WAITALL)

    seconds = median_time(stream, repeat)
    small = (8).to_bytes(8, "little") + b"p" * 8

    def ping():
        sock.sendall(small)
        sock.recv(8, socket.MSG_WAITALL)

    rt = per_call(ping, 2000, repeat)
    sock.close()
    proc.join(5)
    return total_mib / seconds, rt


# -------------------------------------------------------------- models --
def inference_model(folder: str) -> str:
    """A module with a 1x3x224x224 float32 input and 1000 float outputs."""
    import onnx

    import crosscompile
    from tests.onnx_models import make_model
    from onnx import helper

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Reshape", ["input", "rows"], ["r"]),
        helper.make_node("MatMul", ["r", "w1"], ["m"]),
        helper.make_node("Reshape", ["m", "flat"], ["f"]),
        helper.make_node("Gemm", ["f", "w2", "b2"], ["output"]),
    ]
    model = make_model(nodes, {"input": (1, 3, 224, 224)}, {"output": (1, 1000)}, {
        "rows": np.array([672, 224], np.int64), "w1": rng.standard_normal((224, 1)).astype(np.float32),
        "flat": np.array([1, 672], np.int64), "w2": rng.standard_normal((672, 1000)).astype(np.float32),
        "b2": rng.standard_normal(1000).astype(np.float32)}, name="image1000")
    onnx_path = os.path.join(folder, "image1000.onnx")
    onnx.save(model, onnx_path)
    so_path = os.path.join(folder, "image1000.so")
    crosscompile.build(onnx_path, target="host").export_library(so_path)
    return so_path




# ---------------------------------------------------------------- peers --
def bench_env(poll_us: "str | None" = None) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if poll_us is not None:
        env["TETHER_POLL_US"] = poll_us
    return env


def tether_command(kind: str, max_bytes: int) -> list:
    """How to start Tether's ``native`` or ``python`` board server."""
    options = ["--host", "127.0.0.1", "--port", "0", "--max-upload-bytes", str(max_bytes)]
    if kind == "native":
        return [build_native(platform.machine()), *options]
    return python_argv("remote.server", *options)


@contextlib.contextmanager
def tether_server(kind: str, max_bytes: int, poll_us: "str | None" = None):
    """A fresh local server; ``poll_us`` sets TETHER_POLL_US for it (the
    servers poll for the next request, TETHER_POLL_US=0 turns that off)."""
    server = Child(f"bench-{kind}", tether_command(kind, max_bytes),
                   tempfile.mkdtemp(prefix="tether-bench-"), bench_env(poll_us))
    try:
        time.sleep(1.0)  # let the Python server's zygote finish starting
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def tether_session(kind: str, max_bytes: int, poll_us: "str | None" = None):
    """A session on a fresh local server; ``poll_us`` also sets how long the
    client polls for an answer (docs/sessions.md, "Small calls")."""
    with tether_server(kind, max_bytes, poll_us) as server:
        with rpc.connect("127.0.0.1", server.port, timeout=120) as sess:
            if poll_us is not None:
                sess._data.spin = float(poll_us) * 1e-6
            yield sess


def tvm_cpp_server() -> "str | None":
    """benchmarks/tvm_cpp_server.cpp built against the installed wheel (cached
    by the source and the wheel's version), or None without a C++ compiler."""
    import tvm
    import tvm_ffi

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return None
    source = os.path.join(ROOT, "benchmarks", "tvm_cpp_server.cpp")
    tvm_dir = os.path.dirname(tvm.__file__)
    ffi_dir = os.path.dirname(tvm_ffi.__file__)
    with open(source, "rb") as f:
        key = hashlib.sha256(f.read() + repr((tvm.__version__, tvm_dir, compiler)).encode())
    path = os.path.join(cache_dir(), "bench", key.hexdigest()[:16], "tvm-cpp-server")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        libs = [os.path.join(tvm_dir, "lib"), os.path.join(ffi_dir, "lib")]
        subprocess.run([compiler, "-std=c++17", "-O2", source,
                        "-I" + os.path.join(ffi_dir, "include"), "-I" + os.path.join(tvm_dir, "include"),
                        "-L" + libs[0], "-ltvm_runtime", "-L" + libs[1], "-ltvm_ffi",
                        "-Wl,-rpath," + ":".join(libs), "-o", path + ".part"], check=True)
        os.replace(path + ".part", path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TvmPythonServer:
    """``python -m tvm.exec.rpc_server`` on a free port (it prints no address)."""

    def __init__(self):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1",
             "--port", str(self.port), "--port-end", str(self.port + 1), "--silent"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


@contextlib.contextmanager
def tvm_server():
    """(server Child, what it is): TVM's RPC server in C++ if it can be built."""
    import tvm  # noqa: F401 - the peer must be installed

    folder = tempfile.mkdtemp(prefix="tvm-bench-")
    binary = tvm_cpp_server()
    if binary is not None:
        server = Child("tvm-cpp", [binary, "--host", "127.0.0.1", "--port", "0"], folder)
        what = "TVM's RPCServerLoop in C++ (benchmarks/tvm_cpp_server.cpp)"
    else:
        server = TvmPythonServer()
        what = "python -m tvm.exec.rpc_server (no C++ compiler: addone runs in Python)"
    try:
        time.sleep(0.5)
        yield server, what
    finally:
        server.stop()


@contextlib.contextmanager
def tvm_session(server):
    import tvm
    from tvm import rpc as tvm_rpc

    deadline = time.monotonic() + 60
    while True:
        try:
            remote = tvm_rpc.connect("127.0.0.1", server.port)
            break
        except Exception:  # noqa: BLE001 - not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    yield tvm, remote


# --------------------------------------------------------------- memory --
def children(pid: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss(pid: int):
    """(KiB of VmRSS, process count) of ``pid`` and all its descendants."""
    total, count, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        total += rss_kib(p)
        count += 1
        todo.extend(children(p))
    return total, count


def settle_tree(pid: int, count: int, timeout: float = 10.0):
    """Wait until the tree of ``pid`` is back to ``count`` processes (a
    session's process has gone), then its RSS."""
    deadline = time.monotonic() + timeout
    while True:
        kib, n = tree_rss(pid)
        if n <= count or time.monotonic() > deadline:
            return kib, n
        time.sleep(0.05)


def upload_limit(size: int, so_path: str) -> int:
    """The servers' --max-upload-bytes: room for the transfers and the model."""
    return max(4 * size, 2 * os.path.getsize(so_path))


def tether_memory(kind: str, so_path: str, max_bytes: int):
    """VmRSS (KiB) of a fresh server's process tree after start, during a
    session that loaded and ran a module, and after that session closed;
    with the server process alone after start and after the session."""
    with tether_server(kind, max_bytes) as server:
        pid = server.proc.pid
        idle, count = tree_rss(pid)
        idle_server = rss_kib(pid)
        image = np.zeros((1, 3, 224, 224), np.float32)
        with rpc.connect("127.0.0.1", server.port, timeout=120) as sess:
            sess.upload(so_path)
            sess.load_module(os.path.basename(so_path)).run({"input": image})
            during, _ = tree_rss(pid)
        after, _ = settle_tree(pid, count)
        return {"start": idle, "server start": idle_server, "during": during, "after": after,
                "server after": rss_kib(pid), "processes": count}


def tvm_memory(server):
    pid = server.proc.pid
    idle, count = tree_rss(pid)
    with tvm_session(server) as (_, remote):
        remote.get_function("rpc.test.addone")(1)
        during, _ = tree_rss(pid)
        del remote
    gc.collect()
    after, _ = settle_tree(pid, count)
    return {"start": idle, "server start": rss_kib(pid), "during": during, "after": after,
            "server after": rss_kib(pid), "processes": count}


# ---------------------------------------------------------------- main --
def tether_transfers(kinds, args, blob_path, folder, tensor, image, so_path, size) -> dict:
    """Figures of a session on each kind of server, the servers taking turns
    in every measurement (one transfer each, ``--repeat`` rounds) so that
    the machine's load hits them alike."""
    out = {kind: {} for kind in kinds}
    with contextlib.ExitStack() as stack:
        sessions = {kind: stack.enter_context(tether_session(kind, upload_limit(size, so_path))) for kind in kinds}

        def measure(key, make, calls=1, mib=None):
            """Seconds per call, or MiB/s when each call moves ``mib``."""
            times = alternating_per_call([make(kind, sess) for kind, sess in sessions.items()],
                                         calls=calls, rounds=args.repeat)
            for kind, seconds in zip(kinds, times):
                out[kind][key] = mib / seconds if mib else seconds

        measure("upload", lambda kind, sess: lambda: sess.upload(blob_path), mib=args.mib)
        measure("download", lambda kind, sess: lambda: sess.download(
            "blob.bin", os.path.join(folder, f"back-{kind}.bin")), mib=args.mib)
        measure("tensor in", lambda kind, sess: lambda: sess.upload_tensor("t", tensor),
                mib=args.mib)
        measure("tensor out", lambda kind, sess: sess.upload_tensor("t", tensor).numpy,
                mib=args.mib)
        modules = {}
        for kind, sess in sessions.items():
            sess.upload(so_path)
            modules[kind] = sess.load_module("image1000.so")
            (result,) = modules[kind].run({"input": image})
            assert result.shape == (1, 1000)
        measure("inference", lambda kind, sess: lambda: modules[kind].run({"input": image}),
                calls=200)
        for kind in kinds:
            out[kind]["on board"] = modules[kind].benchmark(number=50, repeat=5).median
    return out


def tvm_transfers(server, args, blob_path, tensor, image) -> dict:
    out = {}
    with tvm_session(server) as (tvm, remote):
        dev = remote.cpu(0)
        out["upload"] = args.mib / median_time(lambda: remote.upload(blob_path), args.repeat)
        out["download"] = args.mib / median_time(lambda: remote.download("blob.bin"), args.repeat)
        out["tensor in"] = args.mib / median_time(lambda: tvm.runtime.tensor(tensor, dev),
                                                  args.repeat)
        remote_array = tvm.runtime.tensor(tensor, dev)
        out["tensor out"] = args.mib / median_time(remote_array.numpy, args.repeat)
        addone = remote.get_function("rpc.test.addone")
        out_array = tvm.runtime.empty((1, 1000), "float32", dev)

        def tvm_inference():
            # set_input / run / get_output with no compute at all: a lower bound for TVM.
            tvm.runtime.tensor(image, dev)
            addone(1)
            return out_array.numpy()
        out["inference"] = per_call(tvm_inference, 200, args.repeat)
    return out


def binary_sizes() -> dict:
    """Bytes of the native executable per triple (built stripped, -s)."""
    return {triple: os.path.getsize(build_native(triple)) for triple in sorted(TRIPLE_FLAGS)}


def ratio(a: float, b: "float | None") -> str:
    return f"{a / b:>8.2f}x" if b else f"{'-':>9}"


def measure_all(args, have_tvm, folder, blob_path, tensor, image, so_path, size):
    """Every measurement of the table: (figures, memory, raw MiB/s, raw
    round trip, what the TVM peer is)."""
    raw_mibs, raw_rt = raw_limits(args.mib * 4, args.repeat)
    kinds = ("native", "python")
    figures = tether_transfers(kinds, args, blob_path, folder, tensor, image, so_path, size)
    memory = {kind: tether_memory(kind, so_path, upload_limit(size, so_path)) for kind in kinds}
    figures["tvm"] = {}
    peer = "apache-tvm is not installed (pip install apache-tvm): its column is skipped"

    # Small calls: all take turns in blocks, several rounds, so that the
    # machine's load (which moves wake-up costs a lot) hits all alike.
    small = [("native", "small call", None), ("native", "small call, no polling", "0"),
             ("python", "small call", None), ("python", "small call, no polling", "0")]
    with contextlib.ExitStack() as stack:
        calls = [stack.enter_context(tether_session(kind, size, poll)).ping
                 for kind, _, poll in small]
        if have_tvm:
            server, peer = stack.enter_context(tvm_server())
            memory["tvm"] = tvm_memory(server)
            figures["tvm"] = tvm_transfers(server, args, blob_path, tensor, image)
            _, remote = stack.enter_context(tvm_session(server))
            addone = remote.get_function("rpc.test.addone")
            calls.append(lambda: addone(1))
        times = alternating_per_call(calls, calls=500, rounds=4 * args.repeat)
    for (kind, key, _), seconds in zip(small, times):
        figures[kind][key] = seconds
    if have_tvm:
        figures["tvm"]["small call"] = figures["tvm"]["small call, no polling"] = times[-1]

    return figures, memory, raw_mibs, raw_rt, peer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="size of files and tensors (MiB)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run N spinning processes (started and stopped by pid) during the measurements")
    args = parser.parse_args()
    try:
        import tvm  # noqa: F401
        have_tvm = True
    except ImportError:
        have_tvm = False
    size = args.mib * MIB
    folder = tempfile.mkdtemp(prefix="tether-bench-")
    blob_path = os.path.join(folder, "blob.bin")
    with open(blob_path, "wb") as f:
        for _ in range(args.mib):
            f.write(os.urandom(MIB))
        os.fsync(f.fileno())  # a file at rest: no writeback of it during the uploads
    tensor = np.random.default_rng(1).standard_normal(size // 4).astype(np.float32)
    image = np.random.default_rng(2).standard_normal((1, 3, 224, 224)).astype(np.float32)
    so_path = inference_model(folder)
    sizes = binary_sizes()

    with CompetingLoad(args.busy):
        figures, memory, raw_mibs, raw_rt, peer = measure_all(args, have_tvm, folder, blob_path, tensor,
                                                              image, so_path, size)

    native, python, theirs = figures["native"], figures["python"], figures["tvm"]
    print(f"loopback, {args.mib} MiB files/tensors, median of {args.repeat}; "
          f"raw socket: {raw_mibs:.0f} MiB/s, {raw_rt * 1e6:.1f} us round trip")
    print(f"tvm: {peer}")
    if args.busy:
        print(f"competing load: {args.busy} spinning processes ran during every measurement")
    print(f"{'measurement':<36}{'native':>10}{'python':>10}{'tvm':>10}"
          f"{'native/tvm':>11}{'native/py':>10}{'raw limit':>11}")

    def row(label, key, scale, fmt, limit=""):
        theirs_text = f"{theirs[key] * scale:>10{fmt}}" if key in theirs else f"{'-':>10}"
        print(f"{label:<36}{native[key] * scale:>10{fmt}}{python[key] * scale:>10{fmt}}"
              f"{theirs_text}{ratio(native[key], theirs.get(key)):>11}"
              f"{ratio(native[key], python[key]):>10}{limit:>11}")
    for key in ("upload", "download", "tensor in", "tensor out"):
        row(key + " (MiB/s)", key, 1, ".0f", f"{raw_mibs:.0f}")
    row("small call round trip (us)", "small call", 1e6, ".1f", f"{raw_rt * 1e6:.1f}")
    row("  same, polling off (us)", "small call, no polling", 1e6, ".1f",
        f"{raw_rt * 1e6:.1f}")
    row("1x3x224x224 -> 1000 round trip (us)", "inference", 1e6, ".1f")
    print(f"(MiB/s: native/x above 1 is native faster; us: below 1 is. Inference: ours runs "
          f"the compiled model, {native['on board'] * 1e6:.0f} us (native) / "
          f"{python['on board'] * 1e6:.0f} us (python) of it on the board; TVM's figure is "
          "tensor in + one call + tensor out with no compute. Polling off: "
          "TETHER_POLL_US=0 on the client and the server; TVM never polls)")
    print("resident memory (VmRSS, MiB) of each server's process tree: python = the server, "
          "its zygote and the session process the zygote forks ahead (in a session: that one "
          "serving it and the next spare); native and tvm = the server (in a session: and "
          "the session's process); server alone = the listening process only")
    print(f"{'server':<10}{'procs':>6}{'after start':>13}{'in session':>12}"
          f"{'after session':>15}{'server alone: start':>21}{'after':>8}")
    for kind in ("native", "python", "tvm"):
        if kind in memory:
            m = memory[kind]
            print(f"{kind:<10}{m['processes']:>6}{m['start'] / 1024:>13.1f}"
                  f"{m['during'] / 1024:>12.1f}{m['after'] / 1024:>15.1f}"
                  f"{m['server start'] / 1024:>21.1f}{m['server after'] / 1024:>8.1f}")
    print("native executable (static, stripped): " + ", ".join(
        f"{triple} {n / MIB:.2f} MiB ({n} bytes)" for triple, n in sizes.items()))
    sys.stdout.flush()  # the TVM runtime may end the process without flushing
    return 0


if __name__ == "__main__":
    sys.exit(main())
