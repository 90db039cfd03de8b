"""From an ONNX file to a device leased through a tracker and back, all real processes."""
import os

import numpy as np
import onnxruntime as ort
import pytest

from remote import errors, rpc
from remote.cli.localfarm import LocalFarm
from tests import board_servers
from tests.emulated_boards import ROOT


def reference(model_path, x):
    sess = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


def test_mlp_through_tracker_matches_onnxruntime(farm, mlp_module):
    model_path, so_path = mlp_module
    x = np.random.default_rng(1).standard_normal((1, 1, 28, 28)).astype(np.float32)
    tracker = rpc.connect_tracker(*farm.tracker)
    with tracker.request("host", timeout=30) as sess:
        assert sess.device_info()["machine"]
        assert sess.upload(so_path) == "mlp.so"
        assert sess.listdir() == ["mlp.so"]
        mod = sess.load_module("mlp.so")
        assert mod.input_names == ["input"] and mod.output_names == ["output"]
        (out,) = mod.run({"input": x})
        assert mod.last_run_s > 0
        (again,) = mod.run([x])
    ref = reference(model_path, x)
    assert out.shape == ref.shape == (1, 10)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(out, again)
    keys = {k["key"]: k for k in tracker.summary()["keys"]}
    assert keys["host"]["free"] == 1, "the device must be free again once the session closed"


def test_upload_bytes_in_many_chunks_and_progress(farm):
    data = bytes(range(256)) * (5 * 4096 + 7)  # ~5 MiB, not a chunk multiple
    seen = []
    with rpc.connect_tracker(*farm.tracker).request("host", timeout=30) as sess:
        sess.upload(data, target="blob.bin", progress=lambda done, total: seen.append((done, total)))
        assert sess.listdir() == ["blob.bin"]
    # A start report, then one per 1 MiB chunk (the last one short).
    n = len(data)
    assert seen == [(0, n)] + [(min(i << 20, n), n) for i in range(1, 7)]


def test_bad_inputs_get_typed_errors_and_the_server_keeps_serving(farm, mlp_module):
    model_path, so_path = mlp_module
    x = np.zeros((1, 1, 28, 28), np.float32)
    with rpc.connect_tracker(*farm.tracker).request("host", timeout=30) as sess:
        sess.upload(so_path)
        mod = sess.load_module("mlp.so")
        with pytest.raises(errors.InputError, match="'image'.*input"):
            mod.run({"image": x})
        with pytest.raises(errors.InputError, match=r"\(1, 1, 28, 28\)"):
            mod.run({"input": np.zeros((2, 1, 28, 28), np.float32)})
        with pytest.raises(errors.InputError, match="float32"):
            mod.run({"input": x.astype(np.float64)})
        with pytest.raises(errors.InvalidArgument, match="not allowed"):
            sess.upload(b"x", target="../escape.so")
        with pytest.raises(errors.InvalidArgument, match="no file 'missing.so'"):
            sess.load_module("missing.so")
        (out,) = mod.run({"input": x})  # the same session goes on
        np.testing.assert_allclose(out, reference(model_path, x), rtol=1e-5, atol=1e-7)


def test_garbage_module_is_a_clear_load_error(farm):
    with rpc.connect_tracker(*farm.tracker).request("host", timeout=30) as sess:
        sess.upload(b"this is not a shared object", target="junk.so")
        with pytest.raises(errors.ModuleLoadError, match="junk.so"):
            sess.load_module("junk.so")


def test_unknown_key_fails_at_once_listing_served_keys(farm):
    tracker = rpc.connect_tracker(*farm.tracker)
    with pytest.raises(errors.NoSuchKey, match="'rasp4b64'.*registered keys: host"):
        tracker.request("rasp4b64", timeout=30)


def test_request_times_out_while_device_is_held(farm):
    tracker = rpc.connect_tracker(*farm.tracker)
    with tracker.request("host", timeout=30):
        with pytest.raises(errors.RequestTimeout, match="'host'"):
            tracker.request("host", timeout=0.5)
        status = {k["key"]: k for k in tracker.summary()["keys"]}["host"]
        assert status["free"] == 0
    assert {k["key"]: k for k in tracker.summary()["keys"]}["host"]["free"] == 1


def test_server_behind_tracker_refuses_direct_sessions(farm):
    port = farm.servers[0].port
    with pytest.raises(errors.AuthenticationError, match="through the tracker"):
        rpc.connect("127.0.0.1", port)


def test_connection_refused_is_typed():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(errors.ConnectionFailed, match=f"127.0.0.1:{port}"):
        rpc.connect("127.0.0.1", port, timeout=3)


@pytest.mark.parametrize("kind", board_servers.KINDS)
def test_scalar_and_empty_tensors_keep_their_shapes_both_ways(kind, tmp_path):
    """A 0-d input and output stay 0-d, and a tensor with a zero dimension
    goes and comes back empty, on either board server."""
    from onnx import TensorProto, helper

    import crosscompile
    graph = helper.make_graph(
        [helper.make_node("Mul", ["s", "two"], ["y"]), helper.make_node("Add", ["e", "one"], ["z"])],
        "scalars",
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("e", TensorProto.FLOAT, [0, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [0, 3])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
         helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    so_path = crosscompile.build(model, target="host").export_library(tmp_path / "scalars.so")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with LocalFarm(keys=["host"], env=env, server_command=board_servers.command(kind)) as farm, \
            rpc.connect_tracker(*farm.tracker).request("host", timeout=30) as sess:
        sess.upload(str(so_path))
        mod = sess.load_module("scalars.so")
        for _ in range(2):  # the session goes on after each run
            y, z = mod.run({"s": np.array(1.5, np.float32), "e": np.zeros((0, 3), np.float32)})
            assert y.shape == () and float(y) == 3.0
            assert z.shape == (0, 3)


@pytest.mark.parametrize("kind", board_servers.KINDS)
def test_float16_and_bfloat16_tensors_go_and_come_back_on_either_server(kind, tmp_path):
    """A module with float16 and bfloat16 inputs and outputs runs on either
    board server, and its results are the 16-bit values onnx specifies."""
    import ml_dtypes  # onnx's own dependency: numpy's bfloat16
    from onnx import TensorProto, helper

    import crosscompile
    graph = helper.make_graph(
        [helper.make_node("Mul", ["h", "h"], ["hh"]), helper.make_node("Add", ["b", "b"], ["bb"])],
        "sixteen_bits",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2, 3]),
         helper.make_tensor_value_info("b", TensorProto.BFLOAT16, [4])],
        [helper.make_tensor_value_info("hh", TensorProto.FLOAT16, [2, 3]),
         helper.make_tensor_value_info("bb", TensorProto.BFLOAT16, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    so_path = crosscompile.build(model, target="host").export_library(tmp_path / "sixteen.so")
    h = np.array([[0.1, -2.5, 3.0], [1e-3, 250.0, -0.7]], np.float16)
    b = np.array([1.1, -3.3, 7e10, 0.0], ml_dtypes.bfloat16)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with LocalFarm(keys=["host"], env=env, server_command=board_servers.command(kind)) as farm, \
            rpc.connect_tracker(*farm.tracker).request("host", timeout=30) as sess:
        sess.upload(str(so_path))
        hh, bb = sess.load_module("sixteen.so").run({"h": h, "b": b})
    assert hh.dtype == np.float16 and bb.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(hh, h * h)  # numpy rounds each product to float16 too
    np.testing.assert_array_equal(bb.astype(np.float32), (b + b).astype(np.float32))


@pytest.mark.parametrize("kind", board_servers.KINDS)
def test_float8_and_int4_tensors_go_and_come_back_on_either_server(kind, tmp_path):
    """A module with float8 and int4 inputs and outputs (one byte each)
    runs on either board server, which has no ml_dtypes: the client sends
    ml_dtypes' arrays and gets them back as such, with onnx's values."""
    import ml_dtypes
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    import crosscompile
    graph = helper.make_graph(
        [helper.make_node("Cast", ["f"], ["f_e5m2"], to=TensorProto.FLOAT8E5M2),
         helper.make_node("Cast", ["f"], ["f_float"], to=TensorProto.FLOAT),
         helper.make_node("Transpose", ["q"], ["q_t"], perm=[1, 0])],
        "low_bit",
        [helper.make_tensor_value_info("f", TensorProto.FLOAT8E4M3FN, [5]),
         helper.make_tensor_value_info("q", TensorProto.INT4, [2, 3])],
        [helper.make_tensor_value_info("f_e5m2", TensorProto.FLOAT8E5M2, [5]),
         helper.make_tensor_value_info("f_float", TensorProto.FLOAT, [5]),
         helper.make_tensor_value_info("q_t", TensorProto.INT4, [3, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    so_path = crosscompile.build(model, target="host").export_library(tmp_path / "low_bit.so")
    feeds = {"f": np.array([0.1, -448.0, 3.5, np.nan, 2.0 ** -9], ml_dtypes.float8_e4m3fn),
             "q": np.array([[-8, 7, 0], [1, -1, 5]], ml_dtypes.int4)}
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with LocalFarm(keys=["host"], env=env, server_command=board_servers.command(kind)) as farm, \
            rpc.connect_tracker(*farm.tracker).request("host", timeout=30) as sess:
        sess.upload(str(so_path))
        got = sess.load_module("low_bit.so").run(feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    assert [g.dtype for g in got] == [w.dtype for w in want] == [
        np.dtype(ml_dtypes.float8_e5m2), np.float32, np.dtype(ml_dtypes.int4)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.tobytes() == w.tobytes(), (g, w)
