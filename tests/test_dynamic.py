"""Dynamic batch: one module compiled with bounds runs every size within them.

Each model is compiled once for the host with dynamic={"N": (1, 4)} (plans
for chunks of 4, 2 and 1 rows) and run at sizes 1, 2, 3 and 4 (3 takes two
plans), compared with onnxruntime on the same model; sizes
outside the bounds and graphs that mix batch rows are refused by name.
"""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from crosscompile.dynamic import chunks, plan_sizes
from remote.cli.localfarm import Child
from remote.cli.modelfile import parse_dynamic
from tests import board_servers
from tests.onnx_models import make_model, mlp, rand, reference
from tests.dynamic_models import attention_block, conv_net
from tests.transformer_models import GraphBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
BOUNDS = (1, 4)
SIZES = (1, 2, 3, 4)


def one_node(op_type, shape, out_shape=None, **attrs):
    node = helper.make_node(op_type, ["x"], ["y"], name=f"the_{op_type.lower()}", **attrs)
    return make_model([node], {"x": shape}, {"y": out_shape})


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dynamic")
    built = {}
    for name, model in (("conv", conv_net()), ("attention", attention_block(mlp=False))):
        lib = crosscompile.build(model, "host", dynamic={"N": BOUNDS})
        built[name] = (model, lib, minirt.load(lib.export_library(folder / f"{name}.so"), threads=1))
    return built


def test_plan_sizes_cover_every_size_greedily():
    assert plan_sizes(1, 16) == [16, 8, 4, 2, 1]
    assert plan_sizes(1, 6) == [6, 4, 2, 1]
    assert plan_sizes(3, 3) == [3, 2, 1]
    for size in range(1, 17):
        assert sum(chunks(size, plan_sizes(1, 16))) == size
    assert chunks(16, plan_sizes(1, 16)) == [16] and chunks(13, plan_sizes(1, 16)) == [8, 4, 1]


@pytest.mark.parametrize("name", ["conv", "attention"])
def test_one_module_matches_onnxruntime_at_every_size(modules, name):
    model, lib, module = modules[name]
    assert lib.metadata["dynamic"] == [{"name": "N", "min": 1, "max": 4, "axis": 0, "chunks": [4, 2, 1]}]
    assert module.dynamic == {"N": BOUNDS}
    assert module.inputs[0].shape[0] == 4  # the specs give the upper bound
    feed = module.inputs[0].name
    for size in SIZES:
        x = rand(size, *module.inputs[0].shape[1:], seed=size)
        (got,) = module.run({feed: x})
        (want,) = reference(model, {feed: x})
        assert got.shape == want.shape and got.shape[0] == size
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name} at N={size}")


def test_threads_share_every_chunk(modules):
    model, _, module = modules["conv"]
    module.set_threads(2)
    try:
        x = rand(3, 3, 12, 12, seed=9)
        (got,) = module.run([x])
        np.testing.assert_allclose(got, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    finally:
        module.set_threads(1)


def test_old_entry_runs_the_upper_bound(modules):
    """A loader that knows nothing of dynamic dims calls tether_run with
    the metadata's (upper-bound) shapes; the module computes all 4 rows."""
    model, _, module = modules["conv"]
    x = rand(4, 3, 12, 12, seed=4)
    outputs = np.empty((4, 5), np.float32)
    workspace = module._new_workspace()
    status = module._run((ctypes.c_void_p * 1)(x.ctypes.data), (ctypes.c_void_p * 1)(outputs.ctypes.data),
                         minirt.module._aligned_address(workspace))
    assert status == 0
    np.testing.assert_allclose(outputs, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("size", [0, 5])
def test_size_outside_the_bounds_names_input_dim_and_range(modules, size):
    _, _, module = modules["conv"]
    with pytest.raises(minirt.InputError, match=rf"input 'x': N \(axis 0\) is {size}, outside this "
                                                r"module's range 1\.\.4"):
        module.run({"x": np.zeros((size, 3, 12, 12), np.float32)})
    with pytest.raises(minirt.InputError, match=r"expected shape \(N 1\.\.4, 3, 12, 12\)"):
        module.run({"x": np.zeros((3, 3, 12, 11), np.float32)})


def test_module_checks_the_size_itself(modules):
    """tether_run_dims refuses a size outside the bounds with its own code,
    for callers that skip minirt's check."""
    _, _, module = modules["conv"]
    x = np.zeros((4, 3, 12, 12), np.float32)
    out = np.empty((4, 5), np.float32)
    workspace = module._new_workspace()
    status = module._run_dims((ctypes.c_void_p * 1)(x.ctypes.data), (ctypes.c_void_p * 1)(out.ctypes.data),
                              minirt.module._aligned_address(workspace), (ctypes.c_int64 * 1)(5))
    assert status == 2 and "outside its range" in minirt.module.RUN_ERRORS[status]


@pytest.mark.parametrize("model, refusal", [
    (one_node("Softmax", ("N", 4), axis=0), r"node 'the_softmax' \(Softmax\) is not separable along 'N': "
                                            r"it works along axis 0"),
    (one_node("Transpose", ("N", 4, 3), perm=[1, 0, 2]), r"'the_transpose' \(Transpose\) is not separable along "
                                                         r"'N': it moves axis 0 \(perm \[1, 0, 2\]\)"),
    (one_node("ReduceSum", ("N", 4), keepdims=1), r"'the_reducesum' \(ReduceSum\) is not separable along 'N': "
                                                  r"its tensor 'y' has shape \(1, 1\) at N 2 and \(1, 1\) at N 3"),
])
def test_a_graph_that_mixes_rows_is_refused_by_name(model, refusal):
    """Over more sizes than one plan each can cover (17 > MAX_SPECIALIZED)."""
    with pytest.raises(crosscompile.BuildError, match=refusal + r".*, or narrow N to at most 16 sizes \(compiled "
                                                               r"one plan each; 1\.\.17 is 17\)"):
        crosscompile.build(model, "host", dynamic={"N": (1, 17)})


def test_a_graph_that_mixes_rows_gets_one_plan_per_size(tmp_path):
    model = one_node("Softmax", ("N", 4), axis=0)
    lib = crosscompile.build(model, "host", dynamic={"N": (1, 3)})
    assert lib.metadata["dynamic"] == [{"name": "N", "min": 1, "max": 3, "sizes": [3, 2, 1]}]
    module = minirt.load(lib.export_library(tmp_path / "softmax.so"), threads=1)
    for size in (1, 2, 3):
        x = rand(size, 4, seed=size)
        np.testing.assert_allclose(module.run([x])[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def sequence_attention(width=8):
    """Self-attention over a sequence "T" of 2 rows: x (2, T, width) ->
    outputs "attn" (2, T, T) and "y" (2, T, width)."""
    b = GraphBuilder(13, 2)
    q = b.op("MatMul", ["x", b.weight(width, width)])
    attn = b.op("Softmax", [b.op("MatMul", [q, b.op("Transpose", ["x"], perm=[0, 2, 1])])], axis=-1)
    b.nodes.append(helper.make_node("Identity", [attn], ["attn"], name="attn_out"))
    model = b.model({"x": (2, "T", width)}, b.op("MatMul", [attn, "x"]), "sequence_attention")
    model.graph.output.insert(0, helper.make_tensor_value_info("attn", 1, None))
    return model


@pytest.fixture(scope="module")
def sequence_module(tmp_path_factory):
    """(model, CompiledModule) of sequence_attention with T from 1 to 5."""
    model = sequence_attention()
    return model, crosscompile.build(model, "host", dynamic={"T": (1, 4)})


def test_a_sequence_dimension_gets_one_plan_per_size(sequence_module, tmp_path):
    model, lib = sequence_module
    assert lib.metadata["dynamic"] == [{"name": "T", "min": 1, "max": 4, "sizes": [4, 3, 2, 1]}]
    assert [t["dynamic_axes"] for t in lib.metadata["inputs"] + lib.metadata["outputs"]] == [[1], [1, 2], [1]]
    module = minirt.load(lib.export_library(tmp_path / "seq.so"), threads=1)
    assert module.inputs[0].dynamic_axes == (1,) and module.outputs[0].shape == (2, 4, 4)
    for size in (1, 3, 4):
        x = rand(2, size, 8, seed=size)
        got, want = module.run([x]), reference(model, {"x": x})
        assert [g.shape for g in got] == [(2, size, size), (2, size, 8)]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(minirt.InputError, match=r"input 'x': T \(axis 1\) is 5, outside this module's range 1\.\.4"):
        module.run([rand(2, 5, 8)])
    with pytest.raises(minirt.InputError, match=r"input 'x': expected shape \(2, T 1\.\.4, 8\), got \(3, 4, 8\)"):
        module.run([rand(3, 4, 8)])


def test_a_wide_sequence_range_is_refused():
    with pytest.raises(crosscompile.BuildError, match=r"dynamic dimension 'T' needs one compiled plan per size "
                                                      r"here, and 1\.\.512 is 512 sizes, more than the 16"):
        crosscompile.build(sequence_attention(), "host", dynamic={"T": (1, 512)})


@pytest.mark.parametrize("dynamic, message", [
    ({"batch": (1, 4)}, r"dynamic names \['batch'\], which no model input has as a symbolic dimension; "
                        r"the inputs' dimensions are \{'x': \['N', 4\]\}"),
    ({"N": (0, 4)}, r"dynamic\['N'\] must be \(min, max\) integers with 1 <= min <= max, got \(0, 4\)"),
    ({"N": (5, 4)}, r"1 <= min <= max, got \(5, 4\)"),
])
def test_bad_dynamic_argument_is_named(dynamic, message):
    with pytest.raises(crosscompile.BuildError, match=message):
        crosscompile.build(one_node("Relu", ("N", 4)), "host", dynamic=dynamic)


def start_board_server(kind: str, tmp_path) -> Child:
    """A real board server of a board_servers kind on loopback."""
    folder = tmp_path / "server"
    (folder / "workspaces").mkdir(parents=True)
    return Child("server", [*board_servers.command(kind), "--host", "127.0.0.1", "--port", "0",
                            "--workspace-dir", str(folder / "workspaces")],
                 str(folder), ENV)


@pytest.fixture(params=board_servers.KINDS)
def board_server(request, tmp_path):
    """A real board server of each kind (Python, native C++) on loopback."""
    child = start_board_server(request.param, tmp_path)
    yield child
    child.stop()


def test_board_server_runs_every_size_and_refuses_others(board_server, modules, sequence_module, tmp_path):
    """Through a session with a real board server: one upload, runs at
    several sizes, a clear remote error outside the bounds, and the session
    goes on."""
    from remote import errors, rpc
    model, lib, _ = modules["conv"]
    path = lib.export_library(tmp_path / "dynamic_conv.so")
    with rpc.connect("127.0.0.1", board_server.port) as sess:
        sess.upload(path)
        mod = sess.load_module("dynamic_conv.so")
        assert mod.metadata["dynamic"][0]["max"] == 4
        for size in (1, 3, 4):
            x = rand(size, 3, 12, 12, seed=20 + size)
            (got,) = mod.run({"x": x})
            np.testing.assert_allclose(got, reference(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
        with pytest.raises(errors.InputError, match=r"input 'x': N \(axis 0\) is 5, outside this module's "
                                                    r"range 1\.\.4"):
            mod.run({"x": np.zeros((5, 3, 12, 12), np.float32)})
        with pytest.raises(errors.InputError, match=r"input 'x': expected shape \(N 1\.\.4, 3, 12, 12\)"):
            mod.run({"x": np.zeros((2, 3, 12, 11), np.float32)})
        (got,) = mod.run({"x": np.zeros((2, 3, 12, 12), np.float32)})
        assert got.shape == (2, 5)
        assert len(mod.benchmark(number=2, repeat=1).samples) == 1  # zeros at the upper bound
        model, lib = sequence_module
        sess.upload(lib.export_library(tmp_path / "sequence.so"))
        mod = sess.load_module("sequence.so")
        x = rand(2, 3, 8, seed=7)
        for got, want in zip(mod.run([x]), reference(model, {"x": x})):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        with pytest.raises(errors.InputError, match=r"input 'x': expected shape \(2, T 1\.\.4, 8\), got \(2, 3, 7\)"):
            mod.run([rand(2, 3, 7)])


@pytest.mark.emulated
@pytest.mark.parametrize("kind, target", [("native-aarch64", "rasp4b64"), ("native-armv7", "rasp4b")])
def test_arm_board_runs_every_size(kind, target, tmp_path):
    """The native server for a 64- and a 32-bit ARM board, under qemu: a
    small MLP's chunks (3 = 2 + 1) on the board's own code."""
    from remote import rpc
    model = mlp(sizes=(16, 8, 4), batch="N")
    path = crosscompile.build(model, target, dynamic={"N": (1, 3)}).export_library(tmp_path / "mlp.so")
    server = start_board_server(kind, tmp_path)
    try:
        with rpc.connect("127.0.0.1", server.port) as sess:
            sess.upload(path)
            mod = sess.load_module("mlp.so")
            for size in (1, 3):
                x = rand(size, 16, seed=size)
                np.testing.assert_allclose(mod.run([x])[0], reference(model, {"input": x})[0], rtol=1e-5, atol=1e-6)
    finally:
        server.stop()


def _tether(*args):
    return subprocess.run([sys.executable, "-m", "remote.cli", *args], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_compile_command_takes_dynamic_bounds(tmp_path):
    """`tether compile --dynamic N=1:4` writes one module that runs every size."""
    import onnx
    model = one_node("Softmax", ("N", 7), axis=-1)
    onnx.save(model, tmp_path / "net.onnx")
    proc = _tether("compile", str(tmp_path / "net.onnx"), "--dynamic", "N=1:4", "--no-tuning",
                   "-o", str(tmp_path / "net.so"))
    assert proc.returncode == 0, proc.stderr
    assert "dynamic N (axis 0): any size from 1 to 4 (shapes above at 4; plans for chunks of 4, 2, 1)" in proc.stdout
    module = minirt.load(tmp_path / "net.so", threads=1)
    for size in (3, 4):
        x = rand(size, 7, seed=size)
        np.testing.assert_allclose(module.run([x])[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="--dynamic 'N=4' must look like batch=1:16"):
        parse_dynamic(["N=4"])
    assert parse_dynamic(["T=2:8"]) == {"T": (2, 8)}
