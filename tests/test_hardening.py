"""Attacks on a board and a tracker, performed against real processes on loopback,
and what must come of each: a clear refusal, bounded memory and time, and every
other session going on (docs/security.md)."""
import io
import os
import shutil
import socket
import tarfile
import threading

import numpy as np
import pytest

from remote import errors
from remote.proto import pb
from remote.proto.frames import PROTOCOL_VERSION, FrameSocket
from remote.server.isolation import LAYERS
from tests import board_servers, session_modules, test_sessions
from remote.cli.localfarm import Child, ProcessStartError, python_argv
from tests.test_sessions import ENV, _FOLDERS, connect, connect_when_free, start_server
from tests.cli_processes import command_line
from tests.test_tracker import HANG_S, key_status, local_farm, wait_until

pytestmark = pytest.mark.skipif(session_modules.C_COMPILER is None,
                                reason="needs a C compiler (cc) to build test modules")
LIMIT = 4 << 20


@pytest.fixture(scope="module", autouse=True, params=board_servers.KINDS[:2])
def kind(request):
    """Every board-side test runs against the Python and the native server."""
    test_sessions._COMMAND[:] = board_servers.command(request.param)
    yield request.param
    while _FOLDERS:
        shutil.rmtree(_FOLDERS.pop(), ignore_errors=True)


@pytest.fixture(scope="module")
def server(kind):
    child = start_server("--max-upload-bytes", str(LIMIT))
    yield child
    child.stop()


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hardmods"))
    return {kind: session_modules.build(folder, kind) for kind in ("ok", "chatty")}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def closed_by_peer(sock: socket.socket) -> bool:
    """Waits (up to HANG_S) for the other end to close ``sock``."""
    sock.settimeout(HANG_S)
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
    return True


# ------------------------------------------------------- board connections --

def test_idle_and_trickling_connections_do_not_hold_the_board(server):
    # Sixteen connections that never send a first frame, and one that sends a
    # byte at a time: sessions, status and close go on meanwhile.
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(16)]
    trickle = socket.create_connection(("127.0.0.1", server.port))
    stop = threading.Event()

    def drip():
        try:
            while not stop.wait(0.5):
                trickle.sendall(b"\x01")
        except OSError:
            pass

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        with connect(server) as sess:
            sess.upload(b"fine", target="a.txt")
            assert sess.listdir() == ["a.txt"]
        # Each gets one deadline for its whole first frame, and is closed at it.
        assert closed_by_peer(trickle) and closed_by_peer(idle[0])
    finally:
        stop.set()
        for s in idle + [trickle]:
            s.close()
    with connect_when_free(server) as sess:
        sess.ping()


def test_an_upload_larger_than_announced_is_refused_and_nothing_is_written(server):
    sess = connect(server)
    fs = sess._data
    fs.send_prefix(pb.DataFrame(op="upload", name="big.bin", size=16), 64 << 20)
    try:
        fs.send_raw(b"\0" * (1 << 20))
    except OSError:
        pass  # the board may already have hung up
    reply = fs.recv_header()
    assert reply.error == "InvalidArgument" and "announces 16 bytes" in reply.text
    # The session ended with the connection; its workspace went with it.
    with pytest.raises(errors.TetherError):
        sess.ping()
    sess.close()
    assert not any(n.startswith("big.bin") for _, _, files in os.walk(server.workspaces)
                   for n in files)
    with connect_when_free(server) as again:
        again.ping()


@pytest.mark.parametrize("dtype", ["object", "U8", "V8", "M8[s]"])
def test_tensors_of_non_numeric_dtypes_are_refused_and_the_session_goes_on(server, modules,
                                                                          dtype):
    with connect_when_free(server) as sess:
        fs = sess._data
        fs.send_prefix(pb.DataFrame(op="put_tensor", name="evil", tensors=[
            pb.Tensor(name="evil", dtype=dtype, shape=[2])]), 16)
        fs.send_raw(b"\x41" * 16)
        fs.send(pb.DataFrame(op="end", checksum="x"))
        reply = fs.recv_header()
        assert reply.error == "InvalidArgument" and "numbers only" in reply.text
        sess.upload(modules["ok"], target="addone.so")
        mod = sess.load_module("addone.so")
        fs.send(pb.DataFrame(op="run", name=mod.module_id, timeout_s=30, tensors=[
            pb.Tensor(name="x", dtype=dtype, shape=[1, 4])]), [b"\x41" * 32])
        reply = fs.recv_header()
        assert reply.error in ("InvalidArgument", "InputError") and "numbers only" in reply.text
        fs.skip(fs.body_left)
        np.testing.assert_array_equal(mod.run({"x": np.ones((1, 4), np.float32)})[0], 2.0)


def test_what_a_module_prints_is_kept_as_a_bounded_tail(server, modules):
    with connect_when_free(server, session_timeout=HANG_S) as sess:
        sess.upload(modules["chatty"], target="chatty.so")
        mod = sess.load_module("chatty.so")
        before = rss_bytes(server.proc.pid)
        for _ in range(2):  # 128 MiB of output in all
            np.testing.assert_array_equal(mod.run({"x": np.zeros((1, 4), np.float32)})[0], 1.0)
        grown = rss_bytes(server.proc.pid) - before
    assert grown < 16 << 20, f"the server grew {grown >> 20} MiB for 128 MiB of module output"


def _tar(entries, compress=""):
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:" + compress) as tar:
        for name, payload in entries:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return data.getvalue()


def test_module_archives_are_uncompressed_bounded_and_unpacked_inside_the_workspace(tmp_path):
    # The board's system temp folder is one of its own: nothing may appear there.
    systemp = tmp_path / "systemp"
    systemp.mkdir()
    child = Child("archive-server", python_argv(
        "remote.server", "--host", "127.0.0.1", "--port", "0", "--max-upload-bytes", str(LIMIT),
        "--workspace-dir", str(tmp_path)), str(tmp_path), {**ENV, "TMPDIR": str(systemp)})
    try:
        _archive_attacks(child)
    finally:
        child.stop()
    assert os.listdir(systemp) == []


def _archive_attacks(server):
    with connect_when_free(server) as sess:
        # 1.5 MiB of gzip that would unpack to far more than the 4 MiB limit.
        bomb = _tar([("a.o", b"\0" * (64 << 20))], compress="gz")
        assert len(bomb) < LIMIT
        sess.upload(bomb, target="bomb.tar")
        with pytest.raises(errors.ModuleLoadError, match="compressed archive"):
            sess.load_module("bomb.tar")
        big = _tar([("a.o", b"\0" * (3 << 20)), ("b.o", b"\0" * (3 << 20))])
        with pytest.raises(errors.InvalidArgument, match="at most"):
            sess.upload(big, target="big.tar")  # the archive alone is over the limit
        parts = _tar([(f"p{i}.o", b"\0" * (1 << 20)) for i in range(3)])
        sess.upload(parts, target="parts.tar")
        with pytest.raises(errors.ModuleLoadError, match="ELF|link"):
            sess.load_module("parts.tar")  # unpacked (3 MiB, inside the limit), then refused
        sess.ping()


def test_workspace_names_and_listing_hold_against_odd_entries(server):
    with connect_when_free(server) as sess:
        deep = "/".join(["d"] * 2000) + "/f"
        with pytest.raises(errors.InvalidArgument, match="too long"):
            sess.upload(b"x", target=deep)
        sess.upload(b"mine", target="x.part")
        sess.upload(b"data", target="x")
        assert sorted(sess.listdir()) == ["x", "x.part"]  # uploading x left x.part alone
        assert sess.download("x.part") == b"mine"
        (workspace,) = [os.path.join(server.workspaces, n) for n in os.listdir(server.workspaces)]
        os.symlink("/etc/passwd", os.path.join(workspace, "out"))
        assert sorted(sess.listdir()) == ["x", "x.part"]  # the symlink out is left out
        with pytest.raises(errors.InvalidArgument) as caught:
            sess.download("out")
        assert server.workspaces not in str(caught.value)
        with pytest.raises(errors.TetherError) as failed:
            sess.load_module("x")
        assert workspace not in str(failed.value)


def test_a_truncated_module_is_a_load_error_not_a_crash(server, modules):
    with connect_when_free(server) as sess:
        whole = open(modules["ok"], "rb").read()
        sess.upload(whole[:len(whole) // 2], target="cut.so")
        with pytest.raises(errors.ModuleLoadError, match="truncated"):
            sess.load_module("cut.so")
        sess.upload(whole, target="whole.so")
        np.testing.assert_array_equal(
            sess.load_module("whole.so").run({"x": np.zeros((1, 4), np.float32)})[0], 1.0)


# -------------------------------------------------------------- tracker --

def test_client_names_cannot_write_to_the_terminal_of_who_reads_the_status():
    with local_farm(keys=["k"]) as farm:
        tracker = farm.client()
        with tracker.request("k", timeout=HANG_S, client="evil\x1b[2J\x1b]0;owned\x07"):
            (device,) = tracker.summary()["devices"]
            text = tracker.text_summary()
        assert "\x1b" not in device["holder"] and "\x1b" not in text
        assert "evil\\x1b[2J" in device["holder"]


def test_a_board_id_cannot_be_taken_over_by_another_registration():
    with local_farm(keys=["k"], TETHER_FARM_SECRET="s3cret") as farm:
        tracker = farm.client()
        (device,) = tracker.summary()["devices"]
        fs = FrameSocket(socket.create_connection(("127.0.0.1", farm.tracker[1])))
        fs.send(pb.DataFrame(op="register", version=PROTOCOL_VERSION, key="k",
                             address="127.0.0.1:1", device_id=device["device_id"],
                             farm_secret="s3cret"))
        reply = fs.recv_header()
        fs.close()
        assert reply.error == "AuthenticationError" and "belongs to another board" in reply.text
        (still,) = tracker.summary()["devices"]
        assert still["address"] == device["address"]
        with tracker.request("k", timeout=HANG_S) as sess:
            assert sess.address == device["address"]


def _park_and_refuse(names, one_more: str, refusal: str) -> None:
    """Park a request for the only board under each of ``names`` while it is
    held, then ask once more under ``one_more``: refused with ``refusal``,
    and the board still registered and served once they are gone."""
    with local_farm(keys=["k"]) as farm, farm.client() as tracker:
        holder = tracker.request("k", timeout=HANG_S, client="holder")
        futures = []
        try:
            for name in names:
                request = pb.DeviceRequest(key="k", timeout_s=HANG_S, client=name)
                futures.append(tracker._stub.RequestDevice.future(request, timeout=HANG_S))
            wait_until(lambda: key_status(tracker, "k")["pending"] == len(names),
                       "every parked request queued")
            with pytest.raises(errors.DeviceBusy, match=refusal):
                tracker.lease("k", timeout=HANG_S, client=one_more)
            assert key_status(tracker, "k")["total"] == 1
        finally:
            for f in futures:
                f.cancel()
            holder.close()
        wait_until(lambda: key_status(tracker, "k")["pending"] == 0, "the parked requests gone")
        with tracker.request("k", timeout=HANG_S, client="someone else") as sess:
            sess.ping()


def test_parked_requests_are_capped_and_boards_stay_registered(kind):
    from remote.tracker.service import MAX_WAITING_PER_CLIENT
    tracker_only(kind)
    _park_and_refuse(["parker"] * MAX_WAITING_PER_CLIENT, "parker", "parker already has")


def test_parked_requests_are_capped_per_address_whatever_names_they_give(kind):
    """Without --require-tokens a client names itself: one caller parking
    requests under a new name each is held by the cap on its address."""
    from remote.tracker.service import MAX_WAITING_PER_SOURCE
    tracker_only(kind)
    _park_and_refuse([f"parker{i}" for i in range(MAX_WAITING_PER_SOURCE)], "yet another name",
                     "127.0.0.1 already has .* whatever names")


def test_grants_left_unused_again_and_again_are_refused(kind):
    """A caller that takes board after board and never opens a session holds
    each for the unused-lease timeout: after a few it is refused, and the
    board goes back to the pool each time."""
    from remote.tracker.service import MAX_UNUSED_GRANTS
    tracker_only(kind)
    with local_farm(keys=["k"], tracker_args=["--unused-lease-timeout", "0.3"]) as farm:
        tracker = farm.client()
        for i in range(MAX_UNUSED_GRANTS):
            tracker.lease("k", timeout=HANG_S, client=f"grabber{i}")
            wait_until(lambda: key_status(tracker, "k")["free"] == 1, "the unused grant's end")
        with pytest.raises(errors.DeviceBusy, match=f"{MAX_UNUSED_GRANTS} boards granted to "
                           "127.0.0.1 .* went unused"):
            tracker.lease("k", timeout=HANG_S, client="yet another name")
        assert key_status(tracker, "k") == {"key": "k", "total": 1, "free": 1, "pending": 0}


def test_an_oversized_message_is_refused_before_it_is_held():
    import grpc
    with local_farm(keys=["k"], TETHER_FARM_SECRET="s3cret") as farm:
        before = rss_bytes(farm.tracker_proc.proc.pid)
        with grpc.insecure_channel(f"127.0.0.1:{farm.tracker[1]}", options=[
                ("grpc.max_send_message_length", 256 << 20)]) as channel:
            call = channel.unary_unary("/tether.v1.Tracker/RequestDevice",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=lambda b: b)
            huge = pb.DeviceRequest(key="k", client="x" * (200 << 20), farm_secret="wrong")
            with pytest.raises(grpc.RpcError) as caught:
                call(huge, timeout=HANG_S)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        grown = rss_bytes(farm.tracker_proc.proc.pid) - before
        assert grown < 100 << 20, f"the tracker grew {grown >> 20} MiB for a refused message"
        with farm.client().request("k", timeout=HANG_S) as sess:
            sess.ping()


def test_unfinished_first_frames_hold_a_bounded_budget_of_the_trackers_memory(kind):
    """Hundreds of connections each sending 200 KiB of a first frame and no
    more: what they hold together is capped, those past it are dropped, and
    the tracker goes on serving."""
    from remote.proto.frames import PREFIX
    from remote.tracker.boards import MAX_OPENING_BYTES
    tracker_only(kind)
    part = PREFIX.pack(200 << 10, 0) + b"\0" * ((200 << 10) - 1)  # one byte short
    count = 2 * MAX_OPENING_BYTES // len(part)
    with local_farm(keys=["k"]) as farm, farm.client() as tracker:
        pid = farm.tracker_proc.proc.pid
        before = rss_bytes(pid)
        held = []
        try:
            for _ in range(count):
                sock = socket.create_connection(("127.0.0.1", farm.tracker[1]))
                sock.sendall(part)
                held.append(sock)
            # Past the budget (half of them) the tracker drops them.
            wait_until(lambda: sum(closed_by_peer_now(sock) for sock in held) >= count // 3,
                       f"the tracker dropping a third of {count} unfinished frames")
            grown = rss_bytes(pid) - before
            assert grown < MAX_OPENING_BYTES + (24 << 20), \
                f"the tracker grew {grown >> 20} MiB for {count} unfinished frames of 200 KiB"
            with tracker.request("k", timeout=HANG_S) as sess:
                sess.ping()
        finally:
            for sock in held:
                sock.close()


def closed_by_peer_now(sock: socket.socket) -> bool:
    """Whether the other end has closed (or reset) ``sock`` already."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_user_tokens_name_the_holder_and_are_required_when_the_tracker_says_so(tmp_path):
    import subprocess
    import sys
    tokens = tmp_path / "tokens.json"

    def token(*args):
        done = subprocess.run([sys.executable, "-m", "remote.cli", "token", *args,
                               "--tokens", str(tokens)], capture_output=True, text=True,
                              timeout=HANG_S)
        assert done.returncode == 0, done.stderr
        return done.stdout

    alice = token("add", "alice").splitlines()[-1]
    bob = token("add", "bob").splitlines()[-1]
    assert token("list").split() == ["alice", "bob"]
    assert alice not in tokens.read_text()  # only digests are kept
    with local_farm(keys=["k"], tracker_args=["--require-tokens", "--tokens", str(tokens)],
                    TETHER_TOKEN=alice) as farm:
        from remote.client.tracker import TrackerClient
        anonymous = TrackerClient(*farm.tracker, token="")
        with pytest.raises(errors.AuthenticationError, match="requires a user token"):
            anonymous.lease("k", timeout=HANG_S)
        with pytest.raises(errors.AuthenticationError, match="not known"):
            TrackerClient(*farm.tracker, token="tt_guess").summary()
        with TrackerClient(*farm.tracker, token=alice) as client:
            with client.request("k", timeout=HANG_S, client="someone-else@pretending") as sess:
                sess.ping()
                (device,) = client.summary()["devices"]
                assert device["holder"] == "alice"
        token("remove", "bob")
        with pytest.raises(errors.AuthenticationError):
            TrackerClient(*farm.tracker, token=bob).summary()


def thread_count(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads")


def _tracker_port_call(port: int, frame) -> pb.DataFrame:
    fs = FrameSocket(socket.create_connection(("127.0.0.1", port), timeout=HANG_S))
    try:
        frame.version = PROTOCOL_VERSION
        fs.send(frame)
        return fs.recv_header()
    finally:
        fs.close()


def test_the_relay_carries_status_and_close_only_for_the_lease_holder():
    from remote.tracker.boards import MAX_OPENING_PER_SOURCE
    with local_farm(keys=[]) as farm:
        farm.add_server("r", extra=["--relay"])
        tracker = farm.client()
        (device,) = tracker.summary()["devices"]
        port, pid = farm.tracker[1], farm.tracker_proc.proc.pid
        before = thread_count(pid)
        # Knowing a device id (Summary shows it) is not enough, nor is a made-up token.
        for token in [""] * 150 + ["guess"] * 50:
            reply = _tracker_port_call(port, pb.DataFrame(op="status", name="x", token=token,
                                                   device_id=device["device_id"]))
            assert reply.error == "AuthenticationError" and "token of the lease" in reply.text
        assert thread_count(pid) <= before + 4, "the refused relays left threads behind"
        with tracker.request("r", timeout=HANG_S) as sess:
            sess.ping()
            token = sess._lease_token
            state = _tracker_port_call(port, pb.DataFrame(op="status", name=sess.session_id,
                                                   token=token, device_id=device["device_id"]))
            assert state.open
        # Connections that never say who they are: at most so many from one address.
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = MAX_OPENING_PER_SOURCE + 200
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"opening {want} connections needs RLIMIT_NOFILE >= {want}; it is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
        idle = []
        try:
            for _ in range(want):
                idle.append(socket.create_connection(("127.0.0.1", port)))
            # Those past the cap are dropped at once.
            idle[-1].settimeout(HANG_S)
            assert idle[-1].recv(1) == b""
            assert thread_count(pid) <= before + 4
        finally:
            for s in idle:
                s.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        with tracker.request("r", timeout=HANG_S) as sess:
            sess.ping()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its parent's wait is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def on_the_host(pids, session_pid: int):
    """The host's pids of processes a module in the session served by
    ``session_pid`` knows as ``pids``: in a PID namespace of its own, a module
    sees its namespace's numbers."""
    namespace = os.readlink(f"/proc/{session_pid}/ns/pid")
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                continue
            with open(f"/proc/{entry}/status") as f:
                line = next(line for line in f if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        inner = int(line.split()[-1])
        if inner in pids:
            found[inner] = int(entry)
    assert sorted(found) == sorted(pids), f"processes {pids} of the session not found: {found}"
    return list(found.values())


def _leave_processes(sess, forker):
    """Run the forker module: the host pids of the two processes it left running."""
    from tests.test_sessions import serving_pid
    sess.upload(forker, target="forker.so")
    y = sess.load_module("forker.so").run({"x": np.zeros((1, 4), np.float32)})[0]
    pids = on_the_host([int(p) for p in y[0, :2]], serving_pid(sess))
    assert all(p > 0 for p in pids) and all(alive(p) for p in pids), pids
    return pids


def test_processes_a_module_starts_end_with_its_session(server, tmp_path):
    forker = session_modules.build(str(tmp_path), "forker")
    with connect_when_free(server) as sess:
        pids = _leave_processes(sess, forker)
    wait_until(lambda: not any(alive(p) for p in pids),
               f"the end of processes {pids} a closed session's module left")
    with connect_when_free(server) as sess:
        sess.ping()


def _layers(sess):
    return sess.device_info()["attributes"]["isolation"].split(",")


def test_processes_a_module_starts_end_with_a_server_killed_by_sigkill(kind, tmp_path):
    """The server and (Python) its zygote killed at once: nobody is left to end
    the session's processes but the kernel, through the PID namespace."""
    import signal
    forker = session_modules.build(str(tmp_path), "forker")
    child = start_server()
    try:
        sess = connect_when_free(child)
        if "pids" not in _layers(sess):
            sess.close()
            pytest.skip("this kernel gives the board server no PID namespace: "
                        + child.log_text()[-400:])
        pids = _leave_processes(sess, forker)
        os.killpg(child.proc.pid, signal.SIGKILL)
        wait_until(lambda: not any(alive(p) for p in pids),
                   f"the end of processes {pids} left by a module when its server was killed")
        sess._data.sock.close()
    finally:
        child.stop()


def test_a_layer_the_board_cannot_give_is_named_at_start_and_sessions_go_on(kind, tmp_path):
    """Root of a user namespace of its own (as in a container) cannot take
    the ids of --session-uids: the server says so, shows no "user" layer,
    and its sessions run with the others."""
    import signal
    import subprocess
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-U", "-r", "true"]).returncode != 0:
        pytest.skip("no unshare program, or this kernel refuses a user namespace here")
    command = list(test_sessions._COMMAND)
    test_sessions._COMMAND[:] = [unshare, "-U", "-r", "--fork", *command]
    try:
        child = start_server()
    finally:
        test_sessions._COMMAND[:] = command
    try:
        assert "sandbox: no per-session user: this root cannot take the ids" in child.log_text()
        with connect_when_free(child) as sess:
            assert "user" not in _layers(sess)
            sess.upload(session_modules.build(str(tmp_path), "ok"), target="ok.so")
            y = sess.load_module("ok.so").run({"x": np.ones((1, 4), np.float32)})[0]
            np.testing.assert_array_equal(y, 2.0)
    finally:
        # unshare passes no signal on: the server (in its process group) hears it directly.
        os.killpg(child.proc.pid, signal.SIGTERM)
        child.stop()


def _file_access_from_a_module(sess, tmp_path, kind: str, path: str) -> int:
    """Run a module that reads ('reader') or writes ('writer') ``path``: the
    bytes it read or wrote, or minus the error number."""
    option = {"reader": "read_path", "writer": "write_path"}[kind]
    module = session_modules.build(str(tmp_path), kind, **{option: path})
    name = os.path.basename(module)
    sess.upload(module, target=name)
    return int(sess.load_module(name).run({"x": np.zeros((1, 4), np.float32)})[0][0, 0])


def _read_from_a_module(sess, tmp_path, path: str) -> int:
    return _file_access_from_a_module(sess, tmp_path, "reader", path)


def test_a_module_cannot_read_another_sessions_files_the_secret_or_shadow(kind, tmp_path):
    secret = tmp_path / "farm-secret"
    secret.write_text("farm-secret-not-for-modules\n")
    secret.chmod(0o600)
    child = start_server("--max-sessions", "2", "--farm-secret-file", str(secret))
    try:
        with connect_when_free(child) as first, connect_when_free(child) as second:
            layers = _layers(second)
            if "files" not in layers and "user" not in layers:
                pytest.skip("this board server has neither a mount namespace nor a user per "
                            "session here: " + child.log_text()[-400:])
            first.upload(b"the first session's own data", target="private.txt")
            (folder,) = [f for f in os.listdir(child.workspaces)
                         if os.path.exists(os.path.join(child.workspaces, f, "private.txt"))]
            others = os.path.join(child.workspaces, folder, "private.txt")
            # The reader works: it reads a file every user may read...
            assert _read_from_a_module(second, tmp_path, "/etc/passwd") > 0
            # ...and nothing of another live session, the secret or the board's passwords.
            assert _read_from_a_module(second, tmp_path, others) <= 0
            assert _read_from_a_module(second, tmp_path, str(secret)) <= 0
            if os.path.exists("/etc/shadow"):
                assert _read_from_a_module(second, tmp_path, "/etc/shadow") <= 0
            # The first session still has its file, and both still compute.
            assert bytes(first.download("private.txt")) == b"the first session's own data"
            for sess in (first, second):
                sess.upload(session_modules.build(str(tmp_path), "ok"), target="ok.so")
                y = sess.load_module("ok.so").run({"x": np.ones((1, 4), np.float32)})[0]
                np.testing.assert_array_equal(y, 2.0)
    finally:
        child.stop()


def _write_from_a_module(sess, tmp_path, path: str) -> int:
    return _file_access_from_a_module(sess, tmp_path, "writer", path)


def test_a_module_sees_no_other_process_and_shares_no_world_writable_folder(kind, tmp_path):
    """A module reads the command line of the server and of another live
    session's process from /proc, and leaves files in /dev/shm and /var/tmp
    for the next session's module to read: the sandbox's /proc shows only
    the session's own processes, and both folders are the session's own."""
    import uuid
    from tests.test_sessions import serving_pid
    child = start_server("--max-sessions", "2")
    try:
        with connect_when_free(child) as first, connect_when_free(child) as second:
            layers = _layers(second)
            if "proc" not in layers:
                pytest.skip("this kernel gives the board server no /proc of a session's "
                            "own: " + child.log_text()[-400:])
            # The reader works: the session's own process is in its /proc.
            assert _read_from_a_module(second, tmp_path, "/proc/self/cmdline") > 0
            for pid in (child.proc.pid, serving_pid(first)):
                assert os.path.exists(f"/proc/{pid}/cmdline")
                assert _read_from_a_module(second, tmp_path, f"/proc/{pid}/cmdline") < 0, pid
            left = [f"{folder}/tether-left-{uuid.uuid4().hex}" for folder in ("/dev/shm", "/var/tmp")
                    if os.path.isdir(folder)]
            for path in left:
                assert _write_from_a_module(first, tmp_path, path) > 0, path
                assert _read_from_a_module(first, tmp_path, path) > 0, path
                assert not os.path.exists(path), f"{path} is the board's, not the session's own"
                assert _read_from_a_module(second, tmp_path, path) < 0, path
            second.upload(session_modules.build(str(tmp_path), "ok"), target="ok.so")
            y = second.load_module("ok.so").run({"x": np.ones((1, 4), np.float32)})[0]
            np.testing.assert_array_equal(y, 2.0)
    finally:
        child.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="sessions get users of their own only from a "
                    "server run as root")
def test_session_uids_a_user_of_the_board_holds_are_refused_at_start(kind):
    import pwd
    taken = next((p for p in pwd.getpwall() if 0 < p.pw_uid < 2**32 - 2), None)
    if taken is None:
        pytest.skip("no user but root on this machine")
    uids = f"{taken.pw_uid}-{taken.pw_uid + 1}"
    with pytest.raises(ProcessStartError, match=f"user {taken.pw_name} has uid {taken.pw_uid}"):
        start_server("--session-uids", uids).stop()


def test_a_secret_file_others_may_read_is_refused_at_start(kind, tmp_path):
    secret = tmp_path / "farm-secret"
    secret.write_text("s\n")
    secret.chmod(0o644)
    with pytest.raises(ProcessStartError, match=f"{secret}.*chmod 600 {secret}"):
        start_server("--farm-secret-file", str(secret)).stop()


def tracker_only(kind):
    """Skip all but the first board server: the attack is on the tracker alone."""
    if kind != board_servers.KINDS[0]:
        pytest.skip("the tracker alone is attacked: once is enough")


def test_grpc_callers_that_never_call_are_cut_off_at_the_first_frame_deadline(kind):
    tracker_only(kind)
    from remote.tracker.boards import FIRST_FRAME_S
    import time
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"   # an empty SETTINGS frame
    with local_farm(keys=["k"]) as farm:
        tracker = farm.client()
        tracker.summary()   # a real gRPC channel, made before: it must live on
        stalled = []
        for _ in range(32):
            s = socket.create_connection(("127.0.0.1", farm.tracker[1]))
            s.sendall(preface + settings)
            stalled.append(s)
        started = time.monotonic()
        try:
            for s in stalled:
                assert closed_by_peer(s)
            took = time.monotonic() - started
            assert took < FIRST_FRAME_S + 5, f"preface-only connections lived {took:.1f} s"
        finally:
            for s in stalled:
                s.close()
        with tracker.request("k", timeout=HANG_S) as sess:
            sess.ping()
        assert tracker.summary()["devices"]


def test_a_crowd_of_idle_connections_does_not_keep_sessions_out(server):
    # 64 connections that never send a frame, re-opened as the board drops
    # them, from the same address as the sessions: every session gets through.
    stop = threading.Event()
    crowd = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(64)]

    def reopen():
        while not stop.is_set():
            for i, s in enumerate(crowd):
                s.setblocking(False)
                try:
                    gone = s.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone and not stop.is_set():
                    s.close()
                    try:
                        crowd[i] = socket.create_connection(("127.0.0.1", server.port))
                    except OSError:
                        pass
            stop.wait(0.05)

    keeper = threading.Thread(target=reopen, daemon=True)
    keeper.start()
    try:
        for _ in range(25):
            with connect_when_free(server) as sess:
                sess.ping()
    finally:
        stop.set()
        keeper.join()
        for s in crowd:
            s.close()


def test_after_a_tracker_restart_a_board_id_stays_with_its_board():
    with local_farm(keys=["k"], TETHER_FARM_SECRET="s3cret") as farm:
        tracker = farm.client()
        (device,) = tracker.summary()["devices"]
        farm.restart_tracker()
        # The restarted tracker knows no credential: whoever registers first
        # under the id, before or after the board, is refused all the same.
        impostor = _tracker_port_call(farm.tracker[1], pb.DataFrame(
            op="register", key="k", address="127.0.0.1:1", device_id=device["device_id"],
            token="a credential of my own", farm_secret="s3cret"))
        assert impostor.error == "AuthenticationError" and "belongs to another board" in impostor.text
        wait_until(lambda: [d["device_id"] for d in farm.client().summary()["devices"]]
                   == [device["device_id"]], "the board registered again under its own id")
        (back,) = farm.client().summary()["devices"]
        assert back["address"] == device["address"]
        with farm.client().request("k", timeout=HANG_S) as sess:
            assert sess.address == device["address"]


def test_board_keys_and_attributes_cannot_write_to_the_terminal_of_who_reads_the_status(kind):
    tracker_only(kind)
    with local_farm(keys=[]) as farm:
        farm.add_server("k\x1b[2J", extra=["--attr", "room=\x1b]0;owned\x07"])
        text = farm.client().text_summary()
        assert "\x1b" not in text and "\x07" not in text
        assert "k\\x1b[2J" in text and "room=\\x1b]0;owned\\x07" in text


def test_a_board_link_cannot_release_another_boards_lease(kind):
    tracker_only(kind)
    with local_farm(keys=["k"], TETHER_FARM_SECRET="s3cret") as farm:
        tracker = farm.client()
        lease = tracker.lease("k", timeout=HANG_S, client="holder")
        fs = FrameSocket(socket.create_connection(("127.0.0.1", farm.tracker[1]), timeout=HANG_S))
        try:
            fs.send(pb.DataFrame(op="register", version=PROTOCOL_VERSION, key="other",
                                 address="", relay=True, farm_secret="s3cret"))
            assert fs.recv_header().op == "ok"
            fs.send(pb.DataFrame(op="release", id=5, token=lease.token))
            reply = fs.recv_header()
            while reply.id != 5:
                reply = fs.recv_header()
            assert reply.error == "AuthenticationError", reply
            assert key_status(tracker, "k")["free"] == 0
        finally:
            fs.close()
            tracker.release(lease)
        wait_until(lambda: key_status(tracker, "k")["free"] == 1, "the holder's release")


def test_a_register_with_a_wrong_secret_makes_the_tracker_dial_nothing(kind):
    tracker_only(kind)
    bait = socket.socket()
    bait.bind(("127.0.0.1", 0))
    bait.listen(1)
    bait.settimeout(1.0)
    with local_farm(keys=[], TETHER_FARM_SECRET="s3cret") as farm:
        reply = _tracker_port_call(farm.tracker[1], pb.DataFrame(
            op="register", key="k", address=f"127.0.0.1:{bait.getsockname()[1]}",
            farm_secret="wrong"))
        assert reply.error == "AuthenticationError"
        with pytest.raises(socket.timeout):
            bait.accept()
    bait.close()


def test_a_huge_tensor_shape_is_a_clear_refusal_and_the_session_goes_on(server, modules):
    with connect_when_free(server) as sess:
        sess.upload(modules["ok"], target="addone.so")
        mod = sess.load_module("addone.so")
        fs = sess._data
        # 256 GiB, which numpy would try to allocate, and more than it can count.
        for op, shape in (("put_tensor", [1 << 36]), ("put_tensor", [1 << 40, 1 << 40]),
                          ("run", [1 << 36]), ("run", [1 << 40, 1 << 40])):
            if op == "put_tensor":
                fs.send_prefix(pb.DataFrame(op=op, name="huge", tensors=[
                    pb.Tensor(name="huge", dtype="float32", shape=shape)]), 16)
                fs.send_raw(b"\0" * 16)
                fs.send(pb.DataFrame(op="end", checksum="x"))
            else:
                fs.send(pb.DataFrame(op="run", name=mod.module_id, timeout_s=30, tensors=[
                    pb.Tensor(name="x", dtype="float32", shape=shape)]), [b"\0" * 16])
            reply = fs.recv_header()
            assert reply.error in ("InvalidArgument", "InputError"), reply
            assert "Traceback" not in reply.text and "/" not in reply.text.replace("/s", ""), reply.text
            fs.skip(fs.body_left)
        np.testing.assert_array_equal(mod.run({"x": np.ones((1, 4), np.float32)})[0], 2.0)


def _memory_holds(pid: int, needle: bytes) -> bool:
    """Whether ``needle`` is anywhere in the readable memory of process ``pid``."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("r") or line.rstrip().endswith(("[vvar]", "[vsyscall]")):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
            except OSError:
                continue
    return False


def _serving_pid_or_none(sess, serving_pid, server_pid):
    try:
        pid = serving_pid(sess)
    except AssertionError:
        return None
    return pid if pid != server_pid else None


def test_the_farm_secret_is_not_where_a_module_can_read_it(kind, tmp_path):
    import secrets as random_secrets
    from remote import rpc
    from tests.test_sessions import serving_pid
    secret = "farm-" + random_secrets.token_hex(12)
    path = tmp_path / "farm-secret"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    with local_farm(keys=[], tracker_args=["--farm-secret", secret]) as farm:
        board = farm.add_server("k", extra=["--farm-secret-file", str(path),
                                            "--attr", "isolation=made up"])
        assert secret not in command_line(board.proc.pid)
        # The board says how far its sessions are isolated, whatever its operator wrote.
        (device,) = rpc.connect_tracker(*farm.tracker, farm_secret=secret).summary()["devices"]
        layers = device["attributes"]["isolation"].split(",")
        assert "processes" in layers and set(layers) <= set(LAYERS), layers
        with rpc.connect_tracker(*farm.tracker, farm_secret=secret).request(
                "k", timeout=HANG_S) as sess:
            # The connection may still be on its way to the session's process
            # (held by the server, then passed over a Unix socket).
            pid = wait_until(lambda: _serving_pid_or_none(sess, serving_pid, board.proc.pid),
                             "the session's process holding its connection")
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert secret.encode() not in f.read()
            assert secret not in command_line(pid)
            # The scan finds what the process does hold (a name it was sent)...
            marker = "marker-" + random_secrets.token_hex(8)
            sess.upload(b"x", target=marker)
            assert _memory_holds(pid, marker.encode())
            # ...and not the secret.
            assert not _memory_holds(pid, secret.encode()), \
                "the session's process holds the farm secret in its memory"


def test_the_operators_session_limits_hold_a_modules_processes(tmp_path):
    import time
    hang = session_modules.build(str(tmp_path), "hang")
    child = start_server("--session-limit", "cpu=1")
    try:
        with connect_when_free(child, timeout=HANG_S) as sess:
            sess.upload(hang, target="hang.so")
            mod = sess.load_module("hang.so")
            started = time.monotonic()
            # The run's own timeout is far off: the CPU limit ends it first.
            with pytest.raises(errors.ModuleCrashed, match="SIGXCPU|SIGKILL"):
                mod.run({"x": np.zeros((1, 4), np.float32)}, timeout=HANG_S)
            assert time.monotonic() - started < HANG_S / 2
        with connect_when_free(child) as sess:
            sess.ping()
    finally:
        child.stop()


def _connect_from_a_module(server, probe, port: int) -> int:
    with connect_when_free(server) as sess:
        sess.upload(probe, target="probe.so")
        x = np.array([[port, 0, 0, 0]], np.float32)
        return int(sess.load_module("probe.so").run({"x": x})[0][0, 0])


def test_a_module_has_no_network_unless_the_operator_allows_it(server, tmp_path):
    import errno
    probe = session_modules.build(str(tmp_path), "netprobe")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        with connect_when_free(server) as sess:
            if "no-network" not in _layers(sess):
                pytest.skip("this kernel gives the board server no network namespace: "
                            + server.log_text()[-400:])
        assert _connect_from_a_module(server, probe, port) == -errno.ENETUNREACH
        allowed = start_server("--allow-network")
        try:
            assert _connect_from_a_module(allowed, probe, port) == 0
        finally:
            allowed.stop()
    finally:
        listener.close()
