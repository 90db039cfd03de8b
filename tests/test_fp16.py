"""fp16: convolutions and matrix products computed in half precision on
cores with FP16 arithmetic (build(..., precision="fp16")), run under qemu
as a Cortex-A76, and refused for a target without it."""
import os
import signal
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

import crosscompile
from crosscompile.compiler import lowered_graph
from crosscompile.target import resolve_target
from tests.cross_targets import emulated_tools, run_emulated
from tests.onnx_models import make_model, rand, reference, sample_input

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the issue asks of fp16 against float32.
MIN_COSINE = 0.999


def _weight(*shape, seed):
    fan_in = int(np.prod(shape[1:])) if len(shape) > 2 else shape[0]
    return (rand(*shape, seed=seed) / np.sqrt(fan_in)).astype(np.float32)


def conv_net() -> onnx.ModelProto:
    """x (1, 16, 18, 18) -> 3x3 Conv (Winograd) -> Relu -> 1x1 Conv (pointwise)
    + residual -> 3x3 stride-2 Conv -> Relu -> depthwise 3x3 -> depthwise 3x3
    stride 2 -> 3x1 Conv of two groups -> y (1, 32, 3, 5)."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
        helper.make_node("Add", ["c2", "r1"], ["a2"]),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c3"], ["r3"]),
        helper.make_node("Conv", ["r3", "wd", "bd"], ["cd"], pads=[1, 1, 1, 1], group=24),
        helper.make_node("Conv", ["cd", "we", "be"], ["ce"], pads=[1, 1, 1, 1], strides=[2, 2], group=24),
        helper.make_node("Conv", ["ce", "w4", "b4"], ["y"], group=2),
    ]
    inits = {"w1": _weight(16, 16, 3, 3, seed=1), "b1": rand(16, seed=2),
             "w2": _weight(16, 16, 1, 1, seed=3), "b2": rand(16, seed=4),
             "w3": _weight(24, 16, 3, 3, seed=5), "b3": rand(24, seed=6),
             "wd": _weight(24, 1, 3, 3, seed=7), "bd": rand(24, seed=8),
             "we": _weight(24, 1, 3, 3, seed=15), "be": rand(24, seed=16),
             "w4": _weight(32, 12, 3, 1, seed=9), "b4": rand(32, seed=10)}
    return make_model(nodes, {"x": (1, 16, 18, 18)}, {"y": (1, 32, 3, 5)}, inits, name="fp16_conv_net")


def matmul_net() -> onnx.ModelProto:
    """x (24, 64) -> MatMul + bias -> Relu -> h @ h^T (both operands computed) ->
    Gemm (transB) -> y (24, 10)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["z1"]),
        helper.make_node("Relu", ["z1"], ["h"]),
        helper.make_node("Transpose", ["h"], ["ht"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "ht"], ["s"]),
        helper.make_node("Gemm", ["s", "w2", "b2"], ["y"], transB=1, alpha=0.05),
    ]
    inits = {"w1": _weight(64, 48, seed=11), "b1": rand(48, seed=12),
             "w2": _weight(10, 24, seed=13), "b2": rand(10, seed=14)}
    return make_model(nodes, {"x": (24, 64)}, {"y": (24, 10)}, inits, name="fp16_matmul_net")


def depthwise_net() -> onnx.ModelProto:
    """x (1, 8, 20, 23) -> depthwise 3x3 stride 2 -> depthwise 5x5 dilated 2
    -> y (1, 8, 10, 12): rows of 12 columns, a vector of 8 halves and one
    of 4."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["d1"], pads=[1, 1, 1, 1], strides=[2, 2], group=8),
        helper.make_node("Conv", ["d1", "w2", "b2"], ["y"], pads=[4, 4, 4, 4], dilations=[2, 2], group=8),
    ]
    inits = {"w1": _weight(8, 1, 3, 3, seed=17), "b1": rand(8, seed=18),
             "w2": _weight(8, 1, 5, 5, seed=19), "b2": rand(8, seed=20)}
    return make_model(nodes, {"x": (1, 8, 20, 23)}, {"y": (1, 8, 10, 12)}, inits, name="fp16_depthwise_net")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("make, fp16_nodes", [(conv_net, 6), (matmul_net, 3), (depthwise_net, 2)])
def test_fp16_module_matches_float32_on_an_emulated_cortex_a76(tmp_path, make, fp16_nodes):
    emulated_tools("rasp5")
    model = make()
    feeds = sample_input(model)
    (x,) = feeds.values()
    (want,) = reference(model, feeds)
    lib = crosscompile.build(model, target="rasp5", precision="fp16")
    assert lib.summary["fp16_kernels"] == fp16_nodes
    got = run_emulated(lib, "rasp5", x, want.shape, tmp_path, cpu="cortex-a76")
    assert np.isfinite(got).all()
    assert cosine(got, want) >= MIN_COSINE, cosine(got, want)
    # Half precision, not float32 under another name: the sums carry fp16's
    # rounding (float32's stay within 1e-5 here, see the fp32 module below) ...
    fp32 = run_emulated(crosscompile.build(model, target="rasp5"), "rasp5", x, want.shape, tmp_path,
                        cpu="cortex-a76")
    np.testing.assert_allclose(fp32, want, rtol=1e-4, atol=1e-4)
    assert np.abs(got - want).max() > 1e-4
    # ... and a core without FP16 arithmetic cannot run the module.
    so = lib.export_library(os.path.join(tmp_path, "module.so"))
    driver = os.path.join(tmp_path, "driver")
    qemu, _, sysroot = emulated_tools("rasp5")
    proc = subprocess.run([qemu, "-cpu", "cortex-a72", "-L", sysroot, driver, so,
                           str(lib.metadata["workspace_bytes"]), os.path.join(tmp_path, "in.bin"),
                           str(x.size), os.path.join(tmp_path, "out.bin"), str(want.size)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGILL, (proc.returncode, proc.stderr[-500:])


def test_fp16_is_refused_for_a_target_without_fp16_arithmetic():
    with pytest.raises(crosscompile.BuildError) as info:
        crosscompile.build(conv_net(), target="rasp4b64", precision="fp16")
    message = str(info.value)
    assert "rasp4b64" in message and "cortex-a72" in message
    assert "'fp32'" in message and "rasp5" in message and "+fullfp16" in message
    with pytest.raises(crosscompile.BuildError, match="unknown precision 'bf16'.*fp32, fp16"):
        crosscompile.build(conv_net(), target="rasp5", precision="bf16")


def test_precision_is_written_into_the_graph_and_weights_are_halves():
    target = resolve_target("rasp5")
    _, _, fp32 = lowered_graph(conv_net(), target, None, {})
    _, _, fp16 = lowered_graph(conv_net(), target, None, {}, "fp16")
    marked = {n.name or n.outputs[0]: n.attrs.get("precision") for n in fp16.nodes}
    # Depthwise convolutions compute in halves over a padded copy in halves.
    depthwise = [n for n in fp16.nodes if n.attrs.get("depthwise")]
    assert len(depthwise) == 2 and all(n.attrs["precision"] == "fp16" for n in depthwise), marked
    assert all(n.attrs["padded_planes"] for n in depthwise)
    assert fp16.constants[depthwise[0].inputs[1]].dtype == np.float32  # converted in the kernel
    gemm_convs = [n for n in fp16.nodes if "gemm_tile" in n.attrs]
    assert len(gemm_convs) == 4 and all(n.attrs["precision"] == "fp16" for n in gemm_convs), marked
    for node in gemm_convs:
        tile = node.attrs["gemm_tile"]
        assert tile.precision == "fp16" and tile.lanes == 2 * target.lanes
        assert fp16.constants[node.inputs[1]].dtype == np.float16
    # The first runs as Winograd, its products in fp16 as well.
    assert [bool(n.attrs["winograd"]) for n in gemm_convs] == [True, False, False, False]
    assert not any(n.attrs.get("precision") for n in fp32.nodes)
    assert all(fp32.constants[n.inputs[1]].dtype == np.float32 for n in fp32.nodes if "gemm_tile" in n.attrs)


def test_fp16_weights_take_half_the_bytes():
    fp32 = crosscompile.build(matmul_net(), target="rasp5")
    fp16 = crosscompile.build(matmul_net(), target="rasp5", precision="fp16")
    # The packed weights (64 x 48 and 24 x 10 floats) halve; the biases stay float32.
    saved = (64 * 48 + 24 * 10) * 2
    assert fp32.summary["param_bytes"] - fp16.summary["param_bytes"] >= saved


def _tether(*args):
    return subprocess.run([sys.executable, "-m", "remote.cli", *args], env={**os.environ, "PYTHONPATH": ROOT},
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_commands_take_precision(tmp_path):
    model = str(tmp_path / "net.onnx")
    onnx.save(matmul_net(), model)
    proc = _tether("compile", model, "--target", "rasp5", "--precision", "fp16", "-o", str(tmp_path / "net.so"))
    assert proc.returncode == 0, proc.stderr
    assert "3 convolutions and matrix products compute in fp16" in proc.stdout
    proc = _tether("compile", model, "--target", "rasp4b64", "--precision", "fp16", "-o", str(tmp_path / "no.so"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "rasp4b64" in proc.stderr and "FP16 arithmetic" in proc.stderr
    assert not os.path.exists(tmp_path / "no.so")
    # run and bench compile before they lease a board: the same refusal, no board needed.
    for command in ("run", "bench"):
        proc = _tether(command, model, "--target", "rasp4b64", "--precision", "fp16", "--key", "rasp4b64",
                       "--tracker", "127.0.0.1:9", *(["--random"] if command == "run" else []))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "FP16 arithmetic" in proc.stderr and "rasp4b64" in proc.stderr
