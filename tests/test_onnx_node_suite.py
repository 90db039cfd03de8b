"""The onnx package's backend node tests (see tests/onnx_node_suite.py;
`python -m tests.onnx_node_suite` counts every case onnx ships).

The default run takes a sample: the first few in-scope cases of every op,
so that each supported op passes onnx's own cases while the suite stays
within its time budget. The full sweep of all 2,001 cases runs with
--node-suite (tests marked node_suite):

    python -m pytest --node-suite tests/test_onnx_node_suite.py

The same cases also run compiled for rasp4b64 on the native board server
under qemu-aarch64 (--board native-aarch64): a few by default, every one
with --node-suite.
"""
import pytest

from tests.onnx_node_suite import BOARDS, discover, per_op, run_all

# Ops the compiler claims: each must pass at least one of onnx's own cases.
CLAIMED = {"Conv", "Gemm", "MatMul", "BatchNormalization", "Relu", "LeakyRelu", "PRelu", "Clip",
           "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Add", "Sub", "Mul", "Div", "Sum",
           "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LRN", "Concat",
           "Split", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Softmax",
           "Dropout", "Pad", "Identity", "Constant", "Shape", "Cast", "Slice",
           "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp", "Pow", "Sqrt", "Reciprocal", "Exp",
           "Log", "Abs", "Neg", "Erf", "Gelu", "LayerNormalization", "InstanceNormalization",
           "GroupNormalization", "LogSoftmax", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
           "Not", "And", "Or", "Xor", "Where", "Gather", "Resize", "Upsample", "ConvTranspose", "TopK",
           "ArgMax", "ArgMin", "CumSum", "GatherElements", "LSTM", "GRU", "RNN",
           "Softplus", "Mish", "Elu", "Selu", "Celu", "Softsign", "ThresholdedRelu", "Shrink", "Round",
           "Floor", "Ceil", "Sign", "IsNaN", "IsInf", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh",
           "Cosh", "Asinh", "Acosh", "Atanh", "DepthToSpace", "SpaceToDepth", "Tile", "Trilu", "CastLike",
           "LpNormalization", "Mod", "Max", "Min", "GatherND", "ScatterND", "ScatterElements", "OneHot",
           "RMSNormalization", "Hardmax", "CumProd", "Swish", "NegativeLogLikelihoodLoss",
           "SoftmaxCrossEntropyLoss", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
           "Attention", "RotaryEmbedding", "MeanVarianceNormalization", "SwiGLU", "CausalConvWithState",
           "LpPool", "Compress", "Col2Im", "GridSample", "BitCast", "QuantizeLinear", "DequantizeLinear", "DFT",
           "STFT", "Det", "MaxUnpool", "ReverseSequence", "EyeLike", "If", "Loop", "OptionalHasElement",
           "OptionalGetElement", "TensorScatter", "NonZero", "NonMaxSuppression", "RoiAlign",
           "Unique"}
# In-scope cases run per op by default (a case counts for every op it uses).
CASES_PER_OP = 3


def sample(cases, per_op=CASES_PER_OP):
    """The cases, in order, that bring some op below per_op cases taken."""
    taken, chosen = {}, []
    for case in cases:
        if any(taken.get(op, 0) < per_op for op in case.ops):
            chosen.append(case)
            for op in case.ops:
                taken[op] = taken.get(op, 0) + 1
    return chosen


@pytest.fixture(scope="module")
def results():
    return run_all(sample(discover()))


def _assert_no_wrong_result_or_crash(results):
    bad = [f"{r.status} {r.case.suite}/{r.case.name}: {r.detail}" for r in results
           if r.status in ("mismatch", "crash")]
    assert not bad, "\n".join(bad)


def test_no_case_in_scope_computes_a_wrong_result_or_crashes(results):
    _assert_no_wrong_result_or_crash(results)


def test_every_claimed_op_passes_onnx_cases(results):
    table = per_op(results)
    missing = sorted(op for op in CLAIMED if not table.get(op, {}).get("pass"))
    assert not missing, f"no passing onnx node case for {missing}"
    passed = sum(r.status == "pass" for r in results)
    print(f"{passed} of {len(results)} sampled in-scope onnx node cases pass")


def test_refusals_are_clear_build_errors(results):
    # What is left out must be refused with a message naming the node,
    # never computed wrongly.
    for r in results:
        if r.status == "refused" and "plain tensor" not in r.detail:
            assert "node '" in r.detail or "graph output" in r.detail or r.detail.startswith("input"), r.detail


@pytest.mark.node_suite
def test_every_case_onnx_ships_passes_or_is_refused_with_a_reason():
    from tests.onnx_node_suite import report
    results = run_all(discover(everything=True))
    counts = report(results)
    _assert_no_wrong_result_or_crash(results)
    assert all(r.reason for r in results if r.status == "refused")
    assert sum(counts.values()) == len(results) > 0


# Cases the default run takes on an emulated arm64 board: convolutions, a
# recurrent layer, float8 and int4 casts, a reduction, an attention and a
# gather: kernels whose ARM code differs from the host's, in a few seconds;
# and a NonZero, whose output the board server cuts to its count, and a RoiAlign.
BOARD_SAMPLE = ("test_conv_with_strides_padding", "test_lstm_defaults", "test_cast_FLOAT_to_FLOAT8E4M3FN",
                "test_cast_FLOAT_to_INT4", "test_reduce_sum_square_default_axes_keepdims_random",
                "test_attention_4d", "test_gather_elements_1", "test_softmax_axis_1", "test_nonzero_example",
                "test_roialign_aligned_true")


@pytest.mark.emulated
def test_sampled_cases_pass_on_an_emulated_arm64_board():
    """A few cases compiled for rasp4b64 and run on the native board server
    under qemu-aarch64, through sessions: what the --board sweep does."""
    from tests import board_servers
    board_servers.command("native-aarch64")  # skips without qemu-user or the server's build
    cases = [c for c in discover() if c.name in BOARD_SAMPLE]
    assert sorted(c.name for c in cases) == sorted(BOARD_SAMPLE)
    results = run_all(cases, board="native-aarch64")
    assert [(r.case.name, r.status, r.detail) for r in results if r.status != "pass"] == []


@pytest.mark.node_suite
@pytest.mark.emulated
@pytest.mark.parametrize("board", sorted(BOARDS))
def test_every_case_onnx_ships_passes_or_is_refused_on_an_emulated_board(board):
    from tests import board_servers
    from tests.onnx_node_suite import report
    board_servers.command(board)
    results = run_all(discover(everything=True), board=board)
    counts = report(results)
    _assert_no_wrong_result_or_crash(results)
    assert all(r.reason for r in results if r.status == "refused")
    assert sum(counts.values()) == len(results) > 0
