"""int8 SqueezeNet 1.1, MobileNetV2 and ResNet-50 (random weights, quantized
by crosscompile.quantizer on random samples) compiled for the host, against
the same quantized models in onnxruntime. Minutes of compiling and of
emulation, so behind a marker:

    pytest -m quantized_zoo tests/test_quantized_zoo.py

The reference is onnxruntime's integer output: its aarch64 wheel on an
emulated Cortex-A76 (qemu-user, as benchmarks/bench_arm.py counts it),
whose kernels sum the 8-bit products exactly in int32, as ONNX defines
them. Neither host path of onnxruntime is that on a deep network: without
graph optimizations it computes each layer in float32 (the sums' last bits
tip roundings, and one-step differences compound over MobileNetV2's 50
layers: 77 % of outputs within a step), and its fused kernels on x86
without VNNI saturate 16-bit sums of uint8 x int8 pairs (see
tests/quantized_models.py).
"""
import numpy as np
import onnx
import pytest

import crosscompile
import minirt
from benchmarks.bench_arm import model_inputs, onnxruntime_site
from crosscompile.quantizer import quantize_model
from deploy_recipes import instruction_count
from tests.architectures import mobilenet_v2
from tests.onnx_models import zoo_model
from tests.test_quantized import assert_within_one_step
from tests.quantized_models import output_step

MODELS = {"squeezenet": lambda: zoo_model("squeezenet", logits=False), "mobilenetv2": mobilenet_v2,
          "resnet50": lambda: zoo_model("resnet50", logits=False)}


@pytest.mark.quantized_zoo
@pytest.mark.parametrize("name", list(MODELS))
def test_int8_model_matches_onnxruntime_on_host(name, tmp_path):
    path = str(tmp_path / f"{name}_int8.onnx")
    quantize_model(MODELS[name](), path, random=4)
    model = onnx.load(path)
    module = minirt.load(crosscompile.build(model).export_library(tmp_path / f"{name}.so"))
    inputs = model_inputs(model)
    reference = str(tmp_path / "onnxruntime.npy")
    instruction_count.count_onnx(path, inputs, onnxruntime_site(), cpu="cortex-a76", runs=1, save=reference)
    theirs = np.load(reference)
    # The counted runs' input: one normal draw per input from seed 0, in order.
    rng = np.random.default_rng(0)
    feeds = {input_name: rng.standard_normal(shape).astype(np.float32) for input_name, shape in inputs.items()}
    # A float op after the last quantized one (a Softmax) has no step: 1 % of the range.
    step = output_step(model) or 0.01 * float(abs(theirs).max())
    assert_within_one_step(module.run(feeds)[0], theirs, step, name)
