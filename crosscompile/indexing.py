"""Ops that read or write a tensor at indices given at run time: GatherND,
ScatterND, ScatterElements and OneHot. Negative indices count from the end
of their axis; an index still out of range is clamped to it (as Gather's
are), so a bad index reads or writes a wrong element of the tensor, never
memory outside it."""
from __future__ import annotations

import numpy as np
from llvmlite import ir

from .emit import I64, Kernel
from .errors import BuildError, ShapeError
from .logic import convert
from .op_base import ALL_DTYPES, Op, _axis, _c_strides, _check_choice, _prod

INDEX_DTYPES = ("int64", "int32")
REDUCTIONS = ("none", "add", "mul", "max", "min")


def index_at(k: Kernel, value: ir.Value, size: int) -> ir.Value:
    """An index read at run time (any integer width, or float32) as an i64
    in [0, size)."""
    b = k.builder
    if isinstance(value.type, ir.FloatType):
        value = b.fptosi(value, I64)
    elif value.type.width < 64:
        value = b.sext(value, I64)
    value = b.select(b.icmp_signed("<", value, k.i64(0)), b.add(value, k.i64(size)), value)
    return k.smin(k.smax(value, k.i64(0)), k.i64(max(size - 1, 0)))


def _check_indices(op_type: str, tensor) -> None:
    if tensor.dtype not in INDEX_DTYPES:
        raise BuildError(f"{op_type} indices {tensor.name!r} have dtype {tensor.dtype}; "
                         "int64 or int32 indices are supported")


def _copy_data(k: Kernel, dtype: str, size: int):
    """Input 0 copied into output 0, unactivated (a fused epilogue then
    runs over the whole output once the scatter is done); returns the typed
    output pointer."""
    src, dst = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
    with k.loop(size) as i:
        k.store(k.load(src, i), dst, i)
    return dst


def _reduce(k: Kernel, reduction: str, old: ir.Value, new: ir.Value) -> ir.Value:
    """The value a scatter writes: new, or old combined with new."""
    b = k.builder
    if reduction == "none":
        return new
    floating = isinstance(new.type, ir.FloatType)
    if reduction == "add":
        return b.fadd(old, new) if floating else b.add(old, new)
    if reduction == "mul":
        return b.fmul(old, new) if floating else b.mul(old, new)
    if floating:
        return k.maximum(old, new) if reduction == "max" else k.minimum(old, new)
    return b.select(b.icmp_signed(">" if reduction == "max" else "<", old, new), old, new)


class GatherND(Op):
    """Slices of data picked by the index tuples in the last axis of
    indices; the first batch_dims axes of both are matched, not indexed."""

    op_type = "GatherND"

    def attributes(self, raw, constants, opset):
        return {"batch_dims": int(raw.get("batch_dims", 0))}

    @staticmethod
    def _geometry(data, indices, batch):
        m = indices[-1]
        if batch + m > len(data) or tuple(indices[:batch]) != tuple(data[:batch]):
            raise ShapeError(f"GatherND indices {tuple(indices)} do not fit data {tuple(data)} "
                             f"with batch_dims={batch}")
        return m, tuple(indices[:-1]) + tuple(data[batch + m:])

    def infer(self, inputs, attrs):
        if len(inputs) != 2 or not inputs[1]:
            raise ShapeError(f"GatherND takes data and indices of rank >= 1, got {inputs}")
        return [self._geometry(inputs[0], inputs[1], attrs["batch_dims"])[1]]

    def output_dtype(self, inputs, attrs):
        _check_indices(self.op_type, inputs[1])
        return inputs[0].dtype

    def lower(self, k, inputs, outputs, attrs):
        data, indices = inputs[0].shape, inputs[1].shape
        batch = attrs["batch_dims"]
        m, _ = self._geometry(data, indices, batch)
        tuples, inner = _prod(indices[:-1]), _prod(data[batch + m:])
        per_batch = _prod(indices[batch:-1])
        strides = _c_strides(data)
        b, dtype = k.builder, inputs[0].dtype
        src, dst = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
        idx_ptr = k.typed(k.inputs[1], inputs[1].dtype)
        if outputs[0].size == 0:
            k.activated = True
            return
        with k.loop(tuples) as t:
            batch_base = b.mul(b.udiv(t, k.i64(max(per_batch, 1))), k.i64(_prod(data[batch:])))
            offset = batch_base
            for j in range(m):
                coordinate = index_at(k, k.load(idx_ptr, k.index((t, m), (j, 1))), data[batch + j])
                offset = b.add(offset, b.mul(coordinate, k.i64(strides[batch + j])))
            with k.loop(inner) as i:
                value = k.load(src, b.add(offset, i))
                k.store(k.activate(value), dst, k.index((t, inner), (i, 1)))


class ScatterND(Op):
    """A copy of data with the slices at the index tuples of indices
    replaced by (or, with reduction, combined with) updates."""

    op_type = "ScatterND"
    data_dtypes = ALL_DTYPES

    def attributes(self, raw, constants, opset):
        reduction = raw.get("reduction", "none")
        _check_choice("reduction", reduction, REDUCTIONS)
        return {"reduction": reduction}

    def infer(self, inputs, attrs):
        if len(inputs) != 3:
            raise ShapeError(f"ScatterND takes data, indices and updates, got {len(inputs)} inputs")
        data, indices, updates = inputs
        m = indices[-1] if indices else 0
        expected = tuple(indices[:-1]) + tuple(data[m:])
        if not indices or m > len(data) or tuple(updates) != expected:
            raise ShapeError(f"ScatterND updates of shape {tuple(updates)} should be {expected} "
                             f"for data {tuple(data)} and indices {tuple(indices)}")
        return [data]

    def output_dtype(self, inputs, attrs):
        _check_indices(self.op_type, inputs[1])
        return Op.output_dtype(self, [inputs[0], inputs[2]], attrs)

    def lower(self, k, inputs, outputs, attrs):
        data, indices = inputs[0].shape, inputs[1].shape
        m, dtype, b = indices[-1], inputs[0].dtype, k.builder
        tuples, inner, strides = _prod(indices[:-1]), _prod(data[m:]), _c_strides(data)
        dst, updates = _copy_data(k, dtype, _prod(data)), k.typed(k.inputs[2], dtype)
        idx_ptr = k.typed(k.inputs[1], inputs[1].dtype)
        with k.loop(tuples) as t:
            offset = k.i64(0)
            for j in range(m):
                coordinate = index_at(k, k.load(idx_ptr, k.index((t, m), (j, 1))), data[j])
                offset = b.add(offset, b.mul(coordinate, k.i64(strides[j])))
            with k.loop(inner) as i:
                at = b.add(offset, i)
                new = k.load(updates, k.index((t, inner), (i, 1)))
                k.store(_reduce(k, attrs["reduction"], k.load(dst, at), new), dst, at)


class ScatterElements(Op):
    """A copy of data where each element of updates is written (or
    combined, with reduction) at its own position with the axis coordinate
    taken from indices (the inverse of GatherElements). Scatter (opset < 11)
    is the same op."""

    op_type = "ScatterElements"
    data_dtypes = ALL_DTYPES

    def attributes(self, raw, constants, opset):
        reduction = raw.get("reduction", "none")
        _check_choice("reduction", reduction, REDUCTIONS)
        return {"axis": int(raw.get("axis", 0)), "reduction": reduction}

    def infer(self, inputs, attrs):
        if len(inputs) != 3:
            raise ShapeError(f"{self.op_type} takes data, indices and updates, got {len(inputs)} inputs")
        data, indices, updates = inputs
        axis = _axis(attrs["axis"], len(data))
        if tuple(indices) != tuple(updates) or len(indices) != len(data) or any(
                i > d for a, (i, d) in enumerate(zip(indices, data)) if a != axis):
            raise ShapeError(f"{self.op_type} indices {tuple(indices)} and updates {tuple(updates)} do not fit "
                             f"data {tuple(data)} along axis {axis}")
        return [data]

    output_dtype = ScatterND.output_dtype

    def lower(self, k, inputs, outputs, attrs):
        data, indices = inputs[0].shape, inputs[1].shape
        axis, dtype, b = _axis(attrs["axis"], len(data)), inputs[0].dtype, k.builder
        dst, updates = _copy_data(k, dtype, _prod(data)), k.typed(k.inputs[2], dtype)
        idx_ptr = k.typed(k.inputs[1], inputs[1].dtype)
        data_strides, idx_strides = _c_strides(data), _c_strides(indices)
        if _prod(indices) == 0:
            return
        with k.nested_loops(indices) as idx:
            at = k.index(*zip(idx, idx_strides))
            coordinate = index_at(k, k.load(idx_ptr, at), data[axis])
            terms = [(i, s) for a, (i, s) in enumerate(zip(idx, data_strides)) if a != axis]
            target = k.index((coordinate, data_strides[axis]), *terms)
            k.store(_reduce(k, attrs["reduction"], k.load(dst, target), k.load(updates, at)), dst, target)


class Scatter(ScatterElements):
    op_type = "Scatter"


class OneHot(Op):
    """values[1] where the position along the new axis equals the index,
    values[0] elsewhere; depth is a constant input and negative indices
    count from depth. An index outside [-depth, depth) matches nothing."""

    op_type = "OneHot"
    compile_time_inputs = (1,)

    def attributes(self, raw, constants, opset):
        depth = constants.get(1)
        if depth is None:
            raise BuildError("OneHot needs its depth as a constant input")
        return {"axis": int(raw.get("axis", -1)), "depth": int(np.asarray(depth).reshape(-1)[0])}

    def infer(self, inputs, attrs):
        if len(inputs) != 2 or _prod(inputs[1]) != 2:
            raise ShapeError(f"OneHot takes indices and two values (off, on), got shapes {inputs}")
        x = tuple(inputs[0])
        axis = _axis(attrs["axis"], len(x) + 1)
        return [x[:axis] + (attrs["depth"],) + x[axis:]]

    def output_dtype(self, inputs, attrs):
        if inputs[0].dtype not in INDEX_DTYPES + ("float32",):
            raise BuildError(f"OneHot indices {inputs[0].name!r} have dtype {inputs[0].dtype}; "
                             "int64, int32 or float32 indices are supported")
        return inputs[1].dtype

    def lower(self, k, inputs, outputs, attrs):
        x, depth = inputs[0].shape, attrs["depth"]
        axis = _axis(attrs["axis"], len(x) + 1)
        outer, inner = _prod(x[:axis]), _prod(x[axis:])
        b, dtype = k.builder, outputs[0].dtype
        indices = k.typed(k.inputs[0], inputs[0].dtype)
        values, dst = k.typed(k.inputs[1], dtype), k.typed(k.outputs[0], dtype)
        off, on = k.load(values, k.i64(0)), k.load(values, k.i64(1))
        with k.loop(outer) as o, k.loop(inner) as i:
            raw = k.load(indices, k.index((o, inner), (i, 1)))
            index = convert(k, raw, inputs[0].dtype, "int64")
            index = b.select(b.icmp_signed("<", index, k.i64(0)), b.add(index, k.i64(depth)), index)
            with k.loop(depth) as d:
                value = b.select(b.icmp_signed("==", index, d), on, off)
                k.store(k.activate(value), dst, k.index((o, depth * inner), (d, inner), (i, 1)))
