"""Fuzzing what a board and a tracker read from the network, with hypothesis.

Every input is generated: bytes for the frame decoder, frames for a board's
first-frame and session handlers and for the tracker's port, names for the
workspace, archives for the linker, files for the ELF checks. What must hold:
a reply or a clean refusal, never a crash, a hang or an escape from the
workspace, and the server serving the next client as before.

The examples are derandomized and few in a normal run (the "ci" profile). For
a longer search:

    HYPOTHESIS_PROFILE=long python -m pytest tests/test_fuzz.py
"""
import io
import os
import socket
import tarfile
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis (test extra)")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import minirt  # noqa: E402
from remote import errors  # noqa: E402
from remote.errors import InvalidArgument  # noqa: E402
from remote.proto import pb  # noqa: E402
from remote.proto.frames import (PREFIX, PROTOCOL_VERSION, FrameSocket, PeerClosed,  # noqa: E402
                                 frame_bytes)
from remote.server.workspace import Workspace  # noqa: E402
from tests import board_servers, session_modules, test_sessions  # noqa: E402
from tests.test_sessions import _FOLDERS, connect_when_free, start_server  # noqa: E402
from tests.test_tracker import local_farm  # noqa: E402

settings.register_profile("ci", derandomize=True, max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.register_profile("long", max_examples=3000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SESSION_OPS = ["upload", "download", "put_tensor", "get_tensor", "free_tensor", "load", "run",
               "benchmark", "profile", "list", "remove", "ping", "end", "ok", "nonsense"]
FIRST_OPS = ["open", "status", "info", "close", "register", "relay", "upload", "", "x" * 300]

names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
frames = st.builds(
    pb.DataFrame, op=st.sampled_from(SESSION_OPS), name=names,
    size=st.integers(-5, 1 << 40), version=st.sampled_from([0, 1, 2, 3]),
    timeout_s=st.floats(-1, 2, allow_nan=False), number=st.integers(-3, 3),
    repeat=st.integers(-3, 3),
    tensors=st.lists(st.builds(pb.Tensor, name=names,
                               dtype=st.sampled_from(["float32", "int64", "object", "U3", "x",
                                                      "V0", "float16", ""]),
                               shape=st.lists(st.integers(-2, 1 << 33), max_size=5)),
                     max_size=3),
    refs=st.dictionaries(names, names, max_size=2))


@pytest.fixture(scope="module", params=board_servers.KINDS[:2])
def server(request):
    """The Python and the native server, each in turn."""
    test_sessions._COMMAND[:] = board_servers.command(request.param)
    child = start_server("--max-upload-bytes", str(1 << 20))
    yield child
    child.stop()
    while _FOLDERS:
        import shutil
        shutil.rmtree(_FOLDERS.pop(), ignore_errors=True)


def exchange(port: int, payload: bytes, timeout: float = 30.0) -> bytes:
    """Send raw bytes on a new connection; return what comes back until the
    board answers a frame or closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        received = b""
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                received += data
        except OSError:
            pass
        return received


# --------------------------------------------------------- frame decoder --

@given(st.binary(max_size=300))
def test_the_frame_decoder_turns_any_bytes_into_a_frame_or_a_connection_error(data):
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        fs = FrameSocket(b)
        fs.max_header = 64 * 1024
        try:
            while True:
                header = fs.recv_header()
                assert isinstance(header, pb.DataFrame)
                fs.skip(min(fs.body_left, 1 << 16))
                if fs.body_left:
                    break
        except (PeerClosed, ConnectionError):
            pass
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------ the board --

@given(op=st.sampled_from(FIRST_OPS), frame=frames, tail=st.binary(max_size=64))
def test_any_first_frame_gets_an_answer_or_a_closed_connection(server, op, frame, tail):
    frame.op = op
    exchange(server.port, frame_bytes(frame) + tail)
    # The board answers the next client as before.
    reply = exchange(server.port, frame_bytes(pb.DataFrame(op="info", version=PROTOCOL_VERSION)))
    head_len, _ = PREFIX.unpack_from(reply)
    assert pb.DataFrame.FromString(reply[PREFIX.size:PREFIX.size + head_len]).op == "ok"


@given(sent=st.lists(st.tuples(frames, st.binary(max_size=256)), min_size=1, max_size=4))
def test_any_frames_in_a_session_get_answers_or_end_only_that_session(server, sent):
    sess = connect_when_free(server, within=60)
    try:
        fs = sess._data
        # A frame that leaves the board waiting for more (a tensor's body of a
        # dtype it takes, say) ends the example when no answer comes in 2 s;
        # only the next session must work.
        fs.set_timeout(2)
        for frame, body in sent:
            if frame.op == "ping":
                frame.op = "list"  # a ping with a body would desynchronise on purpose
            try:
                fs.send(frame, [body] if body else ())
                reply = fs.recv_header()
            except (OSError, ConnectionError):
                break  # the board ended this session; the next one must still work
            assert reply.op in ("ok", "error", "end"), reply
            if reply.op == "error":
                assert reply.error and reply.text
                break  # after a refusal the stream may be out of step: start over
            fs.skip(fs.body_left)
    finally:
        sess.close()
    with connect_when_free(server, within=60) as again:
        again.ping()


# ------------------------------------------------------------ workspace --

@given(names)
def test_workspace_names_stay_inside_the_folder(name):
    ws = Workspace()
    try:
        try:
            path = ws.path(name)
        except InvalidArgument:
            return
        real = os.path.realpath(path)
        assert real == ws.root or real.startswith(ws.root + os.sep)
    finally:
        ws.close()


members = st.lists(st.tuples(
    st.text(alphabet="ab./\\-_o", min_size=1, max_size=12),
    st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                     tarfile.FIFOTYPE]),
    st.binary(max_size=64)), max_size=5)


@pytest.mark.skipif(session_modules.C_COMPILER is None, reason="needs a C compiler")
@given(members)
def test_archive_extraction_refuses_or_links_and_never_writes_outside(entries):
    from remote.server.worker import link_objects
    outside = tempfile.mkdtemp(prefix="tether-fuzz-outside-")
    ws = Workspace()
    try:
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w:") as tar:
            for name, kind, payload in entries:
                info = tarfile.TarInfo(name)
                info.type = kind
                if kind == tarfile.REGTYPE:
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
                else:
                    info.linkname = "../../" + os.path.basename(outside)
                    tar.addfile(info)
        archive = os.path.join(ws.root, "m.tar")
        with open(archive, "wb") as f:
            f.write(data.getvalue())
        try:
            link_objects(archive, "m.tar", ws, session_modules.C_COMPILER, 1 << 20)
        except errors.ModuleLoadError:
            pass
        assert os.listdir(outside) == []
        for folder, _, files in os.walk(ws.root):
            assert os.path.realpath(folder).startswith(ws.root)
    finally:
        ws.close()
        os.rmdir(outside)


# ------------------------------------------------------------ ELF checks --

@given(st.binary(min_size=0, max_size=200), st.integers(0, 3))
def test_elf_checks_refuse_any_broken_file_with_a_load_error(body, variant):
    header = [b"", b"\x7fELF", b"\x7fELF\x02\x01\x01", b"\x7fELF\x01\x01\x01"][variant]
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(header + body)
        f.flush()
        with pytest.raises(minirt.ModuleLoadError):
            minirt.load(f.name)


# --------------------------------------------------------------- tracker --

@given(frame=frames, op=st.sampled_from(["register", "open", "status", "close", "relay",
                                         "ping", "redeem", "x"]),
       tail=st.binary(max_size=64))
def test_the_tracker_port_answers_or_closes_and_keeps_serving(tracker_farm, frame, op, tail):
    frame.op = op
    exchange(tracker_farm.tracker[1], frame_bytes(frame) + tail)
    with tracker_farm.client() as client:
        assert [k["key"] for k in client.summary()["keys"]] == ["k"]


@pytest.fixture(scope="module")
def tracker_farm():
    with local_farm(keys=["k"]) as farm:
        yield farm
