"""``tether demo``: one model from ONNX to a (local) board and back.

Starts a tracker and a device server as child processes on loopback, compiles
a small MLP classifier for this machine, leases the board through the tracker,
uploads the module, runs it, checks it against onnxruntime when that is
installed, and prints the latency measured on the device.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from remote.cli.progress import ByteBar
from remote.client import display

DEMO_LAYERS = (784, 256, 128, 10)


def demo_model(layers=DEMO_LAYERS, seed: int = 7):
    """A seeded MLP over a 1x1x28x28 image: Flatten, then Gemm+Relu layers, Softmax."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Flatten", ["input"], ["x0"], axis=1, name="flatten")]
    inits = []
    for i, (n_in, n_out) in enumerate(zip(layers, layers[1:])):
        w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
        b = (0.1 * rng.standard_normal(n_out)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("Gemm", [f"x{i}", f"w{i}", f"b{i}"], [f"g{i}"],
                                      transB=1, name=f"dense{i}"))
        last = i == len(layers) - 2
        nodes.append(helper.make_node("Softmax" if last else "Relu", [f"g{i}"],
                                      ["output" if last else f"x{i + 1}"],
                                      name="softmax" if last else f"relu{i}"))
    graph = helper.make_graph(
        nodes, "demo_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 1, 28, 28])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, layers[-1]])],
        inits)
    # IR version 8 keeps the file readable by every onnxruntime the check may meet.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def run_demo(key: str = "local", runs: int = 20) -> int:
    from remote.cli.localfarm import LocalFarm

    workdir = tempfile.mkdtemp(prefix="tether-demo-")
    try:
        model_path, so_path = _compile(workdir)
        farm = LocalFarm(keys=[key])
        try:
            with farm:
                _run_on_the_board(farm, key, model_path, so_path, runs)
        except Exception:
            print(f"the local farm's logs are kept in {farm.log_dir}", file=sys.stderr)
            raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\ndemo finished: the farm is stopped.")
    return 0


def _compile(workdir):
    import onnx

    import crosscompile

    model_path = os.path.join(workdir, "mlp.onnx")
    onnx.save(demo_model(), model_path)
    print(f"1. model: {model_path} (MLP {'-'.join(map(str, DEMO_LAYERS))}, softmax output)")

    start = time.perf_counter()
    lib = crosscompile.build(model_path, target="host")
    so_path = os.path.join(workdir, "mlp.so")
    lib.export_library(so_path)
    target = lib.metadata["target"]
    print(f"2. compiled for {target['name']} ({target['triple']}, cpu {target['cpu']}) in "
          f"{time.perf_counter() - start:.2f} s -> {so_path} ({os.path.getsize(so_path)} bytes)")
    return model_path, so_path


def _run_on_the_board(farm, key, model_path, so_path, runs):
    from remote import rpc

    x = np.random.default_rng(0).standard_normal((1, 1, 28, 28)).astype(np.float32)
    host, port = farm.tracker
    print(f"3. local farm: tracker on {host}:{port}, one device server with key {key!r}")
    tracker = rpc.connect_tracker(host, port)
    print("\n" + tracker.text_summary() + "\n")
    with tracker.request(key, timeout=30) as sess:
        info = sess.device_info()
        print(f"4. leased a {info['machine']} board ({display.board_cpu(info)}, {info['cores']} "
              f"cores, {info['os']})")
        # Redrawn in place on a terminal; piped, a line at the start and one at the end.
        sess.upload(so_path, progress=ByteBar("   upload mlp.so", stream=sys.stdout))
        mod = sess.load_module("mlp.so")
        print(f"   loaded on the device in {display.ms(mod.load_s)}")
        (probs,) = mod.run({"input": x})
        top = np.argsort(probs[0])[::-1][:3]
        print("5. output: top-3 classes " +
              ", ".join(f"{c} ({probs[0][c]:.3f})" for c in top))
        _compare_with_onnxruntime(model_path, x, probs)
        round_trips = []
        for _ in range(runs):
            t0 = time.perf_counter()
            mod.run({"input": x})
            round_trips.append(time.perf_counter() - t0)
        res = mod.benchmark(number=100, repeat=runs)  # the timing loop runs on the board
        print(f"6. latency on the device over {runs} repeats of 100 runs: median "
              f"{display.ms(res.median)}, p99 {display.ms(res.p99)}; one inference "
              f"round trip from here: median {display.ms(statistics.median(round_trips))}")
    print("\n" + tracker.text_summary())
    tracker.close()


def _compare_with_onnxruntime(model_path, x, probs):
    try:
        import onnxruntime as ort
    except ImportError as exc:
        # onnxruntime's extension module turns a Ctrl-C during its import into an
        # ImportError caused by the KeyboardInterrupt: that is no missing package.
        if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        print("   (onnxruntime not installed: skipped the reference check)")
        return
    ref = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"]).run(
        None, {"input": x})[0]
    err = float(np.max(np.abs(probs - ref) / (np.abs(ref) + 1e-12)))
    verdict = "match" if np.allclose(probs, ref, rtol=1e-5, atol=1e-7) else "DIFFER"
    print(f"   onnxruntime gives the same classes: max relative difference {err:.2e} ({verdict})")
