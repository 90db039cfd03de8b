"""Element-wise ops: unary functions, which fuse into the epilogue of the
node producing their input (passes.fuse_elementwise), and n-ary ops under
numpy broadcasting."""
from __future__ import annotations

import numpy as np

from .emit import Kernel
from .errors import ShapeError
from .op_base import Op, _broadcast_strides, _check_choice, _const_float


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
    vectorizable = True

    def apply(self, k, x, attrs):
        return k.sqrt(x)


class Reciprocal(Unary):
    op_type = "Reciprocal"

    def apply(self, k, x, attrs):
        return k.builder.fdiv(k.f32(1.0), x)


class Log(Unary):
    """log(x); log(0) = -inf and log(x < 0) = NaN, as numpy gives."""

    op_type = "Log"
    vectorizable = True

    def apply(self, k, x, attrs):
        return safe_log(k, x)


def safe_log(k: Kernel, x):
    """Kernel.log with numpy's answers at 0 (-inf) and below (NaN)."""
    b = k.builder
    y = b.select(b.fcmp_ordered("==", x, k.f32(0.0)), k.f32(-np.inf), k.log(x))
    return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), k.f32(np.nan), y)


class Erf(Unary):
    op_type = "Erf"
    vectorizable = True

    def apply(self, k, x, attrs):
        return k.erf(x)


class Gelu(Unary):
    """x * Phi(x) (opset 20), with Phi by erf or, for approximate="tanh",
    0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))). patterns.fuse_gelu
    turns the Erf form exporters write before opset 20 into this op."""

    op_type = "Gelu"
    vectorizable = True

    def attributes(self, raw, constants, opset):
        approximate = raw.get("approximate", "none")
        _check_choice("approximate", approximate, ("none", "tanh"))
        return {"approximate": approximate}

    def apply(self, k, x, attrs):
        b = k.builder
        if attrs["approximate"] == "tanh":
            inner = b.fmul(x, b.fadd(k.f32(1.0), b.fmul(k.f32(0.044715), b.fmul(x, x))))
            phi = k.tanh(b.fmul(inner, k.f32(np.sqrt(2.0 / np.pi))))
        else:
            phi = k.erf(b.fmul(x, k.f32(np.sqrt(0.5))))
        return b.fmul(b.fmul(x, k.f32(0.5)), b.fadd(k.f32(1.0), phi))


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
        sources = [k.typed(ptr, t.dtype) for ptr, t in zip(k.inputs, inputs)]
        dest = k.typed(k.outputs[0], out.dtype)
        if all(t.shape == out.shape for t in inputs):
            with k.loop(out.size) as i:
                value = self.combine(k, [k.load(ptr, i) for ptr in sources])
                k.store(k.activate(value), dest, i)
            return
        shape = out.shape or (1,)
        out_strides = _broadcast_strides(shape, shape)
        in_strides = [_broadcast_strides(s, shape)
                      for s in self.operand_shapes([t.shape for t in inputs], attrs)]
        shape, (out_strides, *in_strides) = _merge_dims(shape, [out_strides, *in_strides])
        with k.nested_loops(shape) as idx:
            values = [k.load(ptr, k.index(*zip(idx, st))) for ptr, st in zip(sources, in_strides)]
            k.store(k.activate(self.combine(k, values)), dest, k.index(*zip(idx, out_strides)))


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


class Pow(Elementwise):
    """x ** y under numpy broadcasting. A constant scalar exponent (the
    decomposed LayerNorm's 2) makes it a unary op that fuses like Relu:
    small integer powers are products, 0.5 a square root."""

    op_type = "Pow"
    def folds_constant(self, pos, value):
        return pos == 1 and value.size == 1

    def attributes(self, raw, constants, opset):
        return {} if 1 not in constants else {"exponent": float(np.asarray(constants[1]).reshape(-1)[0])}

    # Fusable and vectorizable as the unary form (passes.fuse_elementwise
    # only fuses nodes of one runtime input).
    fusable = True
    vectorizable = True

    def infer(self, inputs, attrs):
        if "exponent" in attrs:
            return [inputs[0]]
        return super().infer(inputs, attrs)

    def lower(self, k, inputs, outputs, attrs):
        if "exponent" in attrs:
            Unary.lower(self, k, inputs, outputs, attrs)
        else:
            super().lower(k, inputs, outputs, attrs)

    def apply(self, k, x, attrs):
        return power(k, x, attrs["exponent"])

    def combine(self, k, values):
        return power(k, *values)


def power(k: Kernel, x, y):
    """x ** y as numpy computes it in float32, for a Python float or an IR
    value y: exp(y * log|x|), negated for a negative x and an odd integer y,
    NaN for a negative x and a fractional y; x ** 0 is 1."""
    b = k.builder
    if not isinstance(y, float):
        return _power_of_value(k, x, y)
    if y == int(y) and abs(y) <= 4:
        if y == 0:
            return k.f32(1.0)
        result = x
        for _ in range(int(abs(y)) - 1):
            result = b.fmul(result, x)
        return b.fdiv(k.f32(1.0), result) if y < 0 else result
    if y == 0.5:
        return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), k.f32(np.nan), k.sqrt(x))
    return _power_of_value(k, x, k.f32(y))


def _power_of_value(k: Kernel, x, y):
    b = k.builder
    ax = k.maximum(x, b.fsub(k.f32(0.0), x))
    magnitude = k.exp(b.fmul(y, safe_log(k, ax)))
    # y's parity and integrality: y - 2 * trunc(y / 2) is 0 or +-1 for integers.
    half = b.fptosi(b.fmul(y, k.f32(0.5)), k._int_type(y))
    rest = b.fsub(y, b.fmul(b.sitofp(half, y.type), k.f32(2.0)))
    odd = b.fcmp_ordered("!=", rest, k.f32(0.0))
    integer = b.fcmp_ordered("==", b.sitofp(b.fptosi(y, k._int_type(y)), y.type), y)
    negative = b.fcmp_ordered("<", x, k.f32(0.0))
    signed = b.select(b.and_(negative, odd), b.fsub(k.f32(0.0), magnitude), magnitude)
    result = b.select(b.and_(negative, b.not_(integer)), k.f32(np.nan), signed)
    return b.select(b.fcmp_ordered("==", y, k.f32(0.0)), k.f32(1.0), result)
