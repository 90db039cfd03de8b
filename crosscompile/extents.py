"""Run-time extents: what a kernel needs to work along an axis whose size
depends on the data (crosscompile/bounded.py).

A count is an int64 (1,) tensor in the workspace. An op that works along a
counted axis (TopK, Concat, a reduction, NonMaxSuppression, a Gather
choosing along it) gets that count as one more runtime input, after its
own, and the node's attrs["extents"] = ((input position, axis), ...) say
which input each extra one measures; the kernel reads it with extent()
and uses it as that axis's length in place of the upper bound its shape
holds.

The three ops here are not ONNX ops; the frontend writes them in:
CountShape (the Shape of a counted tensor), CountFill (a
ConstantOfShape sized by such a Shape) and FillPastCount (a copy whose
entries past the count hold a reduction's identity, so that a reduction
over the bound gives the one over the count).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir

from .emit import ELEMENT_TYPES, Kernel
from .op_base import ALL_DTYPES, Op, _prod


def extent(k: Kernel, inputs, attrs: dict, pos: int, axis: int) -> ir.Value:
    """The length of input pos along axis this run: its count when that
    axis is counted (attrs["extents"]), else its static size, as an i64."""
    for order, (counted, along) in enumerate(attrs.get("extents", ())):
        if counted == pos and along == axis:
            at = len(inputs) - len(attrs["extents"]) + order
            return k.load(k.typed(k.inputs[at], "int64"), k.i64(0))
    return k.i64(inputs[pos].shape[axis])


def clamp(k: Kernel, value: ir.Value, low: int, high: int) -> ir.Value:
    return k.smin(k.smax(value, k.i64(low)), k.i64(high))


def _constant(k: Kernel, dtype: str, value) -> ir.Constant:
    kind = ELEMENT_TYPES[dtype]
    if isinstance(kind, ir.IntType):
        return ir.Constant(kind, int(value))
    return ir.Constant(kind, float(value))


class CountShape(Op):
    """The Shape of a counted tensor (attrs: shape, its upper bound; axis,
    the counted one; start, end, as Shape's): the static dimensions, and
    the count (its only input) at the counted axis."""

    op_type = "CountShape"
    data_dtypes = ("int64",)

    def infer(self, inputs, attrs):
        return [(len(attrs["shape"][attrs["start"]:attrs["end"]]),)]

    def output_dtype(self, inputs, attrs):
        return "int64"

    def lower(self, k, inputs, outputs, attrs):
        out = k.typed(k.outputs[0], "int64")
        count = k.load(k.typed(k.inputs[0], "int64"), k.i64(0))
        for place, axis in enumerate(range(len(attrs["shape"]))[attrs["start"]:attrs["end"]]):
            k.store(count if axis == attrs["axis"] else k.i64(attrs["shape"][axis]), out, k.i64(place))
        k.activated = True


class CountFill(Op):
    """ConstantOfShape whose shape is a CountShape's: the upper bound
    (attrs shape) filled with attrs value of attrs dtype; its input, the
    count, only orders it after the count is known (the frontend counts
    the output by it)."""

    op_type = "CountFill"
    data_dtypes = ("int64",)

    def infer(self, inputs, attrs):
        return [tuple(attrs["shape"])]

    def output_dtype(self, inputs, attrs):
        return attrs["dtype"]

    def lower(self, k, inputs, outputs, attrs):
        out = k.typed(k.outputs[0], attrs["dtype"])
        value = _constant(k, attrs["dtype"], attrs["value"])
        with k.loop(_prod(attrs["shape"])) as i:
            k.store(value, out, i)
        k.activated = True


class FillPastCount(Op):
    """A copy of input 0 whose entries past the count (input 1) along
    attrs axis hold attrs value: a reduction's identity (-inf for a max,
    0 for a sum), so that reducing the whole bound reduces the count's
    entries only."""

    op_type = "FillPastCount"
    data_dtypes = ALL_DTYPES

    def infer(self, inputs, attrs):
        return [inputs[0]]

    def output_dtype(self, inputs, attrs):
        return inputs[0].dtype

    def lower(self, k, inputs, outputs, attrs):
        bld = k.builder
        shape, axis, dtype = inputs[0].shape, attrs["axis"], inputs[0].dtype
        outer, size, inner = _prod(shape[:axis]), shape[axis], _prod(shape[axis + 1:])
        data, out = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
        count = clamp(k, k.load(k.typed(k.inputs[1], "int64"), k.i64(0)), 0, size)
        value = _constant(k, dtype, attrs["value"])
        with k.loop(outer) as o, k.loop(size) as j, k.loop(inner) as i:
            at = k.index((o, size * inner), (j, inner), (i, 1))
            kept = bld.icmp_signed("<", j, count)
            k.store(bld.select(kept, k.load(data, at), value), out, at)
        k.activated = True


def identity_of(op_type: str, dtype: str):
    """The value past the count that leaves op_type's reduction unchanged,
    or None when there is none (a mean divides by the extent)."""
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    if op_type in ("ReduceMax", "ArgMax"):
        return info.min if info else -np.inf
    if op_type in ("ReduceMin", "ArgMin"):
        return info.max if info else np.inf
    if op_type in ("ReduceSum", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"):
        return (-np.inf if info is None else None) if op_type == "ReduceLogSumExp" else 0
    if op_type == "ReduceProd":
        return 1
    return None


def identity_of_dtype(dtype: str):
    """identity_of for tensors of dtype, as bounded.along_count takes it."""
    return lambda op_type: identity_of(op_type, dtype)
