"""The onnx package's backend node tests that fall in the supported set
(see tests/onnx_node_suite.py; `python -m tests.onnx_node_suite` prints the
pass count per op)."""
import pytest

from tests.onnx_node_suite import discover, per_op, run_all

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
           "ArgMax", "ArgMin", "CumSum", "GatherElements", "LSTM", "GRU", "RNN"}


@pytest.fixture(scope="module")
def results():
    return run_all(discover())


def test_no_case_in_scope_computes_a_wrong_result_or_crashes(results):
    bad = [f"{r.status} {r.case.suite}/{r.case.name}: {r.detail}" for r in results
           if r.status in ("mismatch", "crash")]
    assert not bad, "\n".join(bad)


def test_every_claimed_op_passes_onnx_cases(results):
    table = per_op(results)
    missing = sorted(op for op in CLAIMED if not table.get(op, {}).get("pass"))
    assert not missing, f"no passing onnx node case for {missing}"
    passed = sum(r.status == "pass" for r in results)
    print(f"{passed} of {len(results)} in-scope onnx node cases pass")


def test_rejections_are_clear_build_errors(results):
    # What is left out (3-D windows, runtime Gather/Expand, batched MatMul)
    # must be refused with a message naming the node, never computed wrongly.
    for r in results:
        if r.status == "refused" and "plain tensor" not in r.detail:
            assert "node '" in r.detail or "graph output" in r.detail, r.detail
