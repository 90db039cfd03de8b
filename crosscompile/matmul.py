"""Matrix products of MatMul, Gemm and Einsum: on the register-tiled GEMM
micro-kernel of gemm.py (lower_tiled), or as plain loops for operands read
through arbitrary strides (a transposed or broadcast operand is a change of
strides, not a copy)."""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir

from .emit import F32, Kernel
from .op_base import _broadcast_strides


def strided_matmul(k: Kernel, m: int, kdim: int, n: int, a_strides, b_strides, bases=(0, 0, 0),
                   operands=None) -> None:
    """out[m, n] = sum_k A[m, k] * B[k, n], with A and B read through strides
    from element offsets bases = (A, B, out) (ints or i64 values). The
    operands (A, B, out) are the kernel's two inputs and its output unless
    given.

    The loop order keeps the innermost loop on unit stride: over n when B's
    rows are contiguous, otherwise over k as a dot product.
    """
    a, b, out = operands or (k.inputs[0], k.inputs[1], k.outputs[0])
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


def tiled_geometry(op_type: str, a_shape, b_shape, attrs) -> tuple:
    """(m, kdim, n, a_strides, batch) of a MatMul or Gemm that runs on the
    GEMM micro-kernel: C[m, n] = A[m, k] @ B[k, n] once per element of the
    batch shape, batch = (shape, A's, B's and C's element strides along
    it), or None for one product. a_strides are A's (along m, along k);
    b_shape is B's shape as the model gives it, or (K, N) for weights
    packed in panels (attrs["packed_weights"]).

    A right-hand side without batch dimensions multiplies every row of A
    in one product: a Linear layer on (batch, tokens, width) input is one
    GEMM of batch * tokens rows.

    >>> tiled_geometry("MatMul", (1, 17, 64), (64, 192), {})
    (17, 64, 192, (64, 1), None)
    >>> tiled_geometry("MatMul", (2, 5, 8), (2, 8, 3), {})[4]
    ((2,), [40], [24], [15])
    """
    if op_type == "Gemm":
        rows, cols = a_shape
        m, kdim = (cols, rows) if attrs["transA"] else (rows, cols)
        n = b_shape[1] if attrs.get("packed_weights") else (b_shape[0] if attrs["transB"] else b_shape[1])
        return m, kdim, n, ((1, m) if attrs["transA"] else (kdim, 1)), None
    a2 = (1, *a_shape) if len(a_shape) == 1 else tuple(a_shape)
    kdim, n = b_shape[-2], b_shape[-1]
    if len(b_shape) == 2:
        return math.prod(a2[:-1]), kdim, n, (kdim, 1), None
    m = a2[-2]
    shape = tuple(np.broadcast_shapes(a2[:-2], tuple(b_shape[:-2])))
    strides = [[s * size for s in _broadcast_strides(dims, shape)]
               for dims, size in ((a2[:-2], m * kdim), (tuple(b_shape[:-2]), kdim * n), (shape, m * n))]
    return m, kdim, n, (kdim, 1), (shape, *strides)


def packed_rows_floats(m: int, kdim: int, tile) -> int:
    """Scratch floats for A packed by pack_rows: whole blocks of tile.mr rows."""
    return -(-m // tile.mr) * tile.mr * kdim


def lower_tiled(k: Kernel, op_type: str, inputs, attrs) -> None:
    """A MatMul or Gemm on the GEMM micro-kernel (gemm.emit_gemm) with the
    tile schedule.assign_tiles wrote into attrs["matmul_tile"]: B is
    weights packed in column panels at compile time (attrs["packed_weights"],
    passes.pack_matmul_weights) or a runtime tensor read in place, its rows
    contiguous. A is read in place, or first packed into scratch where the
    target loads the values it broadcasts a vector at a time
    (attrs["pack_rows"]). A bias per column (attrs["bias"], input 2), the
    fused element-wise ops and a residual (the last input, after
    attrs["residual_at"] of them) run in the tile's registers."""
    from .gemm import emit_gemm
    from .vectors import vector_epilogue
    tile = attrs["matmul_tile"]
    b_shape = attrs.get("weight_shape") or inputs[1].shape
    m, kdim, n, a_strides, batch = tiled_geometry(op_type, inputs[0].shape, b_shape, attrs)
    residual_at = attrs.get("residual_at")
    residual = k.inputs[-1] if residual_at is not None else None
    if residual is not None:
        # The memory planner may give the output the residual's buffer.
        for arg in (k.inputs[-1], k.outputs[0]):
            arg.attributes.discard("noalias")
    bias = k.inputs[2] if attrs.get("bias") else None
    epilogue = vector_epilogue(k)
    packed = bool(attrs.get("packed_weights"))
    bld = k.builder

    def product(a_base, b_base, c_base):
        a_ptr = bld.gep(k.inputs[0], [a_base])
        if attrs.get("pack_rows"):
            pack_rows(k, tile, m, kdim, a_ptr, a_strides)
            k.barrier()  # every thread's tiles read every block
            a_ptr, lda = k.scratch, None
        elif a_strides[1] == 1:
            lda = a_strides[0]
        else:  # A transposed (Gemm's transA): packed as well
            pack_rows(k, tile, m, kdim, a_ptr, a_strides)
            k.barrier()
            a_ptr, lda = k.scratch, None
        emit_gemm(k, tile, m, kdim, n, a_ptr, k.inputs[1], b_base, n, k.outputs[0], c_base, bias, epilogue,
                  residual, residual_at or 0, b_panels=packed, lda=lda, bias_columns=True,
                  b_half=packed and tile.precision == "fp16")
        if lda is None:
            k.barrier()  # before the next product packs over the scratch
    if batch is None:
        product(k.i64(0), k.i64(0), k.i64(0))
    else:
        with k.nested_loops(batch[0]) as idx:
            product(*(k.index(*zip(idx, strides)) for strides in batch[1:]))
    k.activated = epilogue or not k.epilogue


def pack_rows(k: Kernel, tile, m: int, kdim: int, a_ptr: ir.Value, a_strides) -> None:
    """scratch = A (m x kdim, read through a_strides) laid out as
    gemm.pack_weights lays out weights, [block][k][row in block], rows past
    m left unwritten (no tile reads them); threads split the blocks. For
    an fp16 tile the scratch holds A in halves."""
    bld = k.builder
    element = tile.element
    scratch = k.scratch if element == F32 else bld.bitcast(k.scratch, element.as_pointer())
    blocks = -(-m // tile.mr)
    with k.share(blocks) as (lo, hi), k.loop(hi, start=lo) as block:
        first = bld.mul(block, k.i64(tile.mr))
        count = k.smin(bld.sub(k.i64(m), first), k.i64(tile.mr))
        with k.loop(count) as r:
            src = k.index((first, a_strides[0]), (r, a_strides[0]))
            dst = k.index((block, kdim * tile.mr), (r, 1))
            with k.loop(kdim) as p:
                value = k.load(a_ptr, k.index((src, 1), (p, a_strides[1])))
                if element != F32:
                    value = bld.fptrunc(value, element)
                k.store(value, scratch, k.index((dst, 1), (p, tile.mr)))
