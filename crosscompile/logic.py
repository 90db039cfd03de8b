"""Ops over boolean and integer tensors: comparisons giving masks (Equal,
Less, Greater, LessOrEqual, GreaterOrEqual), Not/And/Or/Xor, Where, and
Cast between float32, int64, int32 and bool. Attention masks and token
ids pass through these on their way into float32 arithmetic.

Tensors keep their own dtype in memory (a bool is one byte, 0 or 1), as
numpy and onnxruntime hold them; Kernel.typed gives each buffer its
element type, and the broadcasting loops are elementwise.Elementwise's.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from onnx import TensorProto

from . import lowbit
from .elementwise import Elementwise
from .emit import F32, I8, I16, I32, I64, ELEMENT_TYPES
from .errors import BuildError
from .op_base import INTEGER_DTYPES, NARROW_INTEGERS, Op, UNSIGNED_DTYPES

INTEGERS = INTEGER_DTYPES
# TensorProto data type number -> dtype name, for Cast's `to`.
CAST_TARGETS = {1: "float32", 11: "float64", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64", 9: "bool", 2: "uint8", 3: "int8", 5: "int16",
                4: "uint16", 12: "uint32", 13: "uint64", **lowbit.TENSOR_TYPES}
# The float types a Cast's source may be (the rest are integers and bool).
FLOAT_SOURCES = ("float32", "float64", "float16", "bfloat16")


def _same_dtype(op_type, inputs, allowed) -> str:
    dtypes = {t.dtype for t in inputs}
    if len(dtypes) != 1 or not dtypes <= set(allowed):
        shown = ", ".join(f"{t.name!r} {t.dtype}" for t in inputs)
        raise BuildError(f"{op_type} takes inputs of one dtype among {', '.join(allowed)}; got {shown}")
    return dtypes.pop()


class _Compare(Elementwise):
    """a <op> b under broadcasting, of float32 or integer tensors, as a bool tensor."""

    predicate = ""

    def output_dtype(self, inputs, attrs):
        _same_dtype(self.op_type, inputs, ("float32", *INTEGERS, "bool"))
        return "bool"

    def evaluate(self, k, values, attrs):
        a, b = values
        if a.type == F32:
            truth = k.builder.fcmp_ordered(self.predicate, a, b)
        elif attrs.get("unsigned"):
            truth = k.builder.icmp_unsigned(self.predicate, a, b)
        else:
            truth = k.builder.icmp_signed(self.predicate, a, b)
        return k.builder.zext(truth, I8)


# The comparison ops and their predicates (for fcmp_ordered and icmp_signed):
# they differ in nothing else, so their classes are made from this table.
COMPARISONS = {"Equal": "==", "Less": "<", "LessOrEqual": "<=", "Greater": ">", "GreaterOrEqual": ">="}
for _op_type, _predicate in COMPARISONS.items():
    type(_op_type, (_Compare,), {"op_type": _op_type, "predicate": _predicate, "__module__": __name__})


class _Logical(Elementwise):
    """Boolean tensors in, a boolean tensor out."""

    def output_dtype(self, inputs, attrs):
        _same_dtype(self.op_type, inputs, ("bool",))
        return "bool"


class Not(_Logical):
    op_type = "Not"
    arity = (1, 1)

    def combine(self, k, values):
        return k.builder.xor(values[0], ir.Constant(I8, 1))


class And(_Logical):
    op_type = "And"

    def combine(self, k, values):
        return k.builder.and_(*values)


class Or(_Logical):
    op_type = "Or"

    def combine(self, k, values):
        return k.builder.or_(*values)


class Xor(_Logical):
    op_type = "Xor"

    def combine(self, k, values):
        return k.builder.xor(*values)


class Where(Elementwise):
    """condition ? x : y under broadcasting of all three."""

    op_type = "Where"
    arity = (3, 3)

    def output_dtype(self, inputs, attrs):
        if len(inputs) != 3 or inputs[0].dtype != "bool":
            raise BuildError(f"Where takes a bool condition and two values; got "
                             f"{', '.join(f'{t.name!r} {t.dtype}' for t in inputs)}")
        return _same_dtype("Where", inputs[1:], ("float32", *INTEGERS, "bool"))

    def combine(self, k, values):
        condition, x, y = values
        return k.builder.select(k.builder.icmp_unsigned("!=", condition, ir.Constant(I8, 0)), x, y)


class Cast(Op):
    """Cast between float32, the integer types and bool as numpy's astype does:
    floats to integers round toward zero, anything to bool is `!= 0` (NaN
    is true). Casts of constants fold at import. To and from the low-bit
    types, as crosscompile.lowbit says (with saturate and round_mode)."""

    op_type = "Cast"

    def attributes(self, raw, constants, opset):
        to = int(raw.get("to", 0))
        if to not in CAST_TARGETS:
            name = TensorProto.DataType.Name(to) if to in TensorProto.DataType.values() else to
            raise BuildError(f"Cast of a runtime tensor to {name} is not supported; supported: "
                             + ", ".join(TensorProto.DataType.Name(t) for t in CAST_TARGETS))
        attrs = {"to": CAST_TARGETS[to]}
        if attrs["to"] in lowbit.LOW_BIT_DTYPES:
            attrs.update(_rounding(raw))
        return attrs

    def infer(self, inputs, attrs):
        return [inputs[0]]

    def output_dtype(self, inputs, attrs):
        return attrs["to"]

    def lower(self, k, inputs, outputs, attrs):
        source, target = inputs[0].dtype, outputs[0].dtype
        src, dst = _bits_or_typed(k, k.inputs[0], source), _bits_or_typed(k, k.outputs[0], target)
        with k.loop(outputs[0].size) as i:
            value = k.load(src, i)
            if source in lowbit.LOW_BIT_DTYPES:
                value, source = lowbit.decode(k, value, source), lowbit.held_dtype(source)
            if target in lowbit.LOW_BIT_DTYPES:
                # Through float32 from a float, through int32 from an integer.
                step = "float32" if source in FLOAT_SOURCES or target in lowbit.FORMATS else "int32"
                value = lowbit.encode(k, convert(k, value, source, step), step, target,
                                      attrs["saturate"], attrs["round_mode"])
            else:
                value = k.activate(convert(k, value, source, target))
            k.store(value, dst, i)


def _rounding(raw: dict) -> dict:
    """Cast's saturate and round_mode, which only casts to low-bit types read."""
    mode = raw.get("round_mode", "up")
    if mode not in lowbit.ROUND_MODES:
        raise BuildError(f"attribute round_mode={mode!r} must be one of {', '.join(lowbit.ROUND_MODES)}")
    return {"saturate": bool(int(raw.get("saturate", 1))), "round_mode": mode}


class BitCast(Cast):
    """The input's bits read as `to`, a type of the same width. float64,
    float16 and bfloat16 tensors are held as float32 inside
    (crosscompile.double), so they have no bits of their own to read."""

    op_type = "BitCast"

    def output_dtype(self, inputs, attrs):
        source, target = inputs[0].dtype, attrs["to"]
        held = {source, target} & {"float64", "float16", "bfloat16"}
        if held or np.dtype(source).itemsize != np.dtype(target).itemsize:
            raise BuildError(f"BitCast from {source} to {attrs['to']} is not supported: only between "
                             "types of one width, not float64, float16 or bfloat16 (which are computed "
                             "in float32)")
        return target

    def lower(self, k, inputs, outputs, attrs):
        source, target = inputs[0].dtype, outputs[0].dtype
        src, dst = k.typed(k.inputs[0], source), k.typed(k.outputs[0], target)
        with k.loop(outputs[0].size) as i:
            k.store(k.builder.bitcast(k.load(src, i), ELEMENT_TYPES[target]), dst, i)


class CastLike(Cast):
    """Cast to the dtype of the second input (only its dtype is read)."""

    op_type = "CastLike"

    def folds_constant(self, pos, value):
        return pos == 1

    def attributes(self, raw, constants, opset):
        like = constants.get(1)
        if like is None:
            return {}
        dtype = np.asarray(like).dtype.name
        if dtype not in CAST_TARGETS.values():
            raise BuildError(f"CastLike to {dtype} is not supported; supported: "
                             f"{', '.join(CAST_TARGETS.values())}")
        return {"to": dtype}

    def output_dtype(self, inputs, attrs):
        if "to" in attrs:
            return attrs["to"]
        if len(inputs) != 2 or inputs[1].dtype not in CAST_TARGETS.values():
            raise BuildError(f"CastLike takes the tensor and one whose dtype ({', '.join(CAST_TARGETS.values())}) "
                             "it is cast to")
        return inputs[1].dtype


def convert(k, value: ir.Value, source: str, target: str) -> ir.Value:
    """value of dtype source as dtype target (numpy's astype)."""
    b = k.builder
    to = ELEMENT_TYPES[target]
    if source == target:
        return value
    # float64 is only a boundary type (crosscompile.double): it converts
    # through float32.
    if source == "float64":
        return convert(k, b.fptrunc(value, F32), "float32", target)
    if target == "float64":
        return b.fpext(convert(k, value, source, "float32"), to)
    # float16 and bfloat16 too (crosscompile.double), converted with
    # integer operations so that every target rounds alike, without the
    # half-precision instructions or library calls some lack.
    if source in SIXTEEN_BIT_FLOATS:
        return convert(k, _widen(b, value, source), "float32", target)
    if target in SIXTEEN_BIT_FLOATS:
        return _narrow(b, convert(k, value, source, "float32"), target)
    if target == "bool":
        if source == "float32":
            return b.zext(b.fcmp_unordered("!=", value, ir.Constant(F32, 0.0)), I8)
        return b.zext(b.icmp_unsigned("!=", value, ir.Constant(value.type, 0)), I8)
    unsigned = source == "bool" or source in UNSIGNED_DTYPES
    if source == "float32":
        # Narrow targets through a wider signed integer, so that uint8's
        # 128..255 (uint32's 2**31...) convert too.
        if target == "uint64":
            return b.fptoui(value, to)
        if to.width < 32 or target == "uint32":
            return b.trunc(b.fptosi(value, I32 if to.width < 32 else I64), to)
        return b.fptosi(value, to)
    if target == "float32":
        return b.uitofp(value, F32) if unsigned else b.sitofp(value, F32)
    if to.width > value.type.width:
        return b.zext(value, to) if unsigned else b.sext(value, to)
    if to.width == value.type.width:
        return value
    return b.trunc(value, to)


SIXTEEN_BIT_FLOATS = ("float16", "bfloat16")


def _bits_or_typed(k, ptr: ir.Value, dtype: str) -> ir.Value:
    """A buffer viewed as its dtype's elements, a float16 one as i16 bit
    patterns (LLVM's half loads and bitcasts go through conversions of
    their own on targets without half arithmetic)."""
    return k.builder.bitcast(ptr, I16.as_pointer()) if dtype == "float16" else k.typed(ptr, dtype)


def _narrow(b, value: ir.Value, target: str) -> ir.Value:
    """float32 value as float16 or bfloat16 (their bits as an i16),
    rounded to nearest even as numpy and ONNX do; NaN stays NaN."""
    def const(n):
        return ir.Constant(I32, n)
    bits = b.bitcast(value, I32)
    if target == "bfloat16":
        odd = b.and_(b.lshr(bits, const(16)), const(1))
        rounded = b.lshr(b.add(bits, b.add(const(0x7FFF), odd)), const(16))
        nan = b.fcmp_unordered("uno", value, value)
        return b.trunc(b.select(nan, b.or_(b.lshr(bits, const(16)), const(0x40)), rounded), I16)
    sign = b.and_(b.lshr(bits, const(16)), const(0x8000))
    magnitude = b.and_(bits, const(0x7FFFFFFF))
    # Normal halves: rebias the exponent (127 - 15) and round off 13 bits.
    rebiased = b.sub(magnitude, const(112 << 23))
    odd = b.and_(b.lshr(rebiased, const(13)), const(1))
    normal = b.lshr(b.add(rebiased, b.add(const(0xFFF), odd)), const(13))
    # Subnormal halves: adding 0.5 lets the float32 adder round the value to
    # a multiple of 2**-24, which lands in the low mantissa bits.
    shifted = b.fadd(b.bitcast(magnitude, F32), ir.Constant(F32, 0.5))
    subnormal = b.sub(b.bitcast(shifted, I32), const(0x3F000000))
    half = b.select(b.icmp_unsigned("<", magnitude, const(0x38800000)), subnormal, normal)
    half = b.select(b.icmp_unsigned(">=", magnitude, const(0x477FF000)), const(0x7C00), half)  # to infinity
    half = b.select(b.icmp_unsigned(">", magnitude, const(0x7F800000)), const(0x7E00), half)  # NaN
    return b.trunc(b.or_(half, sign), I16)


def _widen(b, value: ir.Value, source: str) -> ir.Value:
    """A float16 or bfloat16 value (its bits as an i16) as float32, exactly."""
    def const(n):
        return ir.Constant(I32, n)
    if source == "bfloat16":
        return b.bitcast(b.shl(b.zext(value, I32), const(16)), F32)
    bits = b.zext(value, I32)
    sign = b.shl(b.and_(bits, const(0x8000)), const(16))
    magnitude = b.and_(bits, const(0x7FFF))
    exponent = b.and_(bits, const(0x7C00))
    normal = b.add(b.shl(magnitude, const(13)), const(112 << 23))
    special = b.add(normal, const(112 << 23))  # infinity and NaN: float32's all-ones exponent
    subnormal = b.bitcast(b.fmul(b.uitofp(magnitude, F32), ir.Constant(F32, 2.0 ** -24)), I32)
    wide = b.select(b.icmp_unsigned("==", exponent, const(0x7C00)), special, normal)
    wide = b.select(b.icmp_unsigned("==", exponent, const(0)), subnormal, wide)
    return b.bitcast(b.or_(wide, sign), F32)


class _Bitwise(Elementwise):
    """Bitwise ops of integer tensors (all one dtype)."""

    data_dtypes = INTEGER_DTYPES


class BitwiseNot(_Bitwise):
    op_type = "BitwiseNot"
    arity = (1, 1)

    def combine(self, k, values):
        return k.builder.not_(values[0])


# The binary bitwise ops and the IRBuilder method of each; their classes
# are made from this table.
BITWISE = {"BitwiseAnd": "and_", "BitwiseOr": "or_", "BitwiseXor": "xor"}
for _op_type, _method in BITWISE.items():
    type(_op_type, (_Bitwise,), {"op_type": _op_type, "__module__": __name__,
                                 "combine": lambda self, k, values, _m=_method: getattr(k.builder, _m)(*values)})


class BitShift(_Bitwise):
    """X shifted by Y bits LEFT or RIGHT (arithmetic for signed X). A shift
    by a negative Y or by the type's width or more gives what the sign
    alone gives: -1 for a right shift of a negative X, else 0."""

    op_type = "BitShift"

    def attributes(self, raw, constants, opset):
        direction = raw.get("direction", "")
        if direction not in ("LEFT", "RIGHT"):
            raise BuildError(f"attribute direction={direction!r} must be 'LEFT' or 'RIGHT'")
        return {"direction": direction}

    def evaluate(self, k, values, attrs):
        x, y = values
        b = k.builder
        bits = 8 * np.dtype(attrs["dtype"]).itemsize
        signed = attrs["dtype"] not in UNSIGNED_DTYPES
        zero = ir.Constant(x.type, 0)
        # Widened operands hold the value of their narrow type exactly, so
        # the shift count is checked against the narrow type's width.
        in_range = b.icmp_unsigned("<", y, ir.Constant(y.type, bits))
        count = b.select(in_range, y, zero)
        if attrs["direction"] == "LEFT":
            return b.select(in_range, b.shl(x, count), zero)
        shifted = b.ashr(x, count) if signed else b.lshr(x, count)
        sign = b.select(b.icmp_signed("<", x, zero), ir.Constant(x.type, -1), zero) if signed else zero
        return b.select(in_range, shifted, sign)
