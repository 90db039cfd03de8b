"""If and Scan whose course is known when the model is compiled, written
out as the plain nodes they run.

An If whose condition is a constant is the branch it takes. A Scan runs
its body once per element of its scan inputs' sequence axis, whose length
is fixed in a compiled module: it becomes that many copies of the body,
each reading its element with a Gather and the state the copy before it
left, and its scan outputs are the copies' elements stacked along their
axis. Names made inside a body get the node's name (and the iteration)
as a prefix, so that copies never collide; names from the enclosing graph
are read as they are.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import BuildError

# The control-flow ops written out at import, and what they take.
UNROLLED = {"If": "a condition known at compile time", "Scan": "opset 9 or later; a fixed sequence length"}


def branch_nodes(branch: onnx.GraphProto, np_node: onnx.NodeProto, name: str, add_constant) -> list:
    """The nodes of the If's taken branch, computing the If's outputs;
    add_constant(name, value) receives the branch's initializers."""
    return _body_copy(branch, name, {}, list(np_node.output), add_constant)


def unrolled_scan(np_node: onnx.NodeProto, raw: dict, name: str, shapes: dict, opset: int,
                  add_constant) -> list:
    """The nodes computing a Scan (opset 9 and later) by copies of its
    body; shapes maps tensor names to their shapes, add_constant(name,
    value) adds the indices and axes the copies use."""
    if opset < 9:
        raise BuildError(f"node {name!r} (Scan): Scan of opset 8 (with a batch axis and sequence_lens) is "
                         "not supported; re-export the model with opset 9 or later")
    body = raw["body"]
    scans = int(raw["num_scan_inputs"])
    states = len(np_node.input) - scans
    scan_inputs = list(np_node.input[states:])
    in_axes = list(raw.get("scan_input_axes") or [0] * scans)
    in_reverse = list(raw.get("scan_input_directions") or [0] * scans)
    outputs = len(body.output) - states
    out_axes = list(raw.get("scan_output_axes") or [0] * outputs)
    out_reverse = list(raw.get("scan_output_directions") or [0] * outputs)
    for x in scan_inputs:
        if x not in shapes:
            raise BuildError(f"node {name!r} (Scan): the shape of scan input {x!r} is unknown")
    lengths = {shapes[x][a % len(shapes[x])] for x, a in zip(scan_inputs, in_axes)}
    if len(lengths) != 1:
        raise BuildError(f"node {name!r} (Scan): its scan inputs have sequences of different lengths {sorted(lengths)}")
    steps = lengths.pop()

    nodes, current, elements = [], list(np_node.input[:states]), [[] for _ in range(outputs)]
    for t in range(steps):
        prefix = f"{name}/{t}"
        feeds = dict(zip((vi.name for vi in body.input[:states]), current))
        for j, (x, axis, reverse) in enumerate(zip(scan_inputs, in_axes, in_reverse)):
            index = f"{prefix}/index_{j}"
            add_constant(index, np.asarray(steps - 1 - t if reverse else t, dtype=np.int64))
            element = f"{prefix}/element_{j}"
            nodes.append(helper.make_node("Gather", [x, index], [element], axis=int(axis),
                                          name=f"{prefix}/gather_{j}"))
            feeds[body.input[states + j].name] = element
        produced = [f"{prefix}/out_{i}" for i in range(len(body.output))]
        nodes += _body_copy(body, prefix, feeds, produced, add_constant)
        current = produced[:states]
        for k in range(outputs):
            elements[k].append(produced[states + k])

    for out, final in zip(np_node.output[:states], current):
        if out:
            nodes.append(helper.make_node("Identity", [final], [out], name=f"{name}/{out}"))
    for k, out in enumerate(np_node.output[states:states + outputs]):
        if not out:
            continue
        axis, stacked = int(out_axes[k]), []
        for t, element in enumerate(elements[k]):
            stacked.append(f"{element}/stacked")
            if opset >= 13:
                axes = f"{element}/axes"
                add_constant(axes, np.asarray([axis], dtype=np.int64))
                nodes.append(helper.make_node("Unsqueeze", [element, axes], [stacked[-1]], name=f"{element}/unsqueeze"))
            else:
                nodes.append(helper.make_node("Unsqueeze", [element], [stacked[-1]], axes=[axis],
                                              name=f"{element}/unsqueeze"))
        if out_reverse[k]:
            stacked.reverse()
        nodes.append(helper.make_node("Concat", stacked, [out], axis=axis, name=f"{name}/concat_{k}"))
    return nodes


def _body_copy(body: onnx.GraphProto, prefix: str, feeds: dict, results: list, add_constant) -> list:
    """body's nodes reading feeds (body input name -> tensor) and writing
    its outputs to the names in results."""
    made = {out for node in body.node for out in node.output if out}
    renamed = {n: f"{prefix}/{n}" for n in made}
    for init in body.initializer:
        renamed[init.name] = f"{prefix}/{init.name}"
        add_constant(renamed[init.name], numpy_helper.to_array(init))
    renamed.update(feeds)
    copies = []
    for vi, out in zip(body.output, results):
        if vi.name in made:
            renamed[vi.name] = out
        else:  # an input, initializer or outer name passed straight through
            copies.append((vi.name, out))
    nodes = []
    for number, node in enumerate(body.node):
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[:] = [renamed.get(n, n) if n else n for n in node.input]
        copy.output[:] = [renamed.get(n, n) if n else n for n in node.output]
        copy.name = f"{prefix}/{node.name or node.op_type + '_' + str(number)}"
        for attr in copy.attribute:
            for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                _rename_outer(graph, renamed)
        nodes.append(copy)
    for source, out in copies:
        nodes.append(helper.make_node("Identity", [renamed.get(source, source)], [out], name=f"{prefix}/{out}"))
    return nodes


def _rename_outer(graph: onnx.GraphProto, renamed: dict) -> None:
    """Rename, in place, what a nested graph reads from the enclosing one."""
    local = {vi.name for vi in graph.input} | {init.name for init in graph.initializer}
    local |= {out for node in graph.node for out in node.output}
    outer = {old: new for old, new in renamed.items() if old not in local}
    for node in graph.node:
        node.input[:] = [outer.get(n, n) for n in node.input]
        for attr in node.attribute:
            for inner in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                _rename_outer(inner, outer)
    for vi in graph.output:
        if vi.name in outer:
            vi.name = outer[vi.name]
