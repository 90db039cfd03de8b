"""The processes that run sessions' modules (``python -m remote.server.worker``).

The device server starts one of these as a *zygote*: it imports numpy, minirt
and the protocol once, then waits on a control socket. For each session the
server sends it the client's connection, the session's control socket and an
output pipe, and the zygote forks a child that serves that connection. A fork
of a process that has already imported everything takes a millisecond or two
where starting Python and numpy takes a third of a second (seconds on a Pi),
so opening a session never waits for an interpreter.

Everything a session does happens in its child (docs/sessions.md): a module
that crashes or hangs takes down only that process, never the server. The
child tells the server why it ends (``end<TAB>class<TAB>reason``) and asks it
to end the session when the client closes it (``close``, answered
``released`` once the board is back in the tracker's pool).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback

import numpy as np

import minirt
from minirt import elf, timing
from remote import errors
from remote.proto import pb
from remote.proto.frames import (CHUNK_BYTES, Checksum, FrameSocket, PeerClosed, aligned_empty,
                                 error_frame, frame_bytes, little_endian, page_buffer,
                                 recv_array_chunks, recv_tensors, send_array_chunks, tensor_bytes,
                                 send_file_chunks, tensor_dtype, tensor_header)
from remote.server.isolation import (apply_session_limits, confine_session, enter_namespaces,
                                     fork_into_pid_namespace, parse_session_limit,
                                     parse_uid_range)
from remote.server.workspace import Workspace

EXIT_RUN_TIMEOUT = 3
_OK = frame_bytes(pb.DataFrame(op="ok"))


# The session's control socket to the server (set in the session's child).
_CONTROL = None


def _tell_server(line: str) -> None:
    try:
        _CONTROL.sendall(line.replace("\n", " ").encode("utf-8", "replace") + b"\n")
    except (OSError, AttributeError):
        pass  # the server is gone; nobody is left to tell


def log_polling(fs: FrameSocket) -> None:
    """How the session's reads polled (docs/sessions.md, "Small calls"), for
    the server's log."""
    _tell_server("log\t" + fs.poll_gate.summary())


def report_end(error_class: str, reason: str) -> None:
    """Tell the server why this process is about to end."""
    _tell_server(f"end\t{error_class}\t{reason}")


def peak_rss_bytes() -> int:
    """The most memory this process has held resident (VmHWM), or 0 where the
    kernel does not say (no /proc, as on some Android builds)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel counts in kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Watchdog:
    """Ends the process when a module call outlives its timeout, or when the
    client closes the connection while the call runs.

    ctypes releases the GIL while the module runs, so this thread gets to run
    even when the module spins forever. A session's calls are answered in
    order on one connection, so nothing else reads it during a call: a client
    that gives up (Ctrl-C, its process killed) is seen only here, and its
    board is freed at once instead of when the module returns.
    """

    # How often a running call's connection is looked at.
    PEER_CHECK_S = 0.25

    def __init__(self):
        self._cond = threading.Condition()
        self._deadline = None
        self._what = ""
        self._timeout = 0.0
        self._fs = None
        threading.Thread(target=self._loop, name="watchdog", daemon=True).start()

    def arm(self, timeout_s: float, what: str, fs: FrameSocket) -> None:
        with self._cond:
            self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")
            self._what, self._timeout, self._fs = what, timeout_s, fs
            self._cond.notify()

    def disarm(self) -> None:
        if self._deadline is not None:
            with self._cond:
                self._deadline = None

    def _loop(self):
        while True:
            with self._cond:
                while self._deadline is None:
                    self._cond.wait()
                deadline, what, fs = self._deadline, self._what, self._fs
            left = deadline - time.monotonic()
            if left > 0:
                if _peer_closed(fs.sock, min(left, self.PEER_CHECK_S)):
                    with self._cond:
                        if self._deadline is deadline:
                            report_end("SessionEnded", f"the client closed its connection "
                                                       f"during the {what}")
                            os._exit(0)
                continue
            with self._cond:
                if self._deadline is not deadline:
                    continue  # the call finished meanwhile
            message = (f"{what} did not finish within {self._timeout:g} s; the device "
                       "stopped the module and ended the session. Give it more time "
                       "(timeout=, or --timeout on the command line) or ask for fewer runs "
                       "(number=/repeat=, --number/--repeat)")
            report_end("RunTimeout", message)
            try:
                fs.sock.settimeout(1.0)
                fs.send(error_frame("RunTimeout", message))
            except OSError:
                pass
            os._exit(EXIT_RUN_TIMEOUT)


def _peer_closed(sock: socket.socket, wait_s: float) -> bool:
    """Whether the other end has closed ``sock``, waiting up to ``wait_s`` to see."""
    try:
        readable, _, _ = select.select([sock], [], [], wait_s)
        if not readable:
            return False
        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
            time.sleep(wait_s)  # the client sent more; it is read after this call
            return False
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


# gzip, bzip2, xz, zstd: an archive that unpacks to far more than was uploaded.
COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")
EXTRACT_DEADLINE_S = 120.0


def link_objects(tar_path: str, name: str, workspace: Workspace, cc: str,
                 max_bytes: int) -> str:
    """Link the object files in a module .tar with the board's C compiler; returns the .so.

    The archive is unpacked inside the session's workspace, uncompressed
    archives only, at most ``max_bytes`` in all and within EXTRACT_DEADLINE_S.
    """
    stem = name[:-4]
    compiler = shutil.which(cc)
    if compiler is None:
        raise errors.ModuleLoadError(
            f"{name} holds object files that must be linked on the board, but the C compiler "
            f"{cc!r} is not on this board's PATH; install one (e.g. apt install gcc) or "
            "upload a linked module (.so from export_library)")
    with open(tar_path, "rb") as f:
        magic = f.read(6)
    if any(magic.startswith(m) for m in COMPRESSED_MAGIC):
        raise errors.ModuleLoadError(
            f"{name} is a compressed archive; the board takes uncompressed .tar files only "
            "(export_library writes one)")
    folder = tempfile.mkdtemp(prefix=".link-", dir=workspace.root)
    deadline = time.monotonic() + EXTRACT_DEADLINE_S
    try:
        objects = []
        unpacked = 0
        try:
            with tarfile.open(tar_path, "r:") as tar:
                for member in tar:
                    base = os.path.basename(member.name)
                    if member.isdir():
                        continue
                    if not member.isfile() or base in ("", ".", ".."):
                        raise errors.ModuleLoadError(
                            f"{name}: member {member.name!r} is not a regular file; a module "
                            "archive holds only .o files and metadata.json")
                    if not base.endswith(".o"):
                        continue
                    unpacked += member.size
                    if unpacked > max_bytes:
                        raise errors.ModuleLoadError(
                            f"{name} unpacks to more than {max_bytes} bytes, this device's "
                            "limit for a session's files (server option --max-upload-bytes)")
                    if time.monotonic() > deadline:
                        raise errors.ModuleLoadError(
                            f"{name} took more than {EXTRACT_DEADLINE_S:g} s to unpack")
                    target = os.path.join(folder, base)
                    if os.path.exists(target):
                        raise errors.ModuleLoadError(f"{name}: two members are named {base!r}")
                    with tar.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, CHUNK_BYTES)
                    objects.append(target)
        except tarfile.TarError as exc:
            raise errors.ModuleLoadError(f"{name} is not a readable tar archive: {exc}") from None
        if not objects:
            raise errors.ModuleLoadError(f"{name} holds no .o files to link")
        host = elf.host_machine()
        for path in objects:
            header = elf.read_header(path)
            if header is None:
                raise errors.ModuleLoadError(
                    f"{name}: {os.path.basename(path)} is not an ELF object file")
            if host is not None and (header.machine, header.bits) != host:
                raise errors.ModuleLoadError(
                    f"{name}: {os.path.basename(path)} is {header.bits}-bit "
                    f"{header.machine_name} code, but this board runs {host[1]}-bit "
                    f"{elf.MACHINES.get(host[0], host[0])}; build it for this board's target")
        output = workspace.path(stem + ".so")
        done = subprocess.run([compiler, "-shared", "-o", output, *objects],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        if done.returncode != 0:
            raise errors.ModuleLoadError(
                f"linking {name} with {cc} failed (exit {done.returncode}): "
                f"{done.stdout.decode(errors='replace').strip()[-2000:]}")
        return output
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Worker:
    """The state of one session on the board: files, tensors left there, loaded modules."""

    def __init__(self, workspace: Workspace, max_bytes: int, cc: str, idle_timeout_s: float):
        self.workspace = workspace
        self.max_bytes = max_bytes
        self.cc = cc
        self.idle_timeout_s = idle_timeout_s
        self.tensors = {}
        self.modules = {}
        self.load_s = {}
        self.lock = threading.Lock()
        self.last_active = time.monotonic()
        self.watchdog = Watchdog()

    # --------------------------------------------------------- connection --
    def serve(self, conn: socket.socket) -> None:
        """Serve the session's connection until it ends; then this process ends."""
        fs = FrameSocket(conn)
        try:
            conn.settimeout(None)
            if self.idle_timeout_s:
                threading.Thread(target=self._idle_watch, name="idle", daemon=True).start()
            while True:
                header = fs.recv_header()
                if header.op == "ping":
                    fs.send_raw(_OK)  # touches no state: no lock, no dispatch
                elif header.op == "close":
                    self.close(fs)
                else:
                    self.dispatch(fs, header)
                self.last_active = time.monotonic()
        except (PeerClosed, OSError):
            pass
        finally:
            log_polling(fs)
            fs.close()
            report_end("SessionEnded", "the client closed its connection")
            os._exit(0)

    def close(self, fs: FrameSocket) -> None:
        """The client ends the session: answered once the server has given the
        board back, so it is free again when the client's ``with`` block ends."""
        log_polling(fs)  # before the answer: the client's with block ends after it
        self.workspace.close()
        released = _ask_server("close")
        fs.send(pb.DataFrame(op="ok") if released else error_frame(
            "RemoteError", "the device server did not confirm the end of the session"))
        fs.close()
        os._exit(0)

    def _idle_watch(self):
        while True:
            time.sleep(min(1.0, self.idle_timeout_s))
            if (not self.lock.locked()
                    and time.monotonic() - self.last_active > self.idle_timeout_s):
                report_end("SessionEnded", f"the client was idle for {self.idle_timeout_s:g} s")
                os._exit(0)

    def dispatch(self, fs: FrameSocket, header) -> None:
        handler = getattr(self, "op_" + header.op, None)
        try:
            if handler is None:
                raise errors.InvalidArgument(f"unknown operation {header.op!r} on the data "
                                             "connection; client and server versions differ")
            with self.lock:
                handler(fs, header)
        except (PeerClosed, ConnectionError):
            raise
        except errors.TetherError as exc:
            fs.send(error_frame(type(exc).__name__, str(exc)))
        except minirt.InputError as exc:
            fs.send(error_frame("InputError", str(exc)))
        except minirt.ModuleLoadError as exc:
            fs.send(error_frame("ModuleLoadError", str(exc)))
        except ValueError as exc:
            fs.send(error_frame("InvalidArgument", str(exc)))
        except Exception as exc:  # noqa: BLE001 - the client gets the traceback
            # The client knows its files by their names in the workspace.
            text = (f"{header.op} failed on the device: {exc!r}\n{traceback.format_exc()}"
                    ).replace(self.workspace.root + os.sep, "")
            fs.send(error_frame("RemoteError", text))

    def _drop(self, fs: FrameSocket, error_class: str, message: str) -> None:
        """Answer with an error and end the session: the connection is out of step."""
        try:
            fs.send(error_frame(error_class, message))
        except OSError:
            pass
        report_end(error_class, message)
        os._exit(0)

    def _check_size(self, what: str, size: int) -> None:
        if size > self.max_bytes:
            raise errors.InvalidArgument(
                f"{what} is {size} bytes; this device accepts at most {self.max_bytes} "
                "(server option --max-upload-bytes)")

    # -------------------------------------------------------------- files --
    def op_upload(self, fs, header):
        name = header.name
        partial = None
        end = None
        if fs.body_left != header.size or fs.body_left > self.max_bytes:
            # Reading past what was announced (or allowed) to stay in step is
            # what a hostile client wants: refuse, and end the connection.
            self._drop(fs, "InvalidArgument",
                       f"upload of {name!r} announces {header.size} bytes and carries "
                       f"{fs.body_left}; this device accepts at most {self.max_bytes} "
                       "(server option --max-upload-bytes)")
        try:
            target = self.workspace.path(name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # A name of its own: a file the session calls "x.part" is not touched.
            partial = f"{target}.{os.getpid()}-{int(time.monotonic() * 1e6)}.part"
            checksum = Checksum()
            buffer = page_buffer(CHUNK_BYTES)
            with open(partial, "wb") as f:
                while fs.body_left:
                    view = buffer[:min(CHUNK_BYTES, fs.body_left)]
                    fs.recv_body_into(view)
                    checksum.update(view)
                    f.write(view)
            end = fs.recv_header()
            if end.op != "end":
                raise errors.InvalidArgument(f"upload of {name!r} was not finished properly")
            if end.checksum != checksum.text():
                raise errors.InvalidArgument(
                    f"upload of {name!r} is corrupt: {checksum.text()} on the device, "
                    f"{end.checksum} at the sender")
            if os.path.lexists(target):
                # Renaming over an existing file makes ext4 (auto_da_alloc)
                # write the new file's data out before the rename commits,
                # which held uploads to a third of their speed; the name is
                # briefly absent instead.
                os.remove(target)
            os.replace(partial, target)
        except Exception:
            if end is None:  # keep the connection in step: read what the client still sends
                fs.skip(fs.body_left)
                fs.recv_header()
            raise
        finally:
            if partial is not None and os.path.exists(partial):
                os.remove(partial)
        fs.send(pb.DataFrame(op="ok", name=name, size=header.size, checksum=checksum.text()))

    def op_download(self, fs, header):
        path = self.workspace.existing(header.name)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            fs.send_prefix(pb.DataFrame(op="ok", name=header.name, size=size), size)
            checksum = send_file_chunks(fs, f, size)
        if checksum is None:
            # The file shrank under us; the client sees a short body and an error.
            raise errors.RemoteError(f"{header.name} changed while it was being read")
        fs.send(pb.DataFrame(op="end", checksum=checksum))

    def op_list(self, fs, header):
        files = [pb.FileInfo(name=n, size=os.path.getsize(self.workspace.path(n)))
                 for n in self.workspace.listdir()]
        fs.send(pb.DataFrame(op="ok", files=files))

    def op_remove(self, fs, header):
        self.workspace.remove(header.name)
        fs.send(pb.DataFrame(op="ok"))

    # ------------------------------------------------------------ tensors --
    def op_put_tensor(self, fs, header):
        try:
            array, checksum = self._receive_tensor(fs, header)
        except Exception:
            fs.skip(fs.body_left)  # keep the connection in step: the end frame follows
            fs.recv_header()
            raise
        end = fs.recv_header()
        if end.checksum != checksum:
            raise errors.InvalidArgument(f"tensor {header.name!r} arrived corrupt: "
                                         f"{checksum}, sender {end.checksum}")
        self.tensors[header.name] = array.astype(array.dtype.newbyteorder("="), copy=False)
        fs.send(pb.DataFrame(op="ok", name=header.name, size=array.nbytes))

    def _receive_tensor(self, fs, header):
        self._check_size(f"tensor {header.name!r}", fs.body_left)
        if len(header.tensors) != 1:
            raise errors.InvalidArgument("put_tensor carries exactly one tensor")
        desc = header.tensors[0]
        try:
            dtype = tensor_dtype(header.name, desc.dtype)
            nbytes = tensor_bytes(header.name, desc.shape, dtype)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        if nbytes != fs.body_left:
            raise errors.InvalidArgument(f"tensor {header.name!r} of shape {tuple(desc.shape)} "
                                         f"{desc.dtype} needs {nbytes} bytes, "
                                         f"{fs.body_left} were sent")
        array = aligned_empty(tuple(desc.shape), dtype)
        return array, recv_array_chunks(fs, array)

    def op_get_tensor(self, fs, header):
        array = little_endian(self._tensor(header.name))
        fs.send_prefix(pb.DataFrame(op="ok", name=header.name,
                                    tensors=[tensor_header(header.name, array)]), array.nbytes)
        fs.send(pb.DataFrame(op="end", checksum=send_array_chunks(fs, array)))

    def op_free_tensor(self, fs, header):
        self.tensors.pop(header.name, None)
        fs.send(pb.DataFrame(op="ok"))

    def _tensor(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise errors.InvalidArgument(
                f"no tensor {name!r} on the board; upload it with upload_tensor first "
                f"(present: {', '.join(sorted(self.tensors)) or 'none'})") from None

    # ------------------------------------------------------------ modules --
    def op_load(self, fs, header):
        name = header.name
        path = self.workspace.existing(name)
        start = time.perf_counter()
        if name.endswith(".tar"):
            path = link_objects(path, name, self.workspace, self.cc, self.max_bytes)
        try:
            module = minirt.load(path)
        except minirt.ModuleLoadError as exc:
            # minirt names the absolute path; the client knows the file by its name.
            raise errors.ModuleLoadError(str(exc).replace(path, name)) from None
        load_s = time.perf_counter() - start
        module_id = f"{name}#{len(self.modules)}"
        self.modules[module_id] = module
        self.load_s[module_id] = load_s
        fs.send(pb.DataFrame(op="ok", name=module_id, text=json.dumps(module.metadata),
                             seconds=load_s))

    def _module(self, module_id: str):
        module = self.modules.get(module_id)
        if module is None:
            raise errors.InvalidArgument(
                f"no module {module_id!r} loaded in this session; call load_module first")
        return module

    def _inputs(self, fs, header) -> dict:
        arrays = recv_tensors(fs, header.tensors)
        inputs = {t.name: a for t, a in zip(header.tensors, arrays)}
        for input_name, tensor_name in header.refs.items():
            inputs[input_name] = self._tensor(tensor_name)
        return inputs

    def op_run(self, fs, header):
        module = self._module(header.name)
        inputs = self._inputs(fs, header)
        self.watchdog.arm(header.timeout_s, f"run of {header.name}", fs)
        try:
            start = time.perf_counter()
            outputs = module.run(inputs)
            run_s = time.perf_counter() - start
        finally:
            self.watchdog.disarm()
        fs.send(pb.DataFrame(op="ok", seconds=run_s,
                             tensors=[tensor_header(s.name, a, s.dtype)
                                      for s, a in zip(module.outputs, outputs)]),
                [little_endian(a) for a in outputs])

    def _inputs_or_zeros(self, fs, header, module):
        """The inputs sent with a timing request; zeros for any left out."""
        inputs = self._inputs(fs, header)
        for spec in module.inputs:
            if spec.name not in inputs:
                inputs[spec.name] = np.zeros(spec.shape, dtype=spec.dtype)
        return inputs

    def op_benchmark(self, fs, header):
        module = self._module(header.name)
        inputs = self._inputs_or_zeros(fs, header, module)
        self.watchdog.arm(header.timeout_s, f"benchmark of {header.name}", fs)
        try:
            samples, number = timing.time_module(
                module, inputs, number=header.number or 10, repeat=header.repeat or 3,
                min_repeat_ms=header.min_repeat_ms, cooldown_ms=header.cooldown_ms)
        finally:
            self.watchdog.disarm()
        result = {"samples": samples, "number": number, "repeat": len(samples),
                  "load_s": self.load_s[header.name], "peak_rss_bytes": peak_rss_bytes(),
                  "threads": module.threads,
                  **timing.summarize(samples)}
        fs.send(pb.DataFrame(op="ok", text=json.dumps(result)))

    def op_profile(self, fs, header):
        module = self._module(header.name)
        inputs = self._inputs_or_zeros(fs, header, module)
        self.watchdog.arm(header.timeout_s, f"profile of {header.name}", fs)
        try:
            start = time.perf_counter()
            rows = module.profile(inputs, number=header.number or 10)
            elapsed = time.perf_counter() - start
        except minirt.ProfilingUnsupported as exc:
            raise errors.ModuleLoadError(str(exc).replace(module.path, header.name)) from None
        finally:
            self.watchdog.disarm()
        fs.send(pb.DataFrame(op="ok", seconds=elapsed,
                             text=json.dumps({"rows": rows, "number": header.number or 10})))


_released = threading.Event()


def _ask_server(request: str, timeout: float = 60.0) -> bool:
    """Send ``request`` on the control socket and wait for the server's ``released``."""
    try:
        _CONTROL.sendall(request.encode() + b"\n")
    except OSError:
        return False
    return _released.wait(timeout)


def _follow_server(workspace: Workspace) -> None:
    """Read the server's answers; end with the server. It holds the other end
    of the control socket for as long as it runs, so end of file means it is
    gone (even killed with SIGKILL), and nobody is left to end this session or
    clean up after it."""
    buffered = b""
    try:
        while True:
            data = _CONTROL.recv(4096)
            if not data:
                break
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                if line == b"released":
                    _released.set()
    except OSError:
        pass
    workspace.close()
    os._exit(0)


def run_session(fds, message: str, args) -> None:
    """The forked child of one session: serve its connection, then exit."""
    global _CONTROL
    conn_fd, control_fd, output_fd = fds
    # The module's prints go to a pipe whose tail the server keeps.
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    os.close(output_fd)
    uid, workspace_root = message.split(" ", 1)
    try:
        workspace_root = confine_session(args.sandbox, workspace_root, int(uid), args.hide,
                                         args.parent_waits)
        os.chdir(workspace_root)
    except OSError as exc:
        sys.stderr.write(f"the session's sandbox could not be set up: {exc}\n")
        os._exit(1)
    apply_session_limits(args.session_limit)
    _CONTROL = socket.socket(fileno=control_fd)
    conn = socket.socket(fileno=conn_fd)
    worker = Worker(Workspace(root=workspace_root), args.max_bytes, args.cc, args.idle_timeout)
    threading.Thread(target=_follow_server, args=(worker.workspace,), name="lifeline",
                     daemon=True).start()
    worker.serve(conn)
    os._exit(0)


def zygote(control: socket.socket, args) -> int:
    """Fork one child per session the server sends; report each child's end.

    Single-threaded, so forking is safe. Messages are packets on a
    SOCK_SEQPACKET socket: ``spawn <session id> <workspace>`` with three file
    descriptors from the server; ``ready``, ``started <id> <pid>`` and
    ``exit <id> <wait status as exit code>`` back.

    The next session's child is forked ahead of need and waits for its
    session: a fresh fork spends milliseconds on its first steps (copying the
    memory pages Python writes to, starting threads), which then happen
    while no client waits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the server's terminal
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _become_subreaper()
    gc.freeze()  # the collector then leaves the imported objects' pages alone in children
    own = (control, wake_r, wake_w)
    children = {}
    workspaces = {}  # pid -> its session's workspace
    spare = _fork_spare(own, args)
    server = os.getppid()
    uids = SessionUids(args.session_uids)
    control.send(b"ready")
    try:
        while True:
            ready, _, _ = select.select([control, wake_r], [], [], 1.0)
            if os.getppid() != server:
                # The server is gone (its end of the control socket may linger in
                # flight): its sessions' processes end (they see their control
                # sockets close); then everything they started goes too, and
                # their workspaces, which a session in a mount namespace of its
                # own sees only as its /tmp.
                return _after_the_server(children, workspaces)
            if wake_r in ready:
                try:
                    while wake_r.recv(512):
                        pass
                except BlockingIOError:
                    pass
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if spare is not None and pid == spare[0]:
                    spare[1].close()
                    spare = None  # it died waiting; another is forked when needed
                    continue
                session_id = children.pop(pid, None)
                root = workspaces.pop(pid, None)
                uids.free(pid)
                if session_id is None:
                    continue  # a process a session left behind, already ended (see end_strays)
                # What the session started ends with it: its process group, and
                # those that left it (a new session, a double fork) and so came to
                # this subreaper once their parents ended.
                end_process_group(pid)
                end_strays(set(children) | ({spare[0]} if spare is not None else set()))
                if not _tell(control, f"exit {session_id} {os.waitstatus_to_exitcode(status)}"):
                    return _after_the_server(children, {**workspaces, pid: root})
            if control not in ready:
                continue
            try:
                message, fds, _, _ = socket.recv_fds(control, 65536, 3)
            except OSError:
                message = b""
            if not message:
                # The server closed its end: it stopped, or was killed before
                # this process was handed to init. Each child sees its own
                # control socket close; a killed server removes nothing, so
                # the workspaces go here too.
                return _after_the_server(children, workspaces)
            _, session_id, workspace_root = message.decode().split(" ", 2)
            pid, door = spare if spare is not None else _fork_spare(own, args)
            uid = uids.take(pid)
            try:
                socket.send_fds(door, [f"{uid} {workspace_root}".encode()], fds)
            except OSError:
                pass  # it died just now: the server hears of its exit and ends the session
            door.close()
            for fd in fds:
                os.close(fd)
            children[pid] = session_id
            workspaces[pid] = workspace_root
            if not _tell(control, f"started {session_id} {pid}"):
                return _after_the_server(children, workspaces)
            spare = _fork_spare(own, args)

    finally:
        # A SIGCHLD that comes after the wake socket is closed (as the process
        # exits) would otherwise be reported as a write to a bad descriptor.
        signal.set_wakeup_fd(-1)


def _after_the_server(children: dict, workspaces: dict) -> int:
    """The server is gone: its sessions' processes end (they see their control
    sockets close); then everything they started goes too, and their
    workspaces."""
    _outlive(children, SESSION_CLEANUP_S)
    for pid in children:
        end_process_group(pid)
    end_strays(set())
    for root in workspaces.values():
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _tell(control: socket.socket, message: str) -> bool:
    """Send ``message`` to the server; False once the server has closed its end
    (a server that stops closes it while its last sessions end)."""
    try:
        control.send(message.encode())
        return True
    except OSError:
        return False


# How long a server-less zygote waits for its sessions' processes to clean up.
SESSION_CLEANUP_S = 10.0


def _outlive(children, seconds: float) -> None:
    """Reap ``children`` as they end, for ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    left = set(children)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                left.discard(pid)
        time.sleep(0.02)


def _become_subreaper() -> None:
    """Processes whose parents end come to this process, not to init (Linux
    prctl PR_SET_CHILD_SUBREAPER), so none of a session's escapes it."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def end_process_group(pid: int) -> None:
    """Kill what is left of the process group a session's process led."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def end_strays(keep) -> None:
    """Kill and reap this process's children other than ``keep``: processes of
    sessions that have ended, which came here when their parents ended."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            pids = [int(word) for word in f.read().split()]
    except OSError:
        return
    for pid in pids:
        if pid in keep:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass


class SessionUids:
    """The user ids of live sessions, each its own, taken in turn through the
    range from a random start: an id comes back only after the whole range,
    so what a session left in a world-writable folder is not the next one's."""

    def __init__(self, uids: range):
        import random
        self._uids = uids
        self._next = random.randrange(len(uids))
        self._taken = {}

    def take(self, pid: int) -> int:
        live = set(self._taken.values())
        for _ in range(len(self._uids)):
            uid = self._uids[self._next % len(self._uids)]
            self._next += 1
            if uid not in live:
                self._taken[pid] = uid
                return uid
        raise RuntimeError("every id of --session-uids is in use by a live session")

    def free(self, pid: int) -> None:
        self._taken.pop(pid, None)


def _fork_spare(own, args):
    """Fork a child that waits for its session; returns (pid, the socket to send it on).

    With a PID namespace the child is its pid 1: when it ends, the kernel
    kills every process left in it. Root forks it there directly; another
    user's child enters its namespaces and forks once more, and stays
    outside, waiting for the grandchild (the session's process) and ending
    as it did, so the zygote and the server see one process, leader of the
    session's process group, either way."""
    door, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = fork_into_pid_namespace() if "pids" in args.sandbox else None
    args.parent_waits = pid is None
    if pid is None:
        pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)  # the session's processes are one group, ended together
            # Still single-threaded, as a namespace change needs, and ahead of
            # its session: the namespaces cost milliseconds no client waits for.
            why = enter_namespaces([layer for layer in args.sandbox
                                    if args.parent_waits or layer != "pids"])
            if why:
                sys.stderr.write(f"a session process could not enter its sandbox: {why}\n")
                os._exit(1)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for s in own + (door,):
                s.close()
            if "pids" in args.sandbox and args.parent_waits:
                inner = os.fork()
                if inner != 0:
                    inside.close()
                    _end_as(inner)
            message, fds, _, _ = socket.recv_fds(inside, 65536, 3)
            if message and len(fds) == 3:
                inside.close()
                run_session(fds, message.decode(), args)
        except BaseException:
            traceback.print_exc()
            raise
        finally:
            os._exit(1)
    inside.close()
    return pid, door


def _end_as(pid: int) -> None:
    """Wait for ``pid`` and end the way it ended (the same exit code or signal)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    while True:
        try:
            status = os.waitpid(pid, 0)[1]
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote.server.worker")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--max-bytes", type=int, required=True)
    parser.add_argument("--cc", default="cc")
    parser.add_argument("--idle-timeout", type=float, default=0.0)
    parser.add_argument("--session-limit", type=parse_session_limit, action="append", default=[])
    parser.add_argument("--sandbox", type=lambda text: text.split(","), default=[])
    parser.add_argument("--session-uids", type=parse_uid_range, default=range(1, 2))
    parser.add_argument("--hide", action="append", default=[],
                        help="a file a session's process must not read (covered in its mounts)")
    args = parser.parse_args(argv)
    return zygote(socket.socket(fileno=args.control_fd), args)


if __name__ == "__main__":
    sys.exit(main())
