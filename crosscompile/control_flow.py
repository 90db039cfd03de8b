"""If, Loop and Scan, written out as the plain nodes they run.

An If whose condition is a constant is the branch it takes; one whose
condition is computed at run time computes both branches and picks each
output with a Where, when the branches' outputs have the same shapes and
dtypes (or, when one is empty and the other counted along that axis, the
counted one with the count picked: crosscompile/bounded.py). A Loop whose trip count and conditions are known at compile time
is one copy of its body per iteration: each copy is written out only once
the frontend has computed the condition the copy before it left (a
constant, or the Loop is refused), so a loop that ends early ends there
too. A Scan runs
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
UNROLLED = {"If": "both branches computed and their outputs picked when the condition is computed at run time "
                  "(outputs of the same shapes, or an empty one and one whose size depends on the data)",
            "Loop": "a trip count and conditions known at compile time",
            "Scan": "opset 9 or later; a fixed sequence length"}
# Inputs of these ops that set their outputs' shapes (a Loop's trip count
# and condition, through its scan outputs' length).
COMPILE_TIME_INPUTS = {"Loop": (0, 1)}
# The most iterations a Loop without a trip count is written out for.
MAX_ITERATIONS = 1024
# Attributes of the node that carries a Loop on between its iterations
# and of the one that picks an If's outputs; no ONNX op has them.
ITERATION, SCAN_PARTS, SELECTING = "unrolled_iteration", "unrolled_scan_parts", "selecting_branch_outputs"
# The node an If's pick of a counted output becomes: input 0 counted by
# the count in input 1 (along attribute axis); no ONNX op has this name.
RECOUNT = "CountedBy"


def branch_nodes(branch: onnx.GraphProto, np_node: onnx.NodeProto, name: str, add_constant) -> list:
    """The nodes of the If's taken branch, computing the If's outputs;
    add_constant(name, value) receives the branch's initializers."""
    return _body_copy(branch, name, {}, list(np_node.output), add_constant)


def both_branches(np_node: onnx.NodeProto, raw: dict, name: str, add_constant) -> list:
    """The nodes of both branches of an If whose condition is computed at
    run time, and a node that picks between their outputs once their
    shapes are known (select_outputs)."""
    then_outs = [f"{name}/then/{out or i}" for i, out in enumerate(np_node.output)]
    else_outs = [f"{name}/else/{out or i}" for i, out in enumerate(np_node.output)]
    nodes = _body_copy(raw["then_branch"], f"{name}/then", {}, then_outs, add_constant)
    nodes += _body_copy(raw["else_branch"], f"{name}/else", {}, else_outs, add_constant)
    select = helper.make_node("If", [np_node.input[0], *then_outs, *else_outs], list(np_node.output), name=name)
    select.attribute.append(helper.make_attribute(SELECTING, 1))
    return nodes + [select]


def select_outputs(np_node: onnx.NodeProto, name: str, tensors: dict, counts: dict) -> list:
    """Where nodes picking each output of an If from its branches' (the
    node both_branches made), refused unless the branches agree on shapes
    and dtypes, or one branch gives an empty tensor and the other one
    counted along that axis (crosscompile/bounded.py): the counted one,
    with a count of 0 when the empty branch is taken."""
    cond, count = np_node.input[0], len(np_node.output)
    nodes = []
    for k, out in enumerate(np_node.output):
        then_out, else_out = np_node.input[1 + k], np_node.input[1 + count + k]
        shown = [(tensors[t].shape, tensors[t].dtype) for t in (then_out, else_out)]
        emptied = _empty_or_counted(then_out, else_out, tensors, counts)
        if emptied is not None and out:
            empty_first, counted = emptied
            size, axis = counts[counted]
            zero = f"{name}/no_count_{k}"
            picked = [zero, size] if empty_first else [size, zero]
            nodes += [helper.make_node("Constant", [], [zero], value=numpy_helper.from_array(np.zeros(1, np.int64))),
                      helper.make_node("Where", [cond, *picked], [f"{name}/count_{k}"], name=f"{name}/count_{k}"),
                      helper.make_node(RECOUNT, [counted, f"{name}/count_{k}"], [out], name=f"{name}/pick_{k}",
                                       axis=axis)]
            continue
        if shown[0] != shown[1]:
            raise BuildError(f"node {name!r} (If): its condition {cond!r} is computed at run time and its "
                             f"branches give output {k} different shapes or dtypes ({shown[0]} and {shown[1]}); "
                             "a module's shapes are fixed when it is compiled")
        if out:
            nodes.append(helper.make_node("Where", [cond, then_out, else_out], [out], name=f"{name}/pick_{k}"))
    return nodes


def _empty_or_counted(then_out: str, else_out: str, tensors: dict, counts: dict):
    """(whether the then branch is the empty one, the counted output) when
    one branch's output is empty along the axis the other's is counted
    along and they agree otherwise; else None."""
    for empty_first, (empty, counted) in ((True, (then_out, else_out)), (False, (else_out, then_out))):
        if counted not in counts or empty in counts:
            continue
        axis = counts[counted][1]
        a, b = tensors[empty], tensors[counted]
        if a.dtype == b.dtype and a.shape == b.shape[:axis] + (0,) + b.shape[axis + 1:]:
            return empty_first, counted
    return None


def loop_iteration(np_node: onnx.NodeProto, raw: dict, name: str, constants: dict, opset: int,
                   add_constant) -> list:
    """The next iteration of a Loop: a copy of its body and a Loop node
    that carries on after it, or, once the trip count is reached or the
    condition is false, the nodes giving the Loop's outputs. The trip
    count and the condition must be constants by then."""
    body, done = raw["body"], int(raw.get(ITERATION, 0))
    where = f"node {name!r} (Loop)"
    trip, cond = (np_node.input[i] if len(np_node.input) > i else "" for i in (0, 1))
    for what, tensor in (("trip count", trip), ("condition", cond)):
        if tensor and tensor not in constants:
            raise BuildError(f"{where}: its {what} {tensor!r} is computed at run time; only a Loop whose trip count "
                             "and conditions are known at compile time is supported (it is written out one body "
                             "copy per iteration)")
    states = list(np_node.input[2:])
    scans = len(body.output) - 1 - len(states)
    parts = [[] for _ in range(scans)]
    for entry in raw.get(SCAN_PARTS, []):
        k, tensor = (entry.decode() if isinstance(entry, bytes) else entry).split(":", 1)
        parts[int(k)].append(tensor)
    limit = int(np.asarray(constants[trip]).reshape(-1)[0]) if trip else None
    going = not cond or bool(np.asarray(constants[cond]).reshape(-1)[0])
    if going and (limit is None or done < limit):
        if limit is None and done >= MAX_ITERATIONS:
            raise BuildError(f"{where}: it has no trip count and its condition is still true after "
                             f"{MAX_ITERATIONS} iterations")
        prefix = f"{name}/{done}"
        add_constant(f"{prefix}/iteration", np.asarray(done, dtype=np.int64))
        feeds = {body.input[0].name: f"{prefix}/iteration"}
        if cond:
            feeds[body.input[1].name] = cond
        else:
            add_constant(f"{prefix}/condition", np.asarray(True))
            feeds[body.input[1].name] = f"{prefix}/condition"
        feeds.update((vi.name, state) for vi, state in zip(body.input[2:], states))
        produced = [f"{prefix}/out_{i}" for i in range(len(body.output))]
        nodes = _body_copy(body, prefix, feeds, produced, add_constant)
        carry_on = helper.make_node("Loop", [trip, produced[0], *produced[1:1 + len(states)]], list(np_node.output),
                                    name=name, body=body)
        carry_on.attribute.extend([
            helper.make_attribute(ITERATION, done + 1),
            helper.make_attribute(SCAN_PARTS, [f"{k}:{t}" for k in range(scans) for t in parts[k]]
                                  + [f"{k}:{produced[1 + len(states) + k]}" for k in range(scans)])])
        return nodes + [carry_on]
    nodes = [helper.make_node("Identity", [state], [out], name=f"{name}/{out}")
             for out, state in zip(np_node.output[:len(states)], states) if out]
    for k, out in enumerate(np_node.output[len(states):len(states) + scans]):
        if not out:
            continue
        if not parts[k]:
            raise BuildError(f"{where}: it runs no iteration, so its scan output {out!r} would be empty, of a "
                             "shape its body never gives")
        nodes += _stacked(parts[k], out, 0, f"{name}/concat_{k}", opset, add_constant)
    return nodes


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
        if out:
            ordered = elements[k][::-1] if out_reverse[k] else elements[k]
            nodes += _stacked(ordered, out, int(out_axes[k]), f"{name}/concat_{k}", opset, add_constant)
    return nodes


def _stacked(elements: list, out: str, axis: int, name: str, opset: int, add_constant) -> list:
    """Nodes stacking the tensors elements along a new axis into out."""
    nodes, stacked = [], []
    for element in elements:
        stacked.append(f"{element}/stacked")
        if opset >= 13:
            axes = f"{element}/axes"
            add_constant(axes, np.asarray([axis], dtype=np.int64))
            nodes.append(helper.make_node("Unsqueeze", [element, axes], [stacked[-1]], name=f"{element}/unsqueeze"))
        else:
            nodes.append(helper.make_node("Unsqueeze", [element], [stacked[-1]], axes=[axis],
                                          name=f"{element}/unsqueeze"))
    nodes.append(helper.make_node("Concat", stacked, [out], axis=axis, name=name))
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
