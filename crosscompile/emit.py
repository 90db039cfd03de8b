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
                 "uint8": I8, "int8": I8, "int16": I16, "uint16": I16, "uint32": I32, "uint64": I64}


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
    def part(self, count: int, workers: "ir.Value | None" = None):
        """This thread's share [lo, hi) of range(count), as i64 values; the
        whole range in a kernel that is not parallel. With workers (an i32
        value, at most the thread count), the range is shared between the
        first `workers` threads alone."""
        if not self.parallel:
            return self.i64(0), self.i64(count)
        b = self.builder
        # Divided in double precision: ARMv7 may lack an integer divide and a
        # libgcc helper call would make the module need more than the loader.
        # Exact while count * threads < 2**53; thread t's hi is the same
        # expression as thread t+1's lo, so the shares tile the range.
        f64 = ir.DoubleType()
        threads = b.uitofp(self.threads if workers is None else workers, f64)

        def bound(t):
            share = b.fdiv(b.fmul(ir.Constant(f64, float(count)), b.uitofp(t, f64)), threads)
            return b.zext(b.fptoui(share, I32), I64)
        return bound(self.thread), bound(b.add(self.thread, ir.Constant(I32, 1)))

    @contextmanager
    def alone(self):
        """Code emitted inside works on data of its thread's own: part()
        gives it the whole range and barrier() waits for nobody."""
        parallel, self.parallel = self.parallel, False
        try:
            yield
        finally:
            self.parallel = parallel

    @contextmanager
    def share(self, count: int):
        """Run the body emitted inside on chunks [lo, hi) (i64 values) of
        range(count) that the threads take in turn from a shared counter
        until none is left, so that a thread the system deschedules leaves
        its share to the others instead of holding them up at the next
        barrier; the whole range at once in a kernel that is not parallel.
        Every thread must reach the same share() calls in the same order
        (as with barrier()).

        The counter is the low bits of the barrier's arrival word (see
        barrier_function), which the last thread to arrive at a barrier
        clears. Between two barriers the ranges follow one another on it:
        each thread's cursor holds where the current range starts, and a
        thread leaves a range only once the counter has passed its end, so
        no thread takes items of the next range early."""
        if not self.parallel:
            yield self.i64(0), self.i64(count)
            return
        if count >= WORK_LIMIT:
            raise ValueError(f"a shared range of {count} items exceeds {WORK_LIMIT}; share larger items")
        b = self.builder
        with b.goto_entry_block():
            chunk_slot = b.alloca(I32)
        base = b.load(self.cursor)
        size = ir.Constant(I32, count)
        first = b.load_atomic(self.sync, "monotonic", 4)
        before = b.block
        claim = b.append_basic_block("claim")
        take = b.append_basic_block("take")
        body = b.append_basic_block("share")
        after = b.append_basic_block("shared")
        b.branch(claim)
        b.position_at_end(claim)
        word = b.phi(I32)
        word.add_incoming(first, before)
        rel = b.sub(b.and_(word, ir.Constant(I32, WORK_MASK)), base)
        b.cbranch(b.icmp_unsigned(">=", rel, size), after, take)
        b.position_at_end(take)
        # The rest split in CHUNKS_PER_THREAD per thread: large chunks
        # first (few claims), small ones last (threads finish together).
        # Divided in double precision, as in part().
        f64 = ir.DoubleType()
        parts = b.uitofp(b.mul(self.threads, ir.Constant(I32, CHUNKS_PER_THREAD)), f64)
        chunk = b.fptoui(b.fdiv(b.uitofp(b.sub(size, rel), f64), parts), I32)
        chunk = b.select(b.icmp_unsigned("<", chunk, ir.Constant(I32, 1)), ir.Constant(I32, 1), chunk)
        chunk = b.select(b.icmp_signed("<=", self.threads, ir.Constant(I32, 1)), b.sub(size, rel), chunk)
        b.store(chunk, chunk_slot)
        result = b.cmpxchg(self.sync, word, b.add(word, chunk), "acq_rel", "monotonic")
        word.add_incoming(b.extract_value(result, 0), take)
        b.cbranch(b.extract_value(result, 1), body, claim)
        b.position_at_end(body)
        lo = b.zext(rel, I64)
        yield lo, b.add(lo, b.zext(b.load(chunk_slot), I64))
        word.add_incoming(b.load_atomic(self.sync, "monotonic", 4), b.block)
        b.branch(claim)
        b.position_at_end(after)
        b.store(b.add(base, size), self.cursor)

    def barrier(self) -> None:
        """Wait until every thread of a parallel kernel has arrived here."""
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
        # n = round(x / ln2), done with fptosi so no rint/floor libcall appears.
        t = b.fmul(xc, self.f32(1.4426950408889634))
        half = b.select(b.fcmp_ordered("<", t, self.f32(0.0)), self.f32(-0.5), self.f32(0.5))
        n = b.fptosi(b.fadd(t, half), self._int_type(x))
        nf = b.sitofp(n, x.type)
        # Cody-Waite: ln2 split into a part exact in float32 and a remainder.
        r = b.fsub(xc, b.fmul(nf, self.f32(0.693359375)))
        r = b.fsub(r, b.fmul(nf, self.f32(-2.12194440e-4)))
        # Minimax polynomial for exp(r) on [-ln2/2, ln2/2] (Cephes expf).
        coeffs = [1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                  4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1]
        p = self.f32(coeffs[0])
        for c in coeffs[1:]:
            p = self.fmuladd(p, r, self.f32(c))
        p = self.fmuladd(b.fmul(p, r), r, b.fadd(r, self.f32(1.0)))
        scale = b.bitcast(b.shl(b.add(n, self._i32(127, x)), self._i32(23, x)), x.type)
        result = b.fmul(p, scale)
        # Below the clamp the true value is subnormal or zero: return 0.
        return b.select(b.fcmp_ordered("<", x, self.f32(lo_clamp)), self.f32(0.0), result)


# erf's polynomials (Kernel.erf): erf(x) / x in x^2 on [0, 1], and
# erfc(x) * exp(x^2) in 1 / x on [0.875, 4], lowest power first.
ERF_SMALL = (1.1283791275, -0.37612349947, 0.11280365107, -0.026716396296,
             0.0049232840948, -0.00056541118947)
ERFC_SCALED = (0.00035272904076, 0.55768901924, 0.051364641976, -0.50719867673,
               0.57833301586, -0.35704002275, 0.12232266986, -0.018239834347)


def barrier_function(module: ir.Module, target) -> ir.Function:
    """`void tether.barrier(i32 *state, i32 threads, i32 *cursor)`: a
    counting barrier built from atomics alone, since the module links no
    libc.

    state is the caller's struct tether_sync (docs/module-abi.md): state[0]
    is the arrival word, state[1] the generation, and the pointer-sized
    field at byte 8, when not NULL, is the C library's
    `long syscall(long, ...)`. The arrival word counts arrived threads in
    its top bits (ARRIVAL each) and in its low bits the items that
    Kernel.share() handed out since the last barrier. The last thread to
    arrive clears the word and moves the generation on; each thread clears
    its own cursor (where its next shared range starts) as it leaves.

    The others wait in three stages: they spin briefly on the generation
    with the CPU's spin-wait hint (most barriers of a run on idle cores end
    there), then ask the system to run something else (sched_yield) between
    looks, which costs a system call when nothing else wants the core but
    hands it over at once when something does (the thread everybody waits
    for, on a busy board), then sleep on the generation with futex. A
    thread about to sleep first sets the generation's top bit (SLEEPING),
    and the last thread makes the wake-up system call only when it finds
    that bit, since the call would cost microseconds each time.
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
    alone = fn.append_basic_block("alone")
    arrive = fn.append_basic_block("arrive")
    b.cbranch(b.icmp_signed("<=", threads, ir.Constant(I32, 1)), alone, arrive)
    b.position_at_end(alone)
    b.store(ir.Constant(I32, 0), state)
    b.branch(done)
    b.position_at_end(arrive)
    word_ptr = state
    gen_ptr = b.gep(state, [ir.Constant(I32, 1)])
    syscall = _syscall(b, target, state)
    number = ir.Constant(I32, GENERATION_MASK)
    generation = b.and_(b.load_atomic(gen_ptr, "acquire", 4), number)
    word = b.atomic_rmw("add", word_ptr, ir.Constant(I32, ARRIVAL), "acq_rel")
    arrived = b.lshr(word, ir.Constant(I32, ARRIVAL_SHIFT))
    last = fn.append_basic_block("last")
    wait = fn.append_basic_block("wait")
    b.cbranch(b.icmp_unsigned("==", arrived, b.sub(threads, ir.Constant(I32, 1))), last, wait)
    b.position_at_end(last)
    b.store_atomic(ir.Constant(I32, 0), word_ptr, "monotonic", 4)
    # Only this thread moves the generation on; the others may only set
    # SLEEPING, which the exchange clears and reports.
    following = b.and_(b.add(generation, ir.Constant(I32, 1)), number)
    before = b.atomic_rmw("xchg", gen_ptr, following, "acq_rel")
    if syscall is not None:
        sleepers = b.icmp_unsigned("!=", b.and_(before, ir.Constant(I32, SLEEPING)), ir.Constant(I32, 0))
        with b.if_then(sleepers):
            syscall(target.futex_syscall, b.ptrtoint(gen_ptr, syscall.word), FUTEX_WAKE_PRIVATE, 0x7FFFFFFF, 0)
    b.branch(done)
    b.position_at_end(wait)
    looks = b.phi(I32)
    looks.add_incoming(ir.Constant(I32, 0), arrive)
    _spin_hint(b, module, target)
    now = b.and_(b.load_atomic(gen_ptr, "acquire", 4), number)
    again = fn.append_basic_block("again")
    b.cbranch(b.icmp_signed("==", now, generation), again, done)
    b.position_at_end(again)
    next_look = b.add(looks, ir.Constant(I32, 1))
    looks.add_incoming(next_look, again)
    if syscall is not None:
        spun = target.spins_before_yield
        stage = fn.append_basic_block("yield")
        b.cbranch(b.icmp_signed(">", next_look, ir.Constant(I32, spun)), stage, wait)
        b.position_at_end(stage)
        sleep = fn.append_basic_block("sleep")
        give = fn.append_basic_block("give")
        b.cbranch(b.icmp_signed(">", next_look, ir.Constant(I32, spun + YIELDS_BEFORE_SLEEP)), sleep, give)
        b.position_at_end(give)
        syscall(target.sched_yield_syscall)
        looks.add_incoming(next_look, b.block)
        b.branch(wait)
        b.position_at_end(sleep)
        flagged = b.or_(generation, ir.Constant(I32, SLEEPING))
        seen = b.atomic_rmw("or", gen_ptr, ir.Constant(I32, SLEEPING), "acq_rel")
        asleep = fn.append_basic_block("asleep")
        b.cbranch(b.icmp_signed("==", b.and_(seen, number), generation), asleep, done)
        b.position_at_end(asleep)
        # Returns at once if the generation changed since it was flagged.
        syscall(target.futex_syscall, b.ptrtoint(gen_ptr, syscall.word), FUTEX_WAIT_PRIVATE, flagged, 0)
        looks.add_incoming(next_look, b.block)
        b.branch(wait)
    else:
        b.branch(wait)
    b.position_at_end(done)
    b.store(ir.Constant(I32, 0), cursor)
    b.ret_void()
    return fn


# The arrival word of struct tether_sync: arrived threads above
# ARRIVAL_SHIFT (up to MAX_THREADS), items handed out by Kernel.share()
# below it (a shared range must be smaller than WORK_LIMIT).
ARRIVAL_SHIFT = 23
ARRIVAL = 1 << ARRIVAL_SHIFT
WORK_LIMIT = 1 << 22
WORK_MASK = ARRIVAL - 1
MAX_THREADS = 255
# Chunks per thread a shared range is split into (see Kernel.share).
CHUNKS_PER_THREAD = 4
# sched_yield calls a barrier's waiter makes, after its spin, before it
# sleeps: each hands the core to another runnable thread if there is one.
YIELDS_BEFORE_SLEEP = 200
# The generation's top bit: a waiter is (about to be) asleep on the futex.
SLEEPING = -0x80000000
GENERATION_MASK = 0x7FFFFFFF
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
