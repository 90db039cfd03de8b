"""The trigonometric and hyperbolic ops (Sin, Cos, Tan, Asin, Acos, Atan,
Sinh, Cosh, Asinh, Acosh, Atanh), element by element on float32.

A module may call nothing from libm (its glibc symbol versions would tie it
to the board's C library), so each function is built here from exp, log,
sqrt and polynomials. sin and cos reduce x by multiples of pi/2 with a
three-part pi/2 (Cody and Waite), exact enough for |x| up to about 10^4;
their polynomials are Cephes' sinf and cosf ones, atan's is Cephes' atanf.
"""
from __future__ import annotations

import math

from .elementwise import ROUND_MAGIC, Unary, log1p, safe_log
from .emit import Kernel

# pi/2 as three float32 parts whose products with a small integer are exact.
PIO2_PARTS = (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)
SIN_POLY = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)
COS_POLY = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)
ATAN_POLY = (-3.33329491539e-1, 1.99777106478e-1, -1.38776856032e-1, 8.05374449538e-2)


def _horner(k: Kernel, z, coeffs):
    """sum(coeffs[i] * z**i)."""
    p = k.f32(coeffs[-1])
    for c in coeffs[-2::-1]:
        p = k.fmuladd(p, z, k.f32(c))
    return p


def _negate(k: Kernel, x):
    return k.builder.fsub(k.f32(0.0), x)


def _abs(k: Kernel, x):
    return k.maximum(x, _negate(k, x))


def sine_or_cosine(k: Kernel, x, quarter_turns: int):
    """sin(x + quarter_turns * pi / 2): x = q * pi/2 + r with |r| <= pi/4,
    then sin or cos of r by polynomial, chosen and signed by q mod 4."""
    b = k.builder
    q = b.fsub(b.fadd(b.fmul(x, k.f32(2.0 / math.pi)), k.f32(ROUND_MAGIC)), k.f32(ROUND_MAGIC))
    r = x
    for part in PIO2_PARTS:
        r = b.fsub(r, b.fmul(q, k.f32(part)))
    z = b.fmul(r, r)
    sin_r = k.fmuladd(b.fmul(_horner(k, z, SIN_POLY), z), r, r)
    cos_r = b.fsub(k.fmuladd(b.fmul(_horner(k, z, COS_POLY), z), z, k.f32(1.0)), b.fmul(z, k.f32(0.5)))
    turns = b.add(b.fptosi(q, k._int_type(x)), k._i32(quarter_turns, x))
    odd = b.icmp_signed("!=", b.and_(turns, k._i32(1, x)), k._i32(0, x))
    value = b.select(odd, cos_r, sin_r)
    flip = b.icmp_signed("!=", b.and_(turns, k._i32(2, x)), k._i32(0, x))
    value = b.select(flip, _negate(k, value), value)
    # Past 2**22 / (2/pi) the reduction is meaningless; inf and NaN give NaN.
    return b.select(b.fcmp_ordered("<", _abs(k, x), k.f32(4194304.0)), value, k.f32(math.nan))


def arctangent(k: Kernel, x):
    """atan(x): |x| folded into [0, tan(pi/8)] by atan(x) = pi/2 + atan(-1/x)
    and pi/4 + atan((x - 1) / (x + 1)), then a polynomial."""
    b = k.builder
    ax = _abs(k, x)
    big = b.fcmp_ordered(">", ax, k.f32(2.414213562373095))
    middle = b.fcmp_ordered(">", ax, k.f32(0.4142135623730950))
    y = b.select(big, b.fdiv(k.f32(-1.0), ax),
                 b.select(middle, b.fdiv(b.fsub(ax, k.f32(1.0)), b.fadd(ax, k.f32(1.0))), ax))
    base = b.select(big, k.f32(math.pi / 2), b.select(middle, k.f32(math.pi / 4), k.f32(0.0)))
    z = b.fmul(y, y)
    value = b.fadd(base, k.fmuladd(b.fmul(_horner(k, z, ATAN_POLY), z), y, y))
    return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), _negate(k, value), value)


def natural_log(k: Kernel, x):
    """log(x) with numpy's answers for 0, negatives, inf and NaN."""
    b = k.builder
    y = b.select(b.fcmp_ordered("==", x, k.f32(math.inf)), x, safe_log(k, x))
    return b.select(b.fcmp_unordered("uno", x, x), x, y)


class Sin(Unary):
    op_type = "Sin"

    def apply(self, k, x, attrs):
        return sine_or_cosine(k, x, 0)


class Cos(Unary):
    op_type = "Cos"

    def apply(self, k, x, attrs):
        return sine_or_cosine(k, x, 1)


class Tan(Unary):
    op_type = "Tan"

    def apply(self, k, x, attrs):
        return k.builder.fdiv(sine_or_cosine(k, x, 0), sine_or_cosine(k, x, 1))


class Atan(Unary):
    op_type = "Atan"

    def apply(self, k, x, attrs):
        return arctangent(k, x)


class Asin(Unary):
    """atan(x / sqrt((1 - x)(1 + x))): +-pi/2 at +-1, NaN beyond."""

    op_type = "Asin"

    def apply(self, k, x, attrs):
        b = k.builder
        root = k.sqrt(b.fmul(b.fsub(k.f32(1.0), x), b.fadd(k.f32(1.0), x)))
        value = arctangent(k, b.fdiv(x, root))
        return b.select(b.fcmp_ordered("<=", _abs(k, x), k.f32(1.0)), value, k.f32(math.nan))


class Acos(Unary):
    """2 atan(sqrt((1 - x) / (1 + x))): exact near 1 where pi/2 - asin(x)
    would cancel; pi at -1, NaN beyond +-1."""

    op_type = "Acos"

    def apply(self, k, x, attrs):
        b = k.builder
        value = b.fmul(arctangent(k, k.sqrt(b.fdiv(b.fsub(k.f32(1.0), x), b.fadd(k.f32(1.0), x)))), k.f32(2.0))
        return b.select(b.fcmp_ordered("<=", _abs(k, x), k.f32(1.0)), value, k.f32(math.nan))


def _half_exp_squared(k: Kernel, ax):
    """e^ax / 2 as e^(ax/2) * (e^(ax/2) / 2): infinite only where the
    result is, past float32's largest value (ax > 89.4)."""
    h = k.exp(k.builder.fmul(ax, k.f32(0.5)))
    return k.builder.fmul(h, k.builder.fmul(h, k.f32(0.5)))


def _keep_nan(k: Kernel, x, value):
    return k.builder.select(k.builder.fcmp_unordered("uno", x, x), x, value)


def _exp_pair(k: Kernel, ax, sign: float):
    """(e^ax + sign * e^-ax) / 2 for ax >= 0, as e^ax / 2 past 20."""
    b = k.builder
    e = k.exp(ax)
    value = b.fmul(b.fadd(e, b.fmul(b.fdiv(k.f32(1.0), e), k.f32(sign))), k.f32(0.5))
    return b.select(b.fcmp_ordered("<", ax, k.f32(20.0)), value, _half_exp_squared(k, ax))


class Sinh(Unary):
    """(e^x - e^-x) / 2, its Taylor series below |x| = 0.5 where that
    cancels and e^|x| / 2 past |x| = 20."""

    op_type = "Sinh"

    def apply(self, k, x, attrs):
        b = k.builder
        ax = _abs(k, x)
        magnitude = _exp_pair(k, ax, -1.0)
        wide = b.select(b.fcmp_ordered("<", x, k.f32(0.0)), _negate(k, magnitude), magnitude)
        z = b.fmul(x, x)
        series = k.fmuladd(b.fmul(_horner(k, z, (1 / 6, 1 / 120, 1 / 5040, 1 / 362880)), z), x, x)
        return _keep_nan(k, x, b.select(b.fcmp_ordered("<", ax, k.f32(0.5)), series, wide))


class Cosh(Unary):
    op_type = "Cosh"

    def apply(self, k, x, attrs):
        return _keep_nan(k, x, _exp_pair(k, _abs(k, x), 1.0))


class Asinh(Unary):
    """sign(x) log(|x| + sqrt(x^2 + 1)), as log1p(|x| + x^2 / (1 + sqrt(x^2 + 1)))
    so that small x keep their precision; log(2|x|) where x^2 overflows."""

    op_type = "Asinh"

    def apply(self, k, x, attrs):
        b = k.builder
        ax = _abs(k, x)
        z = b.fmul(ax, ax)
        small = log1p(k, b.fadd(ax, b.fdiv(z, b.fadd(k.f32(1.0), k.sqrt(b.fadd(z, k.f32(1.0)))))))
        large = natural_log(k, b.fmul(ax, k.f32(2.0)))
        value = b.select(b.fcmp_ordered("<", ax, k.f32(1e18)), small, large)
        return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), _negate(k, value), value)


class Acosh(Unary):
    """log(x + sqrt(x^2 - 1)) for x >= 1 (NaN below), as
    log1p(t + sqrt(t (t + 2))) with t = x - 1, exact near 1."""

    op_type = "Acosh"

    def apply(self, k, x, attrs):
        b = k.builder
        t = b.fsub(x, k.f32(1.0))
        value = log1p(k, b.fadd(t, k.sqrt(b.fmul(t, b.fadd(t, k.f32(2.0))))))
        value = b.select(b.fcmp_ordered("<", x, k.f32(1e18)), value, natural_log(k, b.fmul(x, k.f32(2.0))))
        return b.select(b.fcmp_ordered(">=", x, k.f32(1.0)), value, k.f32(math.nan))


class Atanh(Unary):
    """log((1 + x) / (1 - x)) / 2 as log1p(2|x| / (1 - |x|)) / 2, signed:
    +-inf at +-1, NaN beyond."""

    op_type = "Atanh"

    def apply(self, k, x, attrs):
        b = k.builder
        ax = _abs(k, x)
        value = b.fmul(log1p(k, b.fdiv(b.fmul(ax, k.f32(2.0)), b.fsub(k.f32(1.0), ax))), k.f32(0.5))
        value = b.select(b.fcmp_ordered("==", ax, k.f32(1.0)), k.f32(math.inf), value)
        value = b.select(b.fcmp_ordered("<", x, k.f32(0.0)), _negate(k, value), value)
        return b.select(b.fcmp_ordered("<=", ax, k.f32(1.0)), value, k.f32(math.nan))
