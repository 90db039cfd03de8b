"""What every ONNX op class implements (Op, AliasOp), and the shape and
attribute helpers the op classes share.

A class that names an op_type registers itself in REGISTERED as it is
defined, so adding an op is one class in one module of ops; ops.py builds
the table OPS from it. The modules holding the larger kinds of op
(elementwise.py, conv.py, pool.py) import this module and never ops.py, so
ops.py can import them.
"""
from __future__ import annotations

import math

import numpy as np

from .emit import Kernel
from .errors import BuildError, ShapeError
from .ir import Tensor


Shape = tuple
# Every dtype a tensor of the graph may have; ops that only move elements
# take them all.
ALL_DTYPES = ("float32", "int64", "int32", "bool", "uint8", "int8", "int16", "uint16", "uint32", "uint64")
# The dtypes arithmetic takes.
NUMERIC_DTYPES = ("float32", "int64", "int32")
# Integer dtypes narrower than int64 that element-wise kernels compute as
# int64 (sign- or zero-extended, True when signed) and truncate back when
# they store: that wraps +, - and * as numpy does, and the other ops never
# leave the type's range.
NARROW_INTEGERS = {"int8": True, "int16": True, "uint8": False, "uint16": False, "uint32": False}
UNSIGNED_DTYPES = ("uint8", "uint16", "uint32", "uint64")
# Every integer dtype of the element-wise integer ops (Add ... Mod, BitShift, Bitwise*).
INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8")
# ONNX op type -> the class lowering it, filled as the op modules are imported.
REGISTERED: dict = {}


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


def _c_strides(shape) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
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
    # {output position: axis} of outputs whose size along that axis depends
    # on the data (crosscompile/bounded.py): infer() gives the upper bound,
    # and the frontend appends an int64 (1,) output the kernel writes the
    # actual size to. counted() may decide it from the attributes instead.
    count_axes: dict = {}
    # Input positions whose values, computed at run time, may have an upper
    # bound known at compile time (crosscompile/bounded.py, MONOTONE): the
    # frontend adds attrs["value_bounds"] = {position: largest value}.
    bounded_inputs: tuple = ()
    # The frontend adds attrs["outputs"] = the node's output count.
    counts_outputs = False
    # The frontend adds attrs["input_positions"] = the node input position of
    # each runtime input, for ops whose optional inputs may be left out
    # anywhere in the list (LSTM's sequence_lens before initial_h).
    positional_inputs = False
    # apply() works on vectors as well as scalars (fused into vector epilogues).
    vectorizable = False
    # The dtypes the runtime inputs may have (all the same one, which the
    # outputs get), unless output_dtype says otherwise.
    data_dtypes: tuple = ("float32",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "op_type" in cls.__dict__:
            if cls.op_type in REGISTERED:
                raise TypeError(f"two classes lower ONNX op {cls.op_type}: "
                                f"{REGISTERED[cls.op_type].__module__} and {cls.__module__}")
            REGISTERED[cls.op_type] = cls

    def attributes(self, raw: dict, constants: dict, opset: int) -> dict:
        return {}

    def folds_constant(self, pos: int, value: np.ndarray) -> bool:
        """Whether input pos, found to be the constant value, is handed to
        attributes() like a compile_time_inputs one (and dropped from the
        node) rather than read at run time: Pow's exponent 2 becomes x * x,
        Gather's constant indices become copies of rows."""
        return False

    def infer(self, inputs: list[Shape], attrs: dict) -> list[Shape]:
        raise NotImplementedError

    def counted(self, attrs: dict) -> dict:
        """count_axes for a node with these attributes."""
        return self.count_axes

    def constant_outputs(self, inputs: list[Shape], attrs: dict) -> dict:
        """Outputs past those infer() gives whose values are known at
        compile time (inference Dropout's mask), by output position."""
        return {}

    def output_dtype(self, inputs: list[Tensor], attrs: dict) -> str:
        """The dtype of every output, from the runtime inputs, or a list of
        one dtype per output (TopK's values and int64 indices); raising
        BuildError refuses inputs of dtypes the op does not take. Most ops
        take and give float32 only; the others name theirs in data_dtypes."""
        if self.data_dtypes == ("float32",):
            for tensor in inputs:
                if tensor.dtype != "float32":
                    raise BuildError(f"input {tensor.name!r} has dtype {tensor.dtype}; {self.op_type} takes "
                                     "float32 tensors only (a Cast to float32 before it would do)")
            return "float32"
        dtypes = {t.dtype for t in inputs}
        if len(dtypes) != 1 or not dtypes <= set(self.data_dtypes):
            shown = ", ".join(f"{t.name!r} {t.dtype}" for t in inputs)
            raise BuildError(f"{self.op_type} takes inputs of one dtype among {', '.join(self.data_dtypes)}; "
                             f"got dtype {shown}")
        return dtypes.pop()

    def lower(self, k: Kernel, inputs: list[Tensor], outputs: list[Tensor], attrs: dict) -> None:
        raise NotImplementedError

    def scratch_bytes(self, inputs: list[Tensor], outputs: list[Tensor], attrs: dict) -> int:
        """Temporary bytes lower() needs during the call (then k.scratch is set)."""
        return 0

    def parallel(self, attrs: dict) -> bool:
        """lower() splits its work between threads (Kernel.share/barrier):
        every thread of tether_run_parallel calls the kernel, not only the first."""
        return False


def copy_strided(k: Kernel, out_shape, src_strides, dtype: str = "float32", base: int = 0, src=None,
                 dst=None, dst_offset: int = 0) -> None:
    """dst[i] = src[base + sum(idx * src_strides)] over out_shape in C
    order, for elements of dtype (src and dst default to input and output 0)."""
    src = k.typed(k.inputs[0] if src is None else src, dtype)
    dst = k.typed(k.outputs[0] if dst is None else dst, dtype)
    shape = tuple(out_shape) or (1,)
    strides = list(src_strides) or [0]
    dst_strides = _broadcast_strides(shape, shape)
    with k.nested_loops(shape) as idx:
        value = k.load(src, k.index(*zip(idx, strides), (base, 1)))
        k.store(k.activate(value), dst, k.index(*zip(idx, dst_strides), (dst_offset, 1)))


class AliasOp(Op):
    """An op that only reinterprets its input's shape, of any dtype."""

    alias = True

    def output_dtype(self, inputs, attrs):
        return inputs[0].dtype

    def lower(self, k, inputs, outputs, attrs):
        dtype = inputs[0].dtype
        src, dst = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
        with k.loop(outputs[0].size) as i:
            k.store(k.load(src, i), dst, i)


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
