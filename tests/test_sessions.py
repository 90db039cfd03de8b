"""Device sessions against real standalone device servers: isolation, transfers,
the workspace sandbox, remote tensors, timing on the board and typed errors.

Every test runs against each kind of tests/board_servers.py: the Python and the
native server on this machine, and the native server built for aarch64 and
32-bit ARM boards under qemu-user (their modules built by the cross compilers).
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from remote import errors, rpc
from remote.cli.localfarm import Child
from tests import board_servers, session_modules
from tests.competing_load import cpu_ticks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
MAX_UPLOAD = 256 << 20

# Every server's workspaces and log, removed when the module's tests are done.
_FOLDERS = []
# The device server these tests start, with the options its kind needs: each
# test runs against every kind.
_COMMAND = []


@pytest.fixture(scope="module", autouse=True,
                params=board_servers.KINDS + board_servers.EMULATED_KINDS)
def kind(request):
    _COMMAND[:] = [*board_servers.command(request.param),
                   *board_servers.server_options(request.param)]
    yield request.param
    while _FOLDERS:
        shutil.rmtree(_FOLDERS.pop(), ignore_errors=True)


def start_server(*extra):
    folder = tempfile.mkdtemp(prefix="tether-test-server-")
    _FOLDERS.append(folder)
    workspaces = os.path.join(folder, "workspaces")
    os.mkdir(workspaces)
    child = Child("server", [*_COMMAND, "--host", "127.0.0.1", "--port", "0",
                             "--workspace-dir", workspaces, *extra], folder, ENV)
    child.workspaces = workspaces
    return child


@pytest.fixture(scope="module")
def server(kind):
    child = start_server("--max-upload-bytes", str(MAX_UPLOAD))
    yield child
    child.stop()


@pytest.fixture(scope="module")
def compiler(kind):
    """The C compiler that builds modules for this kind's board."""
    return board_servers.compiler(kind)


@pytest.fixture(scope="module")
def modules(tmp_path_factory, compiler):
    folder = str(tmp_path_factory.mktemp("cmods"))
    return {name: session_modules.build(folder, name, compiler=compiler)
            for name in ("ok", "crash", "hang")}


def connect(srv, **kw):
    return rpc.connect("127.0.0.1", srv.port, **kw)


def connect_when_free(srv, within=15.0, **kw):
    """Open a session, retrying while the device is still busy."""
    deadline = time.monotonic() + within
    while True:
        try:
            return connect(srv, **kw)
        except errors.DeviceBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def check_addone(sess, path):
    sess.upload(path, target="addone.so")
    mod = sess.load_module("addone.so")
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    (y,) = mod.run({"x": x})
    np.testing.assert_array_equal(y, x + 1)


def vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def serving_pid(sess) -> int:
    """The process on the board's end of a session's connection (its session process)."""
    here = sess._data.sock.getsockname()[1]
    inodes = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and int(fields[2].split(":")[1], 16) == here:
            inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
            except OSError:
                pass
    raise AssertionError(f"no process serves the connection from port {here}")


# ------------------------------------------------------------- isolation --
def test_segfaulting_module_ends_only_its_session(server, modules):
    with connect(server) as sess:
        sess.upload(modules["crash"], target="crash.so")
        mod = sess.load_module("crash.so")
        with pytest.raises(errors.ModuleCrashed, match="run of crash.so.*SIGSEGV"):
            mod.run({"x": np.zeros((1, 4), np.float32)})
        with pytest.raises(errors.SessionEnded, match="SIGSEGV"):
            sess.listdir()
    with connect_when_free(server) as sess:  # the server serves on and is free again
        check_addone(sess, modules["ok"])


def test_hanging_module_is_stopped_at_the_run_timeout(server, modules):
    with connect(server) as sess:
        sess.upload(modules["hang"], target="hang.so")
        mod = sess.load_module("hang.so")
        with pytest.raises(errors.RunTimeout, match=r"hang.so#0 did not finish within 1 s.*ended the session"):
            mod.run({"x": np.zeros((1, 4), np.float32)}, timeout=1.0)
    with connect_when_free(server) as sess:
        check_addone(sess, modules["ok"])


def test_session_timeout_is_enforced(server):
    with connect(server, session_timeout=1.0) as sess:
        sess.ping()
        time.sleep(2.5)
        with pytest.raises(errors.SessionEnded, match="session timeout of 1 s"):
            sess.ping()
    connect_when_free(server).close()


def test_a_client_that_vanishes_frees_the_board(server):
    code = ("import os, signal, sys; from remote import rpc; "
            f"s = rpc.connect('127.0.0.1', {server.port}); s.ping(); print('open', flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "open", out.stderr
    connect_when_free(server, within=10).close()


def test_a_server_killed_outright_takes_its_workers_and_workspaces_with_it():
    srv = start_server()
    try:
        sess = connect(srv)
        sess.upload(b"kept until the session ends", target="note.txt")
        worker = serving_pid(sess)
        (workspace,) = os.listdir(srv.workspaces)
        os.kill(srv.proc.pid, 9)
        srv.proc.wait(timeout=10)
        # States waited for, with a deadline that only a leak outlasts: the
        # clean-up itself gives the session's processes up to 10 s to end.
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.05)
        status = open(f"/proc/{worker}/status").read() if os.path.exists(f"/proc/{worker}") else ""
        assert not status or "zombie" in status, "the worker kept serving after its server died"
        # The workspace goes once the session's processes have ended: a
        # moment after the worker, on a slow (emulated) board.
        folder = os.path.join(srv.workspaces, workspace)
        while os.path.exists(folder) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(folder), "the workspace outlived its killed server"
        with pytest.raises(errors.TetherError):
            sess.ping()
        sess.close()
    finally:
        srv.stop()


def test_sessions_beyond_max_are_refused_or_queued_as_configured():
    refusing = start_server("--max-sessions", "1")
    queueing = start_server("--max-sessions", "1", "--session-queue", "20")
    try:
        with connect(refusing):
            with pytest.raises(errors.DeviceBusy, match="at most 1"):
                connect(refusing)
        first = connect(queueing)
        threading.Timer(1.0, first.close).start()
        start = time.monotonic()
        with connect(queueing) as second:  # waits for the first to close, then runs
            second.ping()
        assert time.monotonic() - start >= 0.9
    finally:
        refusing.stop()
        queueing.stop()


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat: R running, S asleep, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_asleep(pid: int, times: int, within: float = 30.0) -> list:
    """Wait until a process has been seen asleep (S) `times` looks in a
    row, 10 ms apart; the states seen, for the failure message."""
    deadline = time.monotonic() + within
    seen, row = [], 0
    while row < times:
        state = process_state(pid)
        seen.append(state)
        row = row + 1 if state == "S" else 0
        assert time.monotonic() < deadline, f"{pid} was not asleep {times} looks in a row: {''.join(seen[-200:])}"
        time.sleep(0.01)
    return seen


def test_an_idle_session_uses_no_cpu_and_still_answers(server):
    """Readers poll for the next frame only while frames come back to back:
    a session process whose client has stopped calling sleeps in the
    kernel, spending no CPU, and answers the next call (and a fast run of
    them) as before."""
    with connect(server) as sess:
        for _ in range(300):  # back to back: the readers poll
            sess.ping()
        pid = serving_pid(sess)
        wait_asleep(pid, 3)
        before = (cpu_ticks(pid), cpu_ticks(server.proc.pid))
        seen = wait_asleep(pid, 100)
        after = (cpu_ticks(pid), cpu_ticks(server.proc.pid))
        # Clock ticks (1/100 s): the looks above spanned a second or more.
        assert after[0] - before[0] <= 1, f"the idle session process used {after[0] - before[0]} ticks ({seen})"
        assert after[1] - before[1] <= 1, f"the idle server used {after[1] - before[1]} ticks"
        for _ in range(300):
            sess.ping()
        check_addone_echo = sess.listdir()
        assert isinstance(check_addone_echo, list)


# ------------------------------------------------------------- transfers --
def test_upload_download_listdir_remove_with_progress(server, tmp_path):
    data = os.urandom(3 * (1 << 20) + 12345)
    seen = []
    with connect(server) as sess:
        assert sess.upload(data, target="sub/blob.bin",
                           progress=lambda done, total: seen.append((done, total))) == "sub/blob.bin"
        # A start report, then one per 1 MiB chunk.
        n = len(data)
        assert seen == [(0, n), (1 << 20, n), (2 << 20, n), (3 << 20, n), (n, n)]
        assert sess.listdir() == ["sub/blob.bin"]
        assert sess.download("sub/blob.bin") == data
        got = []
        local = str(tmp_path / "back.bin")
        assert sess.download("sub/blob.bin", local, progress=lambda d, t: got.append(d)) == local
        assert open(local, "rb").read() == data and got[-1] == len(data)
        # A second upload or download of the same name replaces the file whole.
        sess.upload(data[:1000], target="sub/blob.bin")
        assert sess.listdir() == ["sub/blob.bin"] and sess.download("sub/blob.bin") == data[:1000]
        sess.download("sub/blob.bin", local)
        assert open(local, "rb").read() == data[:1000]
        sess.upload(data, target="sub/blob.bin")
        sess.upload(b"", target="empty")
        assert sess.download("empty") == b""
        sess.remove("sub/blob.bin")
        assert sess.listdir() == ["empty"]
        with pytest.raises(errors.InvalidArgument, match="no file 'sub/blob.bin'"):
            sess.download("sub/blob.bin")


def test_200_mib_upload_keeps_memory_bounded(server, tmp_path):
    size = 200 << 20
    path = tmp_path / "big.bin"
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(block)
    client = ("import sys; from remote import rpc; s = rpc.connect('127.0.0.1', %d); "
              "print(s.upload(sys.argv[1]), s.listdir()); s.ping(); "
              "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); "
              "s.close()" % server.port)
    server_before = vm_hwm_kib(server.proc.pid)
    proc = subprocess.run([sys.executable, "-c", client, str(path)], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listing, hwm_line = [line for line in proc.stdout.splitlines() if line]
    assert listing == "big.bin ['big.bin']"
    client_hwm_mib = int(hwm_line.split()[1]) / 1024
    server_growth_mib = (vm_hwm_kib(server.proc.pid) - server_before) / 1024
    assert client_hwm_mib < 150, f"client peak {client_hwm_mib:.0f} MiB for a 200 MiB upload"
    assert server_growth_mib < 30, f"server grew {server_growth_mib:.0f} MiB"


def test_worker_memory_stays_bounded_during_a_large_upload(server):
    with connect(server) as sess:
        sess.ping()
        pid = serving_pid(sess)
        assert pid != server.proc.pid, "modules must run outside the server process"
        before = vm_hwm_kib(pid)
        sess.upload(bytes(120 << 20), target="zeros.bin")
        growth_mib = (vm_hwm_kib(pid) - before) / 1024
        assert growth_mib < 30, f"worker grew {growth_mib:.0f} MiB for a 120 MiB upload"


def test_an_upload_whose_checksum_differs_is_refused_and_the_session_goes_on(server):
    from remote.proto import pb
    from remote.proto.frames import Checksum
    body = os.urandom(3 << 20)
    damaged = bytearray(body)
    damaged[(1 << 20) + 7] ^= 1
    sent_sum = Checksum()
    sent_sum.update(body)  # what the sender meant to send
    with connect(server) as sess:
        fs = sess._data
        fs.send_prefix(pb.DataFrame(op="upload", name="blob.bin", size=len(body)), len(body))
        fs.send_raw(damaged)
        fs.send(pb.DataFrame(op="end", checksum=sent_sum.text()))
        reply = fs.recv_header()
        assert (reply.op, reply.error) == ("error", "InvalidArgument")
        assert "upload of 'blob.bin' is corrupt" in reply.text and sent_sum.text() in reply.text
        assert "blob.bin" not in sess.listdir()
        sess.upload(body, target="blob.bin")
        assert sess.download("blob.bin") == body


def test_size_limits_are_refused_with_the_limit_named(server):
    with connect(server) as sess:
        with pytest.raises(errors.InvalidArgument, match=f"at most {MAX_UPLOAD}.*--max-upload"):
            sess.upload(bytes(MAX_UPLOAD + 1), target="huge.bin")
        with pytest.raises(errors.InvalidArgument, match=f"at most {MAX_UPLOAD}"):
            sess.upload_tensor("t", np.zeros(MAX_UPLOAD // 8 + 1))
        assert sess.listdir() == []
        sess.ping()


# -------------------------------------------------------------- workspace --
@pytest.mark.parametrize("name", ["/etc/passwd", "../escape", "a/../../b", "./x", "a//b"])
def test_names_outside_the_workspace_are_refused(server, name):
    with connect(server) as sess:
        with pytest.raises(errors.InvalidArgument, match="not allowed"):
            sess.upload(b"x", target=name)
        with pytest.raises(errors.InvalidArgument, match="not allowed"):
            sess.download(name)
        with pytest.raises(errors.InvalidArgument, match="not allowed"):
            sess.remove(name)
        sess.ping()  # the session goes on


def test_symlinks_leading_out_of_the_workspace_are_refused(server):
    with connect(server) as sess:
        sess.upload(b"inside", target="real.txt")
        (folder,) = [os.path.join(server.workspaces, d) for d in os.listdir(server.workspaces)]
        # What a module or a later bug could leave behind inside the folder.
        os.symlink("/etc", os.path.join(folder, "etc"))
        os.symlink("/etc/hostname", os.path.join(folder, "hostname"))
        # Relative: the session's process may see its folder elsewhere (as /tmp
        # in a mount namespace of its own).
        os.symlink("real.txt", os.path.join(folder, "alias.txt"))
        for name in ("etc/hostname", "hostname"):
            with pytest.raises(errors.InvalidArgument, match="leads outside"):
                sess.download(name)
            with pytest.raises(errors.InvalidArgument, match="leads outside"):
                sess.upload(b"overwrite", target=name)
            with pytest.raises(errors.InvalidArgument, match="leads outside"):
                sess.load_module(name)
        assert sess.download("alias.txt") == b"inside"  # a link that stays inside is fine
    assert os.listdir(server.workspaces) == [], "the workspace is removed with the session"


# ---------------------------------------------------- modules and tensors --
def test_remote_tensors_stay_on_the_board_between_runs(server, modules):
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    with connect(server) as sess:
        sess.upload(modules["ok"], target="addone.so")
        mod = sess.load_module("addone.so")
        rx = sess.upload_tensor("x0", x)
        assert rx.shape == (1, 4) and rx.dtype == "float32"
        (y1,) = mod.run({"x": rx})
        (y2,) = mod.run([rx])
        np.testing.assert_array_equal(y1, x + 1)
        np.testing.assert_array_equal(y2, x + 1)
        big = np.random.default_rng(0).standard_normal((3, 1000, 7))
        np.testing.assert_array_equal(sess.upload_tensor("big", big).numpy(), big)
        rx.free()
        with pytest.raises(errors.InvalidArgument, match="no tensor 'x0'.*upload_tensor"):
            mod.run({"x": rx})
        with pytest.raises(errors.InputError, match=r"expected shape \(1, 4\)"):
            mod.run({"x": sess.upload_tensor("wrong", np.zeros((2, 4), np.float32))})
        sess.ping()


def test_module_tar_is_linked_on_the_board(server, compiler, tmp_path):
    tar = session_modules.build_tar(str(tmp_path), compiler=compiler)
    with connect(server) as sess:
        sess.upload(tar)
        mod = sess.load_module("addone.tar")
        assert mod.metadata["name"] == "addone"
        (y,) = mod.run({"x": np.ones((1, 4), np.float32)})
        np.testing.assert_array_equal(y, np.full((1, 4), 2, np.float32))
        assert "addone.so" in sess.listdir()
        sess.upload(b"not a tar", target="junk.tar")
        with pytest.raises(errors.ModuleLoadError, match="junk.tar is not a readable tar"):
            sess.load_module("junk.tar")


def test_module_tar_without_a_compiler_on_the_board_is_a_clear_error(compiler, tmp_path):
    tar = session_modules.build_tar(str(tmp_path), compiler=compiler)
    srv = start_server("--cc", "no-such-cc")
    try:
        with connect(srv) as sess:
            sess.upload(tar)
            with pytest.raises(errors.ModuleLoadError, match="'no-such-cc' is not on this board"):
                sess.load_module("addone.tar")
    finally:
        srv.stop()


def test_wrong_architecture_names_both_machines(server, kind, tmp_path):
    own = board_servers.machine(kind)
    other, other_compiler = board_servers.foreign_compiler(kind)
    foreign = session_modules.build(str(tmp_path), "ok", compiler=other_compiler)
    with connect(server) as sess:
        sess.upload(foreign, target="foreign.so")
        with pytest.raises(errors.ModuleLoadError,
                           match=fr"foreign.so is a {other.bits}-bit {other.elf_name} module"
                                 fr".*runs {own.bits}-bit {own.elf_name}"):
            sess.load_module("foreign.so")
        sess.upload(b"\x7fELF garbage", target="corrupt.so")
        with pytest.raises(errors.ModuleLoadError, match="corrupt.so is not an ELF shared object"):
            sess.load_module("corrupt.so")


def test_benchmark_runs_on_the_board(server, modules):
    with connect(server) as sess:
        sess.upload(modules["ok"], target="addone.so")
        mod = sess.load_module("addone.so")
        res = mod.benchmark(number=5, repeat=4)
        assert res.number == 5 and len(res.samples) == 4
        assert 0 < res.min <= res.median <= res.max and res.min <= res.p90 <= res.p99 <= res.max
        assert res.mean == pytest.approx(np.mean(res.samples))
        assert res.std == pytest.approx(np.std(res.samples))
        assert res.load_s == pytest.approx(mod.load_s)
        assert res.threads == 1  # a module without tether_run_parallel runs on one
        assert "threads" in str(res) and res.as_dict()["threads"] == 1
        grown = mod.benchmark(number=1, repeat=2, min_repeat_ms=20, cooldown_ms=5,
                              inputs={"x": np.ones((1, 4), np.float32)})
        # number grew until one repeat took about min_repeat_ms; timing noise on a shared
        # machine can make later repeats quicker, so only half of it is required.
        assert grown.number > 1 and grown.number * grown.max >= 0.010
        with pytest.raises(ValueError, match="repeat"):
            mod.benchmark(repeat=0)


def test_benchmark_without_number_or_timeout_sizes_itself_from_a_first_run(server, compiler,
                                                                           tmp_path):
    slow = session_modules.build(str(tmp_path), "slow", compiler=compiler)
    with connect_when_free(server, timeout=5.0) as sess:  # calls get 5 s: less than the loop
        sess.upload(slow, target="slow.so")
        mod = sess.load_module("slow.so")
        res = mod.benchmark(repeat=4)  # 0.3 s a run: 10 per sample would be 12 s
        assert 1 <= res.number < 10 and res.repeat == 4
        assert min(res.samples) >= 0.29


def test_device_info_names_the_board_and_its_runtime(server, kind):
    import platform
    with connect(server) as sess:
        info = sess.device_info()
    board = board_servers.machine(kind).triple if board_servers.emulated(kind) else platform.machine()
    assert info["triple"].startswith(board) and info["cores"] >= 1
    assert info["memory_bytes"] > 0 and info["server_version"]
    assert info["emulated"] == ""  # a real machine; `tether emulate` boards say how
    if kind == "python":
        assert info["numpy"] == np.__version__ and info["python"] == platform.python_version()
    else:  # no Python on the board
        assert info["python"] == info["numpy"] == info["grpcio"] == ""


# ------------------------------------------------------------------ errors --
def test_remote_failure_says_what_failed_on_the_device(server, kind):
    # The Python server adds its traceback; the native one names the system error.
    detail = "Traceback" if kind == "python" else "Not a directory"
    with connect(server) as sess:
        sess.upload(b"file", target="plain")
        with pytest.raises(errors.RemoteError, match=f"(?s)upload failed on the device.*{detail}"):
            sess.upload(b"x", target="plain/inside")
        sess.ping()


def test_a_connection_must_open_a_session_before_anything_else(server):
    from remote.proto import pb
    from remote.proto.frames import PROTOCOL_VERSION, FrameSocket
    with connect(server) as sess:
        sess.ping()

        def first_frame(frame):
            intruder = FrameSocket(socket.create_connection(("127.0.0.1", server.port)))
            try:
                intruder.send(frame)
                return intruder.recv_header()
            finally:
                intruder.close()

        reply = first_frame(pb.DataFrame(op="upload", name="x", version=PROTOCOL_VERSION))
        assert reply.error == "InvalidArgument" and "must begin with open" in reply.text
        reply = first_frame(pb.DataFrame(op="open", version=1))
        assert reply.error == "ConnectionFailed" and "protocol v2" in reply.text
        reply = first_frame(pb.DataFrame(op="status", name="no-such-session",
                                         version=PROTOCOL_VERSION))
        assert not reply.open and reply.error == "SessionError"
        garbage = socket.create_connection(("127.0.0.1", server.port))
        garbage.sendall(b"\xff" * 64)
        garbage.settimeout(30)
        assert garbage.recv(100) == b""  # dropped, nothing served
        garbage.close()
        sess.ping()  # the real client is untouched


def test_a_protocol_v1_client_is_told_the_versions_differ(server):
    """A v1 client spoke gRPC to the board's port; it gets a gRPC error naming both versions."""
    import grpc
    with connect(server) as sess:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.unary_unary("/tether.v1.Device/OpenSession",
                                       request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as caught:
                call(b"", timeout=30)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "protocol v2" in caught.value.details() and "protocol v1" in caught.value.details()
        sess.ping()


def test_a_file_cut_short_while_it_uploads_is_refused_by_name(server, tmp_path):
    path = tmp_path / "model.so"
    path.write_bytes(os.urandom(3 << 20))

    def cut_short(done, total):
        if done == 1 << 20:
            os.truncate(path, 1 << 19)  # another program rewrites the file meanwhile

    with connect(server) as sess:
        with pytest.raises(errors.InvalidArgument, match="model.so' shrank while it was sent"):
            sess.upload(str(path), progress=cut_short)
        # The session goes on, and nothing of the cut file was kept.
        assert "model.so" not in sess.listdir()
        sess.upload(str(path))
        assert sess.download("model.so") == path.read_bytes()
