"""The torchvision-like architectures of tests/architectures.py (the models
benchmarks/bench_arm.py counts) compile for the host and agree with
onnxruntime: depthwise and squeeze-and-excitation blocks, ReLU6 as Clip and
SiLU as Sigmoid times its input, as torch exports them."""
import pytest

import crosscompile
import minirt
from tests.architectures import efficientnet_b0, mobilenet_v2, regnet_x_400mf
from tests.onnx_models import assert_zoo_matches, reference, sample_input


# EfficientNet-B0 (5x5 depthwise, squeeze-and-excitation, SiLU) takes about
# 50 s to compile, RegNetX-400MF (grouped 3x3s) about 50 s on a loaded machine: they run with
# --full-zoo; MobileNetV2 stays in the default run.
@pytest.mark.parametrize("build", [mobilenet_v2, pytest.param(efficientnet_b0, marks=pytest.mark.full_zoo),
                                   pytest.param(regnet_x_400mf, marks=pytest.mark.full_zoo)],
                         ids=lambda f: f.__name__)
def test_architecture_matches_onnxruntime_on_host(tmp_path, build):
    model = build()
    feeds = sample_input(model)
    module = minirt.load(crosscompile.build(model, target="host").export_library(tmp_path / "m.so"))
    got = module.run(feeds)
    assert got[0].shape == (1, 1000)
    assert_zoo_matches(got, reference(model, feeds))
