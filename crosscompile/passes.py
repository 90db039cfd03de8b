"""Graph passes: pure functions from a Graph to a Graph or a plan.

Nothing here touches LLVM, files or the clock, so each pass is unit-testable
on hand-made graphs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from .ir import Graph, Node, Tensor
from .ops import OPS

ALIGNMENT = 64


def eliminate_dead_code(graph: Graph) -> Graph:
    """Drop nodes, constants and tensors the graph outputs do not depend on."""
    live = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if any(out in live for out in node.outputs):
            kept.append(node)
            live.update(node.inputs)
    live.update(graph.inputs)
    return replace(
        graph,
        nodes=kept[::-1],
        constants={k: v for k, v in graph.constants.items() if k in live},
        tensors={k: v for k, v in graph.tensors.items() if k in live},
    )


def _consumers(graph: Graph) -> Counter:
    uses = Counter(name for node in graph.nodes for name in node.inputs)
    uses.update(graph.outputs)
    return uses


def fold_batchnorm(graph: Graph) -> Graph:
    """Fold each BatchNormalization with constant parameters into the Conv
    that feeds it (when the Conv has constant weights and no other reader):
    W' = W * a, B' = (B - mean) * a + beta with a = scale / sqrt(var + eps).
    """
    producer = {out: node for node in graph.nodes for out in node.outputs}
    uses = _consumers(graph)
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    replaced: dict[str, Node] = {}  # conv name -> folded conv
    dropped = set()
    for node in graph.nodes:
        if node.op_type != "BatchNormalization":
            continue
        conv = producer.get(node.inputs[0])
        if (conv is None or conv.op_type != "Conv" or uses[node.inputs[0]] != 1
                or conv.name in replaced
                or not all(t in constants for t in conv.inputs[1:] + node.inputs[1:])):
            continue
        scale, beta, mean, var = (constants[t].astype(np.float64) for t in node.inputs[1:])
        a = scale / np.sqrt(var + node.attrs["epsilon"])
        weight = constants[conv.inputs[1]]
        bias = constants[conv.inputs[2]].astype(np.float64) if len(conv.inputs) == 3 else 0.0
        new_w = (weight * a.reshape((-1,) + (1,) * (weight.ndim - 1))).astype(np.float32)
        new_b = ((bias - mean) * a + beta).astype(np.float32)
        w_name, b_name = f"{conv.name}/bn_weight", f"{conv.name}/bn_bias"
        for name, value in ((w_name, new_w), (b_name, new_b)):
            constants[name] = value
            tensors[name] = Tensor(name, value.shape, "float32")
        replaced[conv.name] = Node("Conv", conv.name, [conv.inputs[0], w_name, b_name],
                                   list(node.outputs), dict(conv.attrs))
        dropped.add(node.name)
    if not replaced:
        return graph
    nodes = [replaced.get(n.name, n) for n in graph.nodes if n.name not in dropped]
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def fold_channel_affine(graph: Graph) -> Graph:
    """Fold a Mul or Add by a per-channel constant (shape (M, 1, 1), (1, M, 1, 1),
    scalar, ...) into the Conv that feeds it: Mul scales W and B, Add shifts B.
    Exporters write BatchNorm this way (e.g. Inception v2)."""
    producer = {out: node for node in graph.nodes for out in node.outputs}
    uses = _consumers(graph)
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    current: dict[str, Node] = {}  # conv name -> its latest folded form
    dropped = set()
    for node in graph.nodes:
        if node.op_type not in ("Mul", "Add") or len(node.inputs) != 2:
            continue
        data = [t for t in node.inputs if t not in constants]
        if len(data) != 1:
            continue
        (const_name,) = [t for t in node.inputs if t in constants]
        conv = producer.get(data[0])
        conv = current.get(conv.name, conv) if conv is not None else None
        if (conv is None or conv.op_type != "Conv" or uses[data[0]] != 1
                or data[0] != conv.outputs[0] or conv.attrs.get("epilogue")
                or not all(t in constants for t in conv.inputs[1:])):
            continue
        out_shape = tensors[conv.outputs[0]].shape
        value = constants[const_name]
        if value.ndim > len(out_shape) or value.dtype != np.float32:
            continue
        padded = value.reshape((1,) * (len(out_shape) - value.ndim) + value.shape)
        m = out_shape[1]
        if any(d != 1 for i, d in enumerate(padded.shape) if i != 1) or padded.shape[1] not in (1, m):
            continue
        per_channel = np.broadcast_to(padded.reshape(-1), (m,)).astype(np.float64)
        weight = constants[conv.inputs[1]]
        bias = constants[conv.inputs[2]].astype(np.float64) if len(conv.inputs) == 3 else np.zeros(m)
        if node.op_type == "Mul":
            weight = weight * per_channel.reshape((-1,) + (1,) * (weight.ndim - 1))
            bias = bias * per_channel
        else:
            bias = bias + per_channel
        w_name, b_name = f"{node.name}/folded_weight", f"{node.name}/folded_bias"
        for name, array in ((w_name, weight.astype(np.float32)), (b_name, bias.astype(np.float32))):
            constants[name] = array
            tensors[name] = Tensor(name, array.shape, "float32")
        current[conv.name] = Node("Conv", conv.name, [conv.inputs[0], w_name, b_name],
                                  list(node.outputs), dict(conv.attrs))
        producer[node.outputs[0]] = current[conv.name]
        dropped.add(node.name)
    if not current:
        return graph
    nodes = [current.get(n.name, n) for n in graph.nodes if n.name not in dropped]
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def fuse_elementwise(graph: Graph) -> Graph:
    """Run each fusable element-wise op (Relu, Clip, Sigmoid, ...) as the
    epilogue of the node producing its input, when that node has one output,
    is not a shape-only alias, and nothing else reads the intermediate.

    The producer's attrs gain "epilogue": a tuple of (op_type, attrs).
    """
    producer = {out: node for node in graph.nodes for out in node.outputs}
    uses = _consumers(graph)
    merged: dict[str, Node] = {}  # producer name -> node with epilogue
    absorbed: dict[str, str] = {}  # activation name -> producer name
    for node in graph.nodes:
        if not OPS[node.op_type].fusable or len(node.inputs) != 1:
            continue
        src = producer.get(node.inputs[0])
        if src is None:
            continue
        src = merged.get(src.name, src)
        if (OPS[src.op_type].alias or len(src.outputs) != 1
                or uses[node.inputs[0]] != 1 or node.inputs[0] not in src.outputs):
            continue
        attrs = dict(src.attrs)
        attrs["epilogue"] = tuple(attrs.get("epilogue", ())) + ((node.op_type, node.attrs),)
        fused = Node(src.op_type, src.name, list(src.inputs), list(node.outputs), attrs)
        merged[src.name] = fused
        producer[node.outputs[0]] = fused
        absorbed[node.name] = src.name
    if not absorbed:
        return graph
    nodes = [merged.get(n.name, n) for n in graph.nodes if n.name not in absorbed]
    live = {t for n in nodes for t in n.inputs + n.outputs} | set(graph.inputs) | set(graph.outputs)
    return replace(graph, nodes=nodes, tensors={k: v for k, v in graph.tensors.items() if k in live})


# Output channels per group below which a Conv keeps its direct loop nest
# (depthwise convolutions): a register tile of rows would be mostly padding.
MIN_GEMM_ROWS = 4


def _is_depthwise(graph: Graph, node: Node) -> bool:
    """One 2-D (or 1-D) filter per channel: the direct depthwise kernel's case."""
    x, w = graph.tensors[node.inputs[0]].shape, graph.tensors[node.inputs[1]].shape
    return len(x) in (3, 4) and node.attrs.get("group", 1) == x[1] == w[0] and w[1] == 1


# Ops that can split their channels between threads, and the input size
# from which they do: below it the barrier after the op would cost more
# than the share of work it saves (a serial op only makes the other threads
# wait once, at the next split op).
SPLITTABLE = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")
MIN_SPLIT_ELEMENTS = 64 * 1024


def mark_split(graph: Graph) -> Graph:
    """Mark attrs["split"] on splittable ops with inputs of at least
    MIN_SPLIT_ELEMENTS values, so they run on every thread of a parallel run."""
    nodes = []
    for node in graph.nodes:
        if node.op_type in SPLITTABLE and graph.tensors[node.inputs[0]].size >= MIN_SPLIT_ELEMENTS:
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, split=True))
        nodes.append(node)
    return replace(graph, nodes=nodes)


def runs_as_gemm(graph: Graph, node: Node) -> bool:
    """Whether a Conv runs as a GEMM on packed weights: constant weights
    and at least MIN_GEMM_ROWS output channels per group (fewer would make
    a register tile of rows mostly padding)."""
    return (node.op_type == "Conv" and len(node.inputs) >= 2 and node.inputs[1] in graph.constants
            and graph.tensors[node.inputs[1]].shape[0] // node.attrs.get("group", 1) >= MIN_GEMM_ROWS)


def pack_conv_weights(graph: Graph) -> Graph:
    """Store the constant weight of each Conv that has a register tile
    (attrs["gemm_tile"], written by schedule.assign_tiles) as
    pack_weights(W_g, tile.mr) (the GEMM micro-kernel's layout) per group g,
    concatenated, and mark the node with attrs["packed_mr"].

    The packed constant is a new tensor, so a weight another node also
    reads stays as it was. Depthwise convolutions are marked
    attrs["depthwise"] instead (they run a direct kernel).
    """
    from .gemm import pack_weights
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    nodes = []
    for node in graph.nodes:
        tile = node.attrs.get("gemm_tile") if node.op_type == "Conv" else None
        if tile is not None:
            group = node.attrs.get("group", 1)
            name = f"{node.inputs[1]}/packed{tile.mr}"
            if name not in constants:
                constants[name] = np.concatenate(
                    [pack_weights(w, tile.mr) for w in np.split(constants[node.inputs[1]], group)])
                tensors[name] = Tensor(name, constants[name].shape, "float32")
            attrs = dict(node.attrs, packed_mr=tile.mr,
                         weight_shape=tuple(graph.tensors[node.inputs[1]].shape))
            node = Node(node.op_type, node.name, [node.inputs[0], name, *node.inputs[2:]],
                        list(node.outputs), attrs)
        elif node.op_type == "Conv" and _is_depthwise(graph, node):
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, depthwise=True))
        nodes.append(node)
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def fuse_residual_add(graph: Graph) -> Graph:
    """Fold `Add(conv, r)` (or a two-input Sum) into a GEMM Conv that only
    the Add reads: the Conv gains r as its last input and adds it in its
    epilogue (attrs["residual_at"]: after that many of its own fused ops,
    followed by the Add's), saving a pass over both tensors. The fused node
    takes the Add's place, where r is already computed. Only when every
    fused op has a vector form, as the micro-kernel's epilogue needs.
    """
    producer = {out: node for node in graph.nodes for out in node.outputs}
    uses = _consumers(graph)
    fused: dict[str, Node] = {}  # add name -> fused conv
    dropped = set()

    def vectorizable(node):
        return all(OPS[op].vectorizable for op, _ in node.attrs.get("epilogue", ()))

    for node in graph.nodes:
        if node.op_type not in ("Add", "Sum") or len(node.inputs) != 2:
            continue
        shape = graph.tensors[node.outputs[0]].shape
        if any(graph.tensors[t].shape != shape for t in node.inputs) or not vectorizable(node):
            continue
        for pos, name in enumerate(node.inputs):
            conv = producer.get(name)
            other = node.inputs[1 - pos]
            if (conv is None or not runs_as_gemm(graph, conv)
                    or conv.name in dropped or uses[name] != 1 or other == name
                    or not vectorizable(conv) or other in graph.constants):
                continue
            own = tuple(conv.attrs.get("epilogue", ()))
            attrs = dict(conv.attrs, residual_at=len(own),
                         epilogue=own + tuple(node.attrs.get("epilogue", ())))
            fused[node.name] = Node("Conv", conv.name, conv.inputs + [other], list(node.outputs), attrs)
            dropped.add(conv.name)
            break
    if not fused:
        return graph
    nodes = [fused.get(n.name, n) for n in graph.nodes if n.name not in dropped]
    return eliminate_dead_code(replace(graph, nodes=nodes))


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
    output_index = {name: j for j, name in enumerate(graph.outputs)}
    inputs = set(graph.inputs)
    parent: dict[str, str] = {}
    shift: dict[str, int] = {}  # bytes from a tensor's start to its parent's (concat slices)

    def root(name: str) -> str:
        while name in parent:
            name = parent[name]
        return name

    def offset_in_root(name: str) -> int:
        total = 0
        while name in parent:
            total += shift.get(name, 0)
            name = parent[name]
        return total

    claimed: dict[str, int] = {}  # intermediate root -> output buffer it lives in
    aliased = set()
    for node in graph.nodes:
        if not OPS[node.op_type].alias:
            continue
        src, out = root(node.inputs[0]), node.outputs[0]
        if out in output_index:
            movable = not (src in inputs or src in graph.constants
                           or src in output_index or src in claimed)
            if not movable:
                continue
            claimed[src] = output_index[out]
        parent[out] = src
        aliased.add(node.name)

    # A Concat whose inputs are each one contiguous block of its output
    # (every dimension before the axis is 1, e.g. channels of one image)
    # needs no copy when each input is computed straight into its slice.
    sliced = _concat_slices(graph, root, parent, claimed, output_index)
    for node, names in sliced:
        at = 0
        for name in names:
            parent[name], shift[name] = node.outputs[0], at
            at += graph.tensors[name].nbytes
        aliased.add(node.name)
    in_concat = {t for node, names in sliced for t in (*names, node.outputs[0])}

    # A Conv adding a residual that nothing reads afterwards writes its
    # output over the residual (each element is read just before the same
    # element is written): one tensor's worth less memory traffic.
    last_read: dict[str, int] = {}
    for pos, node in enumerate(graph.nodes):
        for name in node.inputs:
            last_read[root(name)] = pos
    for pos, node in enumerate(graph.nodes):
        if node.op_type != "Conv" or node.attrs.get("residual_at") is None:
            continue
        src, out = root(node.inputs[-1]), node.outputs[0]
        if (src in inputs or src in graph.constants or src in output_index or src in claimed
                or src in in_concat or out in in_concat
                or out in output_index or out in claimed or last_read.get(src) != pos
                or any(root(t) == src for t in node.inputs[:-1])
                or graph.tensors[src].nbytes != graph.tensors[out].nbytes):
            continue
        parent[out] = src
        last_read[src] = last_read.get(out, pos)

    locations: dict[str, Location] = {}
    for i, name in enumerate(graph.inputs):
        locations[name] = Location("input", i)
    for name in graph.constants:
        locations[name] = Location("constant", name=name)
    for name, j in output_index.items():
        if name not in parent:
            locations[name] = Location("output", j)
    for name, j in claimed.items():
        locations[name] = Location("output", j)

    # Lifetimes of workspace tensors, in node positions, over all their aliases.
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for pos, node in enumerate(graph.nodes):
        for name in node.inputs:
            last[root(name)] = pos
        for name in node.outputs:
            r = root(name)
            if r not in locations:
                first.setdefault(r, pos)
                last.setdefault(r, pos)

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

    for name in graph.tensors:
        if name in locations:
            continue
        base = locations.get(root(name))
        step = offset_in_root(name)
        locations[name] = Location(base.kind, base.index + step) if step else base
    workspace = _align(max((end for _, end, _ in placed), default=0), alignment)
    scratch = _align(max((OPS[n.op_type].scratch_bytes([graph.tensors[t] for t in n.inputs],
                                                        [graph.tensors[t] for t in n.outputs], n.attrs)
                          for n in graph.nodes if n.name not in aliased), default=0), alignment)
    return MemoryPlan(locations, frozenset(aliased), workspace + scratch, scratch)


def _concat_slices(graph: Graph, root, parent: dict, claimed: dict, output_index: dict) -> list:
    """[(concat node, its inputs)] of the Concats plan_memory computes in
    place: along an axis with only 1s before it, with no fused epilogue,
    writing a workspace tensor, and reading tensors that are each computed
    by one node of the graph into a buffer of their own (not a graph input,
    output or constant, not a view of another tensor, not already a slice
    of another Concat, each once). Other readers of an input read it in its
    slice. A Concat output may itself be a slice of a later Concat
    (DenseNet's growing blocks)."""
    produced = {out for node in graph.nodes for out in node.outputs}
    viewed = set(parent.values())  # tensors other tensors are views of
    taken: set = set()
    found = []
    for node in graph.nodes:
        if node.op_type != "Concat" or node.attrs.get("epilogue"):
            continue
        out = node.outputs[0]
        shape = graph.tensors[out].shape
        axis = node.attrs["axis"] % len(shape)
        if any(d != 1 for d in shape[:axis]) or out in output_index or out in claimed or root(out) != out:
            continue
        names = list(node.inputs)
        if len(set(names)) != len(names) or not all(
                t in produced and t not in graph.inputs and t not in graph.constants
                and t not in output_index and t not in claimed and t not in taken
                and t not in viewed and root(t) == t
                for t in names):
            continue
        taken.update(names)
        found.append((node, names))
    return found


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment
