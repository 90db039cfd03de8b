"""Pooling ops large enough to be split between threads (passes.mark_split)
give onnxruntime's result on 1, 2 and 3 threads; small ones stay on one
thread."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from crosscompile.passes import MIN_SPLIT_ELEMENTS
from tests.onnx_models import make_model, rand, reference


def _pool_model(op_type, x_shape, **attrs):
    # A Relu after the pool is fused into its epilogue.
    nodes = [helper.make_node(op_type, ["x"], ["p"], **attrs), helper.make_node("Relu", ["p"], ["y"])]
    return make_model(nodes, {"x": x_shape}, {"y": None})


@pytest.mark.parametrize("op_type,x_shape,attrs", [
    ("MaxPool", (1, 67, 31, 33), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("AveragePool", (2, 35, 30, 32), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    ("GlobalAveragePool", (1, 131, 23, 23), {}),
    ("GlobalMaxPool", (3, 5, 70, 70), {}),  # 15 channels over 3 threads
])
def test_split_pool_matches_onnxruntime_on_1_2_3_threads(tmp_path, op_type, x_shape, attrs):
    assert np.prod(x_shape) >= MIN_SPLIT_ELEMENTS
    model = _pool_model(op_type, x_shape, **attrs)
    x = rand(*x_shape, seed=4)
    want = reference(model, {"x": x})[0]
    lib = crosscompile.build(model, target="host")
    module = minirt.load(lib.export_library(tmp_path / "m.so"))
    for threads in (1, 2, 3):
        module.set_threads(threads)
        for _ in range(3):
            np.testing.assert_allclose(module.run({"x": x})[0], want, rtol=1e-5, atol=1e-6)
    module.close()


def test_only_large_pools_are_split():
    from crosscompile.passes import mark_split
    from crosscompile.frontend import import_onnx
    big = import_onnx(_pool_model("MaxPool", (1, 64, 55, 55), kernel_shape=[3, 3], strides=[2, 2]))
    small = import_onnx(_pool_model("MaxPool", (1, 64, 13, 13), kernel_shape=[3, 3], strides=[2, 2]))
    assert [n.attrs.get("split") for n in mark_split(big).nodes if n.op_type == "MaxPool"] == [True]
    assert [n.attrs.get("split") for n in mark_split(small).nodes if n.op_type == "MaxPool"] == [None]
