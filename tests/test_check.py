"""`tether check`: a board's outputs against a host reference.

The measures on synthetic arrays; then the command against a real tracker with
a real board (this host's Python server, and the native server for aarch64
under qemu-user), checking a right module and a planted wrong one: the same
network with one output element pushed off by a constant, built into a module
and sent with --module in place of the right build."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from remote.accuracy import Tolerances, measure, verdict
from remote.cli.localfarm import LocalFarm
from tests import board_servers
from tests.onnx_models import mlp
from tests.test_tracker import HANG_S, child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_BEYOND_TOLERANCE = 3


# ------------------------------------------------------------ measures --

def test_one_element_off_is_beyond_the_tolerances_and_named():
    rng = np.random.default_rng(0)
    want = [rng.standard_normal((1, 10)).astype(np.float32) for _ in range(3)]
    got = [w.copy() for w in want]
    got[1][0, 3] += 0.01
    m = measure("logits", got, want)
    assert m["max_abs"] == pytest.approx(0.01, rel=1e-3)
    assert m["cosine"] < 1.0
    passed, why = verdict(m, Tolerances())
    assert not passed and any(w.startswith("max abs error 0.01") for w in why)
    exact = measure("logits", want, want)
    assert verdict(exact, Tolerances()) == (True, []) and exact["top1"] == 1.0


def test_classifier_agreement_and_image_psnr():
    scores = np.array([[0.1, 0.5, 0.4], [0.3, 0.3, 0.4]], dtype=np.float32)
    swapped = scores.copy()
    swapped[0] = [0.1, 0.4, 0.5]  # the first row's top class changes
    m = measure("probs", [swapped], [scores], k=2)
    assert m["top1"] == 0.5 and m["topk"] == 1.0 and m["k"] == 2
    assert not verdict(m, Tolerances(atol=1.0))[0]   # top-1 alone fails it
    image = np.linspace(0, 1, 3 * 16 * 16, dtype=np.float32).reshape(1, 3, 16, 16)
    noisy = image + np.float32(0.001) * np.sign(np.sin(np.arange(image.size))).reshape(
        image.shape).astype(np.float32)
    m = measure("image", [noisy], [image])
    assert m["top1"] is None and m["psnr"] == pytest.approx(60.0, abs=0.5)
    assert verdict(m, Tolerances(atol=1e-2))[0]
    assert not verdict(m, Tolerances(atol=1e-2, min_psnr=70))[0]
    with pytest.raises(ValueError, match="the board gave shape \\[2\\], the reference \\[3\\]"):
        measure("y", [np.zeros(2)], [np.zeros(3)])


# ------------------------------------------------------ on real boards --

def off_by_one_element(model: onnx.ModelProto, element: int, by: float) -> onnx.ModelProto:
    """The model with its output's ``element`` moved by ``by``: a wrong kernel's mark."""
    wrong = onnx.ModelProto()
    wrong.CopyFrom(model)
    graph = wrong.graph
    out = graph.output[0]
    shape = [d.dim_value for d in out.type.tensor_type.shape.dim]
    delta = np.zeros(shape, np.float32)
    delta.reshape(-1)[element] = by
    graph.initializer.append(numpy_helper.from_array(delta, "planted_delta"))
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == out.name:
                node.output[i] = "before_planted"
    graph.node.append(helper.make_node("Add", ["before_planted", "planted_delta"], [out.name],
                                       name="planted"))
    return wrong


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("check")
    right = mlp(sizes=(784, 32, 10), softmax=False)
    onnx.save(right, str(folder / "mlp.onnx"))
    onnx.save(off_by_one_element(right, 3, 0.05), str(folder / "wrong.onnx"))
    return folder


def wrong_module(models, target):
    import crosscompile

    path = models / f"wrong-{target}.so"
    if not path.exists():
        crosscompile.build(str(models / "wrong.onnx"), target=target).export_library(str(path))
    return str(path)


def tether_check(farm, *args):
    host, port = farm.tracker
    return subprocess.run([sys.executable, "-m", "remote.cli", "check", *args, "--tracker",
                           f"{host}:{port}"], env=child_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=HANG_S)


def check_right_and_wrong(farm, models, key, target, tmp_path):
    right = tether_check(farm, str(models / "mlp.onnx"), "--key", key, "--random", "2",
                         "--label", "commit=right")
    assert right.returncode == 0, right.stderr
    assert "every output within the tolerances" in right.stdout
    assert "recorded in the farm database" in right.stderr
    wrong = tether_check(farm, str(models / "mlp.onnx"), "--key", key, "--random", "2",
                         "--module", wrong_module(models, target), "--label", "commit=wrong",
                         "--json", str(tmp_path / "wrong.json"))
    assert wrong.returncode == EXIT_BEYOND_TOLERANCE, wrong.stderr
    assert "BEYOND the tolerances" in wrong.stdout and "max abs error 0.05" in wrong.stdout
    with open(tmp_path / "wrong.json") as f:
        (output,) = json.load(f)["results"][0]["outputs"]
    assert output["max_abs"] == pytest.approx(0.05, rel=1e-3) and not output["passed"]
    kept = {c["labels"]["commit"]: c["passed"] for c in farm.client().results("check", key=key)}
    assert kept == {"right": True, "wrong": False}
    host, port = farm.tracker
    shown = subprocess.run([sys.executable, "-m", "remote.cli", "history", "--checks", "--key",
                            key, "--tracker", f"{host}:{port}"], env=child_env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=HANG_S)
    assert shown.returncode == 0, shown.stderr
    assert f"mlp.onnx on key {key}: 2 check(s)" in shown.stdout
    assert "BEYOND" in shown.stdout and "commit=wrong" in shown.stdout


def test_check_on_this_hosts_board_passes_the_right_module_and_fails_a_wrong_one(models,
                                                                                 tmp_path):
    with LocalFarm(keys=["host"], env=child_env()) as farm:
        check_right_and_wrong(farm, models, "host", "host", tmp_path)
        # Input sets from a folder; a model given as a module is refused by name.
        inputs = tmp_path / "inputs"
        inputs.mkdir()
        for n in range(2):
            np.save(inputs / f"{n}.npy", np.random.default_rng(n).standard_normal(
                (1, 1, 28, 28)).astype(np.float32))
        done = tether_check(farm, str(models / "mlp.onnx"), "--key", "host", "--inputs",
                            str(inputs), "--no-record")
        assert done.returncode == 0 and "2 input set(s)" in done.stdout, done.stderr
        done = tether_check(farm, wrong_module(models, "host"), "--key", "host")
        assert done.returncode == 1 and "tether check needs the ONNX model" in done.stderr


@pytest.mark.emulated
def test_check_catches_a_wrong_module_on_an_emulated_aarch64_board(models, tmp_path):
    command = board_servers.command("native-aarch64")
    with LocalFarm(keys=["emu-arm64"], env=child_env(), server_command=command) as farm:
        check_right_and_wrong(farm, models, "emu-arm64", "rasp4b64", tmp_path)


def test_without_onnxruntime_the_reference_is_the_model_built_for_this_host(models,
                                                                           monkeypatch):
    from remote.cli.check import host_reference
    import onnxruntime

    inputs = {"input": np.random.default_rng(1).standard_normal((1, 1, 28, 28)).astype(
        np.float32)}
    expected = onnxruntime.InferenceSession(str(models / "mlp.onnx")).run(None, inputs)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if it were not installed
    what, run, cleanup = host_reference(str(models / "mlp.onnx"), None)
    try:
        assert "host build (onnxruntime not installed)" in what
        (got,) = run(inputs)
        np.testing.assert_allclose(got, expected[0], rtol=1e-4, atol=1e-5)
    finally:
        cleanup()


def test_input_sets_are_read_from_a_folder_and_its_faults_named(tmp_path):
    from crosscompile.input_sets import read_input_sets
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "b.npy", x)
    np.savez(tmp_path / "a.npz", input=x + 1)
    [(first, a), (second, b)] = read_input_sets(str(tmp_path), ["input"])
    assert (os.path.basename(first), os.path.basename(second)) == ("a.npz", "b.npy")
    np.testing.assert_array_equal(a["input"], x + 1)
    np.testing.assert_array_equal(b["input"], x)
    with pytest.raises(ValueError, match=r"a\.npz: holds \['input'\], the model's inputs are "
                                         r"\['input', 'mask'\]"):
        read_input_sets(str(tmp_path), ["input", "mask"])
    os.unlink(tmp_path / "a.npz")
    with pytest.raises(ValueError, match=r"b\.npy: an \.npy is one input, and the model has"):
        read_input_sets(str(tmp_path), ["input", "mask"])
    with pytest.raises(ValueError, match=r"holds no \.npy or \.npz samples"):
        read_input_sets(str(tmp_path / "nothing"), ["input"])
