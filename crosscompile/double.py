"""float64, float16 and bfloat16 models, computed in float32.

The kernels compute in float32 (and the integer types); a model whose
tensors are float64, float16 or bfloat16 keeps those types for its inputs
and outputs at the module's boundary, and inside is the same model in
float32: its initializers and constants of those types are converted to
float32 (exactly, but for float64's rounding), each such input is cast to
float32 as it comes in and each such output back as it goes out. A Cast
to float64 becomes one to float32; a Cast (or CastLike) to float16 or
bfloat16 keeps its rounding to the narrow type, then widens the result to
float32 again. float64 results then carry float32's rounding (a relative
error near 1e-7 per op), which is what the module's users get in place of
float64's; the node suite's float64 cases pass within their tolerances
so. float16 and bfloat16 results are float32's rounded once more at the
boundary, as precise as the types hold or more. A float16 or bfloat16
Softmax (opset 13 on) is its definition's steps, Exp(x - max) over their
ReduceSum, each rounded to the type as ONNX types them (and as onnx's
reference computes them).

A float64 graph made only of ops that compute float64 themselves
(FLOAT64_OPS) keeps its float64 arithmetic: its inputs may hold values
beyond float32's range.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

DOUBLE, FLOAT = TensorProto.DOUBLE, TensorProto.FLOAT
# The float types computed in float32, and the narrow ones among them,
# whose Casts keep their rounding.
OTHER_FLOATS = {DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
NARROW_FLOATS = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
# Ops whose kernels compute float64 tensors in float64 (elementwise._Exact),
# and those that only move elements.
FLOAT64_OPS = {"Add", "Sub", "Mul", "Div", "Constant", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"}
# Ops that only move or pick elements: their results need no rounding.
MOVING_OPS = FLOAT64_OPS - {"Add", "Sub", "Mul", "Div"} | {
    "Transpose", "Concat", "Split", "Slice", "Gather", "Expand", "Where", "Pad", "Max", "Min", "ReduceMax",
    "ReduceMin", "Relu", "Abs", "Neg", "Tile", "MaxPool"}
# Attributes naming an output element type (Cast's `to`, EyeLike's and
# the random generators' `dtype`).
TYPE_ATTRIBUTES = ("to", "dtype")
# Attributes holding a tensor value (Constant's, ConstantOfShape's).
TENSOR_ATTRIBUTES = ("value",)
# The longest bfloat16 Softmax axis summed one element at a time (as
# _narrow_softmax tells); longer ones sum in float32.
SEQUENTIAL_SUM = 64


def other_floats(proto: onnx.ModelProto) -> set:
    """The float types other than float32 (TensorProto numbers) that proto's
    inputs, outputs, initializers, Casts and constants use."""
    return used_types(proto, TYPE_ATTRIBUTES) & OTHER_FLOATS


def used_types(proto: onnx.ModelProto, type_attributes) -> set:
    """The element types (TensorProto numbers) of proto's inputs, outputs,
    initializers and constants, and those its nodes' type_attributes name."""
    g = proto.graph
    used = {vi.type.tensor_type.elem_type for vi in (*g.input, *g.output)}
    used |= {init.data_type for init in g.initializer}
    for node in g.node:
        for attr in node.attribute:
            if attr.name in type_attributes and attr.type == onnx.AttributeProto.INT:
                used.add(attr.i)
            elif attr.name in TENSOR_ATTRIBUTES and attr.type == onnx.AttributeProto.TENSOR:
                used.add(attr.t.data_type)
    return used


def boundary_casts(g: onnx.GraphProto, held: dict, suffix: str, **exit_attributes) -> tuple:
    """For the inputs and outputs of g whose types are keys of held (a
    TensorProto number -> the one it is held in inside): (renamed: name ->
    the held tensor's name, outputs: name -> type, the Casts in, the Casts
    out, which carry exit_attributes)."""
    initialized = {init.name for init in g.initializer}
    renamed, entry = {}, []
    for vi in g.input:
        kind = vi.type.tensor_type.elem_type
        if vi.name not in initialized and kind in held:
            renamed[vi.name] = f"{vi.name}/{suffix}"
            entry.append(helper.make_node("Cast", [vi.name], [renamed[vi.name]], to=held[kind],
                                          name=f"{vi.name}/to_{suffix}"))
    outputs = {vi.name: vi.type.tensor_type.elem_type for vi in g.output if vi.type.tensor_type.elem_type in held}
    exits = []
    for name, kind in outputs.items():
        renamed.setdefault(name, f"{name}/{suffix}")
        exits.append(helper.make_node("Cast", [renamed[name]], [name], to=kind, **exit_attributes,
                                      name=f"{name}/to_{helper.tensor_dtype_to_np_dtype(kind).name}"))
    return renamed, outputs, entry, exits


def compute_in_float32(proto: onnx.ModelProto) -> onnx.ModelProto:
    """proto with its float64, float16 and bfloat16 arithmetic in float32
    and such inputs and outputs cast at the boundary; the same model when
    it has none.

    >>> m = compute_in_float32(onnx.load("cumsum_float64.onnx"))  # doctest: +SKIP
    """
    used = other_floats(proto)
    if not used or (used == {DOUBLE} and all(node.op_type in FLOAT64_OPS for node in proto.graph.node)):
        return proto
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    g = model.graph
    kinds, shapes = _element_types(proto) if used & NARROW_FLOATS else ({}, {})
    kinds.update((vi.name, vi.type.tensor_type.elem_type) for vi in (*g.input, *g.value_info, *g.output))
    kinds.update((init.name, init.data_type) for init in g.initializer)
    for init in g.initializer:
        if init.data_type in OTHER_FLOATS:
            init.CopyFrom(_in_float32(init, init.name))
    renamed, outputs, entry, exits = boundary_casts(g, dict.fromkeys(OTHER_FLOATS, FLOAT), "float32")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    nodes = []
    for node in g.node:
        node.input[:] = [renamed.get(n, n) for n in node.input]
        node.output[:] = [renamed.get(n, n) if n in outputs else n for n in node.output]
        narrow = cast_target(node, kinds, NARROW_FLOATS)
        # Every op's float16 or bfloat16 result is rounded to its type, as
        # ONNX's semantics (and onnxruntime's kernels) have it; the
        # boundary's Cast rounds the graph's outputs.
        rounded = [] if narrow is not None or node.op_type in MOVING_OPS else [
            (pos, kinds[name]) for pos, name in enumerate(node.output)
            if kinds.get(name) in NARROW_FLOATS and name not in outputs]
        for attr in node.attribute:
            if attr.name in TYPE_ATTRIBUTES and attr.type == onnx.AttributeProto.INT and attr.i in OTHER_FLOATS:
                if node.op_type == "Cast" and attr.i in NARROW_FLOATS or node.op_type == "BitCast":
                    continue  # BitCast refuses these types by name
                attr.i = FLOAT
            elif attr.name in TENSOR_ATTRIBUTES and attr.type == onnx.AttributeProto.TENSOR \
                    and attr.t.data_type in OTHER_FLOATS:
                attr.t.CopyFrom(_in_float32(attr.t, attr.t.name))
        if narrow is not None:
            nodes.extend(_round_trip(node.input[0], node.output[0], narrow))
            continue
        if node.op_type == "Softmax" and opset >= 13 and rounded:
            nodes.extend(_narrow_softmax(node, rounded[0][1], opset, shapes.get(node.input[0])))
            continue
        nodes.append(node)
        for pos, kind in rounded:
            name = node.output[pos]
            node.output[pos] = f"{name}/unrounded"
            nodes.extend(_round_trip(node.output[pos], name, kind))
    replace_nodes(g, entry + nodes + exits, OTHER_FLOATS)
    return model


def replace_nodes(g: onnx.GraphProto, nodes: list, held) -> None:
    """Give g these nodes, and drop the value infos of the types in held
    (their tensors are held in other types now)."""
    del g.node[:]
    g.node.extend(nodes)
    kept = [vi for vi in g.value_info if vi.type.tensor_type.elem_type not in held]
    del g.value_info[:]
    g.value_info.extend(kept)


def _narrow_softmax(node: onnx.NodeProto, narrow: int, opset: int, shape) -> list:
    """Nodes computing node, a Softmax of opset 13 or later whose result is
    of the narrow type, in float32 step by step: x - ReduceMax(x), Exp of
    it, the sum of that and the quotient, each rounded to narrow (the max
    only picks an element). A bfloat16 sum over an axis of known length up
    to SEQUENTIAL_SUM adds one element at a time, rounding each partial sum
    (bfloat16 has no wider accumulator of its own; onnx's reference sums so);
    a float16 one, or a longer one, sums in float32 and rounds once."""
    axis = next((attr.i for attr in node.attribute if attr.name == "axis"), -1)
    x, y = node.input[0], node.output[0]
    step = f"{y}/softmax"
    axes = f"{step}/axes"
    nodes = [helper.make_node("Constant", [], [axes], name=axes,
                              value=helper.make_tensor(axes, TensorProto.INT64, [1], [axis]))]

    def reduce(op_type, source, target):
        if opset >= (18 if op_type == "ReduceMax" else 13):
            return helper.make_node(op_type, [source, axes], [target], name=target, keepdims=1)
        return helper.make_node(op_type, [source], [target], name=target, axes=[axis], keepdims=1)

    def rounded(new_node):
        target = new_node.output[0]
        new_node.output[0] = f"{target}/unrounded"
        return [new_node, *_round_trip(new_node.output[0], target, narrow)]

    length = shape[axis] if shape and -len(shape) <= axis < len(shape) else None
    nodes.append(reduce("ReduceMax", x, f"{step}/max"))
    nodes += rounded(helper.make_node("Sub", [x, f"{step}/max"], [f"{step}/shifted"], name=f"{step}/shifted"))
    nodes += rounded(helper.make_node("Exp", [f"{step}/shifted"], [f"{step}/exp"], name=f"{step}/exp"))
    if narrow == TensorProto.BFLOAT16 and length and length <= SEQUENTIAL_SUM:
        partial = None
        for k in range(length):
            bounds = [f"{step}/at{k}", f"{step}/at{k + 1}"]
            for position in (k, k + 1):
                name = f"{step}/at{position}"
                if not any(n.output[0] == name for n in nodes):
                    nodes.append(helper.make_node("Constant", [], [name], name=name,
                                                  value=helper.make_tensor(name, TensorProto.INT64, [1], [position])))
            term = f"{step}/term{k}"
            nodes.append(helper.make_node("Slice", [f"{step}/exp", *bounds, axes], [term], name=term))
            if partial is None:
                partial = term
                continue
            total = f"{step}/sum" if k == length - 1 else f"{step}/partial{k}"
            nodes += rounded(helper.make_node("Add", [partial, term], [total], name=total))
            partial = total
        if length == 1:
            nodes.append(helper.make_node("Identity", [partial], [f"{step}/sum"], name=f"{step}/sum"))
    else:
        nodes += rounded(reduce("ReduceSum", f"{step}/exp", f"{step}/sum"))
    nodes += rounded(helper.make_node("Div", [f"{step}/exp", f"{step}/sum"], [y], name=f"{y}/divide"))
    return nodes


def _round_trip(source: str, target: str, narrow: int) -> list:
    """Nodes giving target = source (float32) rounded to the narrow type
    and widened back to float32."""
    between = f"{target}/{TensorProto.DataType.Name(narrow).lower()}"
    return [helper.make_node("Cast", [source], [between], to=narrow, name=f"{target}/round"),
            helper.make_node("Cast", [between], [target], to=FLOAT, name=f"{target}/widen")]


def _element_types(proto: onnx.ModelProto) -> tuple:
    """name -> TensorProto element type of proto's tensors, and name -> shape
    (a tuple with None for unknown dimensions), as far as onnx's type
    inference finds them (nothing where it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True).graph
    except Exception:  # noqa: BLE001 - a model onnx cannot infer is rounded at its Casts and boundary only
        return {}, {}
    infos = (*inferred.input, *inferred.value_info, *inferred.output)
    shapes = {vi.name: tuple(d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim)
              for vi in infos if vi.type.tensor_type.HasField("shape")}
    return {vi.name: vi.type.tensor_type.elem_type for vi in inferred.value_info}, shapes


def cast_target(node: onnx.NodeProto, kinds: dict, among) -> "int | None":
    """The type (TensorProto number) among `among` that node, a Cast or a
    CastLike, converts to; None for any other node or type."""
    if node.op_type == "Cast":
        to = next((attr.i for attr in node.attribute if attr.name == "to"), None)
    elif node.op_type == "CastLike" and len(node.input) == 2:
        to = kinds.get(node.input[1])
    else:
        return None
    return to if to in among else None


def _in_float32(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype("float32"), name)
