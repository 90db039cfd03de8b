"""Low-bit element types: float8 (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ,
E8M0), float4 (E2M1), int4, uint4, int2 and uint2.

Every value of these types is exact in float32 (the float ones) or int32
(the integer ones), so a model computes with them in those types: a
low-bit tensor is *held* in float32 or int32 inside the module and is one
byte per element only at the module's boundary (its inputs and outputs),
the way ml_dtypes (which onnx's reference and onnxruntime use) stores
them: unpacked, the value's bits in the low bits of the byte.

hold_low_bit_types rewrites a model that uses them, before import:
initializers and constants become their held type; each low-bit input is
cast to its held type as it comes in and each low-bit output back as it
goes out; a Cast (or CastLike) to a low-bit type becomes that Cast, which
rounds and saturates as ONNX says, followed by a Cast back to the held
type. QuantizeLinear to a low-bit type keeps its node, with output_dtype
naming the type: it rounds to the type and gives the held value
(quantize_ops). Only Cast, CastLike, QuantizeLinear, DequantizeLinear and
ops that move elements take these types in ONNX, so nothing else rounds.

The Cast kernel (logic.Cast) converts between the held types and the
bytes with decode() and encode() below:
- float8 and float4 round to nearest even; saturate=1 (the default) clamps
  what is beyond the largest finite value (infinities too) to it;
  saturate=0 gives NaN (E4M3FN, the FNUZ types) or infinity (E5M2). The
  FNUZ types have one zero and one NaN (0x80); an E5M2 NaN comes out as
  0x7E or 0xFE, whatever its payload. float4 has no NaN nor
  infinity: it always saturates and a NaN becomes zero (of the other
  sign, as ml_dtypes and so onnx's reference make it).
- E8M0 (a power of two, 2**-127 ... 2**127, NaN 0xFF) keeps the exponent
  and rounds up, down or to nearest (round_mode); the sign is dropped;
  saturate=1 keeps a value that would round up past 2**127 at 2**127. This
  is what onnx's reference computes (its specification table differs for
  infinity and zero, which the reference makes NaN and 2**-127).
- int4, uint4, int2 and uint2 take the low bits of the integer (a float is
  first truncated toward zero), as numpy's casts between integer types
  do; a NaN or a float beyond int32's range gives 0.

Example:
    >>> FORMATS["float8_e4m3fn"].largest
    448.0
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from llvmlite import ir
from onnx import TensorProto, helper, numpy_helper

from .double import _element_types, boundary_casts, cast_target, replace_nodes, used_types
from .emit import F32, I8, I32

T = TensorProto


@dataclass(frozen=True)
class MiniFloat:
    """A float type of `width` bits (sign, exponent, mantissa) stored in
    the low bits of a byte."""

    width: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    largest_code: int         # the code of the largest finite value
    nan: "int | None"         # NaN's code (without sign); None: no NaN
    infinity: "int | None"    # infinity's code (without sign)
    unsigned_zero: bool = False  # FNUZ: no negative zero; 0x80 is NaN
    exponent_only: bool = False  # E8M0: no sign, no mantissa, no zero

    @property
    def sign_bit(self) -> int:
        return 0 if self.exponent_only else 1 << (self.width - 1)

    def value(self, code: int) -> float:
        """The float the code stands for (its bits above `width` ignored)."""
        code &= (1 << self.width) - 1
        if self.exponent_only:
            return float("nan") if code == self.nan else 2.0 ** (code - self.bias)
        if self.unsigned_zero and code == self.nan:  # 0x80: the sign bit alone
            return -float("nan")
        sign = -1.0 if code & self.sign_bit else 1.0
        magnitude = code & (self.sign_bit - 1)
        if self.infinity is not None and magnitude >= self.infinity:  # E5M2: NaN above infinity
            return sign * float("inf") if magnitude == self.infinity else math.copysign(float("nan"), sign)
        if magnitude == self.nan:  # E4M3FN's all-ones code
            return math.copysign(float("nan"), sign)
        exponent, mantissa = magnitude >> self.mantissa_bits, magnitude & ((1 << self.mantissa_bits) - 1)
        if exponent == 0:
            return sign * mantissa * 2.0 ** (1 - self.bias - self.mantissa_bits)
        return sign * (1 + mantissa / (1 << self.mantissa_bits)) * 2.0 ** (exponent - self.bias)

    @property
    def largest(self) -> float:
        return self.value(self.largest_code)


FORMATS = {
    "float8_e4m3fn": MiniFloat(8, 4, 3, 7, 0x7E, nan=0x7F, infinity=None),
    "float8_e4m3fnuz": MiniFloat(8, 4, 3, 8, 0x7F, nan=0x80, infinity=None, unsigned_zero=True),
    "float8_e5m2": MiniFloat(8, 5, 2, 15, 0x7B, nan=0x7E, infinity=0x7C),
    "float8_e5m2fnuz": MiniFloat(8, 5, 2, 16, 0x7F, nan=0x80, infinity=None, unsigned_zero=True),
    "float4_e2m1fn": MiniFloat(4, 2, 1, 1, 0x7, nan=None, infinity=None),
    "float8_e8m0fnu": MiniFloat(8, 8, 0, 127, 0xFE, nan=0xFF, infinity=None, exponent_only=True),
}
# The integer types: their width in bits and whether they are signed.
INTEGERS = {"int4": (4, True), "uint4": (4, False), "int2": (2, True), "uint2": (2, False)}
LOW_BIT_DTYPES = (*FORMATS, *INTEGERS)
# TensorProto element type -> dtype name (ml_dtypes' names).
TENSOR_TYPES = {T.FLOAT8E4M3FN: "float8_e4m3fn", T.FLOAT8E4M3FNUZ: "float8_e4m3fnuz", T.FLOAT8E5M2: "float8_e5m2",
                T.FLOAT8E5M2FNUZ: "float8_e5m2fnuz", T.FLOAT4E2M1: "float4_e2m1fn", T.FLOAT8E8M0: "float8_e8m0fnu",
                T.INT4: "int4", T.UINT4: "uint4", T.INT2: "int2", T.UINT2: "uint2"}
# Cast's round_mode (opset 24 on, for E8M0).
ROUND_MODES = ("up", "down", "nearest")


def held_dtype(dtype: str) -> str:
    """The dtype a low-bit tensor is held in inside a module."""
    return "int32" if dtype in INTEGERS else "float32"


def integer_range(dtype: str) -> tuple:
    """(lowest, highest) of a low-bit integer type."""
    bits, signed = INTEGERS[dtype]
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


# -- the kernels' conversions -------------------------------------------------------------

def decode(k, byte: ir.Value, dtype: str) -> ir.Value:
    """A stored element (an i8) of a low-bit dtype as its held value: a
    float32 (looked up in a 256-entry table) or an int32."""
    b = k.builder
    if dtype in INTEGERS:
        bits, signed = INTEGERS[dtype]
        wide = b.zext(byte, I32)
        if not signed:
            return b.and_(wide, ir.Constant(I32, (1 << bits) - 1))
        shift = ir.Constant(I32, 32 - bits)
        return b.ashr(b.shl(wide, shift), shift)
    table = _decode_table(k.module, dtype)
    return b.load(b.gep(table, [ir.Constant(I32, 0), b.zext(byte, I32)]))


def _decode_table(module: ir.Module, dtype: str) -> ir.GlobalVariable:
    name = f"tether.decode.{dtype}"
    if name in module.globals:
        return module.globals[name]
    fmt = FORMATS[dtype]
    values = np.array([fmt.value(code) for code in range(256)], np.float32)
    ty = ir.ArrayType(F32, 256)
    gv = ir.GlobalVariable(module, ty, name=name)
    gv.global_constant = True
    gv.linkage = "internal"
    gv.initializer = ir.Constant(ty, [ir.Constant(F32, float(v)) for v in values])
    return gv


def encode(k, value: ir.Value, source: str, dtype: str, saturate: bool = True, round_mode: str = "up") -> ir.Value:
    """value (a float32 or an integer of dtype source, as held) as an
    element of the low-bit dtype: an i8 holding its bits."""
    if dtype in INTEGERS:
        return _encode_integer(k, value, source, dtype)
    if dtype == "float8_e8m0fnu":
        return _encode_e8m0(k.builder, value, saturate, round_mode)
    return _encode_float(k.builder, value, FORMATS[dtype], saturate)


def _encode_integer(k, value: ir.Value, source: str, dtype: str) -> ir.Value:
    b = k.builder
    if isinstance(value.type, ir.FloatType):
        # Truncated toward zero; NaN and floats beyond int32 give 0 (an
        # LLVM fptosi of them would be undefined).
        within = b.fcmp_ordered("<", b.call(k.module.declare_intrinsic("llvm.fabs", [F32]), [value]),
                                ir.Constant(F32, 2.0 ** 31))
        value = b.select(within, b.fptosi(value, I32), ir.Constant(I32, 0))
    bits, _ = INTEGERS[dtype]
    return b.and_(b.trunc(value, I8) if value.type.width > 8 else value if value.type.width == 8
                  else b.zext(value, I8), ir.Constant(I8, (1 << bits) - 1))


def _float_bits(x: float) -> int:
    return int(np.array(x, np.float32).view(np.uint32))


def _encode_float(b, value: ir.Value, fmt: MiniFloat, saturate: bool) -> ir.Value:
    """float32 to a float8 or float4 code, rounded to nearest even."""
    def const(n):
        return ir.Constant(I32, n)
    bits = b.bitcast(value, I32)
    magnitude = b.and_(bits, const(0x7FFFFFFF))
    shift = 23 - fmt.mantissa_bits
    # Normal numbers: rebias the exponent and round off the low bits.
    rebiased = b.sub(magnitude, const((127 - fmt.bias) << 23))
    odd = b.and_(b.lshr(rebiased, const(shift)), const(1))
    normal = b.lshr(b.add(rebiased, b.add(const((1 << (shift - 1)) - 1), odd)), const(shift))
    # Below the smallest normal number: adding 2**(smallest exponent + 23)
    # lets float32's adder round to a multiple of the subnormal spacing,
    # which lands in the low mantissa bits.
    magic = 2.0 ** (1 - fmt.bias - fmt.mantissa_bits + 23)
    shifted = b.fadd(b.bitcast(magnitude, F32), ir.Constant(F32, magic))
    subnormal = b.sub(b.bitcast(shifted, I32), const(_float_bits(magic)))
    smallest_normal = _float_bits(2.0 ** (1 - fmt.bias))
    code = b.select(b.icmp_unsigned("<", magnitude, const(smallest_normal)), subnormal, normal)
    # Beyond the largest finite value (infinity too): the largest when
    # saturating or when the type has neither NaN nor infinity.
    overflow = b.icmp_unsigned(">", code, const(fmt.largest_code))
    if saturate or fmt.nan is None:
        beyond = fmt.largest_code
    else:
        beyond = fmt.infinity if fmt.infinity is not None else fmt.nan
    code = b.select(overflow, const(beyond), code)
    is_nan = b.icmp_unsigned(">", magnitude, const(0x7F800000))
    code = b.select(is_nan, const(0 if fmt.nan is None else fmt.nan), code)
    sign = b.and_(b.lshr(bits, const(31 - (fmt.width - 1))), const(fmt.sign_bit))
    if fmt.nan is None:  # float4: NaN becomes a zero of the other sign, as ml_dtypes makes it
        sign = b.xor(sign, b.select(is_nan, const(fmt.sign_bit), const(0)))
    if fmt.unsigned_zero:  # zero has no sign, and NaN (0x80) is its own
        sign = b.select(b.icmp_unsigned("==", code, const(0)), const(0), sign)
    return b.trunc(b.or_(code, sign), I8)


def _encode_e8m0(b, value: ir.Value, saturate: bool, round_mode: str) -> ir.Value:
    """float32 to E8M0: its exponent, rounded by the mantissa."""
    def const(n):
        return ir.Constant(I32, n)
    bits = b.bitcast(value, I32)
    exponent = b.and_(b.lshr(bits, const(23)), const(0xFF))
    special = b.icmp_unsigned("==", exponent, const(0xFF))
    if round_mode == "up":
        up = b.icmp_unsigned("!=", b.and_(bits, const(0x7FFFFF)), const(0))
    elif round_mode == "nearest":
        # onnx's reference rule: the guard bit (the mantissa's top one) set
        # and any bit below it or a nonzero exponent.
        guard = b.icmp_unsigned("!=", b.and_(bits, const(0x400000)), const(0))
        rest = b.icmp_unsigned("!=", b.and_(bits, const(0x3FFFFF)), const(0))
        up = b.and_(guard, b.or_(rest, b.icmp_unsigned("!=", exponent, const(0))))
    else:
        up = ir.Constant(ir.IntType(1), 0)
    if saturate:
        up = b.and_(up, b.icmp_unsigned("!=", exponent, const(0xFE)))
    code = b.add(exponent, b.zext(up, I32))
    return b.trunc(b.select(special, const(0xFF), code), I8)


# -- the model rewrite --------------------------------------------------------------------

def low_bit_types(proto: onnx.ModelProto) -> set:
    """The low-bit element types (TensorProto numbers) proto's inputs,
    outputs, initializers, Casts, QuantizeLinears and constants use."""
    return used_types(proto, ("to", "output_dtype")) & set(TENSOR_TYPES)


def hold_low_bit_types(proto: onnx.ModelProto) -> onnx.ModelProto:
    """proto with its low-bit tensors held in float32 or int32 (see the
    module's docstring); the same model when it has none.

    >>> m = hold_low_bit_types(onnx.load("cast_to_float8.onnx"))  # doctest: +SKIP
    """
    if not low_bit_types(proto):
        return proto

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    g = model.graph
    kinds, _ = _element_types(proto)
    kinds.update((vi.name, vi.type.tensor_type.elem_type) for vi in (*g.input, *g.output))
    kinds.update((init.name, init.data_type) for init in g.initializer)
    for init in g.initializer:
        if init.data_type in TENSOR_TYPES:
            init.CopyFrom(_held(init, init.name))
    # The held value is one of the type's own, so leaving it rounds nothing
    # (E8M0's smallest, 2**-127, is a float32 subnormal: rounding up would
    # take its mantissa for a fraction).
    renamed, outputs, entry, exits = boundary_casts(g, {kind: _held_type(kind) for kind in TENSOR_TYPES}, "held",
                                                    saturate=0, round_mode="down")
    kinds.update((renamed[name], kinds[name]) for name in renamed)
    nodes = []
    for node in g.node:
        node.input[:] = [renamed.get(n, n) for n in node.input]
        node.output[:] = [renamed.get(n, n) if n in outputs else n for n in node.output]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in TENSOR_TYPES:
                attr.t.CopyFrom(_held(attr.t, attr.t.name))
        to = cast_target(node, kinds, TENSOR_TYPES)
        if to is not None:
            nodes.extend(_cast_and_hold(node, to))
            continue
        if node.op_type == "QuantizeLinear":
            _name_quantized_type(node, kinds)
        nodes.append(node)
    replace_nodes(g, entry + nodes + exits, TENSOR_TYPES)
    return model


def _held_type(kind: int) -> int:
    return T.INT32 if TENSOR_TYPES[kind] in INTEGERS else T.FLOAT


def _held(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    value = numpy_helper.to_array(tensor)
    return numpy_helper.from_array(value.astype(held_dtype(value.dtype.name)), name)


def _cast_and_hold(node: onnx.NodeProto, to: int) -> list:
    """A Cast to the low-bit type `to` (with node's saturate and round_mode)
    and one back to its held type, in place of node."""
    low = f"{node.output[0]}/{TENSOR_TYPES[to]}"
    cast = helper.make_node("Cast", [node.input[0]], [low], to=to, name=node.name or low)
    cast.attribute.extend(a for a in node.attribute if a.name in ("saturate", "round_mode"))
    back = helper.make_node("Cast", [low], [node.output[0]], to=_held_type(to), name=f"{node.name or low}/hold")
    return [cast, back]


def _name_quantized_type(node: onnx.NodeProto, kinds: dict) -> None:
    """Write the low-bit type QuantizeLinear quantizes to (its zero
    point's, held in int32 or float32 now) into its output_dtype."""
    zero = kinds.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if zero in TENSOR_TYPES and not any(a.name == "output_dtype" for a in node.attribute):
        node.attribute.append(helper.make_attribute("output_dtype", zero))
