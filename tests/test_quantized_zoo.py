"""int8 SqueezeNet 1.1, MobileNetV2 and ResNet-50 (random weights, quantized
by crosscompile.quantizer on random samples) compiled for the host, against
the same quantized models in onnxruntime. Minutes of compiling, so behind a
marker:

    pytest -m quantized_zoo tests/test_quantized_zoo.py

The reference is onnxruntime without graph optimizations: the QDQ
arithmetic as ONNX defines it (its fused kernels on x86 without VNNI
saturate 16-bit sums with full 8-bit weights; see tests/quantized_models.py).
"""
import onnx
import pytest

import crosscompile
import minirt
from crosscompile.quantizer import calibration_samples, quantize_model
from tests.architectures import mobilenet_v2
from tests.onnx_models import zoo_model
from tests.test_quantized import assert_within_one_step
from tests.quantized_models import output_step

ort = pytest.importorskip("onnxruntime")
MODELS = {"squeezenet": lambda: zoo_model("squeezenet", logits=False), "mobilenetv2": mobilenet_v2,
          "resnet50": lambda: zoo_model("resnet50", logits=False)}


@pytest.mark.quantized_zoo
@pytest.mark.parametrize("name", list(MODELS))
def test_int8_model_matches_onnxruntime_on_host(name, tmp_path):
    path = str(tmp_path / f"{name}_int8.onnx")
    quantize_model(MODELS[name](), path, random=4)
    model = onnx.load(path)
    module = minirt.load(crosscompile.build(model).export_library(tmp_path / f"{name}.so"))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    (feeds,) = calibration_samples(model, random=1, seed=9)
    theirs = session.run(None, feeds)[0]
    # A float op after the last quantized one (a Softmax) has no step: 1 % of the range.
    step = output_step(model) or 0.01 * float(abs(theirs).max())
    assert_within_one_step(module.run(feeds)[0], theirs, step, name)
