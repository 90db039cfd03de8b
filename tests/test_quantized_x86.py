"""The x86 int8 kernels (crosscompile/int8_x86.py): AVX2's vpmaddwd
("madd") and vpdpbusd ("vnni", AVX-512 VNNI or AVX-VNNI).

A QDQ model built here with awkward sizes (filters and pixels that leave
remainders of every tile, channels not a multiple of 4, strides, padding,
two images, weights over the full int8 range and uint8 weights with a zero
point, int8 and uint8 activations, a product) is compiled for each x86
kernel the host can run and must give exactly the outputs of the widening
kernel (plain integer arithmetic, the x86-64 baseline target), element for
element. Every kernel is also compiled, never run, for explicit targets:
the graph names the kernel and the object code holds its instruction.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import crosscompile
import minirt
from crosscompile.compiler import lowered_graph
from crosscompile.schedule import tile_table
from crosscompile.target import resolve_target

# The x86 kernels by target: (target, kernel, instruction, register it works on).
X86_TARGETS = {
    "avx2": ("x86_64-linux-gnu/x86-64-v3/+avx2,+fma", "madd", "vpmaddwd", "ymm"),
    "avxvnni": ("x86_64-linux-gnu/x86-64-v3/+avx2,+fma,+avxvnni", "vnni", "vpdpbusd", "ymm"),
    "avx512vnni": ("x86_64-linux-gnu/x86-64-v4/+avx512f,+avx512bw,+avx512dq,+avx512vl,+avx2,+fma,+avx512vnni",
                   "vnni", "vpdpbusd", "zmm"),
    # Named without +avx512f or +avx512vl: 256-bit vectors, but only the 512-bit vpdpbusd.
    "avx512vnni-alone": ("x86_64-linux-gnu/x86-64-v3/+avx2,+fma,+avx512vnni", "vnni", "vpdpbusd", "zmm"),
}
# SSE2 only: the widening kernel, the exact reference.
REFERENCE = "x86_64-linux-gnu/x86-64"
SHAPE = (2, 3, 11, 13)


def _quantized_layer(nodes: list, inits: dict, x: str, name: str, weight: np.ndarray, w_zero, w_scale,
                     y_scale: float, y_zero, op: str = "Conv", relu: bool = False, **attrs) -> str:
    """DequantizeLinear of the weight, op on the dequantized x, [Relu],
    QuantizeLinear: the pattern the pass lowers; returns the quantized output."""
    inits[f"{name}_w"], inits[f"{name}_wz"], inits[f"{name}_ws"] = weight, w_zero, w_scale
    inits[f"{name}_ys"], inits[f"{name}_yz"] = np.float32(y_scale), y_zero
    axis = {"axis": 0 if op == "Conv" else 1} if np.ndim(w_scale) else {}
    nodes.append(helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_ws", f"{name}_wz"], [f"{name}_wf"],
                                  **axis))
    inputs = [f"{x}_f", f"{name}_wf"] + ([f"{name}_b"] if f"{name}_b" in inits else [])
    nodes.append(helper.make_node(op, inputs, [f"{name}_out"], name=name, **attrs))
    out = f"{name}_out"
    if relu:
        nodes.append(helper.make_node("Relu", [out], [f"{name}_relu"]))
        out = f"{name}_relu"
    nodes.append(helper.make_node("QuantizeLinear", [out, f"{name}_ys", f"{name}_yz"], [name]))
    return name


def _dequantized(nodes: list, inits: dict, name: str, scale: float, zero) -> None:
    inits[f"{name}_s"], inits[f"{name}_z"] = np.float32(scale), zero
    nodes.append(helper.make_node("DequantizeLinear", [name, f"{name}_s", f"{name}_z"], [f"{name}_f"]))


def edge_model(activations: str) -> onnx.ModelProto:
    """x (2, 3, 11, 13) -> 3 x 3 conv to 10 filters (int8 weights over
    -128..127 per channel, a float bias) -> 1 x 1 conv of stride 2 to 6,
    Relu -> 3 x 3 conv of stride 2 to 17 (uint8 weights, zero point 131:
    w - 131 does not fit int8) -> Flatten -> MatMul to 10 columns (K = 102).
    Each layer's output is dequantized into an output of the graph (y1,
    y2, y3, y), its scale set for some 30 steps of spread either side."""
    rng = np.random.default_rng(3)
    dtype = np.uint8 if activations == "uint8" else np.int8
    zero = dtype(128 if activations == "uint8" else 3)
    w_scale = np.float32(0.01)

    def layer_scale(in_scale: float, depth: int) -> float:
        # inputs of about 50 steps' spread, weights of 74: sums spread over sqrt(depth) * 50 * 74
        return float(in_scale * w_scale * np.sqrt(depth) * 50 * 74 / 30)

    x_scale = 0.05
    nodes, inits = [], {"x_s": np.float32(x_scale), "x_z": zero}
    nodes.append(helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]))
    _dequantized(nodes, inits, "xq", x_scale, zero)
    w1 = rng.integers(-128, 128, (10, 3, 3, 3)).astype(np.int8)
    w1[0, 0, 0, :] = (-128, 127, -128)
    inits["c1_b"] = (0.2 * rng.standard_normal(10)).astype(np.float32)
    s1 = layer_scale(x_scale, 27)
    c1 = _quantized_layer(nodes, inits, "xq", "c1", w1, np.zeros(10, np.int8),
                          w_scale * rng.uniform(0.5, 1.5, 10).astype(np.float32), s1, zero, pads=[1, 1, 1, 1])
    _dequantized(nodes, inits, c1, s1, zero)
    w2 = rng.integers(-127, 128, (6, 10, 1, 1)).astype(np.int8)
    s2 = layer_scale(s1, 10)
    c2 = _quantized_layer(nodes, inits, c1, "c2", w2, np.int8(0), w_scale, s2, zero, relu=True, strides=[2, 2])
    _dequantized(nodes, inits, c2, s2, zero)
    w3 = rng.integers(0, 256, (17, 6, 3, 3)).astype(np.uint8)
    s3 = layer_scale(s2, 54) / 2  # the Relu halved its inputs' spread
    c3 = _quantized_layer(nodes, inits, c2, "c3", w3, np.uint8(131), w_scale, s3, zero, strides=[2, 2])
    _dequantized(nodes, inits, c3, s3, zero)
    nodes.append(helper.make_node("Flatten", [f"{c3}_f"], ["flat"]))
    nodes.append(helper.make_node("QuantizeLinear", ["flat", f"{c3}_s", f"{c3}_z"], ["flatq"]))
    _dequantized(nodes, inits, "flatq", s3, zero)
    w4 = rng.integers(-128, 128, (17 * 2 * 3, 10)).astype(np.int8)
    s4 = layer_scale(s3, 102)
    fc = _quantized_layer(nodes, inits, "flatq", "fc", w4, np.zeros(10, np.int8), np.full(10, w_scale),
                          s4, zero, op="MatMul")
    nodes.append(helper.make_node("DequantizeLinear", [fc, f"{fc}_ys", f"{fc}_yz"], ["y"]))
    outputs = {"y1": (2, 10, 11, 13), "y2": (2, 6, 6, 7), "y3": (2, 17, 2, 3), "y": (2, 10)}
    for name, layer in zip(outputs, (c1, c2, c3)):
        nodes.append(helper.make_node("Identity", [f"{layer}_f"], [name]))
    graph = helper.make_graph(nodes, "edges", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
                              [numpy_helper.from_array(np.asarray(v), n) for n, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _kernels(model: onnx.ModelProto, target: str) -> dict:
    """{integer node name: its int8 kernel} of the model lowered for target."""
    target = resolve_target(target)
    _, _, graph = lowered_graph(model, target, None, tile_table(target, None))
    return {n.name: n.attrs["int8_kernel"] for n in graph.nodes if n.op_type in ("IntegerConv", "IntegerMatMul")}


def _host_runs(target: str) -> bool:
    host = resolve_target("host")
    needed = resolve_target(target).feature_flags
    return host.arch == "x86_64" and needed <= host.feature_flags


def _inputs(count: int) -> list:
    rng = np.random.default_rng(7)
    return [{"x": (2.5 * rng.standard_normal(SHAPE)).astype(np.float32)} for _ in range(count)]


@pytest.mark.parametrize("activations", ["uint8", "int8"])
@pytest.mark.parametrize("isa", list(X86_TARGETS))
def test_x86_int8_kernels_equal_the_exact_reference(isa, activations, tmp_path):
    target, kernel, *_ = X86_TARGETS[isa]
    if not _host_runs(target):
        pytest.skip(f"this host cannot run {isa} code (compiled and checked in "
                    "test_x86_int8_kernels_are_chosen_and_compiled)")
    model = edge_model(activations)
    kernels = _kernels(model, target)
    # vpdpbusd takes int8 weights: c3's uint8 weights less 131 go to madd.
    assert kernels == {"c1": kernel, "c2": kernel, "c3": "madd", "fc": kernel}, kernels
    assert set(_kernels(model, REFERENCE).values()) == {"widening"}
    ours = minirt.load(crosscompile.build(model, target=target).export_library(tmp_path / "ours.so"))
    exact = minirt.load(crosscompile.build(model, target=REFERENCE).export_library(tmp_path / "exact.so"))
    for feeds in _inputs(3):
        for name, got, want in zip(("y1", "y2", "y3", "y"), ours.run(feeds), exact.run(feeds)):
            assert np.array_equal(got, want), (
                f"{isa}, {name}: {np.count_nonzero(got != want)} of {got.size} outputs differ from the exact "
                f"kernel's; largest difference {np.abs(got - want).max():g}")
            # Not all saturated or zero: the outputs spread over many steps.
            assert len(np.unique(want)) > min(10, want.size // 4), (name, np.unique(want))


def _disassembler() -> "list | None":
    for tool in ("llvm-objdump", "objdump"):
        path = shutil.which(tool)
        if path and "x86-64" in subprocess.run([path, "--version"] if tool == "llvm-objdump" else [path, "-i"],
                                               capture_output=True, text=True, timeout=60).stdout:
            return [path, "-d", "--no-show-raw-insn"]
    return None


@pytest.mark.parametrize("isa", list(X86_TARGETS))
def test_x86_int8_kernels_are_chosen_and_compiled(isa, tmp_path):
    """Compiled only (the host may lack the instructions): the target's
    features choose the kernel, and its instruction is in the object code
    on the target's registers."""
    target, kernel, instruction, register = X86_TARGETS[isa]
    model = edge_model("uint8")
    assert _kernels(model, target) == {"c1": kernel, "c2": kernel, "c3": "madd", "fc": kernel}
    tool = _disassembler()
    if tool is None:
        pytest.skip("no disassembler for x86-64 (objdump or llvm-objdump)")
    library = crosscompile.build(model, target=target).export_library(tmp_path / "net.so")
    code = subprocess.run(tool + [library], capture_output=True, text=True, timeout=120, check=True).stdout
    used = re.findall(rf"\b{instruction}\b[^\n]*", code)
    assert any(f"%{register}" in line for line in used), (instruction, register, used[:5])
    if kernel == "vnni":  # and madd's for c3
        assert re.search(r"\bvpmaddwd\b[^\n]*%ymm", code)
