"""The module's metadata (docs/module-abi.md): what build() embeds in the
module and returns beside it, read off the compiled graph and its memory
plan before code generation.

Plain data and functions only.

Example:
    >>> meta = module_metadata(imported, graph, plan, target, "tests")  # doctest: +SKIP
    >>> meta["gemm_tiles"][0]["tile"]                                   # doctest: +SKIP
    [8, 2]
"""
from __future__ import annotations

from .codegen import ABI_VERSION
from .ir import Graph
from .memory import MemoryPlan


def module_metadata(imported: Graph, graph: Graph, plan: MemoryPlan, target, producer: str) -> dict:
    """The metadata JSON object of a module compiled from `imported` (the
    graph as the model gave it) through `graph` (after all passes)."""
    return {
        "abi_version": ABI_VERSION,
        "name": graph.name,
        "target": target.to_dict(),
        "inputs": [_spec(graph.tensors[n]) for n in graph.inputs],
        "outputs": [_output_spec(graph, plan, n) for n in graph.outputs],
        "workspace_bytes": plan.workspace_bytes,
        "param_bytes": param_bytes(graph, plan),
        "ops": sorted({node.op_type for node in imported.nodes}),
        "steps": describe_steps(imported, graph, plan),
        "gemm_tiles": [{"node": node.name, "shape": node.attrs["conv_shape"].key,
                        "tile": node.attrs["gemm_tile"].spec, "tuned": node.attrs["tile_tuned"],
                        "winograd": bool(node.attrs.get("winograd")),
                        "winograd_tile": int(node.attrs.get("winograd") or 0)}
                       for node in gemm_convs(imported, graph)],
        "producer": producer,
    }


def gemm_convs(imported: Graph, graph: Graph) -> list:
    """The GEMM convolutions of a tiled graph (schedule.assign_tiles), in
    model order (a Conv fused with its residual Add stands at the Add's
    place in the graph; a Conv split by passes.split_tap_regions stands,
    region by region, at its own)."""
    order = {node.name: pos for pos, node in enumerate(imported.nodes)}

    def place(node):
        name = node.name
        while name not in order and "/" in name:
            name = name.rsplit("/", 1)[0]
        return order[name]

    convs = [node for node in graph.nodes if "gemm_tile" in node.attrs]
    return sorted(convs, key=lambda node: (place(node), convs.index(node)))


def describe_steps(imported: Graph, graph: Graph, plan: MemoryPlan) -> list:
    """One entry per kernel call of tether_run, in order: the op, its node
    name, the ops fused or folded into it and the shapes it reads and writes
    (the "steps" metadata key of docs/module-abi.md)."""
    producer = {out: node for node in imported.nodes for out in node.outputs}
    steps = []
    for node in graph.nodes:
        if node.name in plan.aliased_nodes:
            continue
        # Walk back from the step's output through the original graph to the
        # node it is named after: everything passed on the way was merged in.
        stop = set(node.inputs) | set(imported.constants)
        merged, seen, todo = [], set(), list(node.outputs[:1])
        while todo:
            source = producer.get(todo.pop())
            if source is None or source.name == node.name or source.name in seen:
                continue
            seen.add(source.name)
            merged.append(source.op_type)
            todo.extend(t for t in source.inputs if t not in stop)
        steps.append({"op": node.op_type, "name": node.name, "fused": merged[::-1],
                      "inputs": [list(graph.tensors[t].shape) for t in node.inputs
                                 if t not in graph.constants],
                      "outputs": [list(graph.tensors[t].shape) for t in node.outputs]})
    return steps


def param_bytes(graph: Graph, plan: MemoryPlan) -> int:
    """Bytes of parameters the module will embed (constants read by kernels)."""
    used = {plan.locations[t].name for node in graph.nodes if node.name not in plan.aliased_nodes
            for t in node.inputs if plan.locations[t].kind == "constant"}
    return sum(graph.tensors[name].nbytes for name in used)


def _spec(tensor) -> dict:
    return {"name": tensor.name, "shape": list(tensor.shape), "dtype": tensor.dtype}


def _output_spec(graph: Graph, plan: MemoryPlan, name: str) -> dict:
    """An output's entry; a counted one (crosscompile/bounded.py) also gives
    its counted axis and where in the workspace the run leaves its size."""
    spec = _spec(graph.tensors[name])
    if name in graph.counts:
        count, axis = graph.counts[name]
        location = plan.locations[count]
        assert location.kind == "workspace", f"the count of {name!r} is not in the workspace"
        spec["count"] = {"axis": axis, "offset": location.index}
    return spec
