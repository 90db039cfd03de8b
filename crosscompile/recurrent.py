"""The recurrent layers: LSTM, GRU and the plain RNN, forward, reverse and
bidirectional, with initial states, per-sequence lengths and either
layout.

Each direction runs in two parts. The input projection X . W^T of every
time step is one matrix product before the recurrence, on the GEMM
micro-kernel (gemm.emit_gemm, X read in place, into scratch). Then each
step multiplies the previous hidden state by R^T, a row of states times a
matrix with whole vectors of gate columns accumulated in registers (see
_times_r), and updates every hidden unit from its gates, a vector of units
at a time. Both products read W and R transposed: a constant W or R is
transposed at compile time (passes.transpose_recurrent_weights); a runtime
W is transposed into scratch at the start of the run and a runtime R read
as it is, one dot product per gate column (gemm.emit_dot_rows), each
ending in a horizontal sum. On the AMD Zen 5 host, one thread, against
onnxruntime, before -> after: the speech model of tests/audio_models.py
(Conv, a bidirectional GRU, LogSoftmax) 1.00 -> 0.56, the keyword spotter
(two LSTMs) 1.20 - 1.28 -> 0.74.

A batch element whose sequence has ended keeps its state and writes zeros
to Y, as onnxruntime does; in reverse its steps run from its own last
element back to the first.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from llvmlite import ir

from .emit import I64, Kernel
from .errors import BuildError, ShapeError
from .gemm import emit_dot_rows, emit_gemm, tile_for
from .op_base import Op, _check_choice
from .vectors import _fmuladd, _vector_ptr, splat, vector_runs

# Input positions of a constant W and R transposed at compile time
# (passes.transpose_recurrent_weights): past ONNX's eight.
W_TRANSPOSED, R_TRANSPOSED = 100, 101
# Activation functions a recurrent layer may name, with their default
# (alpha, beta); None marks a parameter the function does not take.
ACTIVATIONS = {"Sigmoid": (None, None), "Tanh": (None, None), "Relu": (None, None),
               "HardSigmoid": (0.2, 0.5), "LeakyRelu": (0.01, None), "Affine": (1.0, 0.0),
               "ScaledTanh": (1.0, 1.0)}


def _activate(k: Kernel, name: str, alpha, beta, x: ir.Value) -> ir.Value:
    b = k.builder
    if name == "Sigmoid":
        return k.sigmoid(x)
    if name == "Tanh":
        return k.tanh(x)
    if name == "Relu":
        return k.maximum(x, k.f32(0.0))
    if name == "HardSigmoid":
        return k.clamp(b.fadd(b.fmul(x, k.f32(alpha)), k.f32(beta)), 0.0, 1.0)
    if name == "LeakyRelu":
        return b.select(b.fcmp_ordered("<", x, k.f32(0.0)), b.fmul(x, k.f32(alpha)), x)
    if name == "Affine":
        return b.fadd(b.fmul(x, k.f32(alpha)), k.f32(beta))
    return b.fmul(k.tanh(b.fmul(x, k.f32(beta))), k.f32(alpha))  # ScaledTanh


def _activations(raw: dict, defaults: tuple, directions: int) -> tuple:
    """(name, alpha, beta) per function and direction. activation_alpha and
    activation_beta are consumed in order by the functions that take them."""
    names = raw.get("activations")
    names = [n if isinstance(n, str) else n.decode() for n in names] if names else list(defaults) * directions
    if len(names) != len(defaults) * directions:
        raise BuildError(f"activations {names} should name {len(defaults) * directions} functions "
                         f"({len(defaults)} per direction)")
    alphas, betas = list(raw.get("activation_alpha", ())), list(raw.get("activation_beta", ()))
    chosen = []
    for name in names:
        if name not in ACTIVATIONS:
            raise BuildError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        alpha, beta = ACTIVATIONS[name]
        if alpha is not None and alphas:
            alpha = float(alphas.pop(0))
        if beta is not None and betas:
            beta = float(betas.pop(0))
        chosen.append((name, alpha, beta))
    return tuple(chosen)


@dataclass
class _Layer:
    """What one direction's lowering works with: sizes, pointers (None for
    inputs and outputs the node leaves out) and scratch areas."""

    steps: int
    batch: int
    hidden: int
    layout: int
    directions: int
    direction: int
    reverse: bool
    functions: tuple
    attrs: dict       # the node's attributes
    weights: dict     # "W", "R", "B", "P": this direction's pointers
    state: dict       # "h", "c": the running states in scratch
    lengths: "ir.Value | None"
    projected: ir.Value  # X . W^T for every step: [rows, gates * hidden]
    recurrent: ir.Value  # h . R^T: [batch, recurrent_columns]
    recurrent_columns: int
    y: "ir.Value | None"
    gate_columns: int = 0  # gates * hidden: rows of W and R, columns of W^T and R^T
    width: int = 1       # hidden units per value in the cell's code (see vectors)

    @contextmanager
    def vectors(self, k: Kernel, width: int):
        """Within: the cell's values are <width x float> over `width`
        consecutive hidden units (constants splat, loads and stores whole
        vectors); width 1 is plain scalars."""
        saved, self.width = self.width, width
        try:
            with (k.vector_constants(width) if width > 1 else nullcontext()):
                yield
        finally:
            self.width = saved

    def load(self, k: Kernel, ptr, at):
        """The value of hidden unit(s) at `at`: one float, or a vector in vectors()."""
        if self.width == 1:
            return k.load(ptr, at)
        return k.builder.load(_vector_ptr(k, ptr, at, self.width), align=4)

    def store(self, k: Kernel, value, ptr, at) -> None:
        if self.width == 1:
            k.store(value, ptr, at)
        else:
            k.builder.store(value, _vector_ptr(k, ptr, at, self.width), align=4)

    def x_row(self, k: Kernel, t, b):
        """The row of X (and of the projection) holding step t of batch element b."""
        return k.index((t, self.batch), (b, 1)) if self.layout == 0 else k.index((b, self.steps), (t, 1))

    def y_at(self, k: Kernel, t, b, j):
        d, hidden = self.direction, self.hidden
        if self.layout == 0:  # Y [steps, directions, batch, hidden]
            return k.index((t, self.directions * self.batch * hidden), (d, self.batch * hidden), (b, hidden), (j, 1))
        # Y [batch, steps, directions, hidden]
        return k.index((b, self.steps * self.directions * hidden), (t, self.directions * hidden), (d, hidden), (j, 1))

    def state_at(self, k: Kernel, b, j):
        """Offset of (this direction, b, j) in Y_h, Y_c and the initial states."""
        d, hidden = self.direction, self.hidden
        if self.layout == 0:  # [directions, batch, hidden]
            return k.index((d, self.batch * hidden), (b, hidden), (j, 1))
        return k.index((b, self.directions * hidden), (d, hidden), (j, 1))  # [batch, directions, hidden]

    def clipped(self, k: Kernel, x):
        clip = self.attrs["clip"]
        return x if clip is None else k.clamp(x, -clip, clip)

    def act(self, k: Kernel, which: int, x):
        return _activate(k, *self.functions[which], self.clipped(k, x))


def _transpose(k: Kernel, src, rows: int, cols: int, dst) -> None:
    """dst [cols, rows] = src [rows, cols] transposed."""
    with k.loop(rows) as r, k.loop(cols) as c:
        k.store(k.load(src, k.index((r, cols), (c, 1))), dst, k.index((c, rows), (r, 1)))


def _times_r(k: Kernel, layer: "_Layer", n: int, states, first: int, out) -> None:
    """out [batch, n] = states [batch, hidden] . R[first:first + n]^T: from
    R^T (constant R, transposed at compile time) a row of states times a
    matrix, whole vectors of columns accumulated in registers; else
    streaming R, one dot product per column."""
    if "R^T" not in layer.weights:
        r = k.builder.gep(layer.weights["R"], [k.i64(first * layer.hidden)])
        emit_dot_rows(k, k.target.lanes, layer.batch, layer.hidden, n, states, r, out)
        return
    b = k.builder
    lanes, gh = k.target.lanes, layer.gate_columns
    block = max(1, min(8, (k.target.vector_registers - 2) // 2))  # accumulators, and their loads
    vectors = n // lanes
    r_t = b.gep(layer.weights["R^T"], [k.i64(first)])
    zero = ir.Constant(ir.VectorType(ir.FloatType(), lanes), [0.0] * lanes)
    with k.loop(layer.batch) as i:
        row = b.mul(i, k.i64(layer.hidden))
        for v0 in range(0, vectors, block):
            count = min(block, vectors - v0)
            accs = [k.variable(zero) for _ in range(count)]
            with k.loop(layer.hidden) as p:
                x = splat(k, k.load(states, b.add(row, p)), lanes)
                at = b.mul(p, k.i64(gh))
                for v, acc in enumerate(accs):
                    w = b.load(_vector_ptr(k, r_t, b.add(at, k.i64((v0 + v) * lanes)), lanes), align=4)
                    b.store(_fmuladd(k, x, w, b.load(acc)), acc)
            for v, acc in enumerate(accs):
                b.store(b.load(acc), _vector_ptr(k, out, k.index((i, n), ((v0 + v) * lanes, 1)), lanes), align=4)
        with k.loop(n, start=vectors * lanes) as c:  # columns past the last whole vector
            total = k.variable(k.f32(0.0))
            with k.loop(layer.hidden) as p:
                w = k.load(r_t, k.index((p, gh), (c, 1)))
                b.store(b.fadd(b.load(total), b.fmul(k.load(states, b.add(row, p)), w)), total)
            k.store(b.load(total), out, k.index((i, n), (c, 1)))


class _Recurrent(Op):
    """What LSTM, GRU and RNN share: attributes, shapes, the input
    projection, the initial states, sequence lengths and the step loop.
    A subclass names its gates, its default activations, its state inputs
    and outputs, and updates one hidden unit in cell()."""

    positional_inputs = True
    gates = 1
    default_activations: tuple = ()
    states = ("h",)  # running states; initial_h (and initial_c) follow sequence_lens
    extra_rows = 0  # more [batch, hidden] scratch rows a subclass's step needs

    def attributes(self, raw, constants, opset):
        direction = raw.get("direction", "forward")
        _check_choice("direction", direction, ("forward", "reverse", "bidirectional"))
        directions = 2 if direction == "bidirectional" else 1
        attrs = {"direction": direction, "hidden_size": raw.get("hidden_size"),
                 "layout": int(raw.get("layout", 0)), "clip": raw.get("clip"),
                 "functions": _activations(raw, self.default_activations, directions)}
        attrs["clip"] = None if attrs["clip"] is None else float(attrs["clip"])
        return attrs

    def _geometry(self, inputs, attrs):
        """(steps, batch, input size, hidden, directions) from the input shapes."""
        shapes = dict(zip(attrs["input_positions"], inputs))
        for position, transposed in ((1, W_TRANSPOSED), (2, R_TRANSPOSED)):
            if transposed in shapes:  # see passes.transpose_recurrent_weights
                d, depth, columns = shapes.pop(transposed)
                shapes[position] = (d, columns, depth)
        if 0 not in shapes or 1 not in shapes or 2 not in shapes:
            raise ShapeError(f"{self.op_type} needs X, W and R")
        x, w, r = shapes[0], shapes[1], shapes[2]
        if len(x) != 3:
            raise ShapeError(f"{self.op_type} input X should be 3-D, got {x}")
        steps, batch = (x[0], x[1]) if attrs["layout"] == 0 else (x[1], x[0])
        directions = 2 if attrs["direction"] == "bidirectional" else 1
        hidden = attrs["hidden_size"] or (r[2] if len(r) == 3 else 0)
        gh = self.gates * hidden
        expected = {1: (directions, gh, x[2]), 2: (directions, gh, hidden), 3: (directions, 2 * gh),
                    4: (batch,), 5 + len(self.states): (directions, 3 * hidden)}
        state = (directions, batch, hidden) if attrs["layout"] == 0 else (batch, directions, hidden)
        expected.update({5 + i: state for i in range(len(self.states))})
        for pos, shape in shapes.items():
            if pos in expected and tuple(shape) != expected[pos]:
                raise ShapeError(f"{self.op_type} input {pos} has shape {tuple(shape)}, expected {expected[pos]}")
        return steps, batch, x[2], hidden, directions

    def infer(self, inputs, attrs):
        steps, batch, _, hidden, directions = self._geometry(inputs, attrs)
        if attrs["layout"] == 0:
            y, state = (steps, directions, batch, hidden), (directions, batch, hidden)
        else:
            y, state = (batch, steps, directions, hidden), (batch, directions, hidden)
        return [y] + [state] * len(self.states)

    def output_dtype(self, inputs, attrs):
        positions = attrs["input_positions"]
        for pos, tensor in zip(positions, inputs):
            wanted = "int32" if pos == 4 else "float32"
            if tensor.dtype != wanted:
                raise BuildError(f"{self.op_type} input {pos} ({tensor.name!r}) has dtype {tensor.dtype}, "
                                 f"expected {wanted}")
        return "float32"

    def scratch_bytes(self, inputs, outputs, attrs):
        """The input projection of every step, one step's H . R^T, the
        running states, the subclass's extra rows and, for a runtime W, one
        direction's W^T (see lower())."""
        steps, batch, size, hidden, _ = self._geometry([t.shape for t in inputs], attrs)
        gh = self.gates * hidden
        return 4 * (steps * batch * gh + batch * gh + (len(self.states) + self.extra_rows) * batch * hidden
                    + self._w_t_floats(attrs, size, gh))

    @staticmethod
    def _w_t_floats(attrs, size: int, gh: int) -> int:
        """Scratch for W transposed in the run: none when it was at compile time."""
        return 0 if W_TRANSPOSED in attrs["input_positions"] else size * gh

    def lower(self, k, inputs, outputs, attrs):
        steps, batch, size, hidden, directions = self._geometry([t.shape for t in inputs], attrs)
        given = dict(zip(attrs["input_positions"], k.inputs))
        bld = k.builder
        gh = self.gates * hidden
        at = 0

        def area(floats):
            nonlocal at
            ptr = bld.gep(k.scratch, [k.i64(at)])
            at += floats
            return ptr
        projected, recurrent = area(steps * batch * gh), area(batch * gh)
        state = {name: area(batch * hidden) for name in self.states}
        extra = [area(batch * hidden) for _ in range(self.extra_rows)]
        w_t = area(self._w_t_floats(attrs, size, gh))
        lengths = given.get(4)
        y = k.outputs[0]
        if lengths is not None:
            # Steps past a sequence's end leave zeros in Y.
            with k.loop(outputs[0].size) as i:
                k.store(k.f32(0.0), y, i)
        per_direction = len(self.default_activations)
        for d in range(directions):
            weights = {}
            for name, position, depth in (("W", 1, size), ("R", 2, hidden)):
                if position in given:
                    weights[name] = bld.gep(given[position], [k.i64(d * gh * depth)])
                else:  # constant, transposed at compile time
                    transposed = given[W_TRANSPOSED if name == "W" else R_TRANSPOSED]
                    weights[name + "^T"] = bld.gep(transposed, [k.i64(d * gh * depth)])
            if 3 in given:
                weights["B"] = bld.gep(given[3], [k.i64(d * 2 * gh)])
            peephole = 5 + len(self.states)
            if peephole in given:
                weights["P"] = bld.gep(given[peephole], [k.i64(d * 3 * hidden)])
            if "W^T" not in weights:
                _transpose(k, weights["W"], gh, size, w_t)
                weights["W^T"] = w_t
            layer = _Layer(steps, batch, hidden, attrs["layout"], directions, d,
                           attrs["direction"] == "reverse" or d == 1,
                           attrs["functions"][d * per_direction:(d + 1) * per_direction], attrs,
                           weights, state, lengths, projected, recurrent, self.recurrent_columns(attrs, hidden), y,
                           gate_columns=gh)
            emit_gemm(k, tile_for(k.target), steps * batch, size, gh, given[0], weights["W^T"], k.i64(0), gh,
                      projected, k.i64(0), None, False, lda=size)
            for i, name in enumerate(self.states):
                initial = given.get(5 + i)
                with k.loop(batch) as b, k.loop(hidden) as j:
                    start = k.load(initial, layer.state_at(k, b, j)) if initial is not None else k.f32(0.0)
                    k.store(start, state[name], k.index((b, hidden), (j, 1)))
            with k.loop(steps) as s:
                self.step(k, layer, s, extra)
            for i, name in enumerate(self.states):
                if i + 1 < len(k.outputs):
                    with k.loop(batch) as b, k.loop(hidden) as j:
                        value = k.load(state[name], k.index((b, hidden), (j, 1)))
                        k.store(value, k.outputs[i + 1], layer.state_at(k, b, j))
        k.activated = True

    def recurrent_columns(self, attrs, hidden) -> int:
        """How many rows of R multiply the hidden state at the start of each step."""
        return self.gates * hidden

    def step(self, k: Kernel, layer: _Layer, s, extra) -> None:
        """One time step: h . R^T for every batch element, then cell() for
        every hidden unit of the batch elements whose sequence goes on."""
        self.multiply_state(k, layer)
        self.each_unit(k, layer, s, lambda b, t, j: self.cell(k, layer, b, t, j))

    @staticmethod
    def multiply_state(k: Kernel, layer: _Layer) -> None:
        """recurrent = H . R^T over the first recurrent_columns rows of R."""
        _times_r(k, layer, layer.recurrent_columns, layer.state["h"], 0, layer.recurrent)

    def each_unit(self, k: Kernel, layer: _Layer, s, body, stores_h: bool = True) -> None:
        """body(b, t, j) for each batch element b still in its sequence at
        step s (t its time index) and hidden unit j; with stores_h, body
        returns the new h, which goes into the state and Y."""
        bld = k.builder
        with k.loop(layer.batch) as b:
            if layer.lengths is None:
                valid, t = None, bld.sub(k.i64(layer.steps - 1), s) if layer.reverse else s
            else:
                # A length outside [0, steps] is clamped (onnxruntime fails the
                # run instead), so that no step reads outside X.
                length = bld.sext(k.load(k.typed(layer.lengths, "int32"), b), I64)
                length = k.smin(k.smax(length, k.i64(0)), k.i64(layer.steps))
                valid = bld.icmp_signed("<", s, length)
                t = bld.sub(bld.sub(length, k.i64(1)), s) if layer.reverse else s
            with (bld.if_then(valid) if valid is not None else nullcontext()):
                # Vectors of hidden units, then one at a time: every value a
                # unit reads or writes lies next to its neighbours'.
                for first, count, width in vector_runs(layer.hidden, k.target.lanes):
                    with k.loop(first + count, start=first) as group, layer.vectors(k, width):
                        j = bld.mul(group, k.i64(width)) if width > 1 else group
                        new_h = body(b, t, j)
                        if stores_h:
                            layer.store(k, new_h, layer.state["h"], k.index((b, layer.hidden), (j, 1)))
                            layer.store(k, new_h, layer.y, layer.y_at(k, t, b, j))

    def gate_input(self, k: Kernel, layer: _Layer, b, t, j, gate: int, recurrent: bool = True):
        """X_t . W_g^T (+ H . R_g^T) + Wb_g + Rb_g for hidden unit j."""
        bld = k.builder
        gh, column = self.gates * layer.hidden, k.index((j, 1), (gate * layer.hidden, 1))
        value = layer.load(k, layer.projected, k.index((layer.x_row(k, t, b), gh), (column, 1)))
        if recurrent:
            value = bld.fadd(value, layer.load(k, layer.recurrent, k.index((b, layer.recurrent_columns), (column, 1))))
        bias = layer.weights.get("B")
        if bias is not None:
            value = bld.fadd(value, layer.load(k, bias, column))
            if recurrent:
                value = bld.fadd(value, layer.load(k, bias, k.index((column, 1), (gh, 1))))
        return value

    def cell(self, k: Kernel, layer: _Layer, b, t, j) -> ir.Value:
        raise NotImplementedError


class RNN(_Recurrent):
    """H_t = f(X_t . W^T + H_t-1 . R^T + Wb + Rb)."""

    op_type = "RNN"
    default_activations = ("Tanh",)

    def cell(self, k, layer, b, t, j):
        return layer.act(k, 0, self.gate_input(k, layer, b, t, j, 0))


class LSTM(_Recurrent):
    """Gates i, o, f, c in ONNX's order, optional peepholes P (i, o, f) and
    input_forget (f = 1 - i)."""

    op_type = "LSTM"
    gates = 4
    default_activations = ("Sigmoid", "Tanh", "Tanh")
    states = ("h", "c")

    def attributes(self, raw, constants, opset):
        return dict(super().attributes(raw, constants, opset), input_forget=int(raw.get("input_forget", 0)))

    def cell(self, k, layer, b, t, j):
        bld = k.builder
        c_at = k.index((b, layer.hidden), (j, 1))
        c_prev = layer.load(k, layer.state["c"], c_at)
        peephole = layer.weights.get("P")

        def gate(index, peep, c_value):
            value = self.gate_input(k, layer, b, t, j, index)
            if peephole is not None:
                value = bld.fadd(value, bld.fmul(layer.load(k, peephole, k.index((j, 1), (peep * layer.hidden, 1))),
                                                 c_value))
            return layer.act(k, 0, value)
        i = gate(0, 0, c_prev)
        f = bld.fsub(k.f32(1.0), i) if layer.attrs["input_forget"] else gate(2, 2, c_prev)
        candidate = layer.act(k, 1, self.gate_input(k, layer, b, t, j, 3))
        c = bld.fadd(bld.fmul(f, c_prev), bld.fmul(i, candidate))
        layer.store(k, c, layer.state["c"], c_at)
        o = gate(1, 1, c)
        return bld.fmul(o, _activate(k, *layer.functions[2], c))


class GRU(_Recurrent):
    """Gates z, r, h in ONNX's order. With linear_before_reset the reset
    gate scales H . Rh^T + Rbh; without it, it scales H before the product,
    which then needs its own product per step."""

    op_type = "GRU"
    gates = 3
    default_activations = ("Sigmoid", "Tanh")
    extra_rows = 2  # r * H, and (r * H) . Rh^T

    def attributes(self, raw, constants, opset):
        return dict(super().attributes(raw, constants, opset),
                    linear_before_reset=int(raw.get("linear_before_reset", 0)))

    def recurrent_columns(self, attrs, hidden):
        # Without linear_before_reset, Rh multiplies r * H, later in the step.
        return 3 * hidden if attrs["linear_before_reset"] else 2 * hidden

    def step(self, k, layer, s, extra):
        """Without linear_before_reset: z and r from H . [Rz Rr]^T (the
        shared first product), then (r * H) . Rh^T, then the update."""
        if layer.attrs["linear_before_reset"]:
            super().step(k, layer, s, extra)
            return
        self.multiply_state(k, layer)
        bld, hidden = k.builder, layer.hidden
        h = layer.state["h"]
        reset_h, product = extra

        def reset(b, t, j):
            at = k.index((b, hidden), (j, 1))
            r = layer.act(k, 0, self.gate_input(k, layer, b, t, j, 1))
            layer.store(k, bld.fmul(r, layer.load(k, h, at)), reset_h, at)
        self.each_unit(k, layer, s, reset, stores_h=False)
        _times_r(k, layer, hidden, reset_h, 2 * hidden, product)  # Rh: rows 2H..3H of R
        self.each_unit(k, layer, s, lambda b, t, j: self._update(
            k, layer, b, t, j, bld.fadd(layer.load(k, product, k.index((b, hidden), (j, 1))), self._rbh(k, layer, j))))

    def cell(self, k, layer, b, t, j):
        # linear_before_reset: r scales H . Rh^T + Rbh.
        bld, hidden = k.builder, layer.hidden
        r = layer.act(k, 0, self.gate_input(k, layer, b, t, j, 1))
        recurrent = layer.load(k, layer.recurrent, k.index((b, 3 * hidden), (j, 1), (2 * hidden, 1)))
        return self._update(k, layer, b, t, j, bld.fmul(r, bld.fadd(recurrent, self._rbh(k, layer, j))))

    @staticmethod
    def _rbh(k, layer, j):
        """Rbh for hidden unit j (0 without a bias)."""
        bias = layer.weights.get("B")
        return k.f32(0.0) if bias is None else layer.load(k, bias, k.index((j, 1), (5 * layer.hidden, 1)))

    def _update(self, k, layer, b, t, j, reset_term):
        """H = (1 - z) * g(X . Wh^T + Wbh + reset_term) + z * H_prev."""
        bld = k.builder
        z = layer.act(k, 0, self.gate_input(k, layer, b, t, j, 0))
        candidate = layer.act(k, 1, bld.fadd(self.gate_input(k, layer, b, t, j, 2, recurrent=False), reset_term))
        h_prev = layer.load(k, layer.state["h"], k.index((b, layer.hidden), (j, 1)))
        return bld.fadd(bld.fmul(bld.fsub(k.f32(1.0), z), candidate), bld.fmul(z, h_prev))
