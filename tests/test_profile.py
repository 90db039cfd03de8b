"""Per-step profiling (tether_run_profiled): the metadata describes each kernel
call, minirt times them, and a session profiles a module on a real board
process. Only properties of the times are checked (positive, shares sum to
one), never their size."""
import math

import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from remote import errors, rpc
from tests import session_modules
from tests.onnx_models import make_model, rand


def residual_cnn():
    """Conv+BN+Relu, a Conv with a residual Add and Relu merged in, a pool."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("BatchNormalization", ["c1", "s", "bb", "m", "v"], ["n1"], name="bn1"),
             helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Add", ["c2", "r1"], ["a2"], name="add2"),
             helper.make_node("Relu", ["a2"], ["r2"], name="relu2"),
             helper.make_node("MaxPool", ["r2"], ["y"], kernel_shape=[2, 2], strides=[2, 2],
                              name="pool")]
    inits = {"w1": rand(8, 3, 3, 3, seed=1), "b1": rand(8, seed=2), "s": rand(8, seed=3),
             "bb": rand(8, seed=4), "m": rand(8, seed=5), "v": np.abs(rand(8, seed=6)) + 0.5,
             "w2": rand(8, 8, 3, 3, seed=7), "b2": rand(8, seed=8)}
    return make_model(nodes, {"x": (1, 3, 12, 12)}, {"y": None}, inits)


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "cnn.so"
    return crosscompile.build(residual_cnn()).export_library(path)


def check_rows(rows, steps):
    assert [(r["op"], r["name"], r["fused"]) for r in rows] == [
        (s["op"], s["name"], s["fused"]) for s in steps]
    assert all(r["mean_s"] > 0 for r in rows)
    assert math.isclose(sum(r["share"] for r in rows), 1.0, rel_tol=1e-9)


def test_steps_metadata_names_each_kernel_call_and_what_was_merged_into_it():
    steps = crosscompile.build(residual_cnn()).metadata["steps"]
    assert steps == [
        {"op": "Conv", "name": "conv1", "fused": ["BatchNormalization", "Relu"],
         "inputs": [[1, 3, 12, 12]], "outputs": [[1, 8, 12, 12]]},
        {"op": "Conv", "name": "conv2", "fused": ["Add", "Relu"],
         "inputs": [[1, 8, 12, 12], [1, 8, 12, 12]], "outputs": [[1, 8, 12, 12]]},
        {"op": "MaxPool", "name": "pool", "fused": [],
         "inputs": [[1, 8, 12, 12]], "outputs": [[1, 8, 6, 6]]}]


def test_minirt_profile_times_every_step_and_leaves_results_unchanged(cnn_path):
    module = minirt.load(cnn_path)
    x = rand(1, 3, 12, 12, seed=11)
    before = module.run({"x": x})[0]
    rows = module.profile({"x": x}, number=3)
    check_rows(rows, module.metadata["steps"])
    np.testing.assert_array_equal(module.run({"x": x})[0], before)
    with pytest.raises(minirt.InputError, match="number must be a positive integer"):
        module.profile(number=0)


def test_module_without_the_export_says_to_rebuild(tmp_path):
    module = minirt.load(session_modules.build(str(tmp_path)))
    with pytest.raises(minirt.ProfilingUnsupported, match="rebuild it with this crosscompile"):
        module.profile()
    assert module.run({"x": np.zeros((1, 4), np.float32)})[0].tolist() == [[1.0] * 4]


def test_remote_profile_on_a_real_board(farm, mlp_module, cnn_path, tmp_path):
    old = session_modules.build(str(tmp_path))
    with rpc.connect_tracker(*farm.tracker).request("host", timeout=30) as sess:
        for path in (mlp_module[1], cnn_path):
            mod = sess.load_module(sess.upload(path))
            prof = mod.profile(number=3)
            steps = mod.metadata["steps"]
            assert sorted((r["op"], r["name"]) for r in prof.rows) == sorted(
                (s["op"], s["name"]) for s in steps)
            check_rows(sorted(prof.rows, key=lambda r: [s["name"] for s in steps].index(r["name"])),
                       steps)
            times = [r["mean_s"] for r in prof.rows]
            assert times == sorted(times, reverse=True)
            text = str(prof)
            assert text.splitlines()[1].split() == ["OP", "NAME", "FUSED", "INPUTS", "OUTPUTS",
                                                    "TIME", "SHARE"]
            for step in steps:
                assert step["name"] in text and step["name"] in prof._repr_html_()
        legacy = sess.load_module(sess.upload(old))
        with pytest.raises(errors.ModuleLoadError, match="rebuild it with this crosscompile"):
            legacy.profile()
        assert legacy.run({"x": np.ones((1, 4), np.float32)})[0].tolist() == [[2.0] * 4]
