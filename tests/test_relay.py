"""Boards that take no connections, reached through the tracker's relay, and the
board links of protocol v2: real tracker and device server processes on loopback.

A relayed session must behave exactly like a direct one: the same results, the
same errors, the same end of session, the same return of the board.
"""
import socket
import subprocess
import sys

import numpy as np
import pytest

from remote import errors
from remote.proto import pb
from remote.proto.frames import PROTOCOL_VERSION, FrameSocket
from tests import session_modules
from tests.cli_processes import wait_for_line
from tests.test_tracker import HANG_S, child_env, key_status, local_farm, wait_until
# The fixture that runs every test here with both board servers, as in test_tracker.
from tests.test_tracker import kind  # noqa: F401

pytestmark = pytest.mark.skipif(session_modules.C_COMPILER is None,
                                reason="needs a C compiler (cc) to build test modules")


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("relaymods"))
    return {kind: session_modules.build(folder, kind) for kind in ("ok", "crash")}


@pytest.fixture(scope="module")
def farm():
    with local_farm(keys=["direct"]) as farm:
        farm.add_server("relayed", extra=["--relay"])
        yield farm


def test_a_relayed_session_runs_like_a_direct_one(farm, modules):
    tracker = farm.client()
    devices = {d["key"]: d for d in tracker.summary()["devices"]}
    assert devices["relayed"]["relayed"] and not devices["direct"]["relayed"]
    assert "(relay)" in tracker.text_summary()
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    blob = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8).tobytes()
    results = {}
    for key in ("direct", "relayed"):
        with tracker.request(key, timeout=HANG_S, call_timeout=HANG_S) as sess:
            assert sess.relayed == (key == "relayed")
            # The client dials the tracker for the relayed board, the board for the other.
            assert (sess.address == f"127.0.0.1:{farm.tracker[1]}") == (key == "relayed")
            sess.upload(modules["ok"], target="addone.so")
            sess.upload(blob, target="blob.bin")
            assert sess.download("blob.bin") == blob
            assert sorted(sess.listdir()) == ["addone.so", "blob.bin"]
            mod = sess.load_module("addone.so")
            kept = sess.upload_tensor("kept", x)
            results[key] = (mod.run({"x": x})[0], mod.run({"x": kept})[0], kept.numpy())
            with pytest.raises(errors.InvalidArgument, match="not allowed"):
                sess.upload(b"x", target="../escape")
            sess.ping()
        wait_until(lambda: key_status(tracker, key)["free"] == 1, f"{key} board free again")
    for direct, relayed in zip(results["direct"], results["relayed"]):
        np.testing.assert_array_equal(direct, relayed)
    np.testing.assert_array_equal(results["relayed"][0], x + 1)


def test_a_crash_on_a_relayed_board_reads_as_on_a_direct_one(farm, modules):
    tracker = farm.client()
    messages = {}
    for key in ("direct", "relayed"):
        with tracker.request(key, timeout=HANG_S, call_timeout=HANG_S) as sess:
            sess.upload(modules["crash"], target="crash.so")
            mod = sess.load_module("crash.so")
            with pytest.raises(errors.ModuleCrashed) as caught:
                mod.run({"x": np.zeros((1, 4), np.float32)})
            messages[key] = str(caught.value).replace(sess.address, "ADDRESS")
            with pytest.raises(errors.SessionEnded):
                sess.ping()
        wait_until(lambda: key_status(tracker, key)["free"] == 1, f"{key} board free again")
    assert "SIGSEGV" in messages["relayed"]
    assert messages["relayed"] == messages["direct"]


def test_a_client_that_vanishes_through_the_relay_frees_the_board(farm):
    code = (f"import os, signal\nfrom remote import rpc\n"
            f"t = rpc.connect_tracker('127.0.0.1', {farm.tracker[1]})\n"
            f"s = t.request('relayed', timeout={HANG_S})\ns.ping()\nprint('open', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], env=farm.env, capture_output=True,
                         text=True, timeout=HANG_S)
    assert out.stdout.strip() == "open", out.stderr
    tracker = farm.client()
    wait_until(lambda: key_status(tracker, "relayed")["free"] == 1, "relayed board freed")


def test_the_tracker_relays_a_board_it_cannot_reach():
    """A board advertising an address nobody listens on gets its sessions relayed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, never listening: connections are refused
        with local_farm(keys=[], server_args=["--advertise", f"127.0.0.1:{closed}"]) as farm:
            farm.add_server("hidden")
            tracker = farm.client()
            (device,) = tracker.summary()["devices"]
            assert device["relayed"] and device["address"] == f"127.0.0.1:{closed}"
            with tracker.request("hidden", timeout=HANG_S) as sess:
                assert sess.relayed
                sess.ping()


def test_a_board_link_needs_the_farm_secret_and_the_same_protocol():
    with local_farm(keys=["k"], TETHER_FARM_SECRET="s3cret") as farm:
        def first_frame(frame):
            fs = FrameSocket(socket.create_connection(("127.0.0.1", farm.tracker[1])))
            try:
                fs.send(frame)
                return fs.recv_header()
            finally:
                fs.close()

        reply = first_frame(pb.DataFrame(op="register", version=PROTOCOL_VERSION, key="evil",
                                         address="127.0.0.1:1", farm_secret="guess"))
        assert reply.error == "AuthenticationError" and "farm secret" in reply.text
        reply = first_frame(pb.DataFrame(op="register", version=1, key="old"))
        assert reply.error == "ConnectionFailed" and "protocol v2" in reply.text
        reply = first_frame(pb.DataFrame(op="open", version=PROTOCOL_VERSION, token="forged"))
        assert reply.error == "AuthenticationError"
        tracker = farm.client()
        assert [k["key"] for k in tracker.summary()["keys"]] == ["k"]
        with tracker.request("k", timeout=HANG_S) as sess:
            sess.ping()


def test_a_protocol_v1_board_is_told_the_versions_differ():
    """A v1 board registers over gRPC; the tracker refuses it with a message that says why."""
    import grpc
    with local_farm(keys=[]) as farm:
        with grpc.insecure_channel(f"127.0.0.1:{farm.tracker[1]}") as channel:
            register = channel.unary_unary("/tether.v1.Tracker/Register",
                                           request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as caught:
                register(pb.RegisterRequest(key="old", address="127.0.0.1:1"), timeout=30)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "protocol v2" in caught.value.details() and "protocol v1" in caught.value.details()


def test_a_server_says_it_registered_only_once_it_has():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]  # bound, never listening: connections are refused
        proc = subprocess.Popen([sys.executable, "-m", "remote.server", "--host", "127.0.0.1",
                                 "--port", "0", "--tracker", f"127.0.0.1:{nobody}", "--key", "k"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=child_env())
        try:
            line = wait_for_line(proc, lambda _line: True, HANG_S, "the server's first line")
        finally:
            proc.terminate()
            proc.wait(HANG_S)
            proc.stdout.close()
            proc.stderr.close()
    assert "listening on 127.0.0.1:" in line
    assert f"not yet registered with 127.0.0.1:{nobody}: connection refused" in line, line
    assert "retrying" in line
