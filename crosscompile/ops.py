"""The supported ONNX ops, one class each: attribute parsing, shape
inference and lowering to LLVM IR through an emit.Kernel.

OPS lists them all. This module holds the simple ones; element-wise ops
live in elementwise.py, Conv in conv.py and the pools in pool.py, all on
the base class of op_base.py. Adding an op means adding one class with its
op_type to one of these modules: the class registers itself.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir

from . import attention, extents, conv, conv_transpose, einsum, elementwise, indexing, layout, logic, losses, normalization, pool, quantize_ops, ranking, recurrent, reduce, resize, roi_align, scan, selection, trigonometry  # noqa: F401 (their op classes register themselves)
from .emit import ELEMENT_TYPES, I64, Kernel
from .errors import BuildError, ShapeError
from .elementwise import safe_log
from .extents import clamp, extent
from .gemm import emit_dot_rows
from .matmul import lower_tiled, packed_rows_floats, strided_matmul, tiled_geometry
from .op_base import (ALL_DTYPES, REGISTERED, AliasOp, Op, copy_strided, _axis, _broadcast_strides, _c_strides, _check_choice, _const_float,
                      _const_ints, _ints, _prod)
from .ranking import extreme_index
from .reduce import broadcast_scalar, reduce_row
from .vectors import horizontal_reduce, load_strided


class TiledProduct(Op):
    """What MatMul and Gemm share once schedule.assign_tiles has given them
    a register tile (attrs["matmul_tile"]): they run on the GEMM
    micro-kernel (matmul.lower_tiled), split between threads."""

    def scratch_bytes(self, inputs, outputs, attrs):
        tile = attrs.get("matmul_tile")
        if tile is None:
            return 0
        b_shape = attrs.get("weight_shape") or inputs[1].shape
        m, kdim, _, a_strides, _ = tiled_geometry(self.op_type, inputs[0].shape, b_shape, attrs)
        if attrs.get("pack_rows") or a_strides[1] != 1:
            return 4 * packed_rows_floats(m, kdim, tile)
        return 0

    def parallel(self, attrs):
        return "matmul_tile" in attrs


class Gemm(TiledProduct):
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
        if "matmul_tile" in attrs:
            lower_tiled(k, self.op_type, inputs, attrs)
            return
        # Strides are (along M, along K) for A and (along K, along N) for B.
        (a_rows, a_cols), (_, b_cols) = inputs[0].shape, inputs[1].shape
        a_strides = (1, a_cols) if attrs["transA"] else (a_cols, 1)
        b_strides = (1, b_cols) if attrs["transB"] else (b_cols, 1)
        kdim = a_rows if attrs["transA"] else a_cols
        m, n = outputs[0].shape
        if attrs["transB"] and not attrs["transA"]:
            emit_dot_rows(k, k.target.lanes, m, kdim, n,
                          k.inputs[0], k.inputs[1], k.outputs[0])
        else:
            strided_matmul(k, m, kdim, n, a_strides, b_strides)
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


class MatMul(TiledProduct):
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
        if "matmul_tile" in attrs:
            lower_tiled(k, self.op_type, inputs, attrs)
            return
        a2, b2, batch, _ = self._geometry(inputs[0].shape, inputs[1].shape)
        m, kdim, n = a2[-2], a2[-1], b2[-1]
        if not batch:
            strided_matmul(k, m, kdim, n, (kdim, 1), (n, 1))
            return
        a_strides = _broadcast_strides(a2[:-2], batch)
        b_strides = _broadcast_strides(b2[:-2], batch)
        o_strides = _broadcast_strides(batch, batch)
        with k.nested_loops(batch) as idx:
            bases = (k.index(*zip(idx, [s * m * kdim for s in a_strides])),
                     k.index(*zip(idx, [s * kdim * n for s in b_strides])),
                     k.index(*zip(idx, [s * m * n for s in o_strides])))
            strided_matmul(k, m, kdim, n, (kdim, 1), (n, 1), bases)


class Expand(Op):
    """Broadcast to a constant shape (numpy rules, both ways)."""

    op_type = "Expand"
    compile_time_inputs = (1,)
    data_dtypes = ALL_DTYPES

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
        copy_strided(k, out, _broadcast_strides(inputs[0].shape, out), inputs[0].dtype)


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
        """Per row: its maximum, then the sum of exp(x - max), both in vector
        accumulators when the row is contiguous, then one pass writing each
        output (row_output)."""
        outer, length, inner = self.rows(inputs[0].shape, attrs)
        X, bld = k.inputs[0], k.builder
        with k.loop(outer) as o, k.loop(inner) as r:
            base = k.index((o, length * inner), (r, 1))
            peak = reduce_row(k, X, base, length, k.maximum, -math.inf, stride=inner)

            def shifted_exp(value):
                return k.exp(bld.fsub(value, broadcast_scalar(k, peak, value)))
            output = self.row_output(k, X, base, length, inner, peak, shifted_exp)
            with k.loop(length) as j:
                at = k.index((base, 1), (j, inner))
                k.store(k.activate(output(at)), k.outputs[0], at)

    @staticmethod
    def rows(shape, attrs):
        """(outer, length, inner): the rows normalised, each of length
        elements inner apart."""
        axis = _axis(attrs["axis"], len(shape))
        if attrs["flatten"]:
            return _prod(shape[:axis]), _prod(shape[axis:]), 1
        return _prod(shape[:axis]), shape[axis], _prod(shape[axis + 1:])

    def row_output(self, k: Kernel, X, base, length: int, inner: int, peak, shifted_exp):
        """The function from the element offset of a row's value to its
        output value. A contiguous row keeps its exponentials in the output
        as it sums them, so that each is computed once; then it is scaled."""
        bld, Y = k.builder, k.outputs[0]
        lanes = k.target.lanes
        if inner != 1 or lanes == 1 or length < lanes:
            scale = bld.fdiv(k.f32(1.0), reduce_row(k, X, base, length, bld.fadd, 0.0, shifted_exp, stride=inner))
            return lambda at: bld.fmul(shifted_exp(k.load(X, at)), scale)
        full = length // lanes * lanes
        with k.vector_constants(lanes):
            acc = k.variable(k.f32(0.0))
        with k.loop(length // lanes) as i:
            at = k.index((base, 1), (i, lanes))
            with k.vector_constants(lanes):
                e = shifted_exp(load_strided(k, X, at, lanes, 1))
                bld.store(bld.fadd(bld.load(acc), e), acc)
            bld.store(e, bld.bitcast(bld.gep(Y, [at]), e.type.as_pointer()), align=4)
        total = k.variable(horizontal_reduce(k, bld.load(acc)))
        with k.loop(length, start=full) as j:
            at = k.index((base, 1), (j, 1))
            e = shifted_exp(k.load(X, at))
            k.store(e, Y, at)
            bld.store(bld.fadd(bld.load(total), e), total)
        scale = bld.fdiv(k.f32(1.0), bld.load(total))
        return lambda at: bld.fmul(k.load(Y, at), scale)


class LogSoftmax(Softmax):
    """y = (x - max) - log(sum(exp(x - max))) over the same axes as Softmax."""

    op_type = "LogSoftmax"

    def row_output(self, k, X, base, length, inner, peak, shifted_exp):
        bld = k.builder
        log_total = safe_log(k, reduce_row(k, X, base, length, bld.fadd, 0.0, shifted_exp, stride=inner))
        # (x - max) first: exact near the maximum, where the result is small.
        return lambda at: bld.fsub(bld.fsub(k.load(X, at), peak), log_total)


class Hardmax(Softmax):
    """1 at the first largest element of each of Softmax's rows, 0 elsewhere."""

    op_type = "Hardmax"

    def lower(self, k, inputs, outputs, attrs):
        outer, length, inner = self.rows(inputs[0].shape, attrs)
        if outputs[0].size == 0:
            k.activated = True
            return
        bld = k.builder
        with k.loop(outer) as o, k.loop(inner) as r:
            base = k.index((o, length * inner), (r, 1))
            where = extreme_index(k, k.inputs[0], base, length, inner)
            with k.loop(length) as j:
                value = bld.select(bld.icmp_signed("==", j, where), k.f32(1.0), k.f32(0.0))
                k.store(k.activate(value), k.outputs[0], k.index((base, 1), (j, inner)))


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
    """Inference-mode Dropout (or training with ratio 0) is the identity,
    and its mask all true."""

    op_type = "Dropout"
    compile_time_inputs = (1, 2)

    def attributes(self, raw, constants, opset):
        training = constants.get(2)
        ratio = constants.get(1)
        ratio = float(np.asarray(ratio).reshape(-1)[0]) if ratio is not None else float(raw.get("ratio", 0.5))
        if training is not None and bool(np.asarray(training).reshape(-1)[0]) and ratio != 0:
            raise BuildError(f"Dropout with training_mode=True and ratio {ratio:g} is not supported: it drops "
                             "random elements (inference, or a ratio of 0, is the identity)")
        return {"mask_dtype": "bool" if opset >= 10 else "float32"}  # before opset 10 the mask has x's type

    def infer(self, inputs, attrs):
        return [inputs[0]]

    def constant_outputs(self, inputs, attrs):
        return {1: np.ones(inputs[0], dtype=attrs["mask_dtype"])}


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

class Gather(Op):
    """Gather along an axis. Constant indices (a channel pick) become one
    copy loop each; runtime indices (token ids into an embedding table) are
    read at run time, negative ones counting from the end. An index out of
    range is clamped to the axis (onnxruntime fails the run instead), so a
    bad id reads a wrong row rather than memory outside the table. With
    constant data too it folds at import."""

    op_type = "Gather"
    MAX_INDICES = 4096  # each constant index becomes one copy loop

    def folds_constant(self, pos, value):
        return pos == 1

    def attributes(self, raw, constants, opset):
        attrs = {"axis": int(raw.get("axis", 0))}
        indices = constants.get(1)
        if indices is None:
            return attrs
        indices = np.asarray(indices)
        if indices.dtype.kind not in "iu":
            raise BuildError(f"Gather indices must be integers, got {indices.dtype}")
        if indices.size > self.MAX_INDICES:
            raise BuildError(f"Gather with {indices.size} constant indices is not supported "
                             f"(at most {self.MAX_INDICES})")
        return dict(attrs, indices=tuple(int(i) for i in indices.reshape(-1)),
                    indices_shape=tuple(indices.shape))

    def infer(self, inputs, attrs):
        x = inputs[0]
        axis = _axis(attrs["axis"], len(x))
        if "indices" not in attrs:
            return [(*x[:axis], *inputs[1], *x[axis + 1:])]
        for i in attrs["indices"]:
            if not -x[axis] <= i < x[axis]:
                raise ShapeError(f"Gather index {i} is out of range for axis {axis} of size {x[axis]}")
        return [(*x[:axis], *attrs["indices_shape"], *x[axis + 1:])]

    def output_dtype(self, inputs, attrs):
        if len(inputs) == 2 and inputs[1].dtype not in ("int64", "int32"):
            raise BuildError(f"Gather indices {inputs[1].name!r} have dtype {inputs[1].dtype}; "
                             "int64 or int32 indices are supported")
        return inputs[0].dtype

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        axis = _axis(attrs["axis"], len(x))
        outer, inner = _prod(x[:axis]), _prod(x[axis + 1:])
        data, out = k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.outputs[0], outputs[0].dtype)
        if "indices" not in attrs:
            self._lower_runtime(k, inputs, data, out, x[axis], outer, inner, extent(k, inputs, attrs, 0, axis))
            return
        self._lower_constant(k, attrs["indices"], data, out, x[axis], outer, inner)

    @staticmethod
    def _lower_constant(k, indices, data, out, size, outer, inner):
        count = len(indices)
        for j, index in enumerate(indices):
            index %= size
            with k.loop(outer) as o, k.loop(inner) as i:
                value = k.load(data, k.index((o, size * inner), (index, inner), (i, 1)))
                k.store(k.activate(value), out, k.index((o, count * inner), (j, inner), (i, 1)))
        k.activated = True

    @staticmethod
    def _lower_runtime(k, inputs, data, out, size, outer, inner, length=None):
        """length: the axis's length this run (a count, crosscompile/extents.py)
        that negative indices count from; size, the rows' stride."""
        indices = k.typed(k.inputs[1], inputs[1].dtype)
        count = inputs[1].size
        with k.loop(outer) as o, k.loop(count) as j:
            index = _runtime_index(k, k.load(indices, j), size if length is None else length)
            with k.loop(inner) as i:
                value = k.load(data, k.index((o, size * inner), (index, inner), (i, 1)))
                k.store(k.activate(value), out, k.index((o, count * inner), (j, inner), (i, 1)))



class Compress(Gather):
    """The slices along axis whose entry in condition (a bool tensor,
    possibly shorter than the axis) is true; without axis, the elements of
    the flattened input. A constant condition copies them as Gather copies
    constant indices; one computed at run time gives an output whose size
    depends on the data (crosscompile/bounded.py, selection.compress)."""

    op_type = "Compress"

    def attributes(self, raw, constants, opset):
        axis = int(raw["axis"]) if "axis" in raw else None
        if constants.get(1) is None:
            return {"axis": axis, "runtime": True}
        condition = np.asarray(constants[1])
        if condition.ndim != 1:
            raise BuildError(f"Compress condition must be 1-D, got shape {condition.shape}")
        indices = tuple(int(i) for i in np.flatnonzero(condition))
        if len(indices) > self.MAX_INDICES:
            raise BuildError(f"Compress keeping {len(indices)} slices is not supported (at most {self.MAX_INDICES})")
        return {"axis": int(raw["axis"]) if "axis" in raw else None, "indices": indices,
                "indices_shape": (len(indices),)}

    def counted(self, attrs):
        return {0: 0 if attrs["axis"] is None else attrs["axis"]} if attrs.get("runtime") else {}

    def infer(self, inputs, attrs):
        x = inputs[0]
        size = _prod(x) if attrs["axis"] is None else x[_axis(attrs["axis"], len(x))]
        if attrs.get("runtime"):
            return [selection.compressed_shape(x, inputs[1], attrs["axis"])]
        if attrs["indices"] and attrs["indices"][-1] >= size:
            raise ShapeError(f"Compress condition selects index {attrs['indices'][-1]}, beyond the "
                             f"{size} slices of its input {x}")
        if attrs["axis"] is None:
            return [(len(attrs["indices"]),)]
        return super().infer(inputs, attrs)

    def output_dtype(self, inputs, attrs):
        if attrs.get("runtime"):
            return selection.compressed_dtype(inputs)
        return super().output_dtype(inputs, attrs)

    def lower(self, k, inputs, outputs, attrs):
        if attrs.get("runtime"):
            selection.compress(k, inputs, outputs, attrs["axis"])
            return
        if attrs["axis"] is not None:
            super().lower(k, inputs, outputs, attrs)
            return
        data, out = k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.outputs[0], outputs[0].dtype)
        self._lower_constant(k, attrs["indices"], data, out, inputs[0].size, 1, 1)


def _runtime_index(k: Kernel, index, size: "int | ir.Value"):
    """An int64 or int32 index read at run time as an i64 in [0, size):
    negative ones count from the end, and one out of range is clamped (see
    Gather). size may be a run-time length (a count); 0 gives 0."""
    bld = k.builder
    if index.type.width < 64:
        index = bld.sext(index, I64)
    size = size if isinstance(size, ir.Value) else k.i64(size)
    index = bld.select(bld.icmp_signed("<", index, k.i64(0)), bld.add(index, size), index)
    return k.smax(k.smin(index, bld.sub(size, k.i64(1))), k.i64(0))


class GatherElements(Op):
    """out[i, j, ...] = data[..., indices[i, j, ...], ...] with the index
    taking the place of the axis coordinate (torch.gather): indices have the
    data's rank and the output their shape. Indices out of range are clamped
    as Gather's are."""

    op_type = "GatherElements"

    def attributes(self, raw, constants, opset):
        return {"axis": int(raw.get("axis", 0))}

    def infer(self, inputs, attrs):
        if len(inputs) != 2:
            raise ShapeError(f"GatherElements takes data and indices, got {len(inputs)} inputs")
        data, indices = inputs
        axis = _axis(attrs["axis"], len(data))
        if len(indices) != len(data) or any(i > d for a, (i, d) in enumerate(zip(indices, data)) if a != axis):
            raise ShapeError(f"GatherElements indices of shape {indices} do not fit data of shape {data} "
                             f"along axis {axis} (same rank, no larger outside the axis)")
        return [tuple(indices)]

    def output_dtype(self, inputs, attrs):
        if inputs[1].dtype not in ("int64", "int32"):
            raise BuildError(f"GatherElements indices {inputs[1].name!r} have dtype {inputs[1].dtype}; "
                             "int64 or int32 indices are supported")
        return inputs[0].dtype

    def lower(self, k, inputs, outputs, attrs):
        data_shape, out = inputs[0].shape, outputs[0].shape
        axis = _axis(attrs["axis"], len(data_shape))
        data, dst = k.typed(k.inputs[0], inputs[0].dtype), k.typed(k.outputs[0], outputs[0].dtype)
        indices = k.typed(k.inputs[1], inputs[1].dtype)
        data_strides, out_strides = _c_strides(data_shape), _c_strides(out)
        with k.nested_loops(out) as idx:
            at = k.index(*zip(idx, out_strides))
            index = _runtime_index(k, k.load(indices, at), data_shape[axis])
            terms = [(i, s) for a, (i, s) in enumerate(zip(idx, data_strides)) if a != axis]
            value = k.load(data, k.index((index, data_strides[axis]), *terms))
            k.store(k.activate(value), dst, at)


class Transpose(Op):
    op_type = "Transpose"
    data_dtypes = ALL_DTYPES

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
        copy_strided(k, outputs[0].shape, [strides[p] for p in perm], inputs[0].dtype)


class Concat(Op):
    op_type = "Concat"
    data_dtypes = ALL_DTYPES

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
        if attrs.get("extents"):
            self._lower_counted(k, inputs, outputs, attrs, axis, outer, inner)
            return
        offset, dtype = 0, outputs[0].dtype
        dst = k.typed(k.outputs[0], dtype)
        for ptr, t in zip(k.inputs, inputs):
            chunk = t.shape[axis] * inner
            if chunk:
                with k.loop(outer) as o, k.loop(chunk) as j:
                    value = k.load(k.typed(ptr, dtype), k.index((o, chunk), (j, 1)))
                    k.store(k.activate(value), dst, k.index((o, out[axis] * inner), (j, 1), (offset, 1)))
            offset += chunk

    @staticmethod
    def _lower_counted(k, inputs, outputs, attrs, axis, outer, inner):
        """Inputs counted along the axis (crosscompile/extents.py): each
        one's rows up to its count, one after another, zeros after them,
        and the rows taken into the count output."""
        bld = k.builder
        bound, dtype = outputs[0].shape[axis], outputs[0].dtype
        dst = k.typed(k.outputs[0], dtype)
        taken = k.variable(k.i64(0))
        for pos, t in enumerate(inputs[:len(inputs) - len(attrs["extents"])]):
            rows = extent(k, inputs, attrs, pos, axis)
            offset = bld.load(taken)
            with k.loop(outer) as o, k.loop(bld.mul(rows, k.i64(inner))) as j:
                value = k.load(k.typed(k.inputs[pos], dtype), k.index((o, t.shape[axis] * inner), (j, 1)))
                k.store(value, dst, k.index((o, bound * inner), (offset, inner), (j, 1)))
            bld.store(bld.add(offset, rows), taken)
        total = bld.load(taken)
        zero = ir.Constant(dst.type.pointee, 0)
        with k.loop(outer) as o, k.loop(bld.mul(bld.sub(k.i64(bound), total), k.i64(inner))) as j:
            k.store(zero, dst, k.index((o, bound * inner), (total, inner), (j, 1)))
        k.store(total, k.typed(k.outputs[1], "int64"), k.i64(0))
        k.activated = True


class Split(Op):
    """split sizes come from the attribute (< 13), a constant input (>= 13),
    num_outputs (>= 18) or equal parts; set by the frontend from the node's
    output count."""

    op_type = "Split"
    compile_time_inputs = (1,)
    counts_outputs = True
    data_dtypes = ALL_DTYPES

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
        offset, dtype = 0, inputs[0].dtype
        src = k.typed(k.inputs[0], dtype)
        for ptr, t in zip(k.outputs, outputs):
            chunk = t.shape[axis] * inner
            if chunk:
                with k.loop(outer) as o, k.loop(chunk) as j:
                    value = k.load(src, k.index((o, x[axis] * inner), (j, 1), (offset, 1)))
                    k.store(value, k.typed(ptr, dtype), k.index((o, chunk), (j, 1)))
            offset += chunk
        k.activated = True


class Slice(Op):
    """Slice with constant starts/ends/axes/steps (inputs from opset 10)."""

    op_type = "Slice"
    compile_time_inputs = (1, 2, 3, 4)
    data_dtypes = ALL_DTYPES

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
        copy_strided(k, out, [s * st for s, st in zip(strides, step)], inputs[0].dtype, base)
        if attrs.get("extents"):
            # The first rows of a counted axis (crosscompile/bounded.py): as
            # many as the count leaves past begin, within the rows copied.
            ((_, axis),) = attrs["extents"]
            bld = k.builder
            kept = bld.sub(extent(k, inputs, attrs, 0, axis), k.i64(begin[axis]))
            k.store(clamp(k, kept, 0, out[axis]), k.typed(k.outputs[1], "int64"), k.i64(0))


class Pad(Op):
    """constant / reflect / edge / wrap padding of a tensor of any dtype;
    pads (and value, axes) are attributes before opset 11 and constant
    inputs after."""

    op_type = "Pad"
    compile_time_inputs = (1, 2, 3)
    data_dtypes = ALL_DTYPES

    def attributes(self, raw, constants, opset):
        mode = raw.get("mode", "constant")
        _check_choice("mode", mode, ("constant", "reflect", "edge") + (("wrap",) if opset >= 19 else ()))
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
        mode, dtype = attrs["mode"], inputs[0].dtype
        if not out or _prod(out) == 0:
            k.activated = True
            return
        element = ELEMENT_TYPES[dtype]
        fill = ir.Constant(element, attrs["value"] if dtype in ("float32", "float64") else int(attrs["value"]))
        src, dst = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
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
                elif mode == "wrap":  # the input repeated: i modulo d, taken positive
                    r = bld.srem(i, k.i64(d))
                    i = bld.select(bld.icmp_signed("<", r, k.i64(0)), bld.add(r, k.i64(d)), r)
                else:
                    i = bld.select(bld.icmp_signed("<", i, k.i64(0)), bld.sub(k.i64(0), i), i)
                    i = bld.select(bld.icmp_signed(">", i, k.i64(d - 1)), bld.sub(k.i64(2 * d - 2), i), i)
                offset = bld.add(offset, bld.mul(i, k.i64(st)))
            value = k.load(src, offset)
            if inside is not None:
                value = bld.select(inside, value, fill)
            k.store(k.activate(value), dst, k.index(*zip(idx, out_strides)))


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


OPS: dict[str, Op] = {op_type: cls() for op_type, cls in REGISTERED.items()}
