"""Building blocks for kernels written with llvmlite.ir: one function per
node, counted loops, element access and a libm-free exp.

Ops lower themselves through a Kernel so that they never deal with basic
blocks or phi nodes directly.
"""
from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir

F32 = ir.FloatType()
# Half precision: weights and GEMM arithmetic of an fp16 graph (crosscompile.precision).
HALF = ir.HalfType()
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32_PTR = F32.as_pointer()
I8 = ir.IntType(8)
I16 = ir.IntType(16)
# How each tensor dtype is held in memory; kernels take every buffer as a
# float pointer and view it as its element type (Kernel.typed). LLVM's
# integers carry no sign: a kernel extends uint8 with zext, int8 with sext.
ELEMENT_TYPES = {"float32": F32, "float16": HALF, "float64": ir.DoubleType(), "int64": I64, "int32": I32, "bool": I8,
                 "uint8": I8, "int8": I8, "int16": I16, "uint16": I16, "uint32": I32, "uint64": I64,
                 "bfloat16": I16,
                 # the low-bit types, one byte per element (crosscompile.lowbit)
                 **dict.fromkeys(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                  "float8_e8m0fnu", "float4_e2m1fn", "int4", "uint4", "int2", "uint2"), I8)}


class Kernel:
    """An internal function `void name(float *in..., float *out...)`.

    Buffers never overlap an output (the memory planner guarantees it), so
    every pointer is marked noalias, which lets LLVM vectorise the loops.
    """

    def __init__(self, module: ir.Module, name: str, n_inputs: int, n_outputs: int,
                 target, epilogue=(), scratch: bool = False, extra_args=(),
                 parallel: bool = False, *, tiles: dict):
        pointers = n_inputs + n_outputs + int(scratch)
        if parallel:  # (thread, threads, sync state, cursor): see share() and barrier()
            extra_args = (I32, I32, I32.as_pointer(), I32.as_pointer()) + tuple(extra_args)
        fnty = ir.FunctionType(ir.VoidType(), [F32_PTR] * pointers + list(extra_args))
        self.function = ir.Function(module, fnty, name=name)
        self.function.linkage = "internal"
        # Inlining hundreds of kernels into tether_run makes one huge function
        # that the optimiser spends most of the compile time on, for no gain.
        self.function.attributes.add("noinline")
        # Nothing in a kernel unwinds; without this, a call through the
        # syscall pointer (the wake-up in share()) would make 32-bit ARM code
        # reference the C++ unwinder's personality routine.
        self.function.attributes.add("nounwind")
        for arg in self.function.args[:pointers]:
            arg.add_attribute("noalias")
        self.inputs = list(self.function.args[:n_inputs])
        self.outputs = list(self.function.args[n_inputs:n_inputs + n_outputs])
        # Per-call temporary memory (Op.scratch_bytes), e.g. an im2col buffer.
        self.scratch = self.function.args[pointers - 1] if scratch else None
        self.extra = list(self.function.args[pointers:])
        self.parallel = parallel
        if parallel:
            self.thread, self.threads, self.sync, self.cursor = self.extra[:4]
            self.extra = self.extra[4:]
        # Identifies the epilogue for sharing functions between kernels.
        self.epilogue_key = repr(epilogue)
        self.target = target
        # The module's micro-kernels shared between kernels (gemm.py), by key.
        self.tiles = tiles
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

    def typed(self, ptr: ir.Value, dtype: str) -> ir.Value:
        """A buffer argument viewed as a pointer to dtype's element type."""
        element = ELEMENT_TYPES[dtype]
        return ptr if element is F32 else self.builder.bitcast(ptr, element.as_pointer())

    def variable(self, initial: ir.Value) -> ir.Value:
        """A stack slot holding initial; mem2reg turns it into a register."""
        with self.builder.goto_entry_block():
            slot = self.builder.alloca(initial.type)
        self.builder.store(initial, slot)
        return slot

    # -- threads --------------------------------------------------------------
    @contextmanager
    def alone(self):
        """Code emitted inside works on data of its thread's own: share()
        gives it the whole range and barrier() waits for nobody."""
        parallel, self.parallel = self.parallel, False
        try:
            yield
        finally:
            self.parallel = parallel

    @contextmanager
    def share(self, count: int, workers: "ir.Value | None" = None):
        """Run the body emitted inside on chunks [lo, hi) (i64 values) of
        range(count) that the threads take in turn from a shared counter
        until none is left; the whole range at once in a kernel that is not
        parallel. With workers (an i32 value), only threads numbered below
        it take chunks (e.g. one scratch slot each for that many).

        A parallel kernel writes memory only inside share() bodies (or
        alone() on its own data): a thread that the system deschedules,
        or that has not started yet, takes no chunk and nobody waits for
        it, so it may pass a kernel's code long after the others have moved
        on. Every thread must reach the same share() calls in the same
        order (as with barrier()); see shared_range for how it works."""
        if not self.parallel:
            yield self.i64(0), self.i64(count)
            return
        skip = None if workers is None else self.builder.icmp_signed(">=", self.thread, workers)
        with shared_range(self.builder, self.target, self.sync, self.threads, self.cursor, count,
                          skip) as chunk:
            yield chunk

    def barrier(self) -> None:
        """Wait until every chunk handed out so far (by this and earlier
        share() calls) is done; not for threads that took none."""
        if self.parallel:
            self.builder.call(barrier_function(self.module, self.target),
                              [self.sync, self.threads, self.cursor])

    def smax(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.select(self.builder.icmp_signed(">", a, b), a, b)

    def smin(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.builder.select(self.builder.icmp_signed("<", a, b), a, b)

    # -- control flow ---------------------------------------------------------
    @contextmanager
    def loop(self, count: "int | ir.Value", start: "int | ir.Value" = 0):
        """for (i = start; i < count; i++) — yields i as an i64; count and
        start are constants or i64 values."""
        b = self.builder
        before = b.block
        header = b.append_basic_block("loop")
        body = b.append_basic_block("body")
        after = b.append_basic_block("after")
        b.branch(header)
        b.position_at_end(header)
        i = b.phi(I64, name="i")
        i.add_incoming(start if isinstance(start, ir.Value) else self.i64(start), before)
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
        """llvm.sqrt: one instruction on every target with an FPU, no libm
        call; scalars or vectors."""
        fn = self.module.declare_intrinsic("llvm.sqrt", [x.type])
        return self.builder.call(fn, [x])

    def in_range(self, i: ir.Value, upper: int) -> ir.Value:
        """0 <= i < upper for a signed i64, as one unsigned compare."""
        return self.builder.icmp_unsigned("<", i, self.i64(upper))

    def sigmoid(self, x: ir.Value) -> ir.Value:
        """1 / (1 + exp(-x)), scalars or vectors; absolute error below 1e-7,
        relative below 3e-7 (measured against float64, tests/test_ops.py)."""
        b = self.builder
        return b.fdiv(self.f32(1.0), b.fadd(self.f32(1.0), self.exp(b.fsub(self.f32(0.0), x))))

    def tanh(self, x: ir.Value) -> ir.Value:
        """tanh without libm: (1 - e) / (1 + e) with e = exp(-2|x|), and a
        Taylor polynomial near 0 where that form cancels. Scalars or
        vectors; absolute error below 1e-7, relative below 5e-7 (measured
        against float64, tests/test_ops.py)."""
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
        m in [sqrt(1/2), sqrt(2)), log(m) by polynomial. Scalars or vectors."""
        b = self.builder
        bits = b.bitcast(x, self._int_type(x))
        e = b.sub(b.lshr(bits, self._i32(23, x)), self._i32(126, x))
        m = b.bitcast(b.or_(b.and_(bits, self._i32(0x007FFFFF, x)), self._i32(0x3F000000, x)), x.type)
        # m in [0.5, 1): move to [sqrt(1/2), sqrt(2)).
        low = b.fcmp_ordered("<", m, self.f32(0.707106781186547524))
        e = b.select(low, b.sub(e, self._i32(1, x)), e)
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
        ef = b.sitofp(e, x.type)
        y = b.fadd(y, b.fmul(ef, self.f32(-2.12194440e-4)))
        y = b.fsub(y, b.fmul(r2, self.f32(0.5)))
        return b.fadd(b.fadd(r, y), b.fmul(ef, self.f32(0.693359375)))

    def erf(self, x: ir.Value) -> ir.Value:
        """erf without libm, scalars or vectors: x * P(x^2) for |x| < 1 and
        1 - exp(-x^2) * Q(1/|x|) for 1 <= |x| (|x| clamped to 4, where erf
        is 1 in float32). P and Q are least-squares fits in float64 to erf(x)/x
        on [0, 1] and erfc(x) * exp(x^2) on [0.875, 4]; absolute error below
        2e-7 (measured against float64, tests/test_ops_reduce.py)."""
        b = self.builder
        ax = self.minimum(self.maximum(x, b.fsub(self.f32(0.0), x)), self.f32(4.0))
        x2 = b.fmul(ax, ax)
        small = self._polynomial(x2, ERF_SMALL)
        small = b.fmul(small, self.minimum(self.maximum(x, self.f32(-1.0)), self.f32(1.0)))
        tail = self._polynomial(b.fdiv(self.f32(1.0), self.maximum(ax, self.f32(1.0))), ERFC_SCALED)
        large = b.fsub(self.f32(1.0), b.fmul(self.exp(b.fsub(self.f32(0.0), x2)), tail))
        large = b.select(b.fcmp_ordered("<", x, self.f32(0.0)), b.fsub(self.f32(0.0), large), large)
        return b.select(b.fcmp_unordered("<", ax, self.f32(1.0)), small, large)

    def _polynomial(self, x: ir.Value, coeffs) -> ir.Value:
        """sum(coeffs[i] * x**i) by Horner's rule."""
        p = self.f32(coeffs[-1])
        for c in coeffs[-2::-1]:
            p = self.fmuladd(p, x, self.f32(c))
        return p

    def fmuladd(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        """a * b + c, scalars or vectors, as one fused multiply-add where the
        target has one (half the instructions and latency of a Horner step)
        and a multiply then an add where it has not (llvm.fmuladd: never
        a libm call)."""
        suffix = f"v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "f32"
        name = f"llvm.fmuladd.{suffix}"
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(a.type, [a.type] * 3), name=name)
        return self.builder.call(fn, [a, b, c])

    def power(self, x: ir.Value, exponent: float) -> ir.Value:
        """x ** exponent for x > 0."""
        if exponent == 1.0:
            return x
        if exponent == 0.5:
            return self.sqrt(x)
        return self.exp(self.builder.fmul(self.log(x), self.f32(exponent)))

    def _int_type(self, like: ir.Value):
        """i32, or a vector of i32 as wide as the float vector `like`."""
        if isinstance(like.type, ir.VectorType):
            return ir.VectorType(I32, like.type.count)
        return I32

    def _i32(self, value: int, like: ir.Value) -> ir.Constant:
        ty = self._int_type(like)
        return ir.Constant(ty, [value] * ty.count if isinstance(ty, ir.VectorType) else value)

    def exp(self, x: ir.Value) -> ir.Value:
        """exp(x) in float32 without libm: x = n*ln2 + r, exp(r) by polynomial.

        The board's libm would add a versioned glibc dependency to every
        module, so exp is generated inline. Branch-free, so it works on
        vectors too (inside vector_constants). Error bound, measured against
        float64 over [-87, 88] (tests/test_ops.py): relative error below
        2e-7 (about 2 ulp); below -87.34 the result is 0.
        """
        b = self.builder
        hi_clamp, lo_clamp = 88.37626, -87.33654
        xc = b.select(b.fcmp_ordered(">", x, self.f32(hi_clamp)), self.f32(hi_clamp), x)
        xc = b.select(b.fcmp_ordered("<", xc, self.f32(lo_clamp)), self.f32(lo_clamp), xc)
        # n = round(x / ln2) by adding 1.5 * 2^23: the sum's low mantissa
        # bits are n (round to nearest), with no conversion or libm call.
        # Cody-Waite: ln2 split into a part exact in float32 and a remainder.
        shifted = b.fadd(b.fmul(xc, self.f32(1.4426950408889634)), self.f32(ROUNDING_SHIFT))
        nf = b.fsub(shifted, self.f32(ROUNDING_SHIFT))
        r = self.fmuladd(nf, self.f32(-0.693359375), xc)
        r = self.fmuladd(nf, self.f32(2.12194440e-4), r)
        # Minimax polynomial for exp(r) on [-ln2/2, ln2/2] (Cephes expf).
        coeffs = [1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                  4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1]
        p = self.f32(coeffs[0])
        for c in coeffs[1:]:
            p = self.fmuladd(p, r, self.f32(c))
        p = self.fmuladd(b.fmul(p, r), r, b.fadd(r, self.f32(1.0)))
        # 2^n: n + 127 into the exponent field (the shift's bits of the
        # 1.5 * 2^23 all move past bit 31).
        bits = b.bitcast(shifted, self._int_type(x))
        scale = b.bitcast(b.shl(b.add(bits, self._i32(127, x)), self._i32(23, x)), x.type)
        result = b.fmul(p, scale)
        # Below the clamp the true value is subnormal or zero: return 0.
        return b.select(b.fcmp_ordered("<", x, self.f32(lo_clamp)), self.f32(0.0), result)


# Added to x / ln2 to round it to an integer in the low mantissa bits (exp).
ROUNDING_SHIFT = 12582912.0  # 1.5 * 2^23


# erf's polynomials (Kernel.erf): erf(x) / x in x^2 on [0, 1], and
# erfc(x) * exp(x^2) in 1 / x on [0.875, 4], lowest power first.
ERF_SMALL = (1.1283791275, -0.37612349947, 0.11280365107, -0.026716396296,
             0.0049232840948, -0.00056541118947)
ERFC_SCALED = (0.00035272904076, 0.55768901924, 0.051364641976, -0.50719867673,
               0.57833301586, -0.35704002275, 0.12232266986, -0.018239834347)


@contextmanager
def shared_range(b: ir.IRBuilder, target, sync: ir.Value, threads: ir.Value, cursor: ir.Value,
                 count: int, skip: "ir.Value | None" = None):
    """Emit a loop that takes chunks [lo, hi) (i64 values) of range(count)
    from the sync state's claim counter and runs the body emitted inside
    on each, until none is left (Kernel.share; codegen's serial steps).

    Every range of a run has its own stretch of the claim counter
    (sync[0]), which only grows: the thread's cursor holds where the
    current range starts, and each thread's cursor passes the same
    ranges in the same order. A thread takes a chunk by moving the
    counter on with compare-and-swap from a value inside the range, so it
    takes nothing from a range that is over (a late thread passes it at
    once) nor from the next one early (a range is over for the claims
    only once the counter has passed its end). After a chunk it adds
    twice the chunk's size to the done word (sync[1]; its bit 0 says a
    waiter sleeps on it, see barrier_function), which is what a barrier
    waits for; if that finished the range and a waiter sleeps, it wakes
    them. With skip (an i1 value) true the thread takes no chunk. The
    counters count modulo 2**32 (items modulo 2**31 for the done word):
    a run hands out fewer than 2**30 items."""
    if count >= WORK_LIMIT:
        raise ValueError(f"a shared range of {count} items exceeds {WORK_LIMIT}; share larger items")
    fn = b.function
    with b.goto_entry_block():
        chunk_slot = b.alloca(I32)
    base = b.load(cursor)
    size = ir.Constant(I32, count)
    end = b.add(base, size)
    done_ptr = b.gep(sync, [ir.Constant(I32, 1)])
    first = b.load_atomic(sync, "monotonic", 4)
    before = b.block
    claim = fn.append_basic_block("claim")
    take = fn.append_basic_block("take")
    body = fn.append_basic_block("share")
    after = fn.append_basic_block("shared")
    if skip is None:
        b.branch(claim)
    else:
        b.cbranch(skip, after, claim)
    b.position_at_end(claim)
    word = b.phi(I32)
    word.add_incoming(first, before)
    rel = b.sub(word, base)
    b.cbranch(b.icmp_unsigned(">=", rel, size), after, take)
    b.position_at_end(take)
    # The rest split in CHUNKS_PER_THREAD per thread: large chunks
    # first (few claims), small ones last (threads finish together).
    # Divided in double precision: ARMv7 may lack an integer divide and a
    # libgcc helper call would make the module need more than the loader.
    f64 = ir.DoubleType()
    parts = b.uitofp(b.mul(threads, ir.Constant(I32, CHUNKS_PER_THREAD)), f64)
    chunk = b.fptoui(b.fdiv(b.uitofp(b.sub(size, rel), f64), parts), I32)
    chunk = b.select(b.icmp_unsigned("<", chunk, ir.Constant(I32, 1)), ir.Constant(I32, 1), chunk)
    chunk = b.select(b.icmp_signed("<=", threads, ir.Constant(I32, 1)), b.sub(size, rel), chunk)
    b.store(chunk, chunk_slot)
    result = b.cmpxchg(sync, word, b.add(word, chunk), "acq_rel", "monotonic")
    word.add_incoming(b.extract_value(result, 0), take)
    b.cbranch(b.extract_value(result, 1), body, claim)
    b.position_at_end(body)
    lo = b.zext(rel, I64)
    yield lo, b.add(lo, b.zext(b.load(chunk_slot), I64))
    twice = b.shl(b.load(chunk_slot), ir.Constant(I32, 1))
    old = b.atomic_rmw("add", done_ptr, twice, "release")
    asleep = b.icmp_unsigned("!=", b.and_(old, ir.Constant(I32, SLEEPING)), ir.Constant(I32, 0))
    with b.if_then(asleep, likely=False):
        # A waiter sleeps: wake it once this range is done (it waits for
        # the end of this range or a later one, never an earlier).
        finished = _reached(b, b.add(old, twice), end)
        with b.if_then(finished):
            b.atomic_rmw("and", done_ptr, ir.Constant(I32, ~SLEEPING), "monotonic")
            syscall = _syscall(b, target, sync)
            if syscall is not None:
                syscall(target.futex_syscall, b.ptrtoint(done_ptr, syscall.word), FUTEX_WAKE_PRIVATE,
                        0x7FFFFFFF, 0)
    word.add_incoming(b.load_atomic(sync, "monotonic", 4), b.block)
    b.branch(claim)
    b.position_at_end(after)
    b.store(end, cursor)


def _reached(b: ir.IRBuilder, done_word: ir.Value, cursor: ir.Value) -> ir.Value:
    """Whether a done word counts at least `cursor` items: its count
    (twice the items, plus the SLEEPING bit) minus twice the cursor,
    compared as a signed number, which holds across the wrap at 2**32."""
    return b.icmp_signed(">=", b.sub(done_word, b.shl(cursor, ir.Constant(I32, 1))), ir.Constant(I32, 0))


def barrier_function(module: ir.Module, target) -> ir.Function:
    """`void tether.barrier(i32 *state, i32 threads, i32 *cursor)`: wait
    until every chunk handed out before the thread's cursor is done,
    built from atomics alone, since the module links no libc.

    state is the caller's struct tether_sync (docs/module-abi.md): state[0]
    is the claim counter, state[1] the done word (see shared_range), and
    the pointer-sized field at byte 8, when not NULL, is the C library's
    `long syscall(long, ...)`. It waits for the work handed out, not for
    the threads: a thread that took no chunk (descheduled, or not started
    yet) holds nobody up, and one that arrives late finds the barrier
    passed. The first thread through a barrier sees the count of exactly
    the chunks before it, since chunks after it are only taken by threads
    that passed it.

    A waiter spins briefly with the CPU's spin-wait hint (most barriers of
    a run on idle cores end there), then sleeps on the done word with
    futex. A thread about to sleep first sets the word's bit 0 (SLEEPING),
    and the thread that finishes the range makes the wake-up system call
    only when it finds that bit, since the call would cost microseconds
    each time. A waiter does not call sched_yield between the two: on a
    busy board that hands the core to another program for its time slice
    (and not to the thread holding the chunk, which waits on another
    core's queue), while a sleeper is woken as soon as the chunk is done
    (docs/kernels.md has the measurements).
    """
    existing = module.globals.get("tether.barrier")
    if existing is not None:
        return existing
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [I32.as_pointer(), I32, I32.as_pointer()]),
                     name="tether.barrier")
    fn.linkage = "internal"
    # The call through the syscall pointer could unwind as far as LLVM
    # knows; without nounwind, 32-bit ARM code would then reference the
    # C++ unwinder's personality routine, which the loader cannot resolve.
    fn.attributes.add("nounwind")
    state, threads, cursor = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    done = fn.append_basic_block("done")
    arrive = fn.append_basic_block("arrive")
    b.cbranch(b.icmp_signed("<=", threads, ir.Constant(I32, 1)), done, arrive)
    b.position_at_end(arrive)
    done_ptr = b.gep(state, [ir.Constant(I32, 1)])
    syscall = _syscall(b, target, state)
    goal = b.load(cursor)
    wait = fn.append_basic_block("wait")
    b.branch(wait)
    b.position_at_end(wait)
    looks = b.phi(I32)
    looks.add_incoming(ir.Constant(I32, 0), arrive)
    again = fn.append_basic_block("again")
    b.cbranch(_reached(b, b.load_atomic(done_ptr, "acquire", 4), goal), done, again)
    b.position_at_end(again)
    _spin_hint(b, module, target)
    next_look = b.add(looks, ir.Constant(I32, 1))
    looks.add_incoming(next_look, again)
    if syscall is not None:
        sleep = fn.append_basic_block("sleep")
        b.cbranch(b.icmp_signed(">", next_look, ir.Constant(I32, target.spins_before_sleep)), sleep, wait)
        b.position_at_end(sleep)
        seen = b.atomic_rmw("or", done_ptr, ir.Constant(I32, SLEEPING), "acquire")
        asleep = fn.append_basic_block("asleep")
        b.cbranch(_reached(b, seen, goal), done, asleep)
        b.position_at_end(asleep)
        # Returns at once if a chunk was done since the bit was set.
        syscall(target.futex_syscall, b.ptrtoint(done_ptr, syscall.word), FUTEX_WAIT_PRIVATE,
                b.or_(seen, ir.Constant(I32, SLEEPING)), 0)
        looks.add_incoming(next_look, b.block)
        b.branch(wait)
    else:
        b.branch(wait)
    b.position_at_end(done)
    b.ret_void()
    return fn


# A shared range must be smaller than WORK_LIMIT items (exact in the
# double-precision chunk arithmetic, and far from the counters' wrap).
WORK_LIMIT = 1 << 22
# What loaders allow (docs/module-abi.md); the barrier itself counts work,
# not threads.
MAX_THREADS = 255
# Chunks per thread a shared range is split into (see shared_range).
CHUNKS_PER_THREAD = 4
# Bit 0 of the done word: a waiter is (about to be) asleep on the futex.
SLEEPING = 1
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129


def _syscall(b: ir.IRBuilder, target, state: ir.Value):
    """A callable emitting syscall(number, args...) through the syscall
    pointer in the sync state when it is set (nothing when it is NULL), or
    None where the target's system call numbers are not known. Arguments
    are Python ints or values of the target's `long` (its .word type)."""
    if target.futex_syscall is None:
        return None
    word = ir.IntType(target.long_bits)
    fnty = ir.FunctionType(word, [word], var_arg=True)
    slot = b.bitcast(b.gep(state, [ir.Constant(I32, 2)]), fnty.as_pointer().as_pointer())
    pointer = b.load(slot)
    present = b.icmp_unsigned("!=", pointer, ir.Constant(fnty.as_pointer(), None))

    def call(number, *args):
        with b.if_then(present):
            # Every argument is a full `long`: syscall() reads them as such.
            values = [ir.Constant(word, number)]
            for arg in args:
                if isinstance(arg, int):
                    values.append(ir.Constant(word, arg))
                else:
                    values.append(b.zext(arg, word) if arg.type.width < word.width else arg)
            b.call(pointer, values)
    call.word = word
    return call


def _spin_hint(b: ir.IRBuilder, module: ir.Module, target) -> None:
    """The target's spin-wait hint (Target.spin_hint), if it has one."""
    if target.spin_hint is None:
        return
    name, values = target.spin_hint
    args = [ir.Constant(I32, v) for v in values]
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [a.type for a in args]), name=name)
    b.call(fn, args)
