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

    def __init__(self, module: ir.Module, name: str, n_inputs: int, n_outputs: int,
                 epilogue=(), target=None, scratch: bool = False, extra_args=()):
        pointers = n_inputs + n_outputs + int(scratch)
        fnty = ir.FunctionType(ir.VoidType(), [F32_PTR] * pointers + list(extra_args))
        self.function = ir.Function(module, fnty, name=name)
        self.function.linkage = "internal"
        # Inlining hundreds of kernels into tether_run makes one huge function
        # that the optimiser spends most of the compile time on, for no gain.
        self.function.attributes.add("noinline")
        for arg in self.function.args[:pointers]:
            arg.add_attribute("noalias")
        self.inputs = list(self.function.args[:n_inputs])
        self.outputs = list(self.function.args[n_inputs:n_inputs + n_outputs])
        # Per-call temporary memory (Op.scratch_bytes), e.g. an im2col buffer.
        self.scratch = self.function.args[pointers - 1] if scratch else None
        self.extra = list(self.function.args[pointers:])
        # Identifies the epilogue for sharing functions between kernels.
        self.epilogue_key = repr(epilogue)
        self.target = target
        self._lanes = 0
        self.builder = ir.IRBuilder(self.function.append_basic_block("entry"))
        self.module = module
        # Fused element-wise ops: callables value -> value applied to every
        # final output value. Ops that store their results once call
        # activate(); for the others the code generator adds one in-place pass.
        self.epilogue = list(epilogue)
        self.activated = False

    def activate(self, value: ir.Value) -> ir.Value:
        """Apply the fused element-wise epilogue to a final output value."""
        self.activated = True
        for fn in self.epilogue:
            value = fn(self, value)
        return value

    def finish(self) -> None:
        self.builder.ret_void()

    # -- values -------------------------------------------------------------
    def f32(self, value: float) -> ir.Constant:
        """A float32 constant; a splat vector inside vector_constants()."""
        if self._lanes:
            return ir.Constant(ir.VectorType(F32, self._lanes), [float(value)] * self._lanes)
        return ir.Constant(F32, float(value))

    @contextmanager
    def vector_constants(self, lanes: int):
        """Make f32() produce <lanes x float> splats, so element-wise code
        written for scalars (Relu, Clip, ...) applies to whole vectors."""
        saved, self._lanes = self._lanes, lanes
        try:
            yield
        finally:
            self._lanes = saved

    @staticmethod
    def i64(value: int) -> ir.Constant:
        return ir.Constant(I64, int(value))

    def index(self, *terms) -> ir.Value:
        """Sum of (index, stride) pairs as an i64 offset; zero strides drop out.

        An index may be a Python int, which folds into the constant part.
        """
        b = self.builder
        constant, total = 0, None
        for value, stride in terms:
            if stride == 0:
                continue
            if isinstance(value, int):
                constant += value * stride
                continue
            term = value if stride == 1 else b.mul(value, self.i64(stride))
            total = term if total is None else b.add(total, term)
        if total is None:
            return self.i64(constant)
        return b.add(total, self.i64(constant)) if constant else total

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
    def loop(self, count: "int | ir.Value", start: int = 0):
        """for (i = start; i < count; i++) — yields i as an i64; count is a
        constant or an i64 value."""
        b = self.builder
        before = b.block
        header = b.append_basic_block("loop")
        body = b.append_basic_block("body")
        after = b.append_basic_block("after")
        b.branch(header)
        b.position_at_end(header)
        i = b.phi(I64, name="i")
        i.add_incoming(self.i64(start), before)
        end = count if isinstance(count, ir.Value) else self.i64(count)
        b.cbranch(b.icmp_signed("<", i, end), body, after)
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

    def minimum(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.select(self.builder.fcmp_ordered("<", a, b), a, b)

    def clamp(self, x: ir.Value, lo: float, hi: float) -> ir.Value:
        return self.minimum(self.maximum(x, self.f32(lo)), self.f32(hi))

    def sqrt(self, x: ir.Value) -> ir.Value:
        """llvm.sqrt: one instruction on every target with an FPU, no libm call."""
        fn = self.module.declare_intrinsic("llvm.sqrt", [F32])
        return self.builder.call(fn, [x])

    def in_range(self, i: ir.Value, upper: int) -> ir.Value:
        """0 <= i < upper for a signed i64, as one unsigned compare."""
        return self.builder.icmp_unsigned("<", i, self.i64(upper))

    def sigmoid(self, x: ir.Value) -> ir.Value:
        b = self.builder
        return b.fdiv(self.f32(1.0), b.fadd(self.f32(1.0), self.exp(b.fsub(self.f32(0.0), x))))

    def tanh(self, x: ir.Value) -> ir.Value:
        """tanh without libm: (1 - e) / (1 + e) with e = exp(-2|x|), and a
        Taylor polynomial near 0 where that form cancels."""
        b = self.builder
        ax = self.maximum(x, b.fsub(self.f32(0.0), x))
        e = self.exp(b.fmul(ax, self.f32(-2.0)))
        big = b.fdiv(b.fsub(self.f32(1.0), e), b.fadd(self.f32(1.0), e))
        x2 = b.fmul(ax, ax)
        p = self.f32(-17.0 / 315.0)
        for c in (2.0 / 15.0, -1.0 / 3.0, 1.0):
            p = b.fadd(b.fmul(p, x2), self.f32(c))
        small = b.fmul(p, ax)
        mag = b.select(b.fcmp_ordered("<", ax, self.f32(0.125)), small, big)
        return b.select(b.fcmp_ordered("<", x, self.f32(0.0)), b.fsub(self.f32(0.0), mag), mag)

    def log(self, x: ir.Value) -> ir.Value:
        """Natural log for x > 0 without libm (Cephes logf): x = m * 2^e with
        m in [sqrt(1/2), sqrt(2)), log(m) by polynomial."""
        b = self.builder
        bits = b.bitcast(x, I32)
        e = b.sub(b.lshr(bits, ir.Constant(I32, 23)), ir.Constant(I32, 126))
        m = b.bitcast(b.or_(b.and_(bits, ir.Constant(I32, 0x007FFFFF)), ir.Constant(I32, 0x3F000000)), F32)
        # m in [0.5, 1): move to [sqrt(1/2), sqrt(2)).
        low = b.fcmp_ordered("<", m, self.f32(0.707106781186547524))
        e = b.select(low, b.sub(e, ir.Constant(I32, 1)), e)
        m = b.select(low, b.fadd(m, m), m)
        r = b.fsub(m, self.f32(1.0))
        coeffs = [7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                  1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                  3.3333331174e-1]
        p = self.f32(coeffs[0])
        for c in coeffs[1:]:
            p = b.fadd(b.fmul(p, r), self.f32(c))
        r2 = b.fmul(r, r)
        y = b.fmul(b.fmul(p, r), r2)
        ef = b.sitofp(e, F32)
        y = b.fadd(y, b.fmul(ef, self.f32(-2.12194440e-4)))
        y = b.fsub(y, b.fmul(r2, self.f32(0.5)))
        return b.fadd(b.fadd(r, y), b.fmul(ef, self.f32(0.693359375)))

    def power(self, x: ir.Value, exponent: float) -> ir.Value:
        """x ** exponent for x > 0."""
        if exponent == 1.0:
            return x
        if exponent == 0.5:
            return self.sqrt(x)
        return self.exp(self.builder.fmul(self.log(x), self.f32(exponent)))

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
