import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def farm():
    """A real tracker and one real device server (key "host") as child processes."""
    from remote.cli.localfarm import LocalFarm
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with LocalFarm(keys=["host"], env=env) as running:
        yield running


@pytest.fixture(scope="session")
def mlp_module(tmp_path_factory):
    """(onnx model path, compiled host .so path) of the test MLP."""
    import onnx

    import crosscompile
    from tests.onnx_models import mlp
    folder = tmp_path_factory.mktemp("mlp")
    model_path = str(folder / "mlp.onnx")
    onnx.save(mlp(), model_path)
    so_path = str(folder / "mlp.so")
    crosscompile.build(model_path, target="host").export_library(so_path)
    return model_path, so_path


def pytest_addoption(parser):
    parser.addoption("--full-zoo", action="store_true",
                     help="also run every model of the emulated model zoo (tests marked full_zoo; "
                          "about 10 more minutes on 2 cores)")


def pytest_collection_modifyitems(config, items):
    """Leave the full emulated model zoo out unless --full-zoo is given.

    It is reported as deselected, not skipped: the default run keeps one
    representative model per emulated architecture.
    """
    if config.getoption("--full-zoo"):
        return
    kept, left = [], []
    for item in items:
        (left if item.get_closest_marker("full_zoo") else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
