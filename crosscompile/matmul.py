"""The plain-loop matrix product that MatMul, Gemm and Einsum share for
operands read through arbitrary strides (a transposed or broadcast operand
is a change of strides, not a copy)."""
from __future__ import annotations

from .emit import Kernel


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
