"""The supported ONNX ops, one class each: attribute parsing, shape
inference and lowering to LLVM IR through an emit.Kernel.

Adding an op means adding one class here and listing it in OPS.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from .emit import F32, Kernel
from .gemm import (divide, emit_channel_gemm, emit_depthwise, emit_dot_rows, emit_gemm, panel_offset, splits_columns,
                   tile_for)
from .errors import BuildError, ShapeError
from .ir import Tensor
from .vectors import horizontal_reduce, load_strided, row_pieces, splat, vector_epilogue

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
    Raising BuildError (or ShapeError) from attributes() or infer() is how an
    op rejects a model; the frontend adds the node's name and op type.
    """

    op_type = ""
    compile_time_inputs: tuple[int, ...] = ()
    alias = False
    # An element-wise op of one runtime input that can run as the epilogue of
    # the node producing that input (see passes.fuse_elementwise).
    fusable = False
    # The frontend adds attrs["outputs"] = the node's output count.
    counts_outputs = False
    # apply() works on vectors as well as scalars (fused into vector epilogues).
    vectorizable = False

    def attributes(self, raw: dict, constants: dict, opset: int) -> dict:
        return {}

    def infer(self, inputs: list[Shape], attrs: dict) -> list[Shape]:
        raise NotImplementedError

    def lower(self, k: Kernel, inputs: list[Tensor], outputs: list[Tensor], attrs: dict) -> None:
        raise NotImplementedError

    def scratch_bytes(self, inputs: list[Tensor], outputs: list[Tensor], attrs: dict) -> int:
        """Temporary bytes lower() needs during the call (then k.scratch is set)."""
        return 0

    def parallel(self, attrs: dict) -> bool:
        """lower() splits its work between threads (Kernel.part/barrier):
        every thread of tether_run_parallel calls the kernel, not only the first."""
        return False


class AliasOp(Op):
    """An op that only reinterprets its input's shape."""

    alias = True

    def lower(self, k, inputs, outputs, attrs):
        with k.loop(outputs[0].size) as i:
            k.store(k.load(k.inputs[0], i), k.outputs[0], i)


def _matmul(k: Kernel, m: int, kdim: int, n: int, a_strides, b_strides, bases=(0, 0, 0)) -> None:
    """out[m, n] = sum_k A[m, k] * B[k, n], with A and B read through strides
    from element offsets bases = (A, B, out) (ints or i64 values).

    The loop order keeps the innermost loop on unit stride: over n when B's
    rows are contiguous, otherwise over k as a dot product.
    """
    a, b, out = k.inputs[0], k.inputs[1], k.outputs[0]
    a0, b0, o0 = ((base, 1) for base in bases)
    bld = k.builder
    if b_strides[1] == 1:
        with k.loop(m) as i:
            with k.loop(n) as j:
                k.store(k.f32(0.0), out, k.index(o0, (i, n), (j, 1)))
            with k.loop(kdim) as p:
                aval = k.load(a, k.index(a0, (i, a_strides[0]), (p, a_strides[1])))
                with k.loop(n) as j:
                    o = k.index(o0, (i, n), (j, 1))
                    bval = k.load(b, k.index(b0, (p, b_strides[0]), (j, 1)))
                    k.store(bld.fadd(k.load(out, o), bld.fmul(aval, bval)), out, o)
    else:
        with k.loop(m) as i:
            with k.loop(n) as j:
                acc = k.variable(k.f32(0.0))
                with k.loop(kdim) as p:
                    aval = k.load(a, k.index(a0, (i, a_strides[0]), (p, a_strides[1])))
                    bval = k.load(b, k.index(b0, (p, b_strides[0]), (j, b_strides[1])))
                    bld.store(bld.fadd(bld.load(acc), bld.fmul(aval, bval)), acc)
                k.store(bld.load(acc), out, k.index(o0, (i, n), (j, 1)))


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
        if attrs["transB"] and not attrs["transA"] and k.target is not None:
            emit_dot_rows(k, k.target.lanes, m, kdim, n,
                          k.inputs[0], k.inputs[1], k.outputs[0])
        else:
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
                k.store(k.activate(value), out, o)


class MatMul(Op):
    """numpy matmul: 1-D operands are promoted and the added axis dropped;
    batch dimensions broadcast."""

    op_type = "MatMul"

    @staticmethod
    def _geometry(a, b):
        a2 = (1, *a) if len(a) == 1 else tuple(a)
        b2 = (*b, 1) if len(b) == 1 else tuple(b)
        if a2[-1] != b2[-2]:
            raise ShapeError(f"MatMul inner dimensions differ: {tuple(a)} x {tuple(b)}")
        try:
            batch = tuple(np.broadcast_shapes(a2[:-2], b2[:-2]))
        except ValueError:
            raise ShapeError(f"MatMul batch dimensions of {tuple(a)} and {tuple(b)} do not broadcast") from None
        out = batch + (a2[-2],) * (len(a) > 1) + (b2[-1],) * (len(b) > 1)
        return a2, b2, batch, out

    def infer(self, inputs, attrs):
        if len(inputs) != 2 or not inputs[0] or not inputs[1]:
            raise ShapeError(f"MatMul takes two tensors of rank >= 1, got {inputs}")
        return [self._geometry(*inputs)[3]]

    def lower(self, k, inputs, outputs, attrs):
        a2, b2, batch, _ = self._geometry(inputs[0].shape, inputs[1].shape)
        m, kdim, n = a2[-2], a2[-1], b2[-1]
        if not batch:
            _matmul(k, m, kdim, n, (kdim, 1), (n, 1))
            return
        a_strides = _broadcast_strides(a2[:-2], batch)
        b_strides = _broadcast_strides(b2[:-2], batch)
        o_strides = _broadcast_strides(batch, batch)
        with k.nested_loops(batch) as idx:
            bases = (k.index(*zip(idx, [s * m * kdim for s in a_strides])),
                     k.index(*zip(idx, [s * kdim * n for s in b_strides])),
                     k.index(*zip(idx, [s * m * n for s in o_strides])))
            _matmul(k, m, kdim, n, (kdim, 1), (n, 1), bases)


class Expand(Op):
    """Broadcast to a constant shape (numpy rules, both ways)."""

    op_type = "Expand"
    compile_time_inputs = (1,)

    def attributes(self, raw, constants, opset):
        shape = _const_ints(constants, 1)
        if shape is None:
            raise BuildError("Expand needs a constant shape")
        return {"shape": shape}

    def infer(self, inputs, attrs):
        try:
            return [tuple(np.broadcast_shapes(inputs[0], attrs["shape"]))]
        except ValueError:
            raise ShapeError(f"Expand: {inputs[0]} does not broadcast with {attrs['shape']}") from None

    def lower(self, k, inputs, outputs, attrs):
        out = outputs[0].shape
        _copy_strided(k, out, _broadcast_strides(inputs[0].shape, out))


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


def _ints(raw: dict, name: str, default=None):
    value = raw.get(name, default)
    return None if value is None else tuple(int(v) for v in value)


def _const_ints(constants: dict, pos: int):
    value = constants.get(pos)
    return None if value is None else tuple(int(v) for v in np.asarray(value).reshape(-1))


def _const_float(constants: dict, pos: int):
    value = constants.get(pos)
    return None if value is None else float(np.asarray(value).reshape(-1)[0])


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise BuildError(f"attribute {name}={value!r} is not supported; supported: "
                         f"{', '.join(repr(a) for a in allowed)}")


# -- element-wise ---------------------------------------------------------------

class Unary(Op):
    """y = f(x) element by element; fusable into the producer of x."""

    fusable = True

    def infer(self, inputs, attrs):
        if len(inputs) != 1:
            raise ShapeError(f"{self.op_type} takes one runtime input, got {len(inputs)}")
        return [inputs[0]]

    def apply(self, k: Kernel, x, attrs):
        raise NotImplementedError

    def lower(self, k, inputs, outputs, attrs):
        with k.loop(outputs[0].size) as i:
            k.store(k.activate(self.apply(k, k.load(k.inputs[0], i), attrs)), k.outputs[0], i)


class Relu(Unary):
    op_type = "Relu"
    vectorizable = True

    def apply(self, k, x, attrs):
        return k.builder.select(k.builder.fcmp_ordered("<", x, k.f32(0.0)), k.f32(0.0), x)


class LeakyRelu(Unary):
    op_type = "LeakyRelu"
    vectorizable = True

    def attributes(self, raw, constants, opset):
        return {"alpha": float(raw.get("alpha", 0.01))}

    def apply(self, k, x, attrs):
        b = k.builder
        return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), b.fmul(x, k.f32(attrs["alpha"])), x)


class Sigmoid(Unary):
    op_type = "Sigmoid"
    vectorizable = True

    def apply(self, k, x, attrs):
        return k.sigmoid(x)


class Tanh(Unary):
    op_type = "Tanh"
    vectorizable = True

    def apply(self, k, x, attrs):
        return k.tanh(x)


class HardSigmoid(Unary):
    op_type = "HardSigmoid"
    vectorizable = True

    def attributes(self, raw, constants, opset):
        return {"alpha": float(raw.get("alpha", 0.2)), "beta": float(raw.get("beta", 0.5))}

    def apply(self, k, x, attrs):
        b = k.builder
        return k.clamp(b.fadd(b.fmul(x, k.f32(attrs["alpha"])), k.f32(attrs["beta"])), 0.0, 1.0)


class HardSwish(Unary):
    op_type = "HardSwish"
    vectorizable = True

    def apply(self, k, x, attrs):
        b = k.builder
        return b.fmul(x, k.clamp(b.fadd(b.fmul(x, k.f32(1.0 / 6.0)), k.f32(0.5)), 0.0, 1.0))


class Clip(Unary):
    """min/max are attributes before opset 11 and optional constant inputs after."""

    op_type = "Clip"
    vectorizable = True
    compile_time_inputs = (1, 2)

    def attributes(self, raw, constants, opset):
        if opset < 11:
            lo, hi = raw.get("min"), raw.get("max")
        else:
            lo, hi = _const_float(constants, 1), _const_float(constants, 2)
        return {"min": None if lo is None else float(lo), "max": None if hi is None else float(hi)}

    def apply(self, k, x, attrs):
        if attrs["min"] is not None:
            x = k.maximum(x, k.f32(attrs["min"]))
        if attrs["max"] is not None:
            x = k.minimum(x, k.f32(attrs["max"]))
        return x


class Neg(Unary):
    op_type = "Neg"
    vectorizable = True

    def apply(self, k, x, attrs):
        return k.builder.fsub(k.f32(0.0), x)


class Abs(Unary):
    op_type = "Abs"
    vectorizable = True

    def apply(self, k, x, attrs):
        return k.maximum(x, k.builder.fsub(k.f32(0.0), x))


class Exp(Unary):
    op_type = "Exp"
    vectorizable = True

    def apply(self, k, x, attrs):
        return k.exp(x)


class Sqrt(Unary):
    op_type = "Sqrt"

    def apply(self, k, x, attrs):
        return k.sqrt(x)


class Reciprocal(Unary):
    op_type = "Reciprocal"

    def apply(self, k, x, attrs):
        return k.builder.fdiv(k.f32(1.0), x)


class Elementwise(Op):
    """n-ary op with numpy broadcasting. The innermost loop runs over the
    output's last dimension, so same-shape and per-channel operands both give
    unit-stride loops LLVM vectorises."""

    arity = (2, 2)

    def infer(self, inputs, attrs):
        lo, hi = self.arity
        if not lo <= len(inputs) <= hi:
            raise ShapeError(f"{self.op_type} takes {lo}..{hi} runtime inputs, got {len(inputs)}")
        try:
            return [tuple(np.broadcast_shapes(*inputs))]
        except ValueError:
            shapes = " and ".join(str(s) for s in inputs)
            raise ShapeError(f"{self.op_type} operands of shapes {shapes} do not broadcast") from None

    def combine(self, k: Kernel, values: list):
        raise NotImplementedError

    def operand_shapes(self, shapes, attrs):
        """The shapes broadcast against each other (an op may reinterpret one)."""
        return list(shapes)

    def lower(self, k, inputs, outputs, attrs):
        out = outputs[0]
        if all(t.shape == out.shape for t in inputs):
            with k.loop(out.size) as i:
                value = self.combine(k, [k.load(ptr, i) for ptr in k.inputs])
                k.store(k.activate(value), k.outputs[0], i)
            return
        shape = out.shape or (1,)
        out_strides = _broadcast_strides(shape, shape)
        in_strides = [_broadcast_strides(s, shape)
                      for s in self.operand_shapes([t.shape for t in inputs], attrs)]
        shape, (out_strides, *in_strides) = _merge_dims(shape, [out_strides, *in_strides])
        with k.nested_loops(shape) as idx:
            values = [k.load(ptr, k.index(*zip(idx, st))) for ptr, st in zip(k.inputs, in_strides)]
            k.store(k.activate(self.combine(k, values)), k.outputs[0], k.index(*zip(idx, out_strides)))


def _merge_dims(shape, strides_list):
    """Merge each dimension into the next where every operand steps through
    both as one (same-shape or broadcast alike): a per-channel operand of
    (1, C, 1, 1) against (1, C, H, W) leaves loops over C and H * W, and the
    long inner loop vectorises where W alone (7 to 56) would barely.

    >>> _merge_dims((1, 4, 2, 3), [[24, 6, 3, 1], [0, 1, 0, 0]])
    ((4, 6), [[6, 1], [1, 0]])
    """
    dims = [(size, list(st)) for size, st in zip(shape, zip(*strides_list)) if size != 1] or [(1, [0] * len(strides_list))]
    merged = [dims[0]]
    for size, st in dims[1:]:
        prev_size, prev = merged[-1]
        if all(p == s * size for p, s in zip(prev, st)):
            merged[-1] = (prev_size * size, st)
        else:
            merged.append((size, st))
    return tuple(size for size, _ in merged), [list(col) for col in zip(*(st for _, st in merged))]


def _fold(fn):
    def combine(self, k, values):
        acc = values[0]
        for v in values[1:]:
            acc = fn(k, acc, v)
        return acc
    return combine


class Add(Elementwise):
    op_type = "Add"
    combine = _fold(lambda k, a, b: k.builder.fadd(a, b))


class Sub(Elementwise):
    op_type = "Sub"
    combine = _fold(lambda k, a, b: k.builder.fsub(a, b))


class Mul(Elementwise):
    op_type = "Mul"
    combine = _fold(lambda k, a, b: k.builder.fmul(a, b))


class Div(Elementwise):
    op_type = "Div"
    combine = _fold(lambda k, a, b: k.builder.fdiv(a, b))


class Sum(Elementwise):
    op_type = "Sum"
    arity = (1, 1 << 16)
    combine = _fold(lambda k, a, b: k.builder.fadd(a, b))


class Max(Elementwise):
    op_type = "Max"
    arity = (1, 1 << 16)
    combine = _fold(lambda k, a, b: k.maximum(a, b))


class Min(Elementwise):
    op_type = "Min"
    arity = (1, 1 << 16)
    combine = _fold(lambda k, a, b: k.minimum(a, b))


class Mean(Elementwise):
    op_type = "Mean"
    arity = (1, 1 << 16)

    def combine(self, k, values):
        acc = values[0]
        for v in values[1:]:
            acc = k.builder.fadd(acc, v)
        return k.builder.fmul(acc, k.f32(1.0 / len(values)))


class PRelu(Elementwise):
    """y = x < 0 ? slope * x : x, slope broadcast to x (unidirectionally).
    Before opset 7 a 1-D slope of size C applies along the channel axis."""

    op_type = "PRelu"

    def attributes(self, raw, constants, opset):
        return {"channel_slope": opset < 7}

    def operand_shapes(self, shapes, attrs):
        x, slope = shapes
        if attrs["channel_slope"] and len(slope) == 1 and len(x) > 2 and slope[0] == x[1]:
            return [x, (slope[0],) + (1,) * (len(x) - 2)]
        return [x, slope]

    def infer(self, inputs, attrs):
        out = super().infer(self.operand_shapes(inputs, attrs), attrs)
        if out[0] != tuple(inputs[0]):
            raise ShapeError(f"PRelu slope of shape {inputs[1]} does not broadcast to X {inputs[0]}")
        return out

    def combine(self, k, values):
        x, slope = values
        b = k.builder
        return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), b.fmul(x, slope), x)


# -- convolution and pooling --------------------------------------------------------

def _window(in_dims, kernel, strides, dilations, pads, auto_pad, ceil_mode=False):
    """Output sizes and (begin, end) pads of a sliding window over in_dims."""
    n = len(in_dims)
    out, begin, end = [], [], []
    for i in range(n):
        size, k, s, d = in_dims[i], kernel[i], strides[i], dilations[i]
        extent = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-size // s)
            total = max(0, (o - 1) * s + extent - size)
            small = total // 2
            pb, pe = (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)
        else:
            pb, pe = (0, 0) if auto_pad == "VALID" else (pads[i], pads[i + n])
            span = size + pb + pe - extent
            if span < 0:
                raise ShapeError(f"window of extent {extent} (kernel {k}, dilation {d}) is larger "
                                 f"than the padded input ({size} + {pb} + {pe})")
            o = (-(-span // s) if ceil_mode else span // s) + 1
            # ceil_mode: a window must start inside the input or the begin padding.
            if ceil_mode and (o - 1) * s >= size + pb:
                o -= 1
        out.append(o)
        begin.append(pb)
        end.append(pe)
    return tuple(out), tuple(begin), tuple(end)


def _window_attributes(raw) -> dict:
    auto_pad = raw.get("auto_pad", "NOTSET")
    _check_choice("auto_pad", auto_pad, ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"))
    return {"kernel_shape": _ints(raw, "kernel_shape"), "strides": _ints(raw, "strides"),
            "pads": _ints(raw, "pads"), "auto_pad": auto_pad, "dilations": _ints(raw, "dilations")}


def _resolve_window(x_shape, kernel, attrs, ceil_mode=False, what="window"):
    """Spatial geometry as 3-D (depth, height, width); 1-D and 2-D inputs get
    unit leading dimensions, so one lowering serves all three ranks."""
    spatial = tuple(x_shape[2:])
    n = len(spatial)
    if n not in (1, 2, 3):
        raise ShapeError(f"only 1-D, 2-D and 3-D {what}s are supported, input has shape {tuple(x_shape)}")
    if len(kernel) != n:
        raise ShapeError(f"kernel_shape {kernel} does not fit input {tuple(x_shape)}")
    strides = attrs["strides"] or (1,) * n
    dilations = attrs.get("dilations") or (1,) * n
    pads = attrs["pads"] or (0,) * (2 * n)
    if len(strides) != n or len(dilations) != n or len(pads) != 2 * n:
        raise ShapeError(f"strides {strides}, dilations {dilations} or pads {pads} do not fit "
                         f"a {n}-D {what}")
    if min(strides) < 1 or min(dilations) < 1 or min(kernel) < 1:
        raise BuildError(f"strides {strides}, dilations {dilations} and kernel {kernel} must be >= 1")
    out, begin, end = _window(spatial, kernel, strides, dilations, pads, attrs["auto_pad"], ceil_mode)
    ones, zeros = (1,) * (3 - n), (0,) * (3 - n)
    return (ones + spatial, ones + tuple(kernel), ones + tuple(strides), ones + tuple(dilations),
            zeros + tuple(begin), zeros + tuple(end), ones + tuple(out))


def _valid_range(offset: int, stride: int, size: int, count: int) -> tuple[int, int]:
    """Output positions o in [0, count) with 0 <= o * stride + offset < size."""
    lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
    last = size - 1 - offset
    hi = 0 if last < 0 else min(count, last // stride + 1)
    return lo, max(lo, hi)


class Conv(Op):
    """2-D (and 1-D) convolution, NCHW, with groups, dilation and padding.

    Lowered as a direct loop nest whose innermost loop runs along one output
    row with the weight held in a register: contiguous for stride 1, so LLVM
    vectorises it. Padding never becomes a branch in that loop: the valid
    range of output columns for each kernel column is computed here. A 1x1
    stride-1 convolution runs over the whole plane as one row (a GEMM).
    Bias and fused activations are applied to each finished row.
    """

    op_type = "Conv"

    def attributes(self, raw, constants, opset):
        attrs = _window_attributes(raw)
        attrs["group"] = int(raw.get("group", 1))
        return attrs

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise ShapeError(f"Conv takes X, W and an optional B, got {len(inputs)} inputs")
        x, w = inputs[0], inputs[1]
        if len(x) != len(w) or len(x) < 3:
            raise ShapeError(f"Conv input {x} and weight {w} ranks do not match")
        group = attrs["group"]
        if group < 1 or x[1] % group or w[0] % group or x[1] // group != w[1]:
            raise ShapeError(f"Conv with group={group}: input channels {x[1]} and weight {w} do not fit")
        kernel = attrs["kernel_shape"] or tuple(w[2:])
        if tuple(kernel) != tuple(w[2:]):
            raise ShapeError(f"kernel_shape {kernel} differs from the weight's {tuple(w[2:])}")
        if len(inputs) == 3 and tuple(inputs[2]) != (w[0],):
            raise ShapeError(f"Conv bias of shape {inputs[2]} should be ({w[0]},)")
        *_, out = _resolve_window(x, kernel, attrs, what="convolution")
        out = out[5 - len(x):]
        return [(x[0], w[0], *out)]

    def scratch_bytes(self, inputs, outputs, attrs):
        if "packed_mr" not in attrs:
            return 0
        x, w = inputs[0].shape, attrs["weight_shape"]
        geometry = _resolve_window(x, tuple(w[2:]), attrs, what="convolution")
        if self._pointwise(geometry):
            return 0
        pixels = getattr(attrs.get("gemm_tile"), "pixels", 0)
        direct = _direct_plan(geometry, x[1] // attrs["group"], w[0] // attrs["group"], attrs, any_grid=bool(pixels))
        if direct is not None:
            return 4 * direct.scratch_floats
        return 4 * _prod(w[1:]) * _prod(geometry[-1])  # one group's im2col

    def parallel(self, attrs):
        return "packed_mr" in attrs or bool(attrs.get("depthwise"))

    @staticmethod
    def _pointwise(geometry) -> bool:
        _, kernel, strides, _, begin, end, _ = geometry
        return set(kernel + strides) == {1} and set(begin + end) == {0}

    def lower(self, k, inputs, outputs, attrs):
        if "packed_mr" in attrs:
            self._lower_gemm(k, inputs, outputs, attrs)
            return
        if attrs.get("depthwise") and k.target is not None:
            geometry = _resolve_window(inputs[0].shape, tuple(inputs[1].shape[2:]), attrs, what="convolution")
            epilogue = vector_epilogue(k)
            lanes = k.target.lanes
            with k.loop(inputs[0].shape[0]) as image:
                c_n = inputs[0].shape[1]
                volume_in, volume_out = _prod(geometry[0]), _prod(geometry[-1])
                x = k.builder.gep(k.inputs[0], [k.index((image, c_n * volume_in))])
                y = k.builder.gep(k.outputs[0], [k.index((image, c_n * volume_out))])
                emit_depthwise(k, lanes, c_n, geometry, x, y, k.inputs[2] if len(inputs) == 3 else None, epilogue)
            k.activated = epilogue or not k.epilogue
            return
        x, w = inputs[0].shape, inputs[1].shape
        (dz, h, wd), (kz, kh_n, kw_n), (sz, sh, sw), (ddz, dh, dw), (pz, ph, pw), _, (oz, oh_n, ow_n) = \
            _resolve_window(x, tuple(w[2:]), attrs, what="convolution")
        if (kz, kh_n, kw_n, sz, sh, sw, pz, ph, pw) == (1, 1, 1, 1, 1, 1, 0, 0, 0):
            # pointwise: the whole volume is one row
            dz, h, wd, oz, oh_n, ow_n = 1, 1, dz * h * wd, 1, 1, dz * h * wd
        n_n, c_n, m_n, group = x[0], x[1], w[0], attrs["group"]
        mg, cg = m_n // group, c_n // group
        # Output channels in blocks: each input value loaded feeds `block` rows.
        block = next(b for b in (4, 2, 1) if mg % b == 0)
        volume_in, volume_out, taps = dz * h * wd, oz * oh_n * ow_n, kz * kh_n * kw_n
        bld = k.builder
        X, W, Y = k.inputs[0], k.inputs[1], k.outputs[0]
        bias = k.inputs[2] if len(inputs) == 3 else None
        with k.loop(n_n) as n, k.loop(group) as g, k.loop(mg // block) as mb:
            oc = k.index((g, mg), (mb, block))
            starts = [k.load(bias, bld.add(oc, k.i64(b))) if bias is not None else k.f32(0.0)
                      for b in range(block)]
            with k.loop(oz) as od, k.loop(oh_n) as oh:
                row = k.index((n, m_n * volume_out), (oc, volume_out), (od, oh_n * ow_n), (oh, ow_n))
                rows = [bld.add(row, k.i64(b * volume_out)) for b in range(block)]
                with k.loop(ow_n) as ow:
                    for r, start in zip(rows, starts):
                        k.store(start, Y, bld.add(r, ow))
                with k.loop(cg) as c:
                    plane = k.index((n, c_n * volume_in), (g, cg * volume_in), (c, volume_in))
                    wbase = k.index((oc, cg * taps), (c, taps))
                    with k.loop(kz) as kd:
                        iz = k.index((od, sz), (kd, ddz), (-pz, 1))
                        with bld.if_then(k.in_range(iz, dz)), k.loop(kh_n) as kh:
                            ih = k.index((oh, sh), (kh, dh), (-ph, 1))
                            with bld.if_then(k.in_range(ih, h)):
                                line = k.index((plane, 1), (iz, h * wd), (ih, wd))
                                for kw in range(kw_n):
                                    offset = kw * dw - pw
                                    lo, hi = _valid_range(offset, sw, wd, ow_n)
                                    if lo >= hi:
                                        continue
                                    tap = k.index((wbase, 1), (kd, kh_n * kw_n), (kh, kw_n), (kw, 1))
                                    weights = [k.load(W, bld.add(tap, k.i64(b * cg * taps)))
                                               for b in range(block)]
                                    with k.loop(hi, start=lo) as ow:
                                        src = k.load(X, k.index((line, 1), (ow, sw), (offset, 1)))
                                        for r, weight in zip(rows, weights):
                                            o = bld.add(r, ow)
                                            k.store(bld.fadd(k.load(Y, o), bld.fmul(weight, src)), Y, o)
                if k.epilogue:
                    with k.loop(ow_n) as ow:
                        for r in rows:
                            o = bld.add(r, ow)
                            k.store(k.activate(k.load(Y, o)), Y, o)
        k.activated = True


    def _lower_gemm(self, k, inputs, outputs, attrs):
        """Convolution as C[M, N] = W[M, K] @ B[K, N] per image and group, with W
        packed at compile time (passes.pack_conv_weights) and B the input
        itself for a pointwise convolution, windows of a padded copy of it
        where _direct_plan allows (most 2-D convolutions), otherwise its
        im2col in scratch."""
        x, w = inputs[0].shape, attrs["weight_shape"]
        geometry = _resolve_window(x, tuple(w[2:]), attrs, what="convolution")
        tile = attrs.get("gemm_tile") or tile_for(k.target)
        if tile.mr != attrs["packed_mr"]:
            raise BuildError(f"Conv weights were packed for {attrs['packed_mr']} rows, the target's tile has {tile.mr}")
        group = attrs["group"]
        m, kdim = w[0] // group, _prod(w[1:])
        cg = x[1] // group
        volume_in, n = _prod(geometry[0]), _prod(geometry[-1])
        residual_at = attrs.get("residual_at")
        has_bias = len(inputs) - (residual_at is not None) == 3
        if residual_at is not None:
            # The memory planner may give the output the residual's buffer.
            for arg in (k.inputs[-1], k.outputs[0]):
                arg.attributes.discard("noalias")
        epilogue = vector_epilogue(k)
        bld = k.builder
        a_group = -(-m // tile.mr) * tile.mr * kdim
        # The panel copies' zero fills and row copies would otherwise become
        # memset/memcpy calls, which 32-bit Android names __aeabi_memclr4
        # and __aeabi_memcpy4: symbols its loader does not promise. llvmlite
        # does not know this string attribute, hence the set's own add().
        set.add(k.function.attributes, '"no-builtins"')
        pointwise = self._pointwise(geometry)
        direct = None if pointwise else _direct_plan(geometry, cg, m, attrs, any_grid=bool(tile.pixels))
        if tile.pixels and not pointwise and direct is None:
            raise BuildError(f"Conv with input {x} and weight {w}: the transposed tile {tile.label} reads "
                             "1-D and 2-D windows in place only; schedule a tile of rows [mr, nv] for it")
        if tile.pixels:
            if pointwise:
                taps = _i32_table(k, tuple(c * volume_in for c in range(cg)))
                bases = _i32_table(k, tuple(range(n)))
            else:
                taps = _i32_table(k, direct.offsets)
                bases = _i32_table(k, direct.pixel_bases)
        with k.loop(x[0]) as image, k.loop(group) as g:
            x_base = k.index((image, x[1] * volume_in), (g, cg * volume_in))
            y_base = k.index((image, w[0] * n), (g, m * n))
            a_ptr = bld.gep(k.inputs[1], [k.index((g, a_group))])
            bias = bld.gep(k.inputs[2], [k.index((g, m))]) if has_bias else None
            if tile.pixels:
                if pointwise:
                    source = bld.gep(k.inputs[0], [x_base])
                else:
                    _copy_padded(k, direct, x_base)
                    source = k.scratch
                residual = k.inputs[-1] if residual_at is not None else None
                emit_channel_gemm(k, tile, m, kdim, n, a_ptr, source, taps, bases, k.outputs[0], y_base,
                                  bias, epilogue, residual, residual_at or 0)
                k.barrier()  # before the next image or group overwrites the copy
            elif direct is not None:
                _direct_conv(k, tile, direct, x_base, a_ptr, bias, epilogue, y_base)
            else:
                self._gemm_group(k, tile, geometry, m, kdim, n, cg, pointwise, x_base, y_base,
                                 a_ptr, bias, epilogue, residual_at)
        k.activated = epilogue or not k.epilogue

    @staticmethod
    def _gemm_group(k, tile, geometry, m, kdim, n, cg, pointwise, x_base, y_base,
                    a_ptr, bias, epilogue, residual_at):
        """One image and group: B is the input itself (pointwise) or its im2col."""
        bld = k.builder
        pack = None
        if pointwise:
            b_ptr, b_base = k.inputs[0], x_base
        elif splits_columns(tile, m, n):
            # Each thread fills the panels it multiplies, a chunk at a
            # time, just before using them: the chunk is still in L2
            # then, where a whole-image im2col would have gone out to
            # L3 or memory and back (7 MB for a 3x3 conv of 64 x 56 x 56).
            b_ptr, b_base = k.scratch, k.i64(0)

            def pack(p_lo, p_hi):
                ends = [bld.mul(p, k.i64(tile.nr)) for p in (p_lo, p_hi)]
                _im2col(k, tile, cg, geometry, x_base, (k.i64(0), k.i64(cg)),
                        (ends[0], k.smin(ends[1], k.i64(n))))
        else:
            _im2col(k, tile, cg, geometry, x_base, k.part(cg), (k.i64(0), k.i64(n)))
            k.barrier()  # every thread's GEMM reads all of im2col
            b_ptr, b_base = k.scratch, k.i64(0)
        emit_gemm(k, tile, m, kdim, n, a_ptr, b_ptr, b_base, n,
                  k.outputs[0], y_base, bias, epilogue,
                  k.inputs[-1] if residual_at is not None else None, residual_at or 0,
                  b_panels=not pointwise, pack=pack)
        if not pointwise and pack is None:
            k.barrier()  # before the next image or group overwrites im2col


@dataclass(frozen=True)
class _DirectPlan:
    """Geometry of a convolution read in place (_direct_conv).

    The padded input is copied once into `planes` per channel, plane (rh,
    rw) holding the padded positions (y * sh + rh, x * sw + rw): for stride
    1 that is the padded image itself, for stride s its s x s phases. Then
    every tap (c, kh, kw) reads, for output (oh, ow), the element at
    offsets[tap] + oh * wq + ow of that buffer: B of the GEMM is a set of
    windows of one buffer, with columns on a virtual grid of width wq
    (the last wq - ow_n columns of each row are computed and dropped).
    """
    channels: int
    rows: int            # output channels (GEMM rows)
    planes: tuple        # (rh, rw) phases in buffer order, hq x wq each
    hq: int
    wq: int
    offsets: tuple       # per (c, kh, kw) tap, in the weights' K order
    n_virtual: int       # GEMM columns: (oh_n - 1) * wq + ow_n
    buffer_floats: int   # the copied input plus the tail the last windows read
    cbuf_at: int         # where the virtual-grid output starts in scratch
    scratch_floats: int
    geometry: tuple

    @property
    def pixel_bases(self) -> tuple:
        """Where each output pixel's windows start: oh * wq + ow."""
        (oh_n, ow_n) = self.geometry[-1][1:]
        return tuple(oh * self.wq + ow for oh in range(oh_n) for ow in range(ow_n))


GRID_COLUMNS_MULTIPLE = 4


def _direct_plan(geometry, channels: int, m: int, attrs, any_grid: bool = False) -> "_DirectPlan | None":
    """How to run a 1-D/2-D convolution without im2col, or None where the
    im2col GEMM serves (3-D, a fused residual, grids much wider than the
    output, 1x1 kernels but for a strided one whose grid is its output:
    that copies just the pixels it reads). With any_grid (for
    emit_channel_gemm, which reads each output pixel's window itself and
    writes the output in place) only 3-D is refused."""
    (dz, h, wd), (kz, kh_n, kw_n), (sz, sh, sw), (ddz, dh, dw), (pz, ph, pw), (ez, eh, ew), \
        (oz, oh_n, ow_n) = geometry
    if dz != 1 or kz != 1 or (attrs.get("residual_at") is not None and not any_grid):
        return None
    hp, wp = h + ph + eh, wd + pw + ew
    hq, wq = -(-hp // sh), -(-wp // sw)
    if sw == 1:
        # Rows share their padding columns: a window running off the right
        # end of a row reads the next row's left padding, zeros as well.
        wq = wd + max(pw, ew)
    rows = sorted({kh * dh % sh for kh in range(kh_n)})
    cols = sorted({kw * dw % sw for kw in range(kw_n)})
    planes = tuple((rh, rw) for rh in rows for rw in cols)
    plane = hq * wq
    offsets = tuple((c * len(planes) + planes.index((kh * dh % sh, kw * dw % sw))) * plane
                    + kh * dh // sh * wq + kw * dw // sw
                    for c in range(channels) for kh in range(kh_n) for kw in range(kw_n))
    # Whole vectors in the last panel: the extra columns are dropped like
    # the rest of the grid's.
    n_virtual = -(-((oh_n - 1) * wq + ow_n) // GRID_COLUMNS_MULTIPLE) * GRID_COLUMNS_MULTIPLE
    # The dropped columns cost FMAs: on a 7 x 7 output (56 for 49) they cost
    # more than the im2col copy saves; at 14 x 14 (wq 15) less.
    if n_virtual > 1.1 * oh_n * ow_n and not any_grid:
        return None
    if kh_n * kw_n == 1 and n_virtual != oh_n * ow_n and not any_grid:
        # A 1x1 kernel reads each input once: im2col copies no more than
        # this path, which then gains only where it writes C in place.
        return None
    buffer_floats = max(channels * len(planes) * plane, max(offsets) + n_virtual)
    if buffer_floats >= 2 ** 31:
        return None
    cbuf_at = -(-buffer_floats // 16) * 16
    scratch = buffer_floats if any_grid else cbuf_at + m * n_virtual
    return _DirectPlan(channels, m, planes, hq, wq, offsets, n_virtual, buffer_floats, cbuf_at,
                       scratch, geometry)


def _direct_conv(k: Kernel, tile, plan: _DirectPlan, x_base, a_ptr, bias, epilogue: bool, y_base) -> None:
    """One image and group of a convolution as a GEMM whose B rows are
    windows of the (padded, phase-split) input: one copy of the input in
    place of im2col's kh * kw, then one copy of the output from the virtual
    grid. Threads split the copy's channels, the GEMM's panels and the
    output's rows, with a barrier between the three."""
    _copy_padded(k, plan, x_base)
    bld, buf = k.builder, k.scratch
    oh_n, ow_n = plan.geometry[-1][1:]
    table = _i32_table(k, plan.offsets)
    rows = plan.rows
    if plan.n_virtual == oh_n * ow_n:
        # The grid is the output (e.g. a strided 1x1 convolution): no copy.
        emit_gemm(k, tile, rows, len(plan.offsets), plan.n_virtual, a_ptr, buf, k.i64(0), 0,
                  k.outputs[0], y_base, bias, epilogue, b_offsets=table)
        k.barrier()  # before the next image or group overwrites the buffer
        return
    cbuf = bld.gep(buf, [k.i64(plan.cbuf_at)])
    emit_gemm(k, tile, rows, len(plan.offsets), plan.n_virtual, a_ptr, buf, k.i64(0), 0,
              cbuf, k.i64(0), bias, epilogue, b_offsets=table)
    k.barrier()  # each thread copies out rows other threads computed
    r_lo, r_hi = k.part(rows)
    with k.loop(r_hi, start=r_lo) as r, k.loop(oh_n) as oh:
        src = k.index((r, plan.n_virtual), (oh, plan.wq))
        dst = k.index((y_base, 1), (r, oh_n * ow_n), (oh, ow_n))
        with k.loop(ow_n) as ow:
            k.store(k.load(cbuf, bld.add(src, ow)), k.outputs[0], bld.add(dst, ow))
    k.barrier()  # before the next image or group overwrites the buffers


def _copy_padded(k: Kernel, plan: _DirectPlan, x_base) -> None:
    """Copy one image and group of the input into scratch as the plan's
    padded (phase-split) planes, zero tail included; threads split the
    channels and meet at a barrier after."""
    (_, h, wd), _, (_, sh, sw), _, (_, ph, pw), _, _ = plan.geometry
    bld, X = k.builder, k.inputs[0]
    buf = k.scratch
    plane = plan.hq * plan.wq
    n_planes = len(plan.planes)
    c_lo, c_hi = k.part(plan.channels)
    with k.loop(c_hi, start=c_lo) as c:
        src_plane = k.index((x_base, 1), (c, h * wd))
        for index, (rh, rw) in enumerate(plan.planes):
            dst_plane = k.index((c, n_planes * plane), (index * plane, 1))
            lo, hi = _valid_range(rw - pw, sw, wd, plan.wq)
            with k.loop(plan.hq) as y:
                iy = k.index((y, sh), (rh - ph, 1))
                inside = k.in_range(iy, h)
                line = bld.select(inside, k.index((src_plane, 1), (iy, wd), (rw - pw, 1)), src_plane)
                dst = k.index((dst_plane, 1), (y, plan.wq))
                for first, last, copy in ((0, lo, False), (lo, hi, True), (max(lo, hi), plan.wq, False)):
                    if first >= last:
                        continue
                    with k.loop(last, start=first) as x:
                        if copy:
                            value = bld.select(inside, k.load(X, bld.select(inside, k.index((line, 1), (x, sw)),
                                                                               src_plane)), k.f32(0.0))
                        else:
                            value = k.f32(0.0)
                        k.store(value, buf, bld.add(dst, x))
    tail_lo, tail_hi = k.part(plan.buffer_floats - plan.channels * n_planes * plane)
    base = plan.channels * n_planes * plane
    with k.loop(tail_hi, start=tail_lo) as i:
        k.store(k.f32(0.0), buf, bld.add(i, k.i64(base)))
    k.barrier()  # the GEMM's windows cross the channels other threads copied


def _i32_table(k: Kernel, offsets: tuple) -> ir.Value:
    """Offsets (taps, pixel bases) as a constant i32 array of the module."""
    ty = ir.ArrayType(ir.IntType(32), len(offsets))
    gv = ir.GlobalVariable(k.module, ty, name=k.module.get_unique_name("tether.taps"))
    gv.global_constant = True
    gv.linkage = "internal"
    gv.initializer = ir.Constant(ty, list(offsets))
    return k.builder.gep(gv, [k.i64(0), k.i64(0)])


def _im2col(k: Kernel, tile, channels: int, geometry, x_base, chans, cols) -> None:
    """scratch[(c, kd, kh, kw), (od, oh, ow)] = the input value that tap
    meets at that output position, 0 in the padding, for input channels
    c in chans = (lo, hi) and output positions (flattened) in cols =
    (start, end), written in the GEMM's column-panel layout (gemm.panel_offset)."""
    (dz, h, wd), (kz, kh_n, kw_n), (sz, sh, sw), (ddz, dh, dw), (pz, ph, pw), _, (oz, oh_n, ow_n) = geometry
    n = oz * oh_n * ow_n
    kdim = channels * kz * kh_n * kw_n
    bld, X = k.builder, k.inputs[0]
    start, end = cols
    r_lo = divide(k, start, ow_n)
    r_hi = bld.add(divide(k, bld.sub(end, k.i64(1)), ow_n), k.i64(1))
    with k.loop(chans[1], start=chans[0]) as c, k.loop(kz) as kd, k.loop(kh_n) as kh:
        plane = k.index((x_base, 1), (c, dz * h * wd))
        for kw in range(kw_n):
            row = k.index((c, kz * kh_n * kw_n), (kd, kh_n * kw_n), (kh, kw_n), (kw, 1))
            offset = kw * dw - pw
            lo, hi = _valid_range(offset, sw, wd, ow_n)
            with k.loop(r_hi, start=r_lo) as r:  # output rows (od, oh) the columns cross
                od = divide(k, r, oh_n) if oz > 1 else k.i64(0)
                oh = bld.sub(r, bld.mul(od, k.i64(oh_n)))
                iz = k.index((od, sz), (kd, ddz), (-pz, 1))
                ih = k.index((oh, sh), (kh, dh), (-ph, 1))
                inside = bld.and_(k.in_range(iz, dz), k.in_range(ih, h))
                # Out-of-range rows read a valid row and select 0 instead, so
                # the copy loop has no branch and vectorises.
                line = bld.select(inside, k.index((plane, 1), (iz, h * wd), (ih, wd), (offset, 1)), plane)
                col0 = bld.mul(r, k.i64(ow_n))
                first = k.smax(bld.sub(start, col0), k.i64(0))
                last = k.smin(bld.sub(end, col0), k.i64(ow_n))

                def copy(ow, line=line, inside=inside):
                    src = bld.select(inside, k.index((line, 1), (ow, sw)), plane)
                    return bld.select(inside, k.load(X, src), k.f32(0.0))
                segments = []
                if lo > 0:
                    segments.append((first, k.smin(last, k.i64(lo)), None))
                if lo < hi:
                    segments.append((k.smax(first, k.i64(lo)), k.smin(last, k.i64(hi)), copy))
                if max(hi, lo) < ow_n:
                    segments.append((k.smax(first, k.i64(max(hi, lo))), last, None))
                for seg_first, seg_last, value in segments:
                    _panel_row(k, tile, kdim, n, row, col0, seg_first, seg_last, value)


def _panel_row(k: Kernel, tile, kdim: int, n: int, row, col0, first, last, value) -> None:
    """scratch[row, col0 + j] = value(j) (0 when value is None) for j in
    [first, last), in column-panel layout: one contiguous loop per panel
    the columns cross."""
    bld = k.builder
    start, end = bld.add(col0, first), bld.add(col0, last)
    p_lo = divide(k, start, tile.nr)
    p_hi = bld.add(divide(k, bld.sub(end, k.i64(1)), tile.nr), k.i64(1))
    with k.loop(p_hi, start=p_lo) as panel:
        base = panel_offset(k, tile, kdim, n, row, panel)
        panel_col = bld.mul(panel, k.i64(tile.nr))
        lo = k.smax(start, panel_col)
        hi = k.smin(end, bld.add(panel_col, k.i64(tile.nr)))
        with k.loop(hi, start=lo) as col:
            v = k.f32(0.0) if value is None else value(bld.sub(col, col0))
            k.store(v, k.scratch, bld.add(base, col))


class _Pool(Op):
    """MaxPool / AveragePool over 1-D or 2-D windows; only output 0 (no Indices).
    Channels are split between threads when passes.mark_split set attrs["split"]."""

    def attributes(self, raw, constants, opset):
        attrs = _window_attributes(raw)
        if attrs["kernel_shape"] is None:
            raise BuildError(f"{self.op_type} needs the kernel_shape attribute")
        attrs["ceil_mode"] = int(raw.get("ceil_mode", 0))
        attrs["count_include_pad"] = int(raw.get("count_include_pad", 0))
        if int(raw.get("storage_order", 0)) != 0:
            raise BuildError("storage_order=1 is not supported (only row-major indices)")
        return attrs

    def infer(self, inputs, attrs):
        x = inputs[0]
        if len(x) < 3:
            raise ShapeError(f"{self.op_type} needs an N x C x spatial input, got {x}")
        *_, out = _resolve_window(x, attrs["kernel_shape"], attrs, bool(attrs["ceil_mode"]),
                                  what=self.op_type)
        return [(x[0], x[1], *out[5 - len(x):])]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        dims, kernel, strides, dilations, begin, end, out = \
            _resolve_window(x, attrs["kernel_shape"], attrs, bool(attrs["ceil_mode"]))
        is_max = self.op_type == "MaxPool"
        if tuple(kernel) == tuple(dims) and not any(begin) and not any(end) and set(dilations) == {1}:
            # One window over the whole input (ResNet's 7x7 average): a global pool.
            global_pool(k, x[0] * x[1], _prod(dims), is_max)
            return
        if dims[0] == 1 and kernel[0] == 1:
            self._lower_rows(k, x, dims[1:], kernel[1:], strides[1:], dilations[1:], begin[1:], end[1:],
                             out[1:], is_max, bool(attrs["count_include_pad"]))
            return
        bld = k.builder
        X, Y = k.inputs[0], k.outputs[0]
        in_strides, out_strides = _c_strides(dims), _c_strides(out)
        lo, hi = k.part(x[0] * x[1])
        with k.loop(hi, start=lo) as nc, k.nested_loops(out) as opos:
            acc = k.variable(k.f32(-math.inf if is_max else 0.0))
            valid = k.variable(k.f32(0.0))
            padded = k.variable(k.f32(0.0))
            with k.nested_loops(kernel) as kpos:
                ipos = [k.index((o, s), (kk, d), (-b, 1))
                        for o, kk, s, d, b in zip(opos, kpos, strides, dilations, begin)]
                if not is_max:
                    # count_include_pad counts positions inside the padded input.
                    inside_pad = None
                    for i, size, e in zip(ipos, dims, end):
                        ok = bld.icmp_signed("<", i, k.i64(size + e))
                        inside_pad = ok if inside_pad is None else bld.and_(inside_pad, ok)
                    with bld.if_then(inside_pad):
                        bld.store(bld.fadd(bld.load(padded), k.f32(1.0)), padded)
                inside = None
                for i, size in zip(ipos, dims):
                    ok = k.in_range(i, size)
                    inside = ok if inside is None else bld.and_(inside, ok)
                with bld.if_then(inside):
                    v = k.load(X, k.index((nc, _prod(dims)), *zip(ipos, in_strides)))
                    if is_max:
                        bld.store(k.maximum(bld.load(acc), v), acc)
                    else:
                        bld.store(bld.fadd(bld.load(acc), v), acc)
                        bld.store(bld.fadd(bld.load(valid), k.f32(1.0)), valid)
            result = bld.load(acc)
            if not is_max:
                count = bld.load(padded if attrs["count_include_pad"] else valid)
                result = bld.fdiv(result, count)
            k.store(k.activate(result), Y, k.index((nc, _prod(out)), *zip(opos, out_strides)))


    @staticmethod
    def _lower_rows(k, x, dims, kernel, strides, dilations, begin, end, out, is_max, include_pad):
        """1-D and 2-D windows, one output row at a time: rows of the window
        outside the input are masked by a select decided once per output
        row, and the columns whose window lies inside the row run without
        any check, so the loop vectorises; only the few columns at the
        edges test each tap."""
        (h, wd), (kh_n, kw_n), (sh, sw), (dh, dw), (ph, pw), (eh, ew), (oh_n, ow_n) = \
            dims, kernel, strides, dilations, begin, end, out
        bld = k.builder
        X, Y = k.inputs[0], k.outputs[0]
        lo = min(ow_n, max(_valid_range(kw * dw - pw, sw, wd, ow_n)[0] for kw in range(kw_n)))
        hi = max(lo, min(_valid_range(kw * dw - pw, sw, wd, ow_n)[1] for kw in range(kw_n)))
        empty = k.f32(-math.inf if is_max else 0.0)
        one, zero = k.f32(1.0), k.f32(0.0)
        # Explicit vectors for the interior columns, where every fused op has a vector form.
        lanes = k.target.lanes if k.target is not None else 1
        vectors = vector_epilogue(k) or not k.epilogue
        nc_lo, nc_hi = k.part(x[0] * x[1])
        with k.loop(nc_hi, start=nc_lo) as nc, k.loop(oh_n) as oh:
            plane = k.index((nc, h * wd))
            rows = []
            for kh in range(kh_n):
                ih = k.index((oh, sh), (kh * dh - ph, 1))
                inside = k.in_range(ih, h)
                counted = bld.icmp_signed("<", ih, k.i64(h + eh)) if include_pad else inside
                rows.append((inside, counted, bld.select(inside, k.index((plane, 1), (ih, wd)), plane)))
            out_row = k.index((nc, oh_n * ow_n), (oh, ow_n))
            row_count = zero
            if not is_max:
                for _, counted, _ in rows:
                    row_count = bld.fadd(row_count, bld.select(counted, one, zero))

            def combine(acc, value):
                return k.maximum(acc, value) if is_max else bld.fadd(acc, value)

            divisor = bld.fmul(row_count, k.f32(kw_n))  # of every interior column's sum

            def interior(first, last):  # a loop LLVM vectorises at full width
                with k.loop(last, start=first) as ow:
                    acc = empty
                    for inside, _, line in rows:
                        for kw in range(kw_n):
                            value = k.load(X, k.index((line, 1), (ow, sw), (kw * dw - pw, 1)))
                            acc = combine(acc, bld.select(inside, value, empty))
                    if not is_max:
                        acc = bld.fdiv(acc, divisor)
                    k.store(k.activate(acc), Y, bld.add(out_row, ow))

            # Rows of a vector's width or more go to LLVM's loop (measured
            # faster there); shorter ones (13 columns next to 16 lanes), which
            # that loop would run as scalars, to narrower explicit vectors.
            short = vectors and hi - lo < lanes
            if not short and lo < hi:
                interior(lo, hi)
            pieces, vec_end = row_pieces(lo, hi, lanes, sw) if short else ([], hi)
            for first, width in pieces:
                with k.vector_constants(width):
                    acc = k.f32(-math.inf if is_max else 0.0)
                    for inside, _, line in rows:
                        for kw in range(kw_n):
                            start = first * sw + kw * dw - pw
                            value = load_strided(k, X, k.index((line, 1), (start, 1)), width, sw,
                                                 spare=wd - (start + (width - 1) * sw + 1))
                            acc = combine(acc, bld.select(inside, value, k.f32(-math.inf if is_max else 0.0)))
                    if not is_max:
                        acc = bld.fdiv(acc, splat(k, divisor, width))
                    acc = k.activate(acc)
                    bld.store(acc, bld.bitcast(bld.gep(Y, [bld.add(out_row, k.i64(first))]),
                                               ir.VectorType(F32, width).as_pointer()), align=4)
            if vec_end < hi:
                interior(vec_end, hi)
            for first, last in ((0, lo), (hi, ow_n)):
                if first >= last:
                    continue
                with k.loop(last, start=first) as ow:
                    acc, count = empty, zero
                    for inside, counted, line in rows:
                        for kw in range(kw_n):
                            iw = k.index((ow, sw), (kw * dw - pw, 1))
                            ok = bld.and_(inside, k.in_range(iw, wd))
                            value = k.load(X, bld.select(ok, bld.add(line, iw), line))
                            acc = combine(acc, bld.select(ok, value, empty))
                            if not is_max:
                                if include_pad:
                                    ok = bld.and_(counted, bld.icmp_signed("<", iw, k.i64(wd + ew)))
                                count = bld.fadd(count, bld.select(ok, one, zero))
                    if not is_max:
                        acc = bld.fdiv(acc, count)
                    k.store(k.activate(acc), Y, bld.add(out_row, ow))

    def parallel(self, attrs):
        return bool(attrs.get("split"))


class MaxPool(_Pool):
    op_type = "MaxPool"


class AveragePool(_Pool):
    op_type = "AveragePool"


def global_pool(k: Kernel, planes: int, size: int, is_max: bool) -> None:
    """Y[p] = max or mean of X[p, :size] for each of `planes` planes.
    Each plane is reduced in vector accumulators (two, to overlap the adds'
    latency), then across their lanes: a scalar sum is one long chain of
    dependent adds, which LLVM may not reorder into vectors itself."""
    bld = k.builder
    lanes = k.target.lanes if k.target is not None else 1
    step = 2 * lanes if lanes > 1 and size >= 2 * lanes else 0
    lo, hi = k.part(planes)

    def combine(a, b):
        return k.maximum(a, b) if is_max else bld.fadd(a, b)

    with k.loop(hi, start=lo) as p:
        base = k.index((p, size))
        acc = k.variable(k.f32(-math.inf if is_max else 0.0))
        if step:
            with k.vector_constants(lanes):
                start = k.f32(-math.inf if is_max else 0.0)
            accs = [k.variable(start) for _ in range(2)]
            with k.loop(size // step) as i:
                at = bld.add(base, bld.mul(i, k.i64(step)))
                for u, slot in enumerate(accs):
                    value = load_strided(k, k.inputs[0], bld.add(at, k.i64(u * lanes)), lanes, 1)
                    with k.vector_constants(lanes):
                        bld.store(combine(bld.load(slot), value), slot)
            with k.vector_constants(lanes):
                vec = combine(bld.load(accs[0]), bld.load(accs[1]))
            bld.store(horizontal_reduce(k, vec, combine), acc)
        with k.loop(size, start=size // step * step if step else 0) as i:
            bld.store(combine(bld.load(acc), k.load(k.inputs[0], bld.add(base, i))), acc)
        result = bld.load(acc) if is_max else bld.fmul(bld.load(acc), k.f32(1.0 / size))
        k.store(k.activate(result), k.outputs[0], p)


class _GlobalPool(Op):
    def infer(self, inputs, attrs):
        x = inputs[0]
        if len(x) < 3:
            raise ShapeError(f"{self.op_type} needs an N x C x spatial input, got {x}")
        return [(x[0], x[1]) + (1,) * (len(x) - 2)]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        global_pool(k, x[0] * x[1], _prod(x[2:]), self.op_type == "GlobalMaxPool")

    def parallel(self, attrs):
        return bool(attrs.get("split"))


class GlobalAveragePool(_GlobalPool):
    op_type = "GlobalAveragePool"


class GlobalMaxPool(_GlobalPool):
    op_type = "GlobalMaxPool"


class BatchNormalization(Op):
    """Inference BatchNorm: y = (x - mean) / sqrt(var + eps) * scale + B per
    channel. passes.fold_batchnorm folds it into a preceding Conv; this
    lowering serves the rest (e.g. BN before Conv in DenseNet)."""

    op_type = "BatchNormalization"

    def attributes(self, raw, constants, opset):
        if opset < 9 and int(raw.get("spatial", 1)) != 1:
            raise BuildError("BatchNormalization with spatial=0 is not supported")
        if int(raw.get("training_mode", 0)):
            raise BuildError("BatchNormalization with training_mode=1 is not supported (inference only)")
        return {"epsilon": float(raw.get("epsilon", 1e-5))}

    def infer(self, inputs, attrs):
        if len(inputs) != 5:
            raise ShapeError(f"BatchNormalization takes X, scale, B, mean, var; got {len(inputs)} inputs")
        x = inputs[0]
        channels = x[1] if len(x) > 1 else 1
        for s in inputs[1:]:
            if tuple(s) != (channels,):
                raise ShapeError(f"BatchNormalization parameter of shape {s} should be ({channels},)")
        return [x]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        channels = x[1] if len(x) > 1 else 1
        inner = _prod(x[2:])
        bld = k.builder
        X, scale, bias, mean, var = k.inputs
        with k.loop(x[0]) as n, k.loop(channels) as c:
            a = bld.fdiv(k.load(scale, c), k.sqrt(bld.fadd(k.load(var, c), k.f32(attrs["epsilon"]))))
            b = bld.fsub(k.load(bias, c), bld.fmul(k.load(mean, c), a))
            with k.loop(inner) as i:
                o = k.index((n, channels * inner), (c, inner), (i, 1))
                k.store(k.activate(bld.fadd(bld.fmul(k.load(X, o), a), b)), k.outputs[0], o)


class LRN(Op):
    """Local response normalisation across channels:
    y = x / (bias + alpha / size * sum of x^2 over the window) ** beta."""

    op_type = "LRN"

    def attributes(self, raw, constants, opset):
        if "size" not in raw:
            raise BuildError("LRN needs the size attribute")
        return {"size": int(raw["size"]), "alpha": float(raw.get("alpha", 1e-4)),
                "beta": float(raw.get("beta", 0.75)), "bias": float(raw.get("bias", 1.0))}

    def infer(self, inputs, attrs):
        if len(inputs[0]) < 2:
            raise ShapeError(f"LRN needs an N x C x ... input, got {inputs[0]}")
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        channels, inner = x[1], _prod(x[2:])
        size = attrs["size"]
        before = (size - 1) // 2
        bld = k.builder
        X = k.inputs[0]
        with k.loop(x[0]) as n, k.loop(channels) as c, k.loop(inner) as i:
            total = k.variable(k.f32(0.0))
            with k.loop(size) as j:
                cc = k.index((c, 1), (j, 1), (-before, 1))
                with bld.if_then(k.in_range(cc, channels)):
                    v = k.load(X, k.index((n, channels * inner), (cc, inner), (i, 1)))
                    bld.store(bld.fadd(bld.load(total), bld.fmul(v, v)), total)
            base = bld.fadd(k.f32(attrs["bias"]), bld.fmul(bld.load(total), k.f32(attrs["alpha"] / size)))
            o = k.index((n, channels * inner), (c, inner), (i, 1))
            value = bld.fdiv(k.load(X, o), k.power(base, attrs["beta"]))
            k.store(k.activate(value), k.outputs[0], o)


# -- data movement --------------------------------------------------------------------

def _copy_strided(k: Kernel, out_shape, src_strides, base: int = 0, src=None, dst=None,
                  dst_offset: int = 0) -> None:
    """dst[i] = src[base + sum(idx * src_strides)] over out_shape in C order."""
    src = k.inputs[0] if src is None else src
    dst = k.outputs[0] if dst is None else dst
    shape = tuple(out_shape) or (1,)
    strides = list(src_strides) or [0]
    dst_strides = _broadcast_strides(shape, shape)
    with k.nested_loops(shape) as idx:
        value = k.load(src, k.index(*zip(idx, strides), (base, 1)))
        k.store(k.activate(value), dst, k.index(*zip(idx, dst_strides), (dst_offset, 1)))


def _c_strides(shape) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


class Gather(Op):
    """Gather from a runtime tensor with constant indices (an embedding
    lookup, a channel pick); with constant data too it folds at import."""

    op_type = "Gather"
    compile_time_inputs = (1,)
    MAX_INDICES = 4096  # each index becomes one copy loop

    def attributes(self, raw, constants, opset):
        indices = constants.get(1)
        if indices is None:
            raise BuildError("Gather needs constant indices")
        indices = np.asarray(indices)
        if indices.dtype.kind not in "iu":
            raise BuildError(f"Gather indices must be integers, got {indices.dtype}")
        if indices.size > self.MAX_INDICES:
            raise BuildError(f"Gather with {indices.size} indices is not supported (at most {self.MAX_INDICES})")
        return {"axis": int(raw.get("axis", 0)), "indices": tuple(int(i) for i in indices.reshape(-1)),
                "indices_shape": tuple(indices.shape)}

    def infer(self, inputs, attrs):
        x = inputs[0]
        axis = _axis(attrs["axis"], len(x))
        for i in attrs["indices"]:
            if not -x[axis] <= i < x[axis]:
                raise ShapeError(f"Gather index {i} is out of range for axis {axis} of size {x[axis]}")
        return [(*x[:axis], *attrs["indices_shape"], *x[axis + 1:])]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        axis = _axis(attrs["axis"], len(x))
        outer, inner = _prod(x[:axis]), _prod(x[axis + 1:])
        count = len(attrs["indices"])
        for j, index in enumerate(attrs["indices"]):
            index %= x[axis]
            with k.loop(outer) as o, k.loop(inner) as i:
                value = k.load(k.inputs[0], k.index((o, x[axis] * inner), (index, inner), (i, 1)))
                k.store(k.activate(value), k.outputs[0], k.index((o, count * inner), (j, inner), (i, 1)))
        k.activated = True


class Transpose(Op):
    op_type = "Transpose"

    def attributes(self, raw, constants, opset):
        return {"perm": _ints(raw, "perm")}

    def infer(self, inputs, attrs):
        x = inputs[0]
        perm = attrs["perm"] or tuple(range(len(x)))[::-1]
        if sorted(perm) != list(range(len(x))):
            raise ShapeError(f"perm {perm} is not a permutation of the {len(x)} axes of {x}")
        return [tuple(x[p] for p in perm)]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        perm = attrs["perm"] or tuple(range(len(x)))[::-1]
        strides = _c_strides(x)
        _copy_strided(k, outputs[0].shape, [strides[p] for p in perm])


class Concat(Op):
    op_type = "Concat"

    def attributes(self, raw, constants, opset):
        if "axis" not in raw:
            if opset >= 4:
                raise BuildError("Concat needs the axis attribute")
            return {"axis": 1}
        return {"axis": int(raw["axis"])}

    def infer(self, inputs, attrs):
        first = inputs[0]
        axis = _axis(attrs["axis"], len(first))
        for s in inputs[1:]:
            if len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != axis):
                raise ShapeError(f"Concat inputs {inputs} differ outside axis {axis}")
        return [(*first[:axis], sum(s[axis] for s in inputs), *first[axis + 1:])]

    def lower(self, k, inputs, outputs, attrs):
        out = outputs[0].shape
        axis = _axis(attrs["axis"], len(out))
        outer, inner = _prod(out[:axis]), _prod(out[axis + 1:])
        offset = 0
        for ptr, t in zip(k.inputs, inputs):
            chunk = t.shape[axis] * inner
            if chunk:
                with k.loop(outer) as o, k.loop(chunk) as j:
                    value = k.load(ptr, k.index((o, chunk), (j, 1)))
                    k.store(k.activate(value), k.outputs[0], k.index((o, out[axis] * inner), (j, 1), (offset, 1)))
            offset += chunk


class Split(Op):
    """split sizes come from the attribute (< 13), a constant input (>= 13),
    num_outputs (>= 18) or equal parts; set by the frontend from the node's
    output count."""

    op_type = "Split"
    compile_time_inputs = (1,)
    counts_outputs = True

    def attributes(self, raw, constants, opset):
        split = _ints(raw, "split") if opset < 13 else _const_ints(constants, 1)
        return {"axis": int(raw.get("axis", 0)), "split": split,
                "num_outputs": raw.get("num_outputs")}

    def infer(self, inputs, attrs):
        x = inputs[0]
        axis = _axis(attrs["axis"], len(x))
        split = attrs["split"]
        count = attrs.get("outputs") or attrs["num_outputs"]
        if split is None:
            if not count:
                raise ShapeError("Split needs split sizes or a number of outputs")
            part = -(-x[axis] // count)
            split = [min(part, x[axis] - part * i) for i in range(count)]
        if sum(split) != x[axis] or min(split) < 0:
            raise ShapeError(f"split sizes {tuple(split)} do not add up to {x[axis]} along axis {axis} of {x}")
        return [(*x[:axis], s, *x[axis + 1:]) for s in split]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        axis = _axis(attrs["axis"], len(x))
        outer, inner = _prod(x[:axis]), _prod(x[axis + 1:])
        offset = 0
        for ptr, t in zip(k.outputs, outputs):
            chunk = t.shape[axis] * inner
            if chunk:
                with k.loop(outer) as o, k.loop(chunk) as j:
                    value = k.load(k.inputs[0], k.index((o, x[axis] * inner), (j, 1), (offset, 1)))
                    k.store(value, ptr, k.index((o, chunk), (j, 1)))
            offset += chunk
        k.activated = True


class Slice(Op):
    """Slice with constant starts/ends/axes/steps (inputs from opset 10)."""

    op_type = "Slice"
    compile_time_inputs = (1, 2, 3, 4)

    def attributes(self, raw, constants, opset):
        if opset < 10:
            return {"starts": _ints(raw, "starts"), "ends": _ints(raw, "ends"),
                    "axes": _ints(raw, "axes"), "steps": None}
        if constants.get(1) is None or constants.get(2) is None:
            raise BuildError("Slice needs constant starts and ends")
        return {"starts": _const_ints(constants, 1), "ends": _const_ints(constants, 2),
                "axes": _const_ints(constants, 3), "steps": _const_ints(constants, 4)}

    @staticmethod
    def _resolve(x, attrs):
        starts, ends = attrs["starts"], attrs["ends"]
        axes = attrs["axes"] or tuple(range(len(starts)))
        steps = attrs["steps"] or (1,) * len(starts)
        begin, step, out = [0] * len(x), [1] * len(x), list(x)
        for s, e, a, st in zip(starts, ends, axes, steps):
            a = _axis(a, len(x))
            if st == 0:
                raise ShapeError("Slice step 0 is not allowed")
            idx = range(x[a])[slice(s, e, st)]
            begin[a], step[a], out[a] = (idx.start if len(idx) else 0), st, len(idx)
        return begin, step, tuple(out)

    def infer(self, inputs, attrs):
        return [self._resolve(inputs[0], attrs)[2]]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        begin, step, out = self._resolve(x, attrs)
        strides = _c_strides(x)
        base = sum(b * s for b, s in zip(begin, strides))
        _copy_strided(k, out, [s * st for s, st in zip(strides, step)], base)


class Pad(Op):
    """constant / reflect / edge padding; pads (and value, axes) are
    attributes before opset 11 and constant inputs after."""

    op_type = "Pad"
    compile_time_inputs = (1, 2, 3)

    def attributes(self, raw, constants, opset):
        mode = raw.get("mode", "constant")
        _check_choice("mode", mode, ("constant", "reflect", "edge"))
        if opset < 11:
            pads, value, axes = _ints(raw, "pads" if opset >= 2 else "paddings"), float(raw.get("value", 0.0)), None
        else:
            pads, value, axes = _const_ints(constants, 1), _const_float(constants, 2) or 0.0, _const_ints(constants, 3)
        if pads is None:
            raise BuildError("Pad needs constant pads")
        return {"mode": mode, "pads": pads, "value": value, "axes": axes}

    @staticmethod
    def _full_pads(rank, attrs):
        axes = attrs["axes"] or tuple(range(rank))
        pads = attrs["pads"]
        if len(pads) != 2 * len(axes):
            raise ShapeError(f"pads {pads} should have {2 * len(axes)} entries")
        begin, end = [0] * rank, [0] * rank
        for i, a in enumerate(axes):
            a = _axis(a, rank)
            begin[a], end[a] = pads[i], pads[i + len(axes)]
        return begin, end

    def infer(self, inputs, attrs):
        x = inputs[0]
        begin, end = self._full_pads(len(x), attrs)
        out = tuple(d + b + e for d, b, e in zip(x, begin, end))
        if min(out, default=1) < 0:
            raise ShapeError(f"pads {attrs['pads']} crop more than the input {x}")
        if attrs["mode"] == "reflect" and any((b > d - 1 or e > d - 1) and (b or e) for d, b, e in zip(x, begin, end)):
            raise ShapeError(f"reflect pads {attrs['pads']} must be smaller than the input dims {x}")
        if attrs["mode"] != "constant" and any(d == 0 and (b or e) for d, b, e in zip(x, begin, end)):
            raise ShapeError(f"{attrs['mode']} padding of an empty dimension in {x}")
        return [out]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        out = outputs[0].shape
        begin, _ = self._full_pads(len(x), attrs)
        strides = _c_strides(x)
        out_strides = _c_strides(out)
        bld = k.builder
        mode = attrs["mode"]
        if not out or _prod(out) == 0:
            k.activated = True
            return
        with k.nested_loops(out) as idx:
            inside = None
            offset = k.i64(0)
            for o, d, b, st in zip(idx, x, begin, strides):
                i = bld.sub(o, k.i64(b))
                if mode == "constant":
                    ok = k.in_range(i, d)
                    inside = ok if inside is None else bld.and_(inside, ok)
                    i = bld.select(ok, i, k.i64(0))
                elif mode == "edge":
                    i = bld.select(bld.icmp_signed("<", i, k.i64(0)), k.i64(0), i)
                    i = bld.select(bld.icmp_signed(">", i, k.i64(d - 1)), k.i64(d - 1), i)
                else:
                    i = bld.select(bld.icmp_signed("<", i, k.i64(0)), bld.sub(k.i64(0), i), i)
                    i = bld.select(bld.icmp_signed(">", i, k.i64(d - 1)), bld.sub(k.i64(2 * d - 2), i), i)
                offset = bld.add(offset, bld.mul(i, k.i64(st)))
            value = k.load(k.inputs[0], offset)
            if inside is not None:
                value = bld.select(inside, value, k.f32(attrs["value"]))
            k.store(k.activate(value), k.outputs[0], k.index(*zip(idx, out_strides)))


class Squeeze(AliasOp):
    op_type = "Squeeze"
    compile_time_inputs = (1,)

    def attributes(self, raw, constants, opset):
        return {"axes": _ints(raw, "axes") if opset < 13 else _const_ints(constants, 1)}

    def infer(self, inputs, attrs):
        x = inputs[0]
        if attrs["axes"] is None:
            return [tuple(d for d in x if d != 1)]
        axes = {_axis(a, len(x)) for a in attrs["axes"]}
        if any(x[a] != 1 for a in axes):
            raise ShapeError(f"Squeeze axes {attrs['axes']} of {x} are not all of size 1")
        return [tuple(d for i, d in enumerate(x) if i not in axes)]


class Unsqueeze(AliasOp):
    op_type = "Unsqueeze"
    compile_time_inputs = (1,)

    def attributes(self, raw, constants, opset):
        axes = _ints(raw, "axes") if opset < 13 else _const_ints(constants, 1)
        if axes is None:
            raise BuildError("Unsqueeze needs axes")
        return {"axes": axes}

    def infer(self, inputs, attrs):
        x = inputs[0]
        rank = len(x) + len(attrs["axes"])
        axes = sorted(_axis(a, rank) for a in attrs["axes"])
        if len(set(axes)) != len(axes):
            raise ShapeError(f"Unsqueeze axes {attrs['axes']} repeat")
        out, rest = [], iter(x)
        for i in range(rank):
            out.append(1 if i in axes else next(rest))
        return [tuple(out)]


class Cast(AliasOp):
    """A runtime Cast is only float32 -> float32 (the identity); casts of
    constants are folded by the frontend."""

    op_type = "Cast"

    def attributes(self, raw, constants, opset):
        to = int(raw.get("to", 0))
        if to != 1:  # TensorProto.FLOAT
            import onnx
            name = onnx.TensorProto.DataType.Name(to) if to in onnx.TensorProto.DataType.values() else to
            raise BuildError(f"Cast of a runtime tensor to {name} is not supported; "
                             "runtime tensors are float32 only")
        return {}

    def infer(self, inputs, attrs):
        return [inputs[0]]


OPS: dict[str, Op] = {op.op_type: op for op in (
    Gemm(), MatMul(), Softmax(), Flatten(), Reshape(), Identity(), Dropout(),
    Relu(), LeakyRelu(), Sigmoid(), Tanh(), HardSigmoid(), HardSwish(), Clip(),
    Neg(), Abs(), Exp(), Sqrt(), Reciprocal(),
    Add(), Sub(), Mul(), Div(), Sum(), Max(), Min(), Mean(), PRelu(),
    Conv(), MaxPool(), AveragePool(), GlobalAveragePool(), GlobalMaxPool(),
    BatchNormalization(), LRN(),
    Expand(), Gather(), Transpose(), Concat(), Split(), Slice(), Pad(), Squeeze(), Unsqueeze(), Cast(),
)}
