"""Ops that rank the elements along one axis: TopK (a classifier's top
five, a beam's best candidates) and ArgMax/ArgMin (a greedy decoder's
token, a segmentation map's class per pixel). Their indices are int64.

Every row along the axis is ranked on its own, with loops over the other
axes outside; a row of a C-order tensor is strided by the product of the
dimensions after the axis.
"""
from __future__ import annotations

from llvmlite import ir

from .emit import I8, Kernel
from .errors import BuildError, ShapeError
from .extents import clamp, extent
from .op_base import Op, _axis, _const_ints, _prod

RANKED_DTYPES = ("float32", "int64", "int32")


def _ranked_dtype(op_type: str, inputs) -> str:
    if inputs[0].dtype not in RANKED_DTYPES:
        raise BuildError(f"{op_type} of {inputs[0].name!r} of dtype {inputs[0].dtype} is not supported; "
                         f"supported: {', '.join(RANKED_DTYPES)}")
    return inputs[0].dtype


def _beats(k: Kernel, a: ir.Value, b: ir.Value, largest: bool, or_equal: bool = False) -> ir.Value:
    """a ranks before b: a > b for largest, a < b otherwise (>=, <= with
    or_equal), for float or integer values."""
    predicate = (">" if largest else "<") + ("=" if or_equal else "")
    if isinstance(a.type, ir.IntType):
        return k.builder.icmp_signed(predicate, a, b)
    return k.builder.fcmp_ordered(predicate, a, b)


def extreme_index(k: Kernel, data, src, length: int, stride: int, largest: bool = True,
                  last: bool = False) -> ir.Value:
    """The i64 position of the largest (or smallest) of the length values
    at data[src + j * stride]: the first of equal ones, or the last."""
    bld = k.builder
    best = k.variable(k.load(data, src))
    where = k.variable(k.i64(0))
    with k.loop(length, start=1) as j:
        value = k.load(data, k.index((src, 1), (j, stride)))
        better = _beats(k, value, bld.load(best), largest, last)
        bld.store(bld.select(better, value, bld.load(best)), best)
        bld.store(bld.select(better, j, bld.load(where)), where)
    return bld.load(where)


def _row_geometry(shape, axis):
    """(outer, length, inner) of the rows along axis."""
    return _prod(shape[:axis]), shape[axis], _prod(shape[axis + 1:])


class TopK(Op):
    """The k largest (or smallest) elements along an axis and their int64
    indices, best first; equal elements keep their order in the input (the
    lower index first). k is an attribute before opset 10 and an input from
    then on. sorted=0 leaves the order open, and this order serves it too.

    A k computed at run time (min(300, candidates) in a detector's
    post-processing), or data whose axis is counted (crosscompile/bounded.py),
    gives outputs counted along the axis: planned for the axis's length (or
    the largest value k can have, attrs value_bounds), holding min(k, extent) entries,
    zeros after them, and that count in a third output.

    Each row is selected by insertion into the k output places: O(length * k)."""

    op_type = "TopK"
    bounded_inputs = (1,)

    def folds_constant(self, pos, value):
        return pos == 1

    def attributes(self, raw, constants, opset):
        count = raw.get("k") if opset < 10 else _const_ints(constants, 1)
        if count is not None:
            count = int(count[0]) if isinstance(count, tuple) else int(count)
        return {"k": count, "axis": int(raw.get("axis", -1)), "largest": int(raw.get("largest", 1))}

    def counted(self, attrs):
        return {0: attrs["axis"], 1: attrs["axis"]} if attrs["k"] is None else {}

    def infer(self, inputs, attrs):
        if len(inputs) != (1 if attrs["k"] is not None else 2):
            raise ShapeError(f"TopK takes its data and k, got {len(inputs)} runtime inputs")
        x = inputs[0]
        axis = _axis(attrs["axis"], len(x))
        if attrs["k"] is None:
            if inputs[1] not in ((1,), ()):
                raise ShapeError(f"TopK k must be a scalar or one value, got shape {inputs[1]}")
            places = min(x[axis], max(attrs.get("value_bounds", {}).get(1, x[axis]), 0))
        elif not 0 <= attrs["k"] <= x[axis]:
            raise ShapeError(f"TopK k={attrs['k']} is outside [0, {x[axis]}] for axis {axis} of {x}")
        else:
            places = attrs["k"]
        out = (*x[:axis], places, *x[axis + 1:])
        return [out, out]

    def output_dtype(self, inputs, attrs):
        if attrs["k"] is None and inputs[1].dtype != "int64":
            raise BuildError(f"TopK k {inputs[1].name!r} has dtype {inputs[1].dtype}; it must be int64")
        return [_ranked_dtype(self.op_type, inputs), "int64"]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        axis = _axis(attrs["axis"], len(x))
        outer, bound, inner = _row_geometry(x, axis)
        places, largest = outputs[0].shape[axis], bool(attrs["largest"])
        bld = k.builder
        length = extent(k, inputs, attrs, 0, axis)
        if attrs["k"] is None:
            wanted = k.load(k.typed(k.inputs[1], inputs[1].dtype), k.i64(0))
        else:
            wanted = k.i64(attrs["k"])
        count = clamp(k, k.smin(wanted, length), 0, places)
        counted = len(k.outputs) > 2
        if places == 0:
            if counted:
                k.store(count, k.typed(k.outputs[2], "int64"), k.i64(0))
            return
        data = k.typed(k.inputs[0], inputs[0].dtype)
        values, indices = k.typed(k.outputs[0], inputs[0].dtype), k.typed(k.outputs[1], "int64")
        last_place = bld.sub(count, k.i64(1))
        with k.loop(outer) as o, k.loop(inner) as r:
            src = k.index((o, bound * inner), (r, 1))
            dst = k.index((o, places * inner), (r, 1))

            def place(q):
                return k.index((dst, 1), (q, inner))
            with k.loop(bld.select(bld.icmp_signed(">", count, k.i64(0)), length, k.i64(0))) as j:
                value = k.load(data, k.index((src, 1), (j, inner)))
                full = bld.icmp_signed(">=", j, count)
                last = k.smin(j, last_place)
                # A full list takes a value only when it beats the last one.
                enters = bld.or_(bld.not_(full), _beats(k, value, k.load(values, place(last)), largest))
                with bld.if_then(enters):
                    # Move the places the value beats one down, from the
                    # last up: at most `last` steps, the first loss ends them.
                    done = k.variable(ir.Constant(I8, 0))
                    with k.loop(last) as step:
                        q = bld.sub(last, step)
                        with bld.if_then(bld.icmp_unsigned("==", bld.load(done), ir.Constant(I8, 0))):
                            above = k.load(values, place(bld.sub(q, k.i64(1))))
                            with bld.if_else(_beats(k, value, above, largest)) as (moves, stays):
                                with moves:
                                    k.store(above, values, place(q))
                                    k.store(k.load(indices, place(bld.sub(q, k.i64(1)))), indices, place(q))
                                with stays:
                                    k.store(value, values, place(q))
                                    k.store(j, indices, place(q))
                                    bld.store(ir.Constant(I8, 1), done)
                    with bld.if_then(bld.icmp_unsigned("==", bld.load(done), ir.Constant(I8, 0))):
                        k.store(value, values, place(k.i64(0)))
                        k.store(j, indices, place(k.i64(0)))
            if counted:
                # Zeros past the count: valid indices for the ops after it.
                with k.loop(places, start=count) as q:
                    k.store(ir.Constant(values.type.pointee, 0), values, place(q))
                    k.store(k.i64(0), indices, place(q))
        if counted:
            k.store(count, k.typed(k.outputs[2], "int64"), k.i64(0))
        k.activated = True


class _ArgExtreme(Op):
    """The int64 index of the largest (ArgMax) or smallest (ArgMin) element
    along an axis: the first one, or the last with select_last_index."""

    largest = True

    def attributes(self, raw, constants, opset):
        return {"axis": int(raw.get("axis", 0)), "keepdims": int(raw.get("keepdims", 1)),
                "select_last_index": int(raw.get("select_last_index", 0))}

    def infer(self, inputs, attrs):
        if len(inputs) != 1:
            raise ShapeError(f"{self.op_type} takes one input, got {len(inputs)}")
        x = inputs[0]
        axis = _axis(attrs["axis"], len(x))
        if x[axis] == 0:
            raise ShapeError(f"{self.op_type} over axis {axis} of {x}, which is empty")
        if attrs["keepdims"]:
            return [(*x[:axis], 1, *x[axis + 1:])]
        return [(*x[:axis], *x[axis + 1:])]

    def output_dtype(self, inputs, attrs):
        _ranked_dtype(self.op_type, inputs)
        return "int64"

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        outer, length, inner = _row_geometry(x, _axis(attrs["axis"], len(x)))
        data, out = k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.outputs[0], "int64")
        with k.loop(outer) as o, k.loop(inner) as r:
            src = k.index((o, length * inner), (r, 1))
            where = extreme_index(k, data, src, length, inner, self.largest, bool(attrs["select_last_index"]))
            k.store(where, out, k.index((o, inner), (r, 1)))
        k.activated = True


class ArgMax(_ArgExtreme):
    op_type = "ArgMax"


class ArgMin(_ArgExtreme):
    op_type = "ArgMin"
    largest = False

