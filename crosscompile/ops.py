"""The supported ONNX ops, one class each: attribute parsing, shape
inference and lowering to LLVM IR through an emit.Kernel.

Adding an op means adding one class here and listing it in OPS.
"""
from __future__ import annotations

import math

import numpy as np

from .emit import Kernel
from .errors import BuildError, ShapeError
from .ir import Tensor

Shape = tuple


def _prod(dims) -> int:
    return int(math.prod(dims))


def _axis(axis: int, rank: int, *, allow_end: bool = False) -> int:
    """Normalise a possibly negative axis; allow_end admits axis == rank."""
    upper = rank + 1 if allow_end else rank
    if not -rank <= axis < upper:
        raise ShapeError(f"axis {axis} is out of range for a rank-{rank} tensor")
    return axis + rank if axis < 0 else axis


def _broadcast_strides(shape: Shape, out_shape: Shape) -> list[int]:
    """Element strides of a C-order tensor of `shape` read at `out_shape`
    indices under numpy broadcasting (stride 0 along broadcast dims)."""
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    strides, step = [], 1
    for dim in reversed(padded):
        strides.append(0 if dim == 1 else step)
        step *= dim
    return strides[::-1]


class Op:
    """Base for one ONNX op.

    compile_time_inputs: input positions whose values must be constants; the
    frontend hands them to attributes() and drops them from the node.
    alias: the output holds input 0's data unchanged, so the memory planner may
    let it share input 0's buffer; lower() is then only used when it cannot.
    """

    op_type = ""
    compile_time_inputs: tuple[int, ...] = ()
    alias = False

    def attributes(self, raw: dict, constants: dict, opset: int) -> dict:
        return {}

    def infer(self, inputs: list[Shape], attrs: dict) -> list[Shape]:
        raise NotImplementedError

    def lower(self, k: Kernel, inputs: list[Tensor], outputs: list[Tensor], attrs: dict) -> None:
        raise NotImplementedError


class AliasOp(Op):
    """An op that only reinterprets its input's shape."""

    alias = True

    def lower(self, k, inputs, outputs, attrs):
        with k.loop(outputs[0].size) as i:
            k.store(k.load(k.inputs[0], i), k.outputs[0], i)


def _matmul(k: Kernel, m: int, kdim: int, n: int, a_strides, b_strides) -> None:
    """out[m, n] = sum_k A[m, k] * B[k, n], with A and B read through strides.

    The loop order keeps the innermost loop on unit stride: over n when B's
    rows are contiguous, otherwise over k as a dot product.
    """
    a, b, out = k.inputs[0], k.inputs[1], k.outputs[0]
    bld = k.builder
    if b_strides[1] == 1:
        with k.loop(m) as i:
            with k.loop(n) as j:
                k.store(k.f32(0.0), out, k.index((i, n), (j, 1)))
            with k.loop(kdim) as p:
                aval = k.load(a, k.index((i, a_strides[0]), (p, a_strides[1])))
                with k.loop(n) as j:
                    o = k.index((i, n), (j, 1))
                    bval = k.load(b, k.index((p, b_strides[0]), (j, 1)))
                    k.store(bld.fadd(k.load(out, o), bld.fmul(aval, bval)), out, o)
    else:
        with k.loop(m) as i:
            with k.loop(n) as j:
                acc = k.variable(k.f32(0.0))
                with k.loop(kdim) as p:
                    aval = k.load(a, k.index((i, a_strides[0]), (p, a_strides[1])))
                    bval = k.load(b, k.index((p, b_strides[0]), (j, b_strides[1])))
                    bld.store(bld.fadd(bld.load(acc), bld.fmul(aval, bval)), acc)
                k.store(bld.load(acc), out, k.index((i, n), (j, 1)))


class Gemm(Op):
    op_type = "Gemm"

    def attributes(self, raw, constants, opset):
        return {"alpha": float(raw.get("alpha", 1.0)), "beta": float(raw.get("beta", 1.0)),
                "transA": int(raw.get("transA", 0)), "transB": int(raw.get("transB", 0))}

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3) or len(inputs[0]) != 2 or len(inputs[1]) != 2:
            raise ShapeError(f"Gemm needs 2-D A and B, got shapes {inputs[:2]}")
        m, ka = inputs[0][::-1] if attrs["transA"] else inputs[0]
        kb, n = inputs[1][::-1] if attrs["transB"] else inputs[1]
        if ka != kb:
            raise ShapeError(f"Gemm inner dimensions differ: A gives K={ka}, B gives K={kb}")
        if len(inputs) == 3:
            c = inputs[2]
            if len(c) > 2 or any(d not in (1, full) for d, full in zip(c[::-1], (n, m))):
                raise ShapeError(f"Gemm C of shape {c} does not broadcast to ({m}, {n})")
        return [(m, n)]

    def lower(self, k, inputs, outputs, attrs):
        # Strides are (along M, along K) for A and (along K, along N) for B.
        (a_rows, a_cols), (_, b_cols) = inputs[0].shape, inputs[1].shape
        a_strides = (1, a_cols) if attrs["transA"] else (a_cols, 1)
        b_strides = (1, b_cols) if attrs["transB"] else (b_cols, 1)
        kdim = a_rows if attrs["transA"] else a_cols
        m, n = outputs[0].shape
        _matmul(k, m, kdim, n, a_strides, b_strides)
        alpha, beta = attrs["alpha"], attrs["beta"]
        has_c = len(inputs) == 3 and beta != 0.0
        if alpha == 1.0 and not has_c:
            return
        bld, out = k.builder, k.outputs[0]
        c_strides = _broadcast_strides(inputs[2].shape, (m, n)) if has_c else None
        with k.loop(m) as i:
            with k.loop(n) as j:
                o = k.index((i, n), (j, 1))
                value = bld.fmul(k.load(out, o), k.f32(alpha))
                if has_c:
                    c = k.load(k.inputs[2], k.index((i, c_strides[0]), (j, c_strides[1])))
                    value = bld.fadd(value, bld.fmul(c, k.f32(beta)))
                k.store(value, out, o)


class MatMul(Op):
    op_type = "MatMul"

    def infer(self, inputs, attrs):
        a, b = inputs
        if len(a) < 2 or len(b) != 2:
            raise ShapeError(f"MatMul supports A of rank >= 2 times a 2-D B, got {a} x {b}")
        if a[-1] != b[0]:
            raise ShapeError(f"MatMul inner dimensions differ: {a} x {b}")
        return [(*a[:-1], b[1])]

    def lower(self, k, inputs, outputs, attrs):
        a, b = inputs[0].shape, inputs[1].shape
        _matmul(k, _prod(a[:-1]), a[-1], b[1], (a[-1], 1), (b[1], 1))


class Add(Op):
    op_type = "Add"

    def infer(self, inputs, attrs):
        try:
            return [tuple(np.broadcast_shapes(*inputs))]
        except ValueError:
            raise ShapeError(f"Add operands of shapes {inputs[0]} and {inputs[1]} do not broadcast") from None

    def lower(self, k, inputs, outputs, attrs):
        out = outputs[0]
        bld = k.builder
        if all(t.shape == out.shape for t in inputs):
            with k.loop(out.size) as i:
                k.store(bld.fadd(k.load(k.inputs[0], i), k.load(k.inputs[1], i)), k.outputs[0], i)
            return
        out_strides = _broadcast_strides(out.shape, out.shape)
        a_strides, b_strides = (_broadcast_strides(t.shape, out.shape) for t in inputs)
        with k.nested_loops(out.shape) as idx:
            a = k.load(k.inputs[0], k.index(*zip(idx, a_strides)))
            b = k.load(k.inputs[1], k.index(*zip(idx, b_strides)))
            k.store(bld.fadd(a, b), k.outputs[0], k.index(*zip(idx, out_strides)))


class Relu(Op):
    op_type = "Relu"

    def infer(self, inputs, attrs):
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        bld = k.builder
        with k.loop(outputs[0].size) as i:
            x = k.load(k.inputs[0], i)
            negative = bld.fcmp_ordered("<", x, k.f32(0.0))
            k.store(bld.select(negative, k.f32(0.0), x), k.outputs[0], i)


class Softmax(Op):
    """Before opset 13 Softmax flattens to 2-D at `axis` (default 1) and
    normalises over everything after it; from 13 on it normalises over the
    single dimension `axis` (default -1)."""

    op_type = "Softmax"

    def attributes(self, raw, constants, opset):
        legacy = opset < 13
        return {"axis": int(raw.get("axis", 1 if legacy else -1)), "flatten": legacy}

    def infer(self, inputs, attrs):
        _axis(attrs["axis"], len(inputs[0]))
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        shape = inputs[0].shape
        axis = _axis(attrs["axis"], len(shape))
        outer = _prod(shape[:axis])
        if attrs["flatten"]:
            length, inner = _prod(shape[axis:]), 1
        else:
            length, inner = shape[axis], _prod(shape[axis + 1:])
        x, y, bld = k.inputs[0], k.outputs[0], k.builder
        with k.loop(outer) as o, k.loop(inner) as r:
            def at(j):
                return k.index((o, length * inner), (j, inner), (r, 1))
            peak = k.variable(k.f32(-math.inf))
            with k.loop(length) as j:
                bld.store(k.maximum(bld.load(peak), k.load(x, at(j))), peak)
            total = k.variable(k.f32(0.0))
            with k.loop(length) as j:
                e = k.exp(bld.fsub(k.load(x, at(j)), bld.load(peak)))
                k.store(e, y, at(j))
                bld.store(bld.fadd(bld.load(total), e), total)
            scale = bld.fdiv(k.f32(1.0), bld.load(total))
            with k.loop(length) as j:
                k.store(bld.fmul(k.load(y, at(j)), scale), y, at(j))


class Flatten(AliasOp):
    op_type = "Flatten"

    def attributes(self, raw, constants, opset):
        return {"axis": int(raw.get("axis", 1))}

    def infer(self, inputs, attrs):
        shape = inputs[0]
        axis = _axis(attrs["axis"], len(shape), allow_end=True)
        return [(_prod(shape[:axis]), _prod(shape[axis:]))]


class Reshape(AliasOp):
    op_type = "Reshape"
    compile_time_inputs = (1,)

    def attributes(self, raw, constants, opset):
        shape = constants.get(1)
        if shape is None:
            raise BuildError("Reshape needs its 'shape' input")
        return {"shape": tuple(int(d) for d in np.asarray(shape).reshape(-1)),
                "allowzero": int(raw.get("allowzero", 0))}

    def infer(self, inputs, attrs):
        src, requested = inputs[0], list(attrs["shape"])
        for i, d in enumerate(requested):
            if d == 0 and not attrs["allowzero"]:
                if i >= len(src):
                    raise ShapeError(f"Reshape to {attrs['shape']}: 0 at position {i} but input {src} has rank {len(src)}")
                requested[i] = src[i]
        if requested.count(-1) > 1:
            raise ShapeError(f"Reshape to {attrs['shape']}: at most one -1 is allowed")
        if -1 in requested:
            known = _prod(d for d in requested if d != -1)
            if known == 0 or _prod(src) % known:
                raise ShapeError(f"cannot reshape {src} to {attrs['shape']}")
            requested[requested.index(-1)] = _prod(src) // known
        if _prod(requested) != _prod(src) or any(d < 0 for d in requested):
            raise ShapeError(f"cannot reshape {src} ({_prod(src)} elements) to {attrs['shape']}")
        return [tuple(requested)]


class Identity(AliasOp):
    op_type = "Identity"

    def infer(self, inputs, attrs):
        return [inputs[0]]


class Dropout(AliasOp):
    """Inference-mode Dropout is the identity; only output 0 is computed."""

    op_type = "Dropout"
    compile_time_inputs = (1, 2)

    def attributes(self, raw, constants, opset):
        training = constants.get(2)
        if training is not None and bool(np.asarray(training).reshape(-1)[0]):
            raise BuildError("Dropout with training_mode=True is not supported (inference only)")
        return {}

    def infer(self, inputs, attrs):
        return [inputs[0]]


OPS: dict[str, Op] = {op.op_type: op for op in (
    Gemm(), MatMul(), Add(), Relu(), Softmax(), Flatten(), Reshape(), Identity(), Dropout(),
)}
