"""minirt: loading and running real compiled modules on this machine."""
import platform
import threading

import numpy as np
import pytest

import crosscompile
import crosscompile.codegen
import minirt
from minirt import InputError, ModuleLoadError
from tests.onnx_models import matmul_mlp, mlp, reference, sample_input


@pytest.fixture(scope="module")
def model():
    return mlp(batch=2)


@pytest.fixture(scope="module")
def module(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("minirt") / "mlp.so"
    return minirt.load(crosscompile.build(model).export_library(path))


def x_of(model, seed=1):
    return sample_input(model, seed)["input"]


def test_dict_and_list_inputs_match_onnxruntime(model, module):
    x = x_of(model)
    want = reference(model, {"input": x})[0]
    for inputs in ({"input": x}, [x], (x,)):
        (got,) = module.run(inputs)
        assert got.dtype == np.float32 and got.shape == (2, 10)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_non_contiguous_input_is_accepted(model, module):
    x = np.asfortranarray(x_of(model))
    np.testing.assert_allclose(module.run([x])[0], reference(model, {"input": np.ascontiguousarray(x)})[0],
                               rtol=1e-5, atol=1e-6)


def test_specs_and_metadata(module):
    assert module.inputs == [minirt.TensorSpec("input", (2, 1, 28, 28), "float32")]
    assert module.outputs == [minirt.TensorSpec("output", (2, 10), "float32")]
    assert module.metadata["abi_version"] == 1
    assert module.metadata["workspace_bytes"] % 64 == 0
    assert module.metadata["target"]["name"] == "host"


def test_multi_layer_matmul_model(tmp_path):
    model = matmul_mlp()
    m = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so"))
    feeds = sample_input(model)
    np.testing.assert_allclose(m.run(feeds)[0], reference(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_unknown_and_missing_names(model, module):
    x = x_of(model)
    with pytest.raises(InputError, match=r"unknown input name\(s\) \['inptu'\].*\['input'\]"):
        module.run({"inptu": x})
    with pytest.raises(InputError, match=r"missing input\(s\) \['input'\]"):
        module.run({})
    with pytest.raises(InputError, match="got 2 input"):
        module.run([x, x])
    with pytest.raises(InputError, match="dict"):
        module.run(x)


def test_wrong_shape_and_dtype(model, module):
    with pytest.raises(InputError, match=r"'input': expected shape \(2, 1, 28, 28\), got \(1, 784\)"):
        module.run({"input": np.zeros((1, 784), np.float32)})
    with pytest.raises(InputError, match="'input': expected dtype float32, got float64"):
        module.run({"input": x_of(model).astype(np.float64)})
    assert issubclass(InputError, ValueError)


def test_wrong_architecture_names_both_machines(tmp_path):
    if platform.machine() in ("aarch64", "arm64"):
        preset, machine = "rasp4b", "arm"
    else:
        preset, machine = "rasp4b64", "aarch64"
    path = crosscompile.build(mlp(sizes=(17, 3)), target=preset).export_library(tmp_path / "m.so")
    with pytest.raises(ModuleLoadError) as info:
        minirt.load(path)
    message = str(info.value)
    assert f"{machine} module" in message and platform.machine() in message and "m.so" in message


def test_not_an_elf_file(tmp_path):
    path = tmp_path / "net.so"
    path.write_text("hello")
    with pytest.raises(ModuleLoadError, match="net.so is not an ELF shared object"):
        minirt.load(path)
    with pytest.raises(ModuleLoadError, match="cannot read"):
        minirt.load(tmp_path / "missing.so")


def test_abi_version_mismatch(tmp_path, monkeypatch):
    monkeypatch.setattr(crosscompile.codegen, "ABI_VERSION", 2)
    path = crosscompile.build(mlp(sizes=(17, 3))).export_library(tmp_path / "future.so")
    with pytest.raises(ModuleLoadError, match="future.so uses module ABI version 2.*supports version 1"):
        minirt.load(path)


def test_two_threads_run_one_module_concurrently(model, module):
    inputs = [x_of(model, seed) for seed in (10, 11)]
    wants = [reference(model, {"input": x})[0] for x in inputs]
    failures = []
    start = threading.Barrier(2)

    def work(x, want):
        start.wait()
        for _ in range(200):
            got = module.run([x])[0]
            if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                failures.append(got)

    threads = [threading.Thread(target=work, args=pair) for pair in zip(inputs, wants)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
