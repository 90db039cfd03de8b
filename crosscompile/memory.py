"""Memory planning: where each tensor of a compiled graph lives at run time.

A pure function of the graph (no LLVM, files or clocks), in small phases:
views that share a buffer instead of copying (shape-only ops, channel
Concats computed in place, a residual overwritten by the Conv that adds
it), the fixed places (model inputs and outputs, parameters), then the
workspace, where tensors whose lifetimes do not overlap share bytes.

Example:
    >>> plan = plan_memory(graph)          # doctest: +SKIP
    >>> plan.locations[graph.outputs[0]]   # doctest: +SKIP
    Location(kind='output', index=0, name='')
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import Graph
from .ops import OPS

ALIGNMENT = 64


@dataclass(frozen=True)
class Location:
    """Where a tensor's data lives at run time.

    kind is "input" or "output" (index into the tether_run pointer arrays),
    "constant" (name of a parameter baked into the module) or "workspace"
    (byte offset into the caller's workspace).
    """

    kind: str
    index: int = 0
    name: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    locations: dict[str, Location]
    aliased_nodes: frozenset[str]  # nodes that need no code: output shares input's buffer
    workspace_bytes: int
    # The last scratch_bytes of the workspace are a temporary area any
    # kernel may use during its own call (Op.scratch_bytes), e.g. im2col.
    scratch_bytes: int = 0


def plan_memory(graph: Graph, alignment: int = ALIGNMENT) -> MemoryPlan:
    """Assign every tensor a Location, reusing workspace between tensors
    whose lifetimes do not overlap.

    Shape-only ops (Reshape, Flatten, Identity, Dropout) share their input's
    buffer unless their output is a graph output that cannot take over that
    buffer (a model input, a constant, or a buffer already holding another
    output); then they are kept and lowered as a copy. A channel Concat of
    one image needs no code when its inputs can be computed straight into
    their slices of its output (_concat_slices). A node's output never
    shares memory with its inputs, which is what lets kernels use noalias,
    except a Conv's fused residual (its last input) when this Conv is its
    last reader: the output then takes over the residual's buffer.
    """
    views = _Views(graph)
    aliased = _alias_shape_ops(graph, views)
    sliced = _concat_slices(graph, views)
    aliased |= _slice_concats(graph, views, sliced)
    in_concat = {t for node, names in sliced for t in (*names, node.outputs[0])}
    _overwrite_residuals(graph, views, in_concat)
    locations = _fixed_locations(graph, views)
    end = _place_workspace(graph, views, locations, alignment)
    _locate_views(graph, views, locations)
    workspace = _align(end, alignment)
    scratch = _align(max((OPS[n.op_type].scratch_bytes([graph.tensors[t] for t in n.inputs],
                                                        [graph.tensors[t] for t in n.outputs], n.attrs)
                          for n in graph.nodes if n.name not in aliased), default=0), alignment)
    return MemoryPlan(locations, frozenset(aliased), workspace + scratch, scratch)


class _Views:
    """Which tensors are views of another's buffer, as the phases decide them."""

    def __init__(self, graph: Graph):
        self.output_index = {name: j for j, name in enumerate(graph.outputs)}
        self.inputs = set(graph.inputs)
        self.constants = graph.constants
        self.parent: dict[str, str] = {}
        self.shift: dict[str, int] = {}  # bytes from a tensor's start to its parent's (concat slices)
        self.claimed: dict[str, int] = {}  # intermediate root -> output buffer it lives in

    def root(self, name: str) -> str:
        while name in self.parent:
            name = self.parent[name]
        return name

    def offset_in_root(self, name: str) -> int:
        total = 0
        while name in self.parent:
            total += self.shift.get(name, 0)
            name = self.parent[name]
        return total

    def fixed(self, name: str) -> bool:
        """A model input, a constant, a graph output or a buffer one takes over."""
        return (name in self.inputs or name in self.constants
                or name in self.output_index or name in self.claimed)


def _alias_shape_ops(graph: Graph, views: _Views) -> set:
    """Shape-only ops' outputs become views of their inputs; a graph output
    takes over its input's buffer when that buffer is free to move. Returns
    the nodes made views."""
    aliased = set()
    for node in graph.nodes:
        if not OPS[node.op_type].alias:
            continue
        src, out = views.root(node.inputs[0]), node.outputs[0]
        if out in views.output_index:
            if views.fixed(src):
                continue
            views.claimed[src] = views.output_index[out]
        views.parent[out] = src
        aliased.add(node.name)
    return aliased


def _slice_concats(graph: Graph, views: _Views, sliced: list) -> set:
    """A Concat whose inputs are each one contiguous block of its output
    (every dimension before the axis is 1, e.g. channels of one image)
    needs no copy when each input is computed straight into its slice.
    Returns those Concat nodes."""
    aliased = set()
    for node, names in sliced:
        at = 0
        for name in names:
            views.parent[name], views.shift[name] = node.outputs[0], at
            at += graph.tensors[name].nbytes
        aliased.add(node.name)
    return aliased


def _overwrite_residuals(graph: Graph, views: _Views, in_concat: set) -> None:
    """A Conv (or MatMul) adding a residual that nothing reads afterwards writes its
    output over the residual (each element is read just before the same
    element is written): one tensor's worth less memory traffic."""
    last_read: dict[str, int] = {}
    for pos, node in enumerate(graph.nodes):
        for name in node.inputs:
            last_read[views.root(name)] = pos
    for pos, node in enumerate(graph.nodes):
        if node.op_type not in ("Conv", "MatMul") or node.attrs.get("residual_at") is None:
            continue
        src, out = views.root(node.inputs[-1]), node.outputs[0]
        if (views.fixed(src) or src in in_concat or out in in_concat
                or out in views.output_index or out in views.claimed or last_read.get(src) != pos
                or any(views.root(t) == src for t in node.inputs[:-1])
                or graph.tensors[src].nbytes != graph.tensors[out].nbytes):
            continue
        views.parent[out] = src
        last_read[src] = last_read.get(out, pos)


def _fixed_locations(graph: Graph, views: _Views) -> dict:
    """Locations of the buffers the caller or the module provides: model
    inputs and outputs (and the intermediates that live in an output) and
    parameters."""
    locations: dict[str, Location] = {}
    for i, name in enumerate(graph.inputs):
        locations[name] = Location("input", i)
    for name in graph.constants:
        locations[name] = Location("constant", name=name)
    for name, j in views.output_index.items():
        if name not in views.parent:
            locations[name] = Location("output", j)
    for name, j in views.claimed.items():
        locations[name] = Location("output", j)
    return locations


def _place_workspace(graph: Graph, views: _Views, locations: dict, alignment: int) -> int:
    """Give every other buffer a workspace offset, largest first, where no
    buffer alive at the same time overlaps it; returns the end of the last."""
    # Lifetimes of workspace tensors, in node positions, over all their aliases.
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for pos, node in enumerate(graph.nodes):
        for name in node.inputs:
            last[views.root(name)] = pos
        for name in node.outputs:
            r = views.root(name)
            if r not in locations:
                first.setdefault(r, pos)
                last.setdefault(r, pos)
    for name in graph.outputs:
        if name in graph.counts:
            # A counted output's count is read by the loader after the run.
            last[views.root(graph.counts[name][0])] = len(graph.nodes)

    placed: list[tuple[int, int, str]] = []  # (offset, end, name)
    for name in sorted(first, key=lambda n: (-graph.tensors[n].nbytes, first[n])):
        size = graph.tensors[name].nbytes
        clashes = sorted((off, end) for off, end, other in placed
                         if first[other] <= last[name] and first[name] <= last[other])
        offset = 0
        for off, end in clashes:
            if offset + size <= off:
                break
            offset = max(offset, _align(end, alignment))
        placed.append((offset, offset + size, name))
        locations[name] = Location("workspace", offset)
    return max((end for _, end, _ in placed), default=0)


def _locate_views(graph: Graph, views: _Views, locations: dict) -> None:
    """A view lives where its root does, at its offset into it."""
    for name in graph.tensors:
        if name in locations:
            continue
        base = locations.get(views.root(name))
        step = views.offset_in_root(name)
        locations[name] = Location(base.kind, base.index + step) if step else base


def _concat_slices(graph: Graph, views: _Views) -> list:
    """[(concat node, its inputs)] of the Concats plan_memory computes in
    place: along an axis with only 1s before it, with no fused epilogue,
    writing a workspace tensor, and reading tensors that are each computed
    by one node of the graph into a buffer of their own (not a graph input,
    output or constant, not a view of another tensor, not already a slice
    of another Concat, each once). Other readers of an input read it in its
    slice. A Concat output may itself be a slice of a later Concat
    (DenseNet's growing blocks)."""
    produced = {out for node in graph.nodes for out in node.outputs}
    viewed = set(views.parent.values())  # tensors other tensors are views of
    taken: set = set()
    found = []
    for node in graph.nodes:
        if node.op_type != "Concat" or node.attrs.get("epilogue") or node.attrs.get("extents"):
            continue
        out = node.outputs[0]
        shape = graph.tensors[out].shape
        axis = node.attrs["axis"] % len(shape)
        if (any(d != 1 for d in shape[:axis]) or out in views.output_index or out in views.claimed
                or views.root(out) != out):
            continue
        names = list(node.inputs)
        if len(set(names)) != len(names) or not all(
                t in produced and not views.fixed(t) and t not in taken
                and t not in viewed and views.root(t) == t
                for t in names):
            continue
        taken.update(names)
        found.append((node, names))
    return found


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment
