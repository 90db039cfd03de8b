"""Ops that ONNX defines as a function of other ops (Attention,
RotaryEmbedding, Celu, Mish, ai.onnx.preview's FlexAttention, ...),
replaced by that definition before import when crosscompile has no
lowering of its own for them.

The body comes from the op's schema at the model's opset: a fixed body, or
one ONNX builds from the node and its input types (a context-dependent
function; Attention's depends on its masks and on whether Q is 3-D). Each
node becomes a call of a model-local function holding its body, and
onnx.inliner puts the body in the graph with fresh tensor names. A body may
use further function ops; they are expanded in turn.
"""
from __future__ import annotations

import functools

import onnx
import onnx.defs
import onnx.inliner
import onnx.shape_inference
from onnx import helper

from .errors import BuildError

# The domain of the model-local functions holding the bodies while they are
# inlined; nothing of it is left in the expanded model.
CALL_DOMAIN = "tether.function_body"
# Bodies using function ops are expanded again, up to this depth.
MAX_DEPTH = 4


# Ops whose body ONNX builds per node (from its attributes and input
# types) and whose bodies, as the node suite makes them, use supported ops.
CONTEXT_BODIES = ("Attention", "CausalConvWithState", "LinearAttention", "RotaryEmbedding")
# Ops of ONNX's other domains expanded the same way, by domain.
OTHER_DOMAINS = {"ai.onnx.preview": ("FlexAttention",)}


# Inputs of expanded ops that set their output's shape, and so must be
# constants in a compiled module (a window's size, the size AffineGrid
# makes, CenterCropPad's shape).
COMPILE_TIME_INPUTS = {"BlackmanWindow": (0,), "HammingWindow": (0,), "HannWindow": (0,), "AffineGrid": (1,),
                       "CenterCropPad": (1,)}


def function_ops(lowered) -> set:
    """The op types (of the default domain, at the latest opset) that
    expand into ops of lowered (a set of op types), directly or through
    other such ops, and CONTEXT_BODIES.

    >>> "MeanVarianceNormalization" in function_ops({"ReduceMean", "Sub", "Mul", "Div", "Sqrt", "Add", "Constant"})
    True
    """
    return set(_function_ops(frozenset(lowered)))


@functools.lru_cache(maxsize=4)
def _function_ops(lowered: frozenset) -> frozenset:
    found = set(CONTEXT_BODIES) | {f"{domain}.{op}" for domain, ops in OTHER_DOMAINS.items() for op in ops}
    bodies = {}
    for schema in onnx.defs.get_all_schemas():
        if schema.domain == "" and schema.name not in lowered and schema.has_function:
            bodies[schema.name] = {node.op_type for node in _static_body(schema, None).node}
    grew = True
    while grew:
        grew = False
        for op_type, used in bodies.items():
            if op_type not in found and used <= set(lowered) | found:
                found.add(op_type)
                grew = True
    return frozenset(found)


def defined_as_function(op_type: str, opset: "int | None" = None) -> bool:
    """Whether ONNX defines op_type (of the default domain, at opset or
    the latest one) by a body of other ops.

    >>> defined_as_function("Celu"), defined_as_function("Conv")
    (True, False)
    """
    schema = _schema(op_type, opset)
    return schema is not None and (_static_body(schema, opset) is not None
                                   or schema.has_context_dependent_function)


def expand_functions(proto: onnx.ModelProto, lowered) -> onnx.ModelProto:
    """proto with every node whose op is not in lowered (a set of op
    types) but is defined as a function replaced by its body; the same
    model when there is none.

    >>> m = expand_functions(onnx.load("celu.onnx"), {"Elu", "Mul", "Div"})  # doctest: +SKIP
    """
    opset = _default_opset(proto)
    for _ in range(MAX_DEPTH):
        wanted = [i for i, node in enumerate(proto.graph.node)
                  if node.domain in ("", "ai.onnx") and node.op_type not in lowered
                  and defined_as_function(node.op_type, opset)
                  or node.op_type in OTHER_DOMAINS.get(node.domain, ())]
        if not wanted:
            return proto
        proto = _inline(proto, wanted, opset)
    return proto


def _inline(proto: onnx.ModelProto, wanted: list, opset: int) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    types = _value_types(model) if any(
        not _static_body(_schema(model.graph.node[i].op_type, opset), opset)
        or model.graph.node[i].domain not in ("", "ai.onnx") for i in wanted) else {}
    for number, index in enumerate(wanted):
        node = model.graph.node[index]
        where = f"node {node.name or node.op_type + '_' + str(index)!r} ({node.op_type})"
        version = _domain_opset(model, node.domain)
        schema = _schema(node.op_type, version, node.domain)
        _add_defaults(node, schema)
        body = _static_body(schema, version)
        if body is None:
            body = _context_body(node, schema, version, types, where)
        body.name = f"{node.op_type}_{number}"
        body.domain = CALL_DOMAIN
        del body.attribute[:]
        body.attribute.extend(a.name for a in node.attribute)
        model.functions.append(body)
        node.op_type, node.domain = body.name, CALL_DOMAIN
    model.opset_import.append(helper.make_opsetid(CALL_DOMAIN, 1))
    expanded = sorted({proto.graph.node[i].op_type for i in wanted})
    try:
        inlined = onnx.inliner.inline_local_functions(model)
    except Exception as exc:  # onnx raises its own C++ exception types
        raise BuildError(f"expanding {', '.join(expanded)} into ONNX's definition by other ops "
                         f"failed: {exc}") from None
    kept = [o for o in inlined.opset_import if o.domain != CALL_DOMAIN]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    return inlined


def _default_opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)


def _domain_opset(proto: onnx.ModelProto, domain: str) -> int:
    if domain in ("", "ai.onnx"):
        return _default_opset(proto)
    return next((o.version for o in proto.opset_import if o.domain == domain), 1)


def _schema(op_type: str, opset: "int | None", domain: str = ""):
    domain = "" if domain == "ai.onnx" else domain
    try:
        if opset is None:
            return onnx.defs.get_schema(op_type, domain=domain)
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


def _static_body(schema, opset) -> "onnx.FunctionProto | None":
    if schema is None or not schema.has_function:
        return None
    body = onnx.FunctionProto()
    if opset is None:
        body.CopyFrom(schema.function_body)
    else:
        raw = schema.get_function_with_opset_version(opset)
        if not raw:
            return None
        body.ParseFromString(raw)
    return body


def _context_body(node, schema, opset, types, where) -> onnx.FunctionProto:
    """The body ONNX builds for this node from its input types."""
    inputs = []
    for name in node.input:
        if name and name not in types:
            raise BuildError(f"{where}: the type of input {name!r} is unknown, and ONNX's definition "
                             "of the op depends on it; give the model's inputs full types")
        inputs.append(types[name].SerializeToString() if name else onnx.TypeProto().SerializeToString())
    raw = schema.get_context_dependent_function_with_opset_version(opset, node.SerializeToString(), inputs)
    if not raw:
        raise BuildError(f"{where}: ONNX gives no definition of the op for these inputs")
    body = onnx.FunctionProto()
    body.ParseFromString(raw)
    return body


def _add_defaults(node: onnx.NodeProto, schema) -> None:
    """The schema's default of every attribute the node leaves out, so a
    body's references to them resolve."""
    given = {a.name for a in node.attribute}
    for name, attribute in schema.attributes.items():
        default = attribute.default_value
        if name not in given and default.type != onnx.AttributeProto.UNDEFINED:
            copy = onnx.AttributeProto()
            copy.CopyFrom(default)
            copy.name = name
            node.attribute.append(copy)


def _value_types(model: onnx.ModelProto) -> dict:
    """tensor name -> TypeProto, from the declared inputs and initializers
    and ONNX's type inference over the graph."""
    types = {}
    for init in model.graph.initializer:
        types[init.name] = helper.make_tensor_type_proto(init.data_type, list(init.dims))
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - fall back to what the graph declares
        inferred = model
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        types.setdefault(vi.name, vi.type)
    return types
