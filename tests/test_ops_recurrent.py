"""LSTM, GRU and RNN against onnxruntime: forward, reverse and
bidirectional, with and without biases, initial states and sequence
lengths, both layouts, peepholes, clip, linear_before_reset, and outputs
left unnamed."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import crosscompile
import minirt
from crosscompile.compiler import lowered_graph
from crosscompile.recurrent import R_TRANSPOSED, W_TRANSPOSED
from crosscompile.target import resolve_target
from tests.onnx_models import IR_VERSION, reference
from tests.test_ops_logic import run_typed

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
STATES = {"LSTM": 2, "GRU": 1, "RNN": 1}


def recurrent_case(op, steps=5, batch=3, size=6, hidden=8, direction="forward", bias=True, initial=False,
                   lengths=None, layout=0, peepholes=False, outputs=None, seed=0, runtime_weights=False, **attrs):
    """(model, feeds): X, initial states and sequence lengths are runtime
    inputs, W, R, B and P initializers (W and R runtime inputs too with
    runtime_weights); weights scaled so the gates do not saturate."""
    rng = np.random.default_rng(seed)
    directions = 2 if direction == "bidirectional" else 1
    gh = GATES[op] * hidden

    def weight(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    inits = {"W": weight(directions, gh, size), "R": weight(directions, gh, hidden)}
    x_shape = (steps, batch, size) if layout == 0 else (batch, steps, size)
    feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
    if runtime_weights:
        feeds.update(W=inits.pop("W"), R=inits.pop("R"))
    names = ["X", "W", "R", ""]
    if bias:
        inits["B"] = (0.5 * rng.standard_normal((directions, 2 * gh))).astype(np.float32)
        names[3] = "B"
    names.append("")
    if lengths is not None:
        feeds["lengths"] = np.asarray(lengths, np.int32)
        names[4] = "lengths"
    state_shape = (directions, batch, hidden) if layout == 0 else (batch, directions, hidden)
    for i, state in enumerate(["initial_h", "initial_c"][:STATES[op]]):
        names.append(state if initial else "")
        if initial:
            feeds[state] = rng.standard_normal(state_shape).astype(np.float32)
    if peepholes:
        inits["P"] = weight(directions, 3 * hidden)
        names.append("P")
    while names[-1] == "":
        names.pop()
    outputs = outputs or ["Y", "Y_h", "Y_c"][:STATES[op] + 1]
    if layout:
        attrs["layout"] = layout  # from opset 14
    node = helper.make_node(op, names, outputs, name=f"the_{op.lower()}", hidden_size=hidden,
                            direction=direction, **attrs)
    elem = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int32): TensorProto.INT32}
    graph = helper.make_graph(
        [node], "recurrent",
        [helper.make_tensor_value_info(n, elem[v.dtype], v.shape) for n, v in feeds.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs if n],
        [numpy_helper.from_array(v, n) for n, v in inits.items()])
    opset = 14 if layout else 13
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    return model, feeds


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("initial,lengths", [(False, None), (True, None), (True, [5, 2, 4]), (False, [1, 5, 3])])
def test_recurrent_directions_states_and_lengths(tmp_path, op, direction, initial, lengths):
    run_typed(*recurrent_case(op, direction=direction, initial=initial, lengths=lengths), tmp_path)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("runtime_weights", [False, True])
def test_hidden_units_in_vectors_and_one_at_a_time(tmp_path, op, runtime_weights):
    """37 hidden units: whole vectors then single units on any vector width
    (4, 8 or 16 lanes), and 4 x 37 gate columns, not a whole number of
    vectors either. Constant W and R are transposed at compile time; as
    runtime inputs, W is transposed in the run and R read as it is."""
    model, feeds = recurrent_case(op, steps=6, batch=2, size=21, hidden=37, direction="bidirectional",
                                  initial=True, lengths=[6, 4], runtime_weights=runtime_weights,
                                  **({"linear_before_reset": 0} if op == "GRU" else {}))
    run_typed(model, feeds, tmp_path)
    _, _, graph = lowered_graph(model, resolve_target("host"), None, {})
    (node,) = [n for n in graph.nodes if n.op_type == op]
    transposed = {W_TRANSPOSED, R_TRANSPOSED} & set(node.attrs["input_positions"])
    assert transposed == (set() if runtime_weights else {W_TRANSPOSED, R_TRANSPOSED})


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_recurrent_batch_first_layout(tmp_path, op, direction):
    # onnxruntime runs layout=0 only: the reference is the same layer with
    # the batch and step axes swapped on the way in and out.
    case = dict(direction=direction, initial=True, lengths=[3, 5, 1])
    model, feeds = recurrent_case(op, layout=1, **case)
    seq_first, _ = recurrent_case(op, layout=0, **case)
    swapped = {n: v if n == "lengths" else v.transpose(1, 0, 2) for n, v in feeds.items()}
    want = reference(seq_first, swapped)
    want = [want[0].transpose(2, 0, 1, 3)] + [w.transpose(1, 0, 2) for w in want[1:]]
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run(feeds)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lengths", [None, [4, 5, 2]])
def test_gru_linear_before_reset(tmp_path, direction, lengths):
    # torch's nn.GRU exports with linear_before_reset=1.
    run_typed(*recurrent_case("GRU", direction=direction, lengths=lengths, initial=True, linear_before_reset=1),
              tmp_path)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_recurrent_without_bias_on_a_long_sequence(tmp_path, op):
    # A hidden size and input size that are not multiples of any vector width.
    run_typed(*recurrent_case(op, steps=40, batch=1, size=13, hidden=37, bias=False), tmp_path)


def test_lstm_peepholes_clip_and_coupled_gates(tmp_path):
    run_typed(*recurrent_case("LSTM", direction="bidirectional", peepholes=True, clip=0.8, input_forget=1,
                              initial=True), tmp_path)


def test_recurrent_activations_and_their_parameters(tmp_path):
    case = recurrent_case("LSTM", direction="bidirectional", activations=[
        "HardSigmoid", "Tanh", "Relu", "Sigmoid", "ScaledTanh", "LeakyRelu"],
        activation_alpha=[0.3, 0.9, 0.05], activation_beta=[0.4, 1.1])
    run_typed(*case, tmp_path)


@pytest.mark.parametrize("outputs", [["", "Y_h"], ["Y"], ["", "", "Y_c"]])
def test_lstm_outputs_left_unnamed_or_out(tmp_path, outputs):
    run_typed(*recurrent_case("LSTM", outputs=outputs, initial=True), tmp_path)


def test_unsupported_activation_is_refused_naming_the_node():
    model, _ = recurrent_case("GRU", activations=["Sigmoid", "Softsign"])
    with pytest.raises(crosscompile.BuildError, match="the_gru.*activation 'Softsign' is not supported"):
        crosscompile.build(model)


def test_weights_of_the_wrong_shape_are_refused():
    model, _ = recurrent_case("LSTM", hidden=8)
    (hidden_size,) = [a for a in model.graph.node[0].attribute if a.name == "hidden_size"]
    hidden_size.i = 7  # no longer fits W and R
    with pytest.raises(crosscompile.BuildError, match="the_lstm.*input 1 has shape"):
        crosscompile.build(model)


def test_sequence_length_beyond_the_steps_is_clamped(tmp_path):
    # onnxruntime fails the run; the module reads the whole sequence, never past it.
    model, feeds = recurrent_case("GRU", direction="bidirectional", lengths=[9, 3, 5])
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run(feeds)
    want = reference(model, dict(feeds, lengths=np.array([5, 3, 5], np.int32)))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
