"""Session transfers and calls: Tether's device server against Apache TVM RPC.

Both servers run as separate processes on loopback, next to the raw limit of a
Python socket between two processes on the same machine. Prints one line per
measurement with the ratio ours/TVM (above 1 means we are faster).

    pip install apache-tvm        # the peer
    python benchmarks/bench_transfer.py [--mib 64] [--repeat 5]

Numbers are medians of --repeat runs; this machine is shared and noisy, so
compare the ratios of one run rather than absolute figures across runs.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
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
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tvm_session():
    import tvm
    from tvm import rpc as tvm_rpc

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1",
                             "--port", str(port), "--port-end", str(port + 1), "--silent"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                remote = tvm_rpc.connect("127.0.0.1", port)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        yield tvm, remote
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def tether_session(max_bytes: int, poll_us: "str | None" = None):
    """A session on a fresh local server; ``poll_us`` sets TETHER_POLL_US on
    both ends (docs/sessions.md, "Small calls")."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if poll_us is not None:
        env["TETHER_POLL_US"] = poll_us
    server = Child("bench-server", python_argv(
        "remote.server", "--host", "127.0.0.1", "--port", "0",
        "--max-upload-bytes", str(max_bytes)), tempfile.mkdtemp(prefix="tether-bench-"), env)
    try:
        time.sleep(1.0)  # let the server's spare worker finish starting
        with rpc.connect("127.0.0.1", server.port, timeout=120) as sess:
            if poll_us is not None:
                sess._data.spin = float(poll_us) * 1e-6
            yield sess
    finally:
        server.stop()


# ---------------------------------------------------------------- main --
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="size of files and tensors (MiB)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    size = args.mib * MIB
    folder = tempfile.mkdtemp(prefix="tether-bench-")
    blob_path = os.path.join(folder, "blob.bin")
    with open(blob_path, "wb") as f:
        for _ in range(args.mib):
            f.write(os.urandom(MIB))
    tensor = np.random.default_rng(1).standard_normal(size // 4).astype(np.float32)
    image = np.random.default_rng(2).standard_normal((1, 3, 224, 224)).astype(np.float32)
    so_path = inference_model(folder)

    raw_mibs, raw_rt = raw_limits(args.mib * 4, args.repeat)
    ours, theirs = {}, {}

    with tether_session(4 * size) as sess:
        ours["upload"] = args.mib / median_time(lambda: sess.upload(blob_path), args.repeat)
        ours["download"] = args.mib / median_time(
            lambda: sess.download("blob.bin", os.path.join(folder, "back.bin")), args.repeat)
        ours["tensor in"] = args.mib / median_time(lambda: sess.upload_tensor("t", tensor),
                                                   args.repeat)
        remote_tensor = sess.upload_tensor("t", tensor)
        ours["tensor out"] = args.mib / median_time(remote_tensor.numpy, args.repeat)
        sess.upload(so_path)
        mod = sess.load_module("image1000.so")
        (out,) = mod.run({"input": image})
        assert out.shape == (1, 1000)
        ours["inference"] = per_call(lambda: mod.run({"input": image}), 200, args.repeat)
        on_board = mod.benchmark(number=50, repeat=5).median
    with tvm_session() as (tvm, remote):
        dev = remote.cpu(0)
        theirs["upload"] = args.mib / median_time(lambda: remote.upload(blob_path), args.repeat)
        theirs["download"] = args.mib / median_time(lambda: remote.download("blob.bin"),
                                                    args.repeat)
        theirs["tensor in"] = args.mib / median_time(lambda: tvm.runtime.tensor(tensor, dev),
                                                     args.repeat)
        remote_array = tvm.runtime.tensor(tensor, dev)
        theirs["tensor out"] = args.mib / median_time(remote_array.numpy, args.repeat)
        addone = remote.get_function("rpc.test.addone")
        out_array = tvm.runtime.empty((1, 1000), "float32", dev)

        def tvm_inference():
            # set_input / run / get_output with no compute at all: a lower bound for TVM.
            tvm.runtime.tensor(image, dev)
            addone(1)
            return out_array.numpy()
        theirs["inference"] = per_call(tvm_inference, 200, args.repeat)

        # Small calls: the three alternate in blocks, several rounds, so that
        # the machine's load (which moves wake-up costs a lot) hits all alike.
        with tether_session(size) as polling, tether_session(size, poll_us="0") as sleeping:
            ours["small call"], ours["small call, no polling"], theirs["small call"] = \
                alternating_per_call([polling.ping, sleeping.ping, lambda: addone(1)],
                                     calls=500, rounds=4 * args.repeat)

    print(f"loopback, {args.mib} MiB files/tensors, median of {args.repeat}; "
          f"raw socket: {raw_mibs:.0f} MiB/s, {raw_rt * 1e6:.1f} us round trip")
    print(f"{'measurement':<34}{'tether':>14}{'tvm rpc':>14}{'ratio':>9}{'raw limit':>14}")
    for key in ("upload", "download", "tensor in", "tensor out"):
        print(f"{key + ' (MiB/s)':<34}{ours[key]:>14.0f}{theirs[key]:>14.0f}"
              f"{ours[key] / theirs[key]:>8.1f}x{raw_mibs:>14.0f}")
    theirs["small call, no polling"] = theirs["small call"]
    for key, label in (("small call", "small call round trip (us)"),
                       ("small call, no polling", "  same, polling off (us)"),
                       ("inference", "1x3x224x224 -> 1000 round trip (us)")):
        limit = f"{raw_rt * 1e6:>14.1f}" if key.startswith("small call") else f"{'':>14}"
        print(f"{label:<34}{ours[key] * 1e6:>14.1f}{theirs[key] * 1e6:>14.1f}"
              f"{theirs[key] / ours[key]:>8.1f}x{limit}")
    print(f"(inference: ours runs the compiled model, {on_board * 1e6:.0f} us of it on the "
          "board; TVM's figure is tensor in + one call + tensor out with no compute)")
    sys.stdout.flush()  # the TVM runtime may end the process without flushing
    return 0


if __name__ == "__main__":
    sys.exit(main())
