"""The Reduce ops (ReduceMean, ReduceSum, ReduceMax, ... ReduceLogSumExp)
and the row reduction they share with the normalisation kernels.

Every output element is reduced on its own: loops over the kept
dimensions outside, over the reduced ones inside. The reduced dimensions
of a row-major tensor that are innermost (a mean over H and W, LayerNorm's
last axis) are one contiguous run, which reduce_row sums in vector
accumulators; a reduction over an outer axis steps through memory instead.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir

from .elementwise import safe_log
from .emit import Kernel
from .errors import BuildError, ShapeError
from .op_base import Op, _axis, _c_strides, _const_ints, _ints, _prod
from .vectors import horizontal_reduce, load_strided, splat


def reduce_row(k: Kernel, ptr: ir.Value, base: ir.Value, length: int, combine, start: float,
               pre=None, stride: int = 1) -> ir.Value:
    """combine(...combine(start, pre(ptr[base])), ..., pre(ptr[base + (length - 1) * stride])).

    combine and pre take scalars or vectors (constants through k.f32). A
    contiguous row of at least two vectors is reduced in two vector
    accumulators (overlapping the combines' latency), then across lanes:
    LLVM does not reorder a chain of float adds into vectors itself.
    """
    bld = k.builder
    pre = pre or (lambda value: value)
    lanes = k.target.lanes
    step = 2 * lanes if stride == 1 and lanes > 1 and length >= 2 * lanes else 0
    acc = k.variable(k.f32(start))
    if step:
        with k.vector_constants(lanes):
            accs = [k.variable(k.f32(start)) for _ in range(2)]
        with k.loop(length // step) as i:
            at = bld.add(base, bld.mul(i, k.i64(step)))
            for u, slot in enumerate(accs):
                value = load_strided(k, ptr, bld.add(at, k.i64(u * lanes)), lanes, 1)
                with k.vector_constants(lanes):
                    bld.store(combine(bld.load(slot), pre(value)), slot)
        with k.vector_constants(lanes):
            vec = combine(bld.load(accs[0]), bld.load(accs[1]))
        bld.store(horizontal_reduce(k, vec, combine), acc)
    with k.loop(length, start=length // step * step if step else 0) as i:
        value = pre(k.load(ptr, k.index((base, 1), (i, stride))))
        bld.store(combine(bld.load(acc), value), acc)
    return bld.load(acc)


def broadcast_scalar(k: Kernel, scalar: ir.Value, like: ir.Value) -> ir.Value:
    """scalar as a value of like's type: splat across a vector's lanes."""
    if isinstance(like.type, ir.VectorType):
        return splat(k, scalar, like.type.count)
    return scalar


def _runs(shape, reduced) -> tuple[list, list]:
    """(kept, reduced) runs of a row-major tensor, each a list of
    (size, element stride): dimensions of size 1 drop out and neighbours of
    the same kind merge into one run."""
    runs = []
    for size, stride, red in zip(shape, _c_strides(shape), (i in reduced for i in range(len(shape)))):
        if size == 1:
            continue
        if runs and runs[-1][2] == red:
            runs[-1] = (runs[-1][0] * size, stride, red)
        else:
            runs.append((size, stride, red))
    return ([(s, st) for s, st, red in runs if not red], [(s, st) for s, st, red in runs if red])


class _Reduce(Op):
    """One Reduce op: combine(acc, pre(x)) from `start` over the reduced
    axes, then post(acc, count). Axes are an attribute before opset
    `axes_input_from` and a constant input from it on; no axes reduce all
    of them, or none with noop_with_empty_axes."""

    compile_time_inputs = (1,)
    axes_input_from = 18
    start = 0.0

    def pre(self, k, x):
        return x

    def combine(self, k, a, b):
        return k.builder.fadd(a, b)

    def post(self, k, acc, count):
        return acc

    def attributes(self, raw, constants, opset):
        if opset >= self.axes_input_from:
            if "axes" in raw:
                raise BuildError(f"{self.op_type} takes its axes as an input from opset "
                                 f"{self.axes_input_from} on, not as an attribute; move them to input 1")
            axes = _const_ints(constants, 1)
        else:
            axes = _ints(raw, "axes")
        return {"axes": axes, "keepdims": int(raw.get("keepdims", 1)),
                "noop_with_empty_axes": int(raw.get("noop_with_empty_axes", 0))}

    @staticmethod
    def _reduced(rank, attrs) -> set:
        axes = attrs["axes"]
        if not axes:
            return set() if attrs["noop_with_empty_axes"] else set(range(rank))
        reduced = {_axis(a, rank) for a in axes}
        if len(reduced) != len(axes):
            raise ShapeError(f"axes {axes} name an axis twice")
        return reduced

    def infer(self, inputs, attrs):
        if len(inputs) != 1:
            raise ShapeError(f"{self.op_type} takes one runtime input (constant axes), got {len(inputs)}")
        x = inputs[0]
        reduced = self._reduced(len(x), attrs)
        if attrs["keepdims"]:
            return [tuple(1 if i in reduced else d for i, d in enumerate(x))]
        return [tuple(d for i, d in enumerate(x) if i not in reduced)]

    # ReduceSum, ReduceMax, ReduceMin and ReduceProd also take int64 and
    # int32 tensors (a shape's product, the smaller of two counts): their
    # combine on integers, by name.
    INTEGER_COMBINES = {"ReduceSum": "add", "ReduceProd": "mul", "ReduceMax": "smax", "ReduceMin": "smin"}

    def output_dtype(self, inputs, attrs):
        if self.op_type in self.INTEGER_COMBINES and inputs[0].dtype in ("int64", "int32"):
            return inputs[0].dtype
        return super().output_dtype(inputs, attrs)

    def _lower_integer(self, k, inputs, attrs):
        """One scalar loop per kept element: integers wrap as numpy's do."""
        x, dtype = inputs[0].shape, inputs[0].dtype
        reduced = self._reduced(len(x), attrs)
        kept_axes = [a for a in range(len(x)) if a not in reduced]
        strides = _c_strides(x)
        info = np.iinfo(dtype)
        start = {"add": 0, "mul": 1, "smax": info.min, "smin": info.max}[self.INTEGER_COMBINES[self.op_type]]
        kind = ir.IntType(info.bits)
        combine = getattr(k, self.INTEGER_COMBINES[self.op_type]) if self.op_type in ("ReduceMax", "ReduceMin") \
            else getattr(k.builder, self.INTEGER_COMBINES[self.op_type])
        data, out = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
        out_strides = _c_strides([x[a] for a in kept_axes])
        with k.nested_loops([x[a] for a in kept_axes]) as idx:
            acc = k.variable(ir.Constant(kind, int(start)))
            base = [(i, strides[a]) for i, a in zip(idx, kept_axes)]
            with k.nested_loops([x[a] for a in sorted(reduced)]) as inner:
                at = k.index(*base, *zip(inner, [strides[a] for a in sorted(reduced)]))
                k.builder.store(combine(k.builder.load(acc), k.load(data, at)), acc)
            k.store(k.builder.load(acc), out, k.index(*zip(idx, out_strides)))

    def lower(self, k, inputs, outputs, attrs):
        if inputs[0].dtype in ("int64", "int32"):
            self._lower_integer(k, inputs, attrs)
            return
        x = inputs[0].shape
        kept, reduced = _runs(x, self._reduced(len(x), attrs))
        count = _prod(s for s, _ in reduced)
        out_strides = _c_strides([s for s, _ in kept])
        with k.nested_loops([s for s, _ in kept]) as idx:
            base = k.index(*zip(idx, [st for _, st in kept]))
            value = self.post(k, self.reduce(k, base, reduced), count)
            k.store(k.activate(value), k.outputs[0], k.index(*zip(idx, out_strides)))

    def reduce(self, k: Kernel, base: ir.Value, reduced: list, pre=None, combine=None, start=None):
        """The reduction of the input at element offset base over the runs
        `reduced` (the op's own pre, combine and start unless given)."""
        pre = pre or (lambda value: self.pre(k, value))
        combine = combine or (lambda a, b: self.combine(k, a, b))
        start = self.start if start is None else start
        if not reduced:
            return combine(k.f32(start), pre(k.load(k.inputs[0], base)))
        bld = k.builder
        *outer, (length, stride) = reduced
        acc = k.variable(k.f32(start))
        with k.nested_loops([s for s, _ in outer]) as idx:
            at = k.index((base, 1), *zip(idx, [st for _, st in outer]))
            row = reduce_row(k, k.inputs[0], at, length, combine, start, pre, stride)
            bld.store(combine(bld.load(acc), row), acc)
        return bld.load(acc)


class ReduceSum(_Reduce):
    op_type = "ReduceSum"
    axes_input_from = 13


class ReduceMean(_Reduce):
    op_type = "ReduceMean"

    def post(self, k, acc, count):
        return k.builder.fmul(acc, k.f32(1.0 / count)) if count else k.f32(math.nan)


class ReduceMax(_Reduce):
    op_type = "ReduceMax"
    start = -math.inf

    def combine(self, k, a, b):
        return k.maximum(a, b)


class ReduceMin(_Reduce):
    op_type = "ReduceMin"
    start = math.inf

    def combine(self, k, a, b):
        return k.minimum(a, b)


class ReduceProd(_Reduce):
    op_type = "ReduceProd"
    start = 1.0

    def combine(self, k, a, b):
        return k.builder.fmul(a, b)


class ReduceL1(_Reduce):
    op_type = "ReduceL1"

    def pre(self, k, x):
        return k.maximum(x, k.builder.fsub(k.f32(0.0), x))


class ReduceSumSquare(_Reduce):
    op_type = "ReduceSumSquare"

    def pre(self, k, x):
        return k.builder.fmul(x, x)


class ReduceL2(ReduceSumSquare):
    op_type = "ReduceL2"

    def post(self, k, acc, count):
        return k.sqrt(acc)


class ReduceLogSum(_Reduce):
    op_type = "ReduceLogSum"

    def post(self, k, acc, count):
        return safe_log(k, acc)


class ReduceLogSumExp(_Reduce):
    """log(sum(exp(x - m))) + m with m the maximum, so that exp never overflows."""

    op_type = "ReduceLogSumExp"

    def reduce(self, k, base, reduced, pre=None, combine=None, start=None):
        peak = super().reduce(k, base, reduced, pre=lambda v: v, combine=k.maximum, start=-math.inf)
        # An all -inf (or empty) input would give -inf - -inf = NaN below.
        shift = k.builder.select(k.builder.fcmp_ordered("==", peak, k.f32(-math.inf)), k.f32(0.0), peak)

        def shifted_exp(value):
            return k.exp(k.builder.fsub(value, broadcast_scalar(k, shift, value)))
        total = super().reduce(k, base, reduced, pre=shifted_exp)
        return k.builder.fadd(safe_log(k, total), shift)
