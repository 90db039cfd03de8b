"""MaxPool / AveragePool over 1-D and 2-D windows, lowered one output row
at a time with unchecked interior columns and checked edge columns.
Shapes give edge columns on both sides, windows wider than the padding,
ceil_mode windows running past the end padding, dilation, strides 1 to 3,
count_include_pad, and inputs large enough that threads split the channels;
each is compared with onnxruntime for 1, 2 and 3 threads."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from tests.onnx_models import make_model, rand, reference

CASES = [
    ("MaxPool", (1, 64, 67, 71), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", (1, 3, 24, 20), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ("MaxPool", (2, 5, 17, 30), {"kernel_shape": [2, 5], "strides": [1, 3], "pads": [0, 2, 1, 1],
                                 "dilations": [2, 1]}),
    ("MaxPool", (1, 4, 50), {"kernel_shape": [4], "strides": [1], "pads": [2, 1]}),
    ("AveragePool", (1, 40, 56, 57), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}),
    ("AveragePool", (1, 6, 21, 22), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                     "count_include_pad": 1, "ceil_mode": 1}),
    ("AveragePool", (1, 3, 13, 29), {"kernel_shape": [5, 7], "strides": [3, 2], "pads": [2, 3, 2, 3]}),
    # Rows shorter than a vector: explicit vectors of 8 and 4 then scalars;
    # 25 columns make the last window end at the row's end.
    ("MaxPool", (1, 9, 27, 27), {"kernel_shape": [3, 3], "strides": [2, 2]}),
    ("MaxPool", (1, 5, 25, 25), {"kernel_shape": [3, 3], "strides": [2, 2]}),
    ("AveragePool", (1, 7, 9, 9), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}),
    ("AveragePool", (1, 6, 13, 13), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                     "count_include_pad": 1}),
]


@pytest.mark.parametrize("op,x_shape,attrs", CASES)
def test_pool_rows_match_onnxruntime_on_1_2_3_threads(tmp_path, op, x_shape, attrs):
    model = make_model([helper.make_node(op, ["x"], ["y"], **attrs)], {"x": x_shape}, {"y": None}, {})
    x = rand(*x_shape, seed=3)
    want = reference(model, {"x": x})[0]
    module = minirt.load(crosscompile.build(model, target="host").export_library(tmp_path / "m.so"))
    for threads in (1, 2, 3):
        module.set_threads(threads)
        got = module.run({"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    module.close()


LP_CASES = [
    ((1, 3, 11, 13), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 2]}),
    ((2, 4, 10, 9), {"kernel_shape": [2, 3], "p": 1, "ceil_mode": 1, "strides": [2, 2]}),
    ((1, 4, 10, 9), {"kernel_shape": [2, 3], "p": 2, "dilations": [2, 1], "pads": [0, 1, 1, 1]}),
    ((1, 2, 17), {"kernel_shape": [4], "p": 3, "auto_pad": "SAME_UPPER"}),
    ((1, 2, 5, 6, 7), {"kernel_shape": [2, 2, 3], "auto_pad": "SAME_LOWER", "strides": [1, 2, 2]}),
]


@pytest.mark.parametrize("x_shape,attrs", LP_CASES)
def test_lp_pool_matches_the_onnx_reference(tmp_path, x_shape, attrs):
    """LpPool, (sum of |x|^p)^(1/p) over each window, with p 1 to 3, pads,
    auto_pad, dilations, ceil_mode and 1-D to 3-D windows, on 1 and 2
    threads (the onnx reference: onnxruntime's LpPool lacks dilations)."""
    from onnx.reference import ReferenceEvaluator

    model = make_model([helper.make_node("LpPool", ["x"], ["y"], **attrs)], {"x": x_shape}, {"y": None}, {},
                       opset=18)
    x = rand(*x_shape, seed=5) - 0.5
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    module = minirt.load(crosscompile.build(model, target="host").export_library(tmp_path / "m.so"))
    for threads in (1, 2):
        module.set_threads(threads)
        np.testing.assert_allclose(module.run({"x": x})[0], want, rtol=1e-5, atol=1e-6)
    module.close()
