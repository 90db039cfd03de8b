"""Attention's chain MatMul(Q, K^T) -> scale -> (+ masks) -> Softmax(last
axis) -> MatMul(., V) as one kernel (patterns.fuse_attention puts it in
the graph), head by head.

Per (batch..., head) item the kernel computes the head's m x n scores
with the GEMM micro-kernel into its thread's slot of scratch, scales
them, adds the masks and replaces each row by its exponentials (less the
row's maximum) in place, multiplies them by V straight into the output
and divides each output row by its row's sum there (dv values a row
rather than n). The workspace then holds attrs["slots"] score matrices
instead of every head's; threads split the items, and threads beyond the
slot count wait at the op's barrier.
"""
from __future__ import annotations

import math

from llvmlite import ir

from .emit import I32, I64, Kernel
from .errors import BuildError
from .op_base import Op, _broadcast_strides, _c_strides
from .reduce import broadcast_scalar
from .vectors import _vector_ptr, horizontal_reduce


class FusedAttention(Op):
    """Inputs Q (..., m, d), K^T (..., d, n), V (..., n, dv) with the same
    batch dimensions, then the additive masks (each broadcasting to the
    scores (..., m, n), rows contiguous); output (..., m, dv). attrs:
    "scale" (the scores' factor), "matmul_tile" and "slots" (score
    matrices in scratch, the most threads that work on it)."""

    op_type = "FusedAttention"

    def attributes(self, raw, constants, opset):
        raise BuildError("FusedAttention is not an ONNX op: patterns.fuse_attention makes it from "
                         "MatMul, Softmax and MatMul")

    def infer(self, inputs, attrs):
        return [tuple(inputs[0][:-1]) + (inputs[2][-1],)]

    def scratch_bytes(self, inputs, outputs, attrs):
        m, n = inputs[0].shape[-2], inputs[1].shape[-1]
        return 4 * attrs["slots"] * (m * n + m)

    def parallel(self, attrs):
        return True

    def lower(self, k, inputs, outputs, attrs):
        from .gemm import emit_gemm
        q_shape, out_shape = inputs[0].shape, outputs[0].shape
        batch = tuple(out_shape[:-2])
        m, d = q_shape[-2:]
        n, dv = inputs[1].shape[-1], out_shape[-1]
        tile, slots = attrs["matmul_tile"], attrs["slots"]
        b = k.builder
        workers = k.threads if k.parallel else ir.Constant(I32, 1)
        workers = b.select(b.icmp_signed("<", workers, ir.Constant(I32, slots)), workers, ir.Constant(I32, slots))
        thread = k.thread if k.parallel else ir.Constant(I32, 0)
        # One score matrix per thread that takes items: the first `slots` threads.
        scores = b.gep(k.scratch, [b.mul(b.zext(thread, I64), k.i64(m * n + m))])
        inverses = b.gep(scores, [k.i64(m * n)])  # 1 / each row's sum of exponentials
        masks = [(k.inputs[3 + i], _broadcast_strides(t.shape, batch + (m, n))) for i, t in enumerate(inputs[3:])]
        item_strides = _c_strides(batch)
        with k.share(math.prod(batch), workers) as (lo, hi), k.alone(), k.nested_loops(batch) as idx:
            item = k.index(*zip(idx, item_strides))
            inside = b.and_(b.icmp_signed(">=", item, lo), b.icmp_signed("<", item, hi))
            with b.if_then(inside):
                q = b.gep(k.inputs[0], [b.mul(item, k.i64(m * d))])
                emit_gemm(k, tile, m, d, n, q, k.inputs[1], b.mul(item, k.i64(d * n)), n,
                          scores, k.i64(0), None, False, lda=d)
                bases = [(ptr, k.index(*zip(idx, strides[:-2])), strides[-2]) for ptr, strides in masks]
                with k.loop(m) as row:
                    inverse = _softmax_row(k, b.gep(scores, [b.mul(row, k.i64(n))]), n, attrs["scale"],
                                           [(ptr, b.add(base, b.mul(row, k.i64(step)))) for ptr, base, step in bases])
                    k.store(inverse, inverses, row)
                out = b.mul(item, k.i64(m * dv))
                emit_gemm(k, tile, m, n, dv, scores, k.inputs[2], b.mul(item, k.i64(n * dv)), dv,
                          k.outputs[0], out, None, False, lda=n)
                with k.loop(m) as row:
                    _scale_row(k, b.gep(k.outputs[0], [b.add(out, b.mul(row, k.i64(dv)))]), dv,
                               k.load(inverses, row))
        k.activated = not k.epilogue


def _load(k: Kernel, ptr, at, width: int):
    b = k.builder
    return k.load(ptr, at) if width == 1 else b.load(_vector_ptr(k, ptr, at, width), align=4)


def _store(k: Kernel, value, ptr, at, width: int) -> None:
    if width == 1:
        k.store(value, ptr, at)
    else:
        k.builder.store(value, _vector_ptr(k, ptr, at, width), align=4)


def _row_lanes(k: Kernel, n: int) -> int:
    """The vector width a row of n values is walked in (1: scalars only)."""
    return k.target.lanes if n >= k.target.lanes else 1


def _each(k: Kernel, n: int, body) -> None:
    """body(offset, width) over a row of n values: vectors, then the scalar tail."""
    lanes = _row_lanes(k, n)
    full = n // lanes * lanes if lanes > 1 else 0
    if lanes > 1:
        with k.loop(n // lanes) as v, k.vector_constants(lanes):
            body(k.builder.mul(v, k.i64(lanes)), lanes)
    with k.loop(n, start=full) as j:
        body(j, 1)


def _scale_row(k: Kernel, row: ir.Value, n: int, factor: ir.Value) -> None:
    """row[j] *= factor for the n values of a row."""
    b = k.builder

    def scale(at, width):
        value = _load(k, row, at, width)
        _store(k, b.fmul(value, broadcast_scalar(k, factor, value)), row, at, width)
    _each(k, n, scale)


def _softmax_row(k: Kernel, row: ir.Value, n: int, scale: float, masks) -> ir.Value:
    """row[j] = exp(x_j - max x) with x_j = row[j] * scale + the sum of
    mask[base + j], in place, for the n values of one row (masks are
    (pointer, base offset) pairs); returns 1 / the sum of the row, the
    factor that makes it a softmax, which the caller applies to the row's
    product by V instead (dv values rather than n)."""
    b = k.builder
    lanes = _row_lanes(k, n)

    def slots(start):
        """(vector, scalar) accumulators both starting at start."""
        vector = None
        if lanes > 1:
            with k.vector_constants(lanes):
                vector = k.variable(k.f32(start))
        return vector, k.variable(k.f32(start))

    def fold(pair, combine):
        vector, scalar = pair
        if vector is None:
            return b.load(scalar)
        return combine(horizontal_reduce(k, b.load(vector), combine), b.load(scalar))

    peak = slots(-math.inf)

    def shift(at, width):
        value = _load(k, row, at, width)
        if scale != 1.0:
            value = b.fmul(value, k.f32(scale))
        for ptr, base in masks:
            value = b.fadd(value, _load(k, ptr, b.add(base, at), width))
        _store(k, value, row, at, width)
        slot = peak[0] if width > 1 else peak[1]
        b.store(k.maximum(b.load(slot), value), slot)
    _each(k, n, shift)
    top = fold(peak, k.maximum)
    total = slots(0.0)

    def exponentiate(at, width):
        value = _load(k, row, at, width)
        e = k.exp(b.fsub(value, broadcast_scalar(k, top, value)))
        _store(k, e, row, at, width)
        slot = total[0] if width > 1 else total[1]
        b.store(b.fadd(b.load(slot), e), slot)
    _each(k, n, exponentiate)
    return b.fdiv(k.f32(1.0), fold(total, b.fadd))
