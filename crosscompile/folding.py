"""Constant folding at import: a node whose inputs are all known at compile
time is evaluated once here, and its outputs become constants.

This is what turns shape arithmetic (Shape → Gather → Unsqueeze → Concat →
Reshape), ConstantOfShape, Range, Cast of constants and weight preprocessing
into plain constants, so the code generator only ever sees float32 kernels.
Values come from the ONNX reference implementation of each op, so any
standard op folds, including ones the code generator cannot lower.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .errors import BuildError

# Ops whose output depends only on the input's shape, not its data.
SHAPE_OPS = {"Shape", "Size"}
# Ops that must never be folded even with constant inputs.
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike",
                    "RandomUniformLike", "Multinomial", "Bernoulli"}
# Quantization stays in the graph even on constants (a weight's
# DequantizeLinear): quantized.lower_qdq needs the integer weights and folds
# the ones it does not lower itself.
QUANTIZATION = {"QuantizeLinear", "DequantizeLinear"}


def shape_value(op_type: str, shape: tuple, raw: dict) -> np.ndarray:
    """The value of Shape (with opset-15 start/end) or Size for a known shape."""
    if op_type == "Size":
        return np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
    start, end = int(raw.get("start", 0)), raw.get("end")
    return np.array(shape, dtype=np.int64)[start:None if end is None else int(end)]


def can_fold(np_node: onnx.NodeProto, constants: dict) -> bool:
    present = [name for name in np_node.input if name]
    return (np_node.op_type not in NONDETERMINISTIC | QUANTIZATION and bool(present)
            and all(name in constants for name in present))


def evaluate(np_node: onnx.NodeProto, constants: dict, opset: int, where: str) -> list[np.ndarray]:
    """Run one node on constant inputs with the ONNX reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    feeds = {name: np.asarray(constants[name]) for name in dict.fromkeys(np_node.input) if name}
    node = helper.make_node(np_node.op_type, list(np_node.input), list(np_node.output),
                            domain=np_node.domain)
    node.attribute.extend(np_node.attribute)
    graph = helper.make_graph(
        [node], "fold",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in feeds.items()],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in np_node.output if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        values = ReferenceEvaluator(model).run(None, feeds)
    except Exception as exc:  # the reference raises whatever numpy raises
        raise BuildError(f"{where}: evaluating it on its constant inputs failed "
                         f"({type(exc).__name__}: {exc})") from None
    for out, value in zip([o for o in np_node.output if o], values):
        if value is None or isinstance(value, (list, tuple, dict)):
            raise BuildError(f"{where}: its output {out!r} is a sequence, map or optional, not a tensor; "
                             "only tensors are supported")
    return [np.asarray(v) for v in values]
