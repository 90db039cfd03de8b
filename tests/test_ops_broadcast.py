"""Element-wise ops whose loops merge dimensions the operands step through
alike (elementwise._merge_dims): per-channel, per-row, per-column and mixed
broadcasts, with and without a fused Relu, against onnxruntime."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from tests.onnx_models import make_model, rand, reference

CASES = [
    ("Mul", (1, 37, 9, 11), (37, 1, 1)),       # per channel: loops over C and H * W
    ("Add", (2, 5, 7, 3), (1, 5, 1, 3)),       # channel and column: nothing merges past C
    ("Sub", (3, 4, 6), (3, 1, 6)),             # per row and column
    ("Div", (2, 3, 4, 5), (2, 3, 4, 5)),       # same shapes: one loop
    ("Max", (1, 6, 1, 8), (4, 1, 7, 1)),       # both operands broadcast
    ("Add", (8, 1), (1,)),
]


@pytest.mark.parametrize("op,a_shape,b_shape", CASES)
def test_broadcast_elementwise_matches_onnxruntime(tmp_path, op, a_shape, b_shape):
    nodes = [helper.make_node(op, ["a", "b"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    model = make_model(nodes, {"a": a_shape, "b": b_shape}, {"y": None}, {})
    feeds = {"a": rand(*a_shape, seed=1), "b": rand(*b_shape, seed=2) + (3.0 if op == "Div" else 0.0)}
    module = minirt.load(crosscompile.build(model, target="host").export_library(tmp_path / "m.so"))
    np.testing.assert_allclose(module.run(feeds)[0], reference(model, feeds)[0], rtol=1e-6, atol=1e-6)
    module.close()
