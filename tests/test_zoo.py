"""Every model of the onnx package's light zoo, compiled for the host and for
emulated boards, against onnxruntime on the same input.

The tolerance (tests.onnx_models.ZOO_RTOL / ZOO_ATOL_SCALE) is explained there.
tests/test_zoo_emulated.py runs every model on emulated boards through a tracker.
"""
import time

import pytest

import crosscompile
import minirt
from tests.cross_targets import emulated_tools, run_emulated
from tests.onnx_models import (ZOO, assert_zoo_close, assert_zoo_matches, reference, zoo_input,
                               zoo_model)


# Plain stacks of convolutions and large fully connected layers, as bvlc_alexnet
# is: the default run leaves these two (the longest to compile and check) to
# --full-zoo.
LIKE_ALEXNET = ("vgg19", "zfnet512")


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.full_zoo]
                                               if name in LIKE_ALEXNET else [])
                                  for name in ZOO])
def test_zoo_model_matches_onnxruntime_on_host(tmp_path, name):
    model = zoo_model(name)
    feeds = zoo_input(model)
    started = time.perf_counter()
    lib = crosscompile.build(model, target="host")
    seconds = time.perf_counter() - started
    module = minirt.load(lib.export_library(tmp_path / f"{name}.so"))
    got, want = module.run(feeds), reference(model, feeds)
    assert_zoo_matches(got, want)
    print(f"{name}: compiled in {seconds:.1f} s, {lib.summary}")


@pytest.mark.parametrize("preset", ["rasp4b64", "rasp3b"])
def test_squeezenet_runs_on_emulated_boards(tmp_path, preset):
    emulated_tools(preset)
    model = zoo_model("squeezenet", logits=False)
    feeds = zoo_input(model)
    (x,) = feeds.values()
    want = reference(model, feeds)[0]
    got = run_emulated(crosscompile.build(model, target=preset), preset, x, want.shape, tmp_path)
    assert_zoo_close([got], [want])
