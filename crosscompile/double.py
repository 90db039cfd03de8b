"""float64 models, computed in float32.

The kernels compute in float32 (and the integer types); a model whose
tensors are float64 keeps float64 inputs and outputs at the module's
boundary, and inside is the same model in float32: its float64
initializers and constants are rounded to float32, a Cast to float64
becomes one to float32, each float64 input is cast to float32 as it comes
in and each float64 output back as it goes out. Results then carry
float32's rounding (a relative error near 1e-7 per op), which is what the
module's users get in place of float64's; the node suite's float64 cases
pass within their tolerances so.

A graph made only of ops that compute float64 themselves (FLOAT64_OPS)
keeps its float64 arithmetic: its inputs may hold values beyond float32's
range.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

DOUBLE, FLOAT = TensorProto.DOUBLE, TensorProto.FLOAT
# Ops whose kernels compute float64 tensors in float64 (elementwise._Exact),
# and those that only move elements.
FLOAT64_OPS = {"Add", "Sub", "Mul", "Div", "Constant", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"}
# Attributes naming an output element type (Cast's `to`, EyeLike's and
# the random generators' `dtype`).
TYPE_ATTRIBUTES = ("to", "dtype")
# Attributes holding a tensor value (Constant's, ConstantOfShape's).
TENSOR_ATTRIBUTES = ("value",)


def uses_float64(proto: onnx.ModelProto) -> bool:
    g = proto.graph
    if any(vi.type.tensor_type.elem_type == DOUBLE for vi in (*g.input, *g.output)):
        return True
    if any(init.data_type == DOUBLE for init in g.initializer):
        return True
    return any(_node_makes_float64(node) for node in g.node)


def compute_in_float32(proto: onnx.ModelProto) -> onnx.ModelProto:
    """proto with its float64 arithmetic in float32 and float64 inputs and
    outputs cast at the boundary; the same model when it has no float64.

    >>> m = compute_in_float32(onnx.load("cumsum_float64.onnx"))  # doctest: +SKIP
    """
    if not uses_float64(proto) or all(node.op_type in FLOAT64_OPS for node in proto.graph.node):
        return proto
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    g = model.graph
    for init in g.initializer:
        if init.data_type == DOUBLE:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype("float32"), init.name))
    initialized = {init.name for init in g.initializer}
    renamed, entry = {}, []
    for vi in g.input:
        if vi.name not in initialized and vi.type.tensor_type.elem_type == DOUBLE:
            renamed[vi.name] = f"{vi.name}/float32"
            entry.append(helper.make_node("Cast", [vi.name], [renamed[vi.name]], to=FLOAT,
                                          name=f"{vi.name}/to_float32"))
    outputs = {vi.name for vi in g.output if vi.type.tensor_type.elem_type == DOUBLE}
    exits = []
    for name in outputs:
        inner = f"{name}/float32"
        renamed.setdefault(name, inner)
        exits.append(helper.make_node("Cast", [inner], [name], to=DOUBLE, name=f"{name}/to_float64"))
    nodes = []
    for node in g.node:
        node.input[:] = [renamed.get(n, n) for n in node.input]
        node.output[:] = [renamed.get(n, n) if n in outputs else n for n in node.output]
        for attr in node.attribute:
            if attr.name in TYPE_ATTRIBUTES and attr.type == onnx.AttributeProto.INT and attr.i == DOUBLE:
                attr.i = FLOAT
            elif attr.name in TENSOR_ATTRIBUTES and attr.type == onnx.AttributeProto.TENSOR \
                    and attr.t.data_type == DOUBLE:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype("float32"),
                                                        attr.t.name))
        nodes.append(node)
    del g.node[:]
    g.node.extend(entry + nodes + exits)
    kept = [vi for vi in g.value_info if vi.type.tensor_type.elem_type != DOUBLE]
    del g.value_info[:]
    g.value_info.extend(kept)
    return model


def _node_makes_float64(node: onnx.NodeProto) -> bool:
    for attr in node.attribute:
        if attr.name in TYPE_ATTRIBUTES and attr.type == onnx.AttributeProto.INT and attr.i == DOUBLE:
            return True
        if attr.name in TENSOR_ATTRIBUTES and attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == DOUBLE:
            return True
    return False
