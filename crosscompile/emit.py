"""Building blocks for kernels written with llvmlite.ir: one function per
node, counted loops, element access and a libm-free exp.

Ops lower themselves through a Kernel so that they never deal with basic
blocks or phi nodes directly.
"""
from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir

F32 = ir.FloatType()
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32_PTR = F32.as_pointer()


class Kernel:
    """An internal function `void name(float *in..., float *out...)`.

    Buffers never overlap an output (the memory planner guarantees it), so
    every pointer is marked noalias, which lets LLVM vectorise the loops.
    """

    def __init__(self, module: ir.Module, name: str, n_inputs: int, n_outputs: int):
        fnty = ir.FunctionType(ir.VoidType(), [F32_PTR] * (n_inputs + n_outputs))
        self.function = ir.Function(module, fnty, name=name)
        self.function.linkage = "internal"
        for arg in self.function.args:
            arg.add_attribute("noalias")
        self.inputs = list(self.function.args[:n_inputs])
        self.outputs = list(self.function.args[n_inputs:])
        self.builder = ir.IRBuilder(self.function.append_basic_block("entry"))

    def finish(self) -> None:
        self.builder.ret_void()

    # -- values -------------------------------------------------------------
    @staticmethod
    def f32(value: float) -> ir.Constant:
        return ir.Constant(F32, float(value))

    @staticmethod
    def i64(value: int) -> ir.Constant:
        return ir.Constant(I64, int(value))

    def index(self, *terms) -> ir.Value:
        """Sum of (index, stride) pairs as an i64 offset; zero strides drop out."""
        b = self.builder
        total = self.i64(0)
        for value, stride in terms:
            if stride == 0:
                continue
            term = value if stride == 1 else b.mul(value, self.i64(stride))
            total = b.add(total, term)
        return total

    def load(self, ptr: ir.Value, offset: ir.Value) -> ir.Value:
        return self.builder.load(self.builder.gep(ptr, [offset]))

    def store(self, value: ir.Value, ptr: ir.Value, offset: ir.Value) -> None:
        self.builder.store(value, self.builder.gep(ptr, [offset]))

    def variable(self, initial: ir.Value) -> ir.Value:
        """A stack slot holding initial; mem2reg turns it into a register."""
        with self.builder.goto_entry_block():
            slot = self.builder.alloca(initial.type)
        self.builder.store(initial, slot)
        return slot

    # -- control flow ---------------------------------------------------------
    @contextmanager
    def loop(self, count: int):
        """for (i = 0; i < count; i++) — yields i as an i64."""
        b = self.builder
        before = b.block
        header = b.append_basic_block("loop")
        body = b.append_basic_block("body")
        after = b.append_basic_block("after")
        b.branch(header)
        b.position_at_end(header)
        i = b.phi(I64, name="i")
        i.add_incoming(self.i64(0), before)
        b.cbranch(b.icmp_signed("<", i, self.i64(count)), body, after)
        b.position_at_end(body)
        yield i
        i.add_incoming(b.add(i, self.i64(1)), b.block)
        b.branch(header)
        b.position_at_end(after)

    @contextmanager
    def nested_loops(self, shape):
        """One loop per dimension of shape; yields the list of indices."""
        if not shape:
            yield []
            return
        with self.loop(shape[0]) as i:
            with self.nested_loops(shape[1:]) as rest:
                yield [i, *rest]

    # -- math -----------------------------------------------------------------
    def maximum(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.select(self.builder.fcmp_ordered(">", a, b), a, b)

    def exp(self, x: ir.Value) -> ir.Value:
        """exp(x) in float32 without libm: x = n*ln2 + r, exp(r) by polynomial.

        The board's libm would add a versioned glibc dependency to every
        module, so exp is generated inline. Error is a few ulp.
        """
        b = self.builder
        hi_clamp, lo_clamp = 88.37626, -87.33654
        xc = b.select(b.fcmp_ordered(">", x, self.f32(hi_clamp)), self.f32(hi_clamp), x)
        xc = b.select(b.fcmp_ordered("<", xc, self.f32(lo_clamp)), self.f32(lo_clamp), xc)
        # n = round(x / ln2), done with fptosi so no rint/floor libcall appears.
        t = b.fmul(xc, self.f32(1.4426950408889634))
        half = b.select(b.fcmp_ordered("<", t, self.f32(0.0)), self.f32(-0.5), self.f32(0.5))
        n = b.fptosi(b.fadd(t, half), I32)
        nf = b.sitofp(n, F32)
        # Cody-Waite: ln2 split into a part exact in float32 and a remainder.
        r = b.fsub(xc, b.fmul(nf, self.f32(0.693359375)))
        r = b.fsub(r, b.fmul(nf, self.f32(-2.12194440e-4)))
        # Minimax polynomial for exp(r) on [-ln2/2, ln2/2] (Cephes expf).
        coeffs = [1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                  4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1]
        p = self.f32(coeffs[0])
        for c in coeffs[1:]:
            p = b.fadd(b.fmul(p, r), self.f32(c))
        p = b.fadd(b.fmul(b.fmul(p, r), r), b.fadd(r, self.f32(1.0)))
        scale = b.bitcast(b.shl(b.add(n, ir.Constant(I32, 127)), ir.Constant(I32, 23)), F32)
        result = b.fmul(p, scale)
        # Below the clamp the true value is subnormal or zero: return 0.
        return b.select(b.fcmp_ordered("<", x, self.f32(lo_clamp)), self.f32(0.0), result)
