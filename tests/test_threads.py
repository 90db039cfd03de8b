"""Modules split large ops across threads (tether_run_parallel): the same
results for any thread count, and old modules still run on one thread."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
import crosscompile.codegen
import minirt
from minirt import InputError
from tests.onnx_models import make_model, reference
from tests.test_crosscompile import rand


def small_cnn(batch=2):
    """im2col convs (scratch reused per image and group), a pointwise conv, a
    grouped conv and serial ops in between, so threads hand work back and forth."""
    def w(*shape, seed):
        return (rand(*shape, seed=seed) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"]),
             helper.make_node("Conv", ["c2", "w3"], ["c3"], group=2, pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Sigmoid", ["c3"], ["y"])]
    inits = {"w1": w(40, 3, 3, 3, seed=1), "b1": rand(40, seed=2), "w2": w(30, 40, 1, 1, seed=3),
             "b2": rand(30, seed=4), "w3": w(26, 15, 3, 3, seed=5)}
    return make_model(nodes, {"x": (batch, 3, 37, 41)}, {"y": None}, inits)


@pytest.fixture(scope="module")
def cnn_module(tmp_path_factory):
    model = small_cnn()
    path = tmp_path_factory.mktemp("threads") / "cnn.so"
    return model, minirt.load(crosscompile.build(model).export_library(path))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_single_thread_result(cnn_module, threads):
    model, module = cnn_module
    x = rand(2, 3, 37, 41, seed=9)
    want = reference(model, {"x": x})[0]
    module.set_threads(threads)
    assert module.threads == threads
    for _ in range(20):  # races would show as differing runs
        got = module.run({"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_default_thread_count_is_the_number_of_cores(cnn_module, tmp_path):
    import os
    module = minirt.load(crosscompile.build(small_cnn(batch=1)).export_library(tmp_path / "m.so"))
    assert module.threads == (os.cpu_count() or 1)


def test_bad_thread_count_is_an_input_error(cnn_module):
    _, module = cnn_module
    with pytest.raises(InputError, match="threads must be a positive integer, got 0"):
        module.set_threads(0)


def test_module_without_the_parallel_entry_point_runs_on_one_thread(tmp_path, monkeypatch):
    serial_only = crosscompile.codegen._define_run

    def define_run(module, graph, plan, kernels, params, target, parallel):
        if not parallel:
            serial_only(module, graph, plan, kernels, params, target, parallel)
    monkeypatch.setattr(crosscompile.codegen, "_define_run", define_run)
    model = small_cnn(batch=1)
    lib = crosscompile.build(model)
    module = minirt.load(lib.export_library(tmp_path / "old.so"), threads=2)
    assert module.threads == 1
    x = rand(1, 3, 37, 41, seed=3)
    np.testing.assert_allclose(module.run({"x": x})[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
