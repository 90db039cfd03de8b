"""The precision a graph computes in: the one place that decides which
nodes run in half precision, and refuses a precision a target cannot run.

mark_precision is a graph pass: with "fp16" it writes attrs["precision"] =
"fp16" into every convolution and matrix product that runs on the GEMM
micro-kernel (passes.runs_as_gemm, passes.runs_as_tiled_product).
schedule.assign_tiles then gives those nodes an fp16 register tile
(gemm.tile_for(target, "fp16")), the packing passes store their weights
as halves, and the kernels multiply and accumulate in half precision
with float32 inputs, outputs, bias and epilogue. Depthwise convolutions
(passes._is_depthwise) with strides up to 2 are marked too: they convert
each input channel to halves once, into a zero-padded copy
(conv.emit_depthwise_padded), and accumulate twice as many lanes per
vector. Everything else (pools, element-wise ops, the classifier's
matrix-vector product) stays float32, as do the module's inputs and
outputs.

Example:
    >>> from crosscompile.target import resolve_target
    >>> check_precision("fp16", resolve_target("rasp5"))
    'fp16'
"""
from __future__ import annotations

from dataclasses import replace

from .errors import BuildError
from .ir import Graph, Node
from .op_base import _prod
from .passes import _is_depthwise, runs_as_gemm, runs_as_tiled_product

PRECISIONS = ("fp32", "fp16")


def check_precision(precision: str, target) -> str:
    """The precision, if the target can compute in it; else a BuildError
    naming the target and what to use instead."""
    if precision not in PRECISIONS:
        raise BuildError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and not target.has_fp16_arithmetic:
        with_fp16 = "rasp5, android-arm64"
        raise BuildError(
            f"precision 'fp16' needs FP16 arithmetic, which target {target.name!r} "
            f"({target.triple}, cpu {target.cpu}, features {target.features or 'none'!r}) does not have; "
            f"build it with precision 'fp32', or for a core that has it: {with_fp16}, or a triple "
            "with '+fullfp16' among its features (e.g. aarch64-linux-gnu/cortex-a55/+neon,+fullfp16)")
    return precision


def mark_precision(graph: Graph, target, precision: str = "fp32") -> Graph:
    """Write the precision of each node that has a half-precision kernel
    into the graph (see the module's docstring). Raises BuildError for a
    precision the target cannot run.

    >>> mark_precision(graph, resolve_target("rasp5"), "fp16")  # doctest: +SKIP
    """
    if check_precision(precision, target) == "fp32":
        return graph
    nodes = []
    for node in graph.nodes:
        if runs_as_gemm(graph, node) or runs_as_tiled_product(graph, node) or _half_depthwise(graph, node):
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, precision=precision))
        nodes.append(node)
    return replace(graph, nodes=nodes)


def _half_depthwise(graph: Graph, node: Node) -> bool:
    """A depthwise convolution the half-precision kernel runs: a window of
    more than one tap and strides up to 2 (conv.depthwise_planes)."""
    if node.op_type != "Conv" or not _is_depthwise(graph, node):
        return False
    taps = graph.tensors[node.inputs[1]].shape[2:]
    return all(s <= 2 for s in node.attrs.get("strides") or (1,)) and _prod(taps) > 1
