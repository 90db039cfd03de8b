"""ONNX → graph IR: load the model, resolve input shapes, parse attributes,
fold compile-time inputs into attributes and infer every tensor's shape."""
from __future__ import annotations

import functools
import os

import numpy as np
import onnx
import onnx.defs
from onnx import helper, numpy_helper

from . import bounded, control_flow, extents, folding
from .decompositions import DECOMPOSED, decompose, decomposed_name
from .double import compute_in_float32
from .errors import BuildError, ShapeError, UnsupportedOpError
from .functions import COMPILE_TIME_INPUTS, expand_functions, function_ops
from .ir import Graph, Node, Tensor
from .lowbit import LOW_BIT_DTYPES, hold_low_bit_types
from .ops import OPS
from .quantize_ops import EXPANSIONS, expand_operators

# Model inputs and outputs: float32 data, integer ids and indices, masks.
SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "bool", "int16", "int8", "uint64",
                    "uint32", "uint16", "uint8", *LOW_BIT_DTYPES)
# Ops the frontend evaluates itself instead of lowering (any other standard
# op also folds when all its inputs are constants).
FRONTEND_OPS = {"Constant", "ConstantOfShape", "Shape", "Size", "Range", "MelWeightMatrix"}


def supported_ops() -> list[str]:
    """ONNX op types a model may use: lowered ops (not the graph's own
    fused ones), compile-time ones, the quantized ops rewritten before
    import, the control flow written out at import and the ops replaced
    by their ONNX function bodies.

    >>> "Conv" in supported_ops()
    True
    """
    lowered = ({op for op in OPS if onnx.defs.has(op)} | FRONTEND_OPS | set(EXPANSIONS) | set(control_flow.UNROLLED)
               | set(DECOMPOSED))
    return sorted(lowered | function_ops(lowered))


def compile_time_inputs(node: onnx.NodeProto) -> list:
    """The inputs of node whose values a compiled module is specialised
    on: those its op needs at compile time (shapes, axes, pads, a Loop's
    trip count) and every input of the ops evaluated at compile time.

    >>> compile_time_inputs(helper.make_node("Reshape", ["x", "shape"], ["y"]))
    ['shape']
    """
    if node.op_type in FRONTEND_OPS:
        return [name for name in node.input if name]
    positions = set(control_flow.COMPILE_TIME_INPUTS.get(node.op_type, ()))
    positions |= set(COMPILE_TIME_INPUTS.get(node.op_type, ()))
    if decomposed_name(node) in DECOMPOSED:
        positions |= set(DECOMPOSED[decomposed_name(node)].compile_time_inputs)
    if node.op_type in OPS:
        positions |= set(OPS[node.op_type].compile_time_inputs)
    return [name for pos, name in enumerate(node.input) if pos in positions and name]


def load_model(model: "str | os.PathLike | onnx.ModelProto") -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise BuildError(f"ONNX model file {path!r} does not exist")
    try:
        return onnx.load(path)
    except Exception as exc:  # onnx raises DecodeError, ValueError, ... on garbage
        raise BuildError(f"{path!r} is not a valid ONNX model ({type(exc).__name__}: {exc})") from None


def import_onnx(model: "str | os.PathLike | onnx.ModelProto",
                input_shapes: "dict[str, tuple] | None" = None) -> Graph:
    """Build a Graph from an ONNX model (path or ModelProto).

    >>> g = import_onnx("model.onnx", input_shapes={"input": (1, 784)})  # doctest: +SKIP
    """
    # Function ops are expanded at their inputs' own types, so that a
    # float16 or bfloat16 op's body rounds its steps to that type.
    proto = expand_functions(expand_operators(load_model(model)),
                             set(OPS) | FRONTEND_OPS | set(EXPANSIONS) | set(control_flow.UNROLLED) | set(DECOMPOSED))
    proto = compute_in_float32(hold_low_bit_types(proto))
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    g = proto.graph
    input_shapes = dict(input_shapes or {})

    constants = {init.name: numpy_helper.to_array(init) for init in g.initializer}
    tensors = {name: Tensor(name, tuple(int(d) for d in value.shape), value.dtype.name)
               for name, value in constants.items()}

    inputs = []
    for vi in g.input:
        if vi.name in constants:
            continue  # an initializer listed as an input (older exporters)
        tensors[vi.name] = Tensor(vi.name, _input_shape(vi, input_shapes.pop(vi.name, None)),
                                  _dtype_name(vi.type.tensor_type.elem_type))
        _check_dtype(tensors[vi.name], f"input {vi.name!r}")
        inputs.append(vi.name)
    if input_shapes:
        raise BuildError(f"input_shapes names {sorted(input_shapes)} which are not model inputs; "
                         f"model inputs: {inputs}")

    nodes = []
    counts = {}  # counted tensor -> (its count tensor, axis): crosscompile/bounded.py
    shape_vectors = {}  # the Shape of a counted tensor -> (its count tensor, position, bound shape)
    selections = {}  # a counting node's op, inputs and attributes -> its outputs (one count for equal ones)
    count_sources = {}  # what a count is made of -> the count tensor holding it
    upper = {}  # runtime integer tensor -> upper bounds of its values (bounded.MONOTONE)
    dropped = {}  # optional outputs we do not compute -> node description
    # Every unsupported op and every node refusing its attributes or shapes
    # is named in one error: their nodes, and the nodes fed by their outputs
    # (which cannot be inferred), are skipped until the end.
    unsupported, refused, unknown = {}, [], set()
    pending = list(reversed(g.node))  # popped from the end; an If's branch is pushed back
    index = -1
    while pending:
        np_node = pending.pop()
        index += 1
        name = np_node.name or f"{np_node.op_type}_{index}"
        if np_node.domain not in ("", "ai.onnx") and decomposed_name(np_node) not in DECOMPOSED:
            unsupported.setdefault(f"{np_node.domain}.{np_node.op_type}", []).append(name)
            unknown.update(np_node.output)
            continue
        if unknown.intersection(np_node.input):
            if np_node.op_type not in OPS and np_node.op_type not in FRONTEND_OPS | set(control_flow.UNROLLED) \
                    and decomposed_name(np_node) not in DECOMPOSED:
                unsupported.setdefault(np_node.op_type, []).append(name)
            unknown.update(np_node.output)
            continue
        raw = {a.name: _attribute_value(a) for a in np_node.attribute}
        where = f"node {name!r} ({np_node.op_type})"
        add_constant = functools.partial(_add_constant, constants, tensors)
        if np_node.op_type == "If" and np_node.input[0] in constants:
            # A condition known now: the branch taken is part of the graph.
            branch = raw["then_branch" if np.asarray(constants[np_node.input[0]]).reshape(-1)[0] else "else_branch"]
            pending.extend(reversed(control_flow.branch_nodes(branch, np_node, name, add_constant)))
            continue
        if np_node.op_type in ("If", "Loop"):
            try:
                if np_node.op_type == "Loop":
                    written = control_flow.loop_iteration(np_node, raw, name, constants, opset, add_constant)
                elif raw.get(control_flow.SELECTING):
                    written = control_flow.select_outputs(np_node, name, tensors, counts)
                else:
                    written = control_flow.both_branches(np_node, raw, name, add_constant)
                pending.extend(reversed(written))
            except BuildError as exc:
                refused.append(exc)
                unknown.update(np_node.output)
            continue
        if np_node.op_type == "Scan":
            shapes = {x: tensors[x].shape for x in np_node.input if x in tensors}
            try:
                pending.extend(reversed(control_flow.unrolled_scan(np_node, raw, name, shapes, opset, add_constant)))
            except BuildError as exc:
                refused.append(exc)
                unknown.update(np_node.output)
            continue
        if np_node.op_type == "Constant":
            _add_constant(constants, tensors, np_node.output[0], _constant_value(name, raw))
            continue
        if np_node.op_type == control_flow.RECOUNT:
            data, count, out = np_node.input[0], np_node.input[1], np_node.output[0]
            tensors[out] = Tensor(out, tensors[data].shape, tensors[data].dtype)
            counts[out] = (count, raw["axis"])
            nodes.append(Node("Identity", name, [data], [out], {}))
            continue
        if np_node.op_type in folding.SHAPE_OPS and np_node.input[0] in counts:
            try:
                nodes.append(_count_shape(np_node, name, raw, tensors, counts, shape_vectors))
                upper[np_node.output[0]] = np.asarray(nodes[-1].attrs["shape"][nodes[-1].attrs["start"]:
                                                                             nodes[-1].attrs["end"]], np.int64)
            except BuildError as exc:
                refused.append(BuildError(f"{where}: {exc}"))
                unknown.update(np_node.output)
            continue
        if np_node.op_type == "ConstantOfShape" and np_node.input and np_node.input[0] in shape_vectors:
            nodes.append(_count_fill(np_node, name, raw, tensors, counts, shape_vectors[np_node.input[0]]))
            continue
        if np_node.op_type in folding.SHAPE_OPS and np_node.input[0] in tensors:
            _add_constant(constants, tensors, np_node.output[0],
                          folding.shape_value(np_node.op_type, tensors[np_node.input[0]].shape, raw))
            continue
        if np_node.op_type == "CastLike" and np_node.input[0] in constants and np_node.input[1] in tensors:
            # A constant cast to a runtime tensor's type: its dtype is known now.
            cast = helper.make_node("Cast", [np_node.input[0]], list(np_node.output[:1]),
                                    to=helper.np_dtype_to_tensor_dtype(np.dtype(tensors[np_node.input[1]].dtype)))
            cast.attribute.extend(a for a in np_node.attribute if a.name == "saturate")
            _add_constant(constants, tensors, np_node.output[0], folding.evaluate(cast, constants, opset, where)[0])
            continue
        if folding.can_fold(np_node, constants) or (np_node.op_type in FRONTEND_OPS and not np_node.input):
            for out, value in zip(np_node.output, folding.evaluate(np_node, constants, opset, where)):
                if out:
                    _add_constant(constants, tensors, out, value)
            continue
        if decomposed_name(np_node) in DECOMPOSED and DECOMPOSED[decomposed_name(np_node)].applies(raw):
            try:
                pending.extend(reversed(decompose(np_node, raw, name, opset, tensors, constants, add_constant)))
            except BuildError as exc:
                refused.append(exc)
                unknown.update(np_node.output)
            continue
        op = OPS.get(np_node.op_type)
        if op is None:
            if np_node.op_type in FRONTEND_OPS:
                raise BuildError(f"{where}: its inputs must be constants (it is evaluated at compile "
                                 "time); a runtime input here is not supported")
            unsupported.setdefault(np_node.op_type, []).append(name)
            unknown.update(np_node.output)
            continue

        compile_time, runtime, positions = {}, [], []
        for pos, tensor_name in enumerate(np_node.input):
            known = tensor_name in constants and op.folds_constant(pos, np.asarray(constants[tensor_name]))
            if pos in op.compile_time_inputs or known:
                if tensor_name and tensor_name not in constants:
                    raise BuildError(f"{where}: input {tensor_name!r} must be a constant "
                                     "(an initializer or Constant node)")
                compile_time[pos] = constants.get(tensor_name) if tensor_name else None
            elif tensor_name:
                runtime.append(tensor_name)
                positions.append(pos)
        for tensor_name in runtime:
            if tensor_name in dropped:
                raise BuildError(f"{where} uses {dropped[tensor_name]}, which is not supported")
            if tensor_name not in tensors:
                raise BuildError(f"{where}: input {tensor_name!r} is not produced by any node")
        try:
            attrs = op.attributes(raw, compile_time, opset)
            known = {pos: int(upper[np_node.input[pos]].max()) for pos in op.bounded_inputs
                     if pos < len(np_node.input) and np_node.input[pos] in upper}
            if known:
                attrs["value_bounds"] = known
            if op.counts_outputs:
                attrs["outputs"] = len(np_node.output)
            if op.positional_inputs:
                attrs["input_positions"] = tuple(positions)
            shapes = op.infer([tensors[t].shape for t in runtime], attrs)
            dtypes = op.output_dtype([tensors[t] for t in runtime], attrs)
            counted, plan = _counted_outputs(op, attrs, runtime, tensors, counts, shapes)
        except BuildError as exc:
            refused.append(type(exc)(f"{where}: {exc}"))
            unknown.update(np_node.output)
            continue

        # An output left unnamed (LSTM's Y when only Y_h is wanted) is still
        # computed, into a tensor of its own.
        outputs = [out or f"{name}/unused_output_{pos}" for pos, out in enumerate(np_node.output[:len(shapes)])]
        known_outputs = op.constant_outputs([tensors[t].shape for t in runtime], attrs)
        for pos, extra in enumerate(np_node.output[len(shapes):], start=len(shapes)):
            if extra and pos in known_outputs:
                _add_constant(constants, tensors, extra, known_outputs[pos])
            elif extra:
                dropped[extra] = f"output {pos} ({extra!r}) of {where}"
        if isinstance(dtypes, str):
            dtypes = [dtypes] * len(shapes)
        new_counts = dict(op.counted(attrs))
        if plan is not None:
            runtime = _apply_plan(plan, name, attrs, runtime, tensors, counts, nodes)
            new_counts.update(plan.new)
        key = repr((np_node.op_type, runtime, attrs)) if new_counts else None
        if key in selections:
            # The same selection of the same data (torch exports x[mask]
            # once per tensor it picks from): one count for both.
            for out, earlier in zip(outputs, selections[key]):
                nodes.append(Node("Identity", f"{name}/same_as/{earlier}", [earlier], [out], {}))
                tensors[out] = Tensor(out, tensors[earlier].shape, tensors[earlier].dtype)
                if earlier in counts:
                    counts[out] = counts[earlier]
            continue
        for out, shape, dtype in zip(outputs, shapes, dtypes):
            tensors[out] = Tensor(out, tuple(shape), dtype)
        if new_counts:
            # The kernel writes the actual size into one more output. Two
            # nodes that make it of the same counts (boxes, scores and
            # labels concatenated class by class) have one count.
            made_of = name
            if np_node.op_type in bounded.SIZES_ONLY:
                made_of = repr((np_node.op_type, attrs, [counts[t][0] if t in counts else t for t in runtime]))
            count = f"{name}/count"
            tensors[count] = Tensor(count, (1,), "int64")
            for pos, axis in new_counts.items():
                counts[outputs[pos]] = (count_sources.setdefault(made_of, count), axis % len(shapes[pos]))
            selections[key] = outputs
            outputs = outputs + [count]
        else:
            for pos, (count, axis) in counted.items():
                counts[outputs[pos]] = (count, axis)
        if np_node.op_type in bounded.MONOTONE and upper.keys() & set(np_node.input):
            _bound_values(np_node, constants, upper, opset, where)
        nodes.append(Node(np_node.op_type, name, runtime, outputs, attrs))

    if unsupported:
        raise UnsupportedOpError(unsupported, [str(exc) for exc in refused])
    if refused:
        also = "".join(f"; {exc}" for exc in refused[1:])
        raise type(refused[0])(f"{refused[0]}{also}")
    outputs = []
    for vi in g.output:
        kind = vi.type.WhichOneof("value")
        if kind not in (None, "tensor_type"):
            raise BuildError(f"graph output {vi.name!r} is a {kind.replace('_type', '')}, not a tensor; a module's "
                             "outputs are tensors")
        if vi.name in dropped:
            raise BuildError(f"graph output {vi.name!r} is {dropped[vi.name]}, which is not supported")
        if vi.name not in tensors:
            raise BuildError(f"graph output {vi.name!r} is not produced by any node")
        if (vi.name in constants and constants[vi.name].dtype.name in SUPPORTED_DTYPES
                and vi.name not in outputs):
            # A constant output (e.g. a folded subgraph): copied out by an Identity.
            value_name = f"{vi.name}/value"
            constants[value_name] = constants.pop(vi.name)
            dtype = constants[value_name].dtype.name
            tensors[value_name] = Tensor(value_name, tensors[vi.name].shape, dtype)
            for node in nodes:
                node.inputs = [value_name if t == vi.name else t for t in node.inputs]
            nodes.append(Node("Identity", f"{vi.name}/copy", [value_name], [vi.name], {}))
            tensors[vi.name] = Tensor(vi.name, tensors[value_name].shape, dtype)
        elif vi.name in inputs or vi.name in constants or vi.name in outputs:
            raise BuildError(f"graph output {vi.name!r} is a model input, a constant or a repeated "
                             "output; route it through an Identity node")
        declared = _declared_shape(vi)
        if declared is not None and vi.name in counts:
            # The declared size of the counted axis is an example run's at best.
            declared = tuple(None if axis == counts[vi.name][1] else d for axis, d in enumerate(declared))
        if declared is not None and _conflicts(declared, tensors[vi.name].shape):
            raise ShapeError(f"graph output {vi.name!r} is declared with shape {declared} "
                             f"but computes to {tensors[vi.name].shape}")
        outputs.append(vi.name)

    return Graph(g.name or "model", inputs, outputs, nodes, tensors, constants,
                 {name: counts[name] for name in tensors if name in counts})


def _counted_outputs(op, attrs: dict, runtime: list, tensors: dict, counts: dict, shapes: list):
    """({output position: (count tensor, axis)}, plan) for a node reading
    counted tensors (crosscompile/bounded.py): the outputs that keep an
    input's count, and how the node works along a counted axis (an
    AlongCount, or None); BuildError when it may not."""
    counted = {pos: counts[t] for pos, t in enumerate(runtime) if t in counts}
    if not counted and not op.counted(attrs):
        return {}, None
    axes = {pos: axis for pos, (_, axis) in counted.items()}
    plan = bounded.along_count(op.op_type, attrs, [tensors[t].shape for t in runtime], axes,
                               extents.identity_of_dtype(tensors[runtime[0]].dtype)) if counted else None
    if plan is not None:
        return {pos: (counted[source][0], axis) for pos, (source, axis) in plan.passed.items()}, plan
    if not counted:
        return {}, None
    sources = {count for count, _ in counted.values()}
    if len(sources) > 1:
        raise BuildError(f"it reads tensors whose sizes depend on the data through different counts "
                         f"({', '.join(sorted(sources))}), which a module cannot line up")
    axes = bounded.counted_axes(op.op_type, attrs, runtime, [tensors[t].shape for t in runtime], shapes, axes,
                                lambda probe: op.infer(probe, attrs))
    (count,) = sources
    return {pos: (count, axis) for pos, axis in axes.items()}, None


def _apply_plan(plan, name: str, attrs: dict, runtime: list, tensors: dict, counts: dict, nodes: list) -> list:
    """The node's runtime inputs once it works along counted axes
    (crosscompile/extents.py): a reduction reads a copy whose entries past
    the count hold its identity; a kernel that reads counts gets them
    after its own inputs."""
    runtime = list(runtime)
    if plan.fill is not None:
        count, axis = counts[runtime[0]]
        filled = f"{name}/past_count"
        tensors[filled] = Tensor(filled, tensors[runtime[0]].shape, tensors[runtime[0]].dtype)
        nodes.append(Node("FillPastCount", filled, [runtime[0], count], [filled],
                          {"axis": axis, "value": plan.fill}))
        runtime[0] = filled
    if plan.extents:
        attrs["extents"] = plan.extents
        runtime += [counts[runtime[pos]][0] for pos, _ in plan.extents]
    return runtime


def _bound_values(np_node, constants: dict, upper: dict, opset: int, where: str) -> None:
    """upper bounds of a MONOTONE node's outputs, when every input it has
    is a constant or has them (crosscompile/bounded.py)."""
    if not all(t in constants or t in upper for t in np_node.input if t):
        return
    if np_node.op_type not in bounded.MONOTONE_IN_ALL and any(t in upper for t in np_node.input[1:]):
        return  # indices, shapes or axes computed at run time
    values = {t: upper[t] if t in upper else constants[t] for t in np_node.input if t}
    try:
        found = folding.evaluate(np_node, values, opset, where)
    except BuildError:
        return  # no bound: the op's own shapes decide
    for out, value in zip(np_node.output, found):
        if out and value.dtype.kind in "iu":
            upper[out] = value


def _count_shape(np_node, name: str, raw: dict, tensors: dict, counts: dict, shape_vectors: dict) -> Node:
    """The Shape of a counted tensor, computed at run time from its count."""
    if np_node.op_type != "Shape":
        raise BuildError(f"input {np_node.input[0]!r} has a size that depends on the data, so its "
                         f"{np_node.op_type} is only known when the model runs; only its Shape is computed then")
    source = np_node.input[0]
    count, axis = counts[source]
    shape = tensors[source].shape
    rank = len(shape)
    start, end = (int(raw.get("start", 0)), int(raw.get("end", rank)))
    start, end = (min(max(v + rank if v < 0 else v, 0), rank) for v in (start, end))
    out = np_node.output[0]
    tensors[out] = Tensor(out, (max(end - start, 0),), "int64")
    if start <= axis < end:
        shape_vectors[out] = (count, axis - start, tuple(shape[start:end]))
    return Node("CountShape", name, [count], [out], {"shape": tuple(shape), "axis": axis, "start": start, "end": end})


def _count_fill(np_node, name: str, raw: dict, tensors: dict, counts: dict, vector: tuple) -> Node:
    """ConstantOfShape of the Shape of a counted tensor: counted as it is."""
    count, axis, shape = vector
    value = numpy_helper.to_array(raw["value"]).reshape(-1) if "value" in raw else np.zeros(1, np.float32)
    out = np_node.output[0]
    tensors[out] = Tensor(out, shape, value.dtype.name)
    counts[out] = (count, axis)
    return Node("CountFill", name, [count], [out], {"shape": shape, "value": value[0].item(), "dtype": value.dtype.name})


def _add_constant(constants: dict, tensors: dict, name: str, value: np.ndarray) -> None:
    constants[name] = value
    tensors[name] = Tensor(name, tuple(int(d) for d in value.shape), value.dtype.name)


def _input_shape(vi: onnx.ValueInfoProto, override) -> tuple[int, ...]:
    if override is not None:
        shape = tuple(int(d) for d in override)
        declared = _declared_shape(vi)
        if declared is not None and (len(declared) != len(shape) or _conflicts(declared, shape)):
            raise ShapeError(f"input_shapes[{vi.name!r}] = {shape} does not match the model's "
                             f"declared shape {declared}")
        return shape
    declared = _declared_shape(vi)
    if declared is None or any(not isinstance(d, int) for d in declared):
        shown = "unknown rank" if declared is None else declared
        raise ShapeError(f"input {vi.name!r} has unknown dimensions {shown}; pass its concrete "
                         f"shape, e.g. build(model, input_shapes={{{vi.name!r}: (1, ...)}})")
    return declared


def _declared_shape(vi: onnx.ValueInfoProto):
    """Declared shape with ints for known dims and str/None for symbolic ones."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                 for d in tt.shape.dim)


def _conflicts(declared, actual) -> bool:
    return len(declared) != len(actual) or any(
        isinstance(d, int) and d != a for d, a in zip(declared, actual))


def _dtype_name(elem_type: int) -> str:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:
        return onnx.TensorProto.DataType.Name(elem_type).lower()


def _check_dtype(tensor: Tensor, what: str) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise BuildError(f"{what} has dtype {tensor.dtype}; supported: {', '.join(SUPPORTED_DTYPES)}")


def _attribute_value(attr: onnx.AttributeProto):
    value = helper.get_attribute_value(attr)
    return value.decode() if isinstance(value, bytes) else value


def _constant_value(name: str, raw: dict) -> np.ndarray:
    if "value" in raw:
        return numpy_helper.to_array(raw["value"])
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in raw:
            return np.asarray(raw[key], dtype=dtype)
    raise BuildError(f"Constant node {name!r}: only value, value_float(s) and value_int(s) are supported")
