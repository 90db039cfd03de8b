"""Element-wise ops: unary functions, which fuse into the epilogue of the
node producing their input (passes.fuse_elementwise), and n-ary ops under
numpy broadcasting."""
from __future__ import annotations

import numpy as np

from .emit import ELEMENT_TYPES, I64, Kernel
from .errors import BuildError, ShapeError
from llvmlite import ir

from .op_base import (INTEGER_DTYPES, NARROW_INTEGERS, NUMERIC_DTYPES, UNSIGNED_DTYPES, Op, _broadcast_strides,
                      _check_choice, _const_float)


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
        src, dst = k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.outputs[0], outputs[0].dtype)
        with k.loop(outputs[0].size) as i:
            k.store(k.activate(self.apply(k, k.load(src, i), attrs)), dst, i)


def is_float(value) -> bool:
    """Whether an IR value is a float32 scalar or vector (else an integer)."""
    element = value.type.element if isinstance(value.type, ir.VectorType) else value.type
    return isinstance(element, (ir.FloatType, ir.DoubleType))


def _int_zero(value):
    return ir.Constant(value.type, 0)


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


class Swish(Unary):
    """x * sigmoid(alpha * x). Its own pass rather than a convolution's
    epilogue: inside a register tile its dozen constants are made again for
    every vector (the accumulators hold the registers), which cost more
    than the pass saves (EfficientNet-B0: 224 M instructions fused against
    216 M as Sigmoid and Mul on a Cortex-A72, and 27.5 ms as its own pass
    against 33.3 ms fused on an AVX2 host)."""

    op_type = "Swish"
    vectorizable = True
    fusable = False

    def attributes(self, raw, constants, opset):
        return {"alpha": float(raw.get("alpha", 1.0))}

    def apply(self, k, x, attrs):
        return k.builder.fmul(x, k.sigmoid(k.builder.fmul(x, k.f32(attrs["alpha"]))))


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
    """-x, of float32 or integer tensors."""

    op_type = "Neg"
    vectorizable = True
    data_dtypes = NUMERIC_DTYPES

    def apply(self, k, x, attrs):
        if is_float(x):
            return k.builder.fsub(k.f32(0.0), x)
        return k.builder.sub(_int_zero(x), x)


class Abs(Unary):
    """|x|, of float32 or integer tensors."""

    op_type = "Abs"
    vectorizable = True
    data_dtypes = NUMERIC_DTYPES

    def apply(self, k, x, attrs):
        if is_float(x):
            return k.maximum(x, k.builder.fsub(k.f32(0.0), x))
        return k.smax(x, k.builder.sub(_int_zero(x), x))


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

    def evaluate(self, k: Kernel, values: list, attrs: dict):
        """combine(), for an op whose result depends on its attributes too."""
        return self.combine(k, values)

    def operand_shapes(self, shapes, attrs):
        """The shapes broadcast against each other (an op may reinterpret one)."""
        return list(shapes)

    def lower(self, k, inputs, outputs, attrs):
        out = outputs[0]
        # Whether integer operands are unsigned (the comparisons, division
        # and extremes ask), and their dtype (BitShift asks its width).
        attrs = dict(attrs, unsigned=inputs[-1].dtype in UNSIGNED_DTYPES, dtype=inputs[-1].dtype)
        sources = [k.typed(ptr, t.dtype) for ptr, t in zip(k.inputs, inputs)]
        dest = k.typed(k.outputs[0], out.dtype)

        def load(ptr, t, offset):
            return widen(k, k.load(ptr, offset), t.dtype)

        def store(value, offset):
            k.store(narrow(k, k.activate(wrap(k, value, out.dtype)), out.dtype), dest, offset)

        if all(t.shape == out.shape for t in inputs):
            with k.loop(out.size) as i:
                store(self.evaluate(k, [load(ptr, t, i) for ptr, t in zip(sources, inputs)], attrs), i)
            return
        shape = out.shape or (1,)
        out_strides = _broadcast_strides(shape, shape)
        in_strides = [_broadcast_strides(s, shape)
                      for s in self.operand_shapes([t.shape for t in inputs], attrs)]
        shape, (out_strides, *in_strides) = _merge_dims(shape, [out_strides, *in_strides])
        with k.nested_loops(shape) as idx:
            values = [load(ptr, t, k.index(*zip(idx, st))) for ptr, t, st in zip(sources, inputs, in_strides)]
            store(self.evaluate(k, values, attrs), k.index(*zip(idx, out_strides)))


def widen(k: Kernel, value, dtype: str):
    """A loaded element of a narrow integer dtype as int64 (see
    op_base.NARROW_INTEGERS); any other value as it is."""
    if dtype not in NARROW_INTEGERS:
        return value
    return k.builder.sext(value, I64) if NARROW_INTEGERS[dtype] else k.builder.zext(value, I64)


def narrow(k: Kernel, value, dtype: str):
    """An int64 result as the narrow integer dtype it is stored in."""
    if dtype not in NARROW_INTEGERS or value.type != I64:
        return value
    return k.builder.trunc(value, ELEMENT_TYPES[dtype])


def wrap(k: Kernel, value, dtype: str):
    """An int64 result wrapped into dtype's range and widened again, so a
    fused epilogue sees the value that is stored."""
    if dtype not in NARROW_INTEGERS or value.type != I64:
        return value
    return widen(k, narrow(k, value, dtype), dtype)


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


def _arithmetic(float_op: str, int_op: str):
    """A fold by one IRBuilder method for float32 and another for integers."""
    return _fold(lambda k, a, b: getattr(k.builder, float_op if is_float(a) else int_op)(a, b))


def _integer_divisor(k: Kernel, y):
    """y, with 0 and -1 replaced by 1 (where the callers pick the result
    themselves): integer division by 0 and INT_MIN / -1 trap on x86."""
    b = k.builder
    odd = b.or_(b.icmp_signed("==", y, _int_zero(y)), b.icmp_signed("==", y, ir.Constant(y.type, -1)))
    return b.select(odd, ir.Constant(y.type, 1), y)


def _divide(k, a, b_, unsigned=False):
    """a / b: float32 division, or integer division truncating toward zero
    (C's and onnxruntime's); an integer divided by 0 gives 0 instead of a
    trap, by -1 its negation."""
    b = k.builder
    if is_float(a):
        return b.fdiv(a, b_)
    if unsigned:
        zero = b.icmp_unsigned("==", b_, _int_zero(b_))
        quotient = b.udiv(a, b.select(zero, ir.Constant(b_.type, 1), b_))
        return b.select(zero, _int_zero(a), quotient)
    quotient = b.sdiv(a, _integer_divisor(k, b_))
    quotient = b.select(b.icmp_signed("==", b_, ir.Constant(b_.type, -1)), b.sub(_int_zero(a), a), quotient)
    return b.select(b.icmp_signed("==", b_, _int_zero(b_)), _int_zero(a), quotient)


class _Arithmetic(Elementwise):
    data_dtypes = ("float32", *INTEGER_DTYPES)


class _Exact(_Arithmetic):
    """An op that also computes float64 tensors in float64
    (crosscompile.double keeps graphs of only these ops in float64)."""

    data_dtypes = ("float32", "float64", *INTEGER_DTYPES)


class Add(_Exact):
    op_type = "Add"
    combine = _arithmetic("fadd", "add")


class Sub(_Exact):
    op_type = "Sub"
    combine = _arithmetic("fsub", "sub")


class Mul(_Exact):
    op_type = "Mul"
    combine = _arithmetic("fmul", "mul")


class Div(_Exact):
    op_type = "Div"

    def evaluate(self, k, values, attrs):
        a, d = values
        return _divide(k, a, d, attrs.get("unsigned", False))


class Sum(_Arithmetic):
    op_type = "Sum"
    arity = (1, 1 << 16)
    combine = _arithmetic("fadd", "add")


def _extreme(k, a, b, predicate, unsigned=False):
    if is_float(a):
        return k.maximum(a, b) if predicate == ">" else k.minimum(a, b)
    compare = k.builder.icmp_unsigned if unsigned else k.builder.icmp_signed
    return k.builder.select(compare(predicate, a, b), a, b)


class _Extreme(_Arithmetic):
    arity = (1, 1 << 16)
    predicate = ""

    def evaluate(self, k, values, attrs):
        acc = values[0]
        for v in values[1:]:
            acc = _extreme(k, acc, v, self.predicate, attrs.get("unsigned", False))
        return acc


class Max(_Extreme):
    op_type = "Max"
    predicate = ">"


class Min(_Extreme):
    op_type = "Min"
    predicate = "<"


class Mod(_Arithmetic):
    """The remainder of a / b: with fmod=0 it takes the divisor's sign
    (Python's %), with fmod=1 the dividend's (C's fmod). An integer
    remainder by 0 is 0; a float one NaN."""

    op_type = "Mod"

    def attributes(self, raw, constants, opset):
        return {"fmod": int(raw.get("fmod", 0))}

    def evaluate(self, k, values, attrs):
        a, d = values
        b = k.builder
        if is_float(a):
            # a - trunc(a / d) * d; trunc by rounding, stepped toward zero.
            q = b.fdiv(a, d)
            t = round_even(k, q)
            aq, at = k.maximum(q, b.fsub(k.f32(0.0), q)), k.maximum(t, b.fsub(k.f32(0.0), t))
            step = b.select(b.fcmp_ordered("<", q, k.f32(0.0)), k.f32(-1.0), k.f32(1.0))
            t = b.select(b.fcmp_ordered(">", at, aq), b.fsub(t, step), t)
            r = b.fsub(a, b.fmul(t, d))
            # An infinite divisor leaves a finite dividend whole.
            r = b.select(b.fcmp_ordered("==", k.maximum(d, b.fsub(k.f32(0.0), d)), k.f32(np.inf)), a, r)
            if attrs["fmod"]:
                return r
            differs = b.xor(b.fcmp_ordered("<", r, k.f32(0.0)), b.fcmp_ordered("<", d, k.f32(0.0)))
            fix = b.and_(b.fcmp_ordered("!=", r, k.f32(0.0)), differs)
            return b.select(fix, b.fadd(r, d), r)
        if attrs.get("unsigned"):
            zero = b.icmp_unsigned("==", d, _int_zero(d))
            return b.select(zero, _int_zero(a), b.urem(a, b.select(zero, ir.Constant(d.type, 1), d)))
        r = b.srem(a, _integer_divisor(k, d))
        r = b.select(b.icmp_signed("==", d, ir.Constant(d.type, -1)), _int_zero(a), r)
        r = b.select(b.icmp_signed("==", d, _int_zero(d)), _int_zero(a), r)
        if attrs["fmod"]:
            return r
        # The divisor's sign: a non-zero remainder of the other sign moves by d.
        differs = b.xor(b.icmp_signed("<", r, _int_zero(r)), b.icmp_signed("<", d, _int_zero(d)))
        fix = b.and_(b.icmp_signed("!=", r, _int_zero(r)), differs)
        return b.select(fix, b.add(r, d), r)

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


def expm1(k: Kernel, x):
    """exp(x) - 1, exact near 0 where that difference cancels: with
    u = exp(x), (u - 1) * x / log(u) (Kahan's form), x itself where u
    rounds to 1."""
    b = k.builder
    u = k.exp(x)
    um1 = b.fsub(u, k.f32(1.0))
    ratio = b.fmul(um1, b.fdiv(x, k.log(u)))
    ratio = b.select(b.fcmp_ordered("==", um1, k.f32(-1.0)), um1, ratio)
    ratio = b.select(b.fcmp_ordered(">", x, k.f32(80.0)), u, ratio)
    return b.select(b.fcmp_ordered("==", u, k.f32(1.0)), x, ratio)


def log1p(k: Kernel, u):
    """log(1 + u) for u >= 0, exact for small u where 1 + u rounds:
    log(w) * u / (w - 1) with w = 1 + u (Goldberg's form)."""
    b = k.builder
    w = b.fadd(u, k.f32(1.0))
    wm1 = b.fsub(w, k.f32(1.0))
    scaled = b.fmul(k.log(w), b.fdiv(u, wm1))
    return b.select(b.fcmp_ordered("==", wm1, k.f32(0.0)), u, scaled)


def softplus(k: Kernel, x):
    """log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)): no overflow for large x."""
    b = k.builder
    ax = k.maximum(x, b.fsub(k.f32(0.0), x))
    return b.fadd(k.maximum(x, k.f32(0.0)), log1p(k, k.exp(b.fsub(k.f32(0.0), ax))))


class Softplus(Unary):
    op_type = "Softplus"

    def apply(self, k, x, attrs):
        return softplus(k, x)


class Mish(Unary):
    """x * tanh(softplus(x))."""

    op_type = "Mish"

    def apply(self, k, x, attrs):
        return k.builder.fmul(x, k.tanh(softplus(k, x)))


class Elu(Unary):
    """x for x >= 0, alpha * (exp(x) - 1) below."""

    op_type = "Elu"

    def attributes(self, raw, constants, opset):
        return {"alpha": float(raw.get("alpha", 1.0))}

    def apply(self, k, x, attrs):
        b = k.builder
        return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), b.fmul(expm1(k, x), k.f32(attrs["alpha"])), x)


class Selu(Elu):
    """gamma * Elu(x) with Selu's own alpha and gamma defaults."""

    op_type = "Selu"

    def attributes(self, raw, constants, opset):
        return {"alpha": float(raw.get("alpha", 1.67326319217681884765625)),
                "gamma": float(raw.get("gamma", 1.05070102214813232421875))}

    def apply(self, k, x, attrs):
        return k.builder.fmul(super().apply(k, x, attrs), k.f32(attrs["gamma"]))


class Celu(Unary):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""

    op_type = "Celu"

    def attributes(self, raw, constants, opset):
        alpha = float(raw.get("alpha", 1.0))
        if alpha == 0.0:
            raise BuildError("Celu's alpha must not be 0")
        return {"alpha": alpha}

    def apply(self, k, x, attrs):
        b = k.builder
        alpha = k.f32(attrs["alpha"])
        negative = k.minimum(b.fmul(expm1(k, b.fdiv(x, alpha)), alpha), k.f32(0.0))
        value = b.fadd(k.maximum(x, k.f32(0.0)), negative)
        return b.select(b.fcmp_unordered("uno", x, x), x, value)


class Softsign(Unary):
    op_type = "Softsign"

    def apply(self, k, x, attrs):
        b = k.builder
        return b.fdiv(x, b.fadd(k.f32(1.0), k.maximum(x, b.fsub(k.f32(0.0), x))))


class ThresholdedRelu(Unary):
    """x where x > alpha, else 0."""

    op_type = "ThresholdedRelu"

    def attributes(self, raw, constants, opset):
        return {"alpha": float(raw.get("alpha", 1.0))}

    def apply(self, k, x, attrs):
        b = k.builder
        return b.select(b.fcmp_ordered(">", x, k.f32(attrs["alpha"])), x, k.f32(0.0))


class Shrink(Unary):
    """x + bias below -lambd, x - bias above lambd, 0 between."""

    op_type = "Shrink"

    def attributes(self, raw, constants, opset):
        return {"lambd": float(raw.get("lambd", 0.5)), "bias": float(raw.get("bias", 0.0))}

    def apply(self, k, x, attrs):
        b = k.builder
        lambd, bias = attrs["lambd"], k.f32(attrs["bias"])
        high = b.select(b.fcmp_ordered(">", x, k.f32(lambd)), b.fsub(x, bias), k.f32(0.0))
        return b.select(b.fcmp_ordered("<", x, k.f32(-lambd)), b.fadd(x, bias), high)


# 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude below
# 2**22 to an integer, ties to even (no libm call: llvm.roundeven, floor and
# ceil become calls on targets without a rounding instruction). From 2**22 on
# every float32 is an integer already.
ROUND_MAGIC = 12582912.0
ROUND_LIMIT = 4194304.0


def round_even(k: Kernel, x):
    b = k.builder
    ax = k.maximum(x, b.fsub(k.f32(0.0), x))
    rounded = b.fsub(b.fadd(x, k.f32(ROUND_MAGIC)), k.f32(ROUND_MAGIC))
    return b.select(b.fcmp_ordered("<", ax, k.f32(ROUND_LIMIT)), rounded, x)


class Round(Unary):
    """Nearest integer, halves to even (numpy.round)."""

    op_type = "Round"

    def apply(self, k, x, attrs):
        return round_even(k, x)


class _RoundToward(Unary):
    """Floor and Ceil: the nearest integer, moved one step toward `step`
    where it lies on the wrong side of x."""

    step = 0.0
    wrong_side = ""

    def apply(self, k, x, attrs):
        b = k.builder
        r = round_even(k, x)
        return b.select(b.fcmp_ordered(self.wrong_side, r, x), b.fadd(r, k.f32(self.step)), r)


class Floor(_RoundToward):
    op_type = "Floor"
    step, wrong_side = -1.0, ">"


class Ceil(_RoundToward):
    op_type = "Ceil"
    step, wrong_side = 1.0, "<"


class Sign(Unary):
    """1 above 0, -1 below, 0 at 0 (NaN stays NaN)."""

    op_type = "Sign"

    def apply(self, k, x, attrs):
        b = k.builder
        up = b.select(b.fcmp_ordered(">", x, k.f32(0.0)), k.f32(1.0), x)
        return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), k.f32(-1.0), up)


class _FloatTest(Op):
    """A float32 tensor in, a bool tensor of one test per element out."""

    def infer(self, inputs, attrs):
        return [inputs[0]]

    def output_dtype(self, inputs, attrs):
        super().output_dtype(inputs, attrs)
        return "bool"

    def test(self, k: Kernel, x, attrs):
        raise NotImplementedError

    def lower(self, k, inputs, outputs, attrs):
        from .emit import I8
        dest = k.typed(k.outputs[0], "bool")
        with k.loop(outputs[0].size) as i:
            k.store(k.builder.zext(self.test(k, k.load(k.inputs[0], i), attrs), I8), dest, i)
        k.activated = True


class IsNaN(_FloatTest):
    op_type = "IsNaN"

    def test(self, k, x, attrs):
        return k.builder.fcmp_unordered("uno", x, x)


class IsInf(_FloatTest):
    """x is +inf (when detect_positive) or -inf (when detect_negative)."""

    op_type = "IsInf"

    def attributes(self, raw, constants, opset):
        return {"negative": bool(raw.get("detect_negative", 1)), "positive": bool(raw.get("detect_positive", 1))}

    def test(self, k, x, attrs):
        b = k.builder
        positive = b.fcmp_ordered("==", x, k.f32(np.inf))
        negative = b.fcmp_ordered("==", x, k.f32(-np.inf))
        if attrs["positive"] and attrs["negative"]:
            return b.or_(positive, negative)
        if attrs["positive"]:
            return positive
        if attrs["negative"]:
            return negative
        return b.fcmp_ordered("!=", x, x)  # detects nothing: false everywhere
