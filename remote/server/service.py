"""The device server: sessions, their workspaces, and the modules they run.

A server either stands alone (any client may open a session) or sits behind a
tracker, when a client must present a lease token that the tracker confirms.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import secrets
import threading
import time
import traceback
from typing import Callable, Dict, Optional

import socket

import minirt
from remote import errors
from remote.errors import TetherError, abort
from remote.proto import pb
from remote.proto.frames import FrameSocket, little_endian, recv_tensors, tensor_header
from remote.proto.tensors import from_message
from remote.server import devinfo
from remote.server.isolation import WorkerProcess
from remote.server.workspace import Workspace

log = logging.getLogger("tether.server")

DEFAULT_MAX_UPLOAD_BYTES = 1 << 30
DEFAULT_IDLE_TIMEOUT_S = 300.0
# A gRPC Run without a deadline still must not hold a worker forever.
DEFAULT_RUN_TIMEOUT_S = 300.0


# Ended sessions whose reason a client may still ask for.
ENDED_KEPT = 256


class Session:
    def __init__(self, session_id: str, client: str, lease_token: str, timeout_s: float,
                 workspace_parent: Optional[str]):
        self.session_id = session_id
        self.client = client
        self.lease_token = lease_token
        self.timeout_s = timeout_s
        self.opened = self.last_used = time.monotonic()
        self.workspace = Workspace(workspace_parent)
        self.worker: Optional[WorkerProcess] = None
        self.worker_host = "127.0.0.1"
        self.lock = threading.RLock()
        self._link: Optional[FrameSocket] = None

    def link(self) -> FrameSocket:
        """The server's own connection to the worker, for the gRPC LoadModule/Run path."""
        if self._link is None:
            sock = socket.create_connection(("127.0.0.1" if self.worker_host in ("0.0.0.0", "")
                                             else self.worker_host, self.worker.port), timeout=30)
            sock.settimeout(None)
            self._link = FrameSocket(sock)
            self._link.send(pb.DataFrame(op="hello", token=self.worker.token, primary=False))
        return self._link

    def close(self):
        if self._link is not None:
            self._link.close()
        self.workspace.close()


def rpc_method(fn):
    """Turn TetherErrors into their status codes and anything else into RemoteError."""
    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except TetherError as exc:
            abort(context, exc)
        except minirt.InputError as exc:
            abort(context, errors.InputError(str(exc)))
        except minirt.ModuleLoadError as exc:
            abort(context, errors.ModuleLoadError(str(exc)))
        except Exception as exc:  # noqa: BLE001 - the client gets the traceback
            log.exception("%s failed", fn.__name__)
            abort(context, errors.RemoteError(
                f"{fn.__name__} failed on the device: {exc}\n{traceback.format_exc()}"))
    return wrapper


class DeviceService:
    """Implements the tether.v1.Device service."""

    def __init__(self, max_sessions: int = 1,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
                 workspace_parent: Optional[str] = None, attributes=None,
                 host: str = "0.0.0.0", session_queue_s: float = 0.0, cc: str = "cc",
                 tls_cert: str = "", tls_key: str = ""):
        self._redeem: Optional[Callable[[str], None]] = None
        self._release: Optional[Callable[[str], None]] = None
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_upload_bytes = max_upload_bytes
        self.workspace_parent = workspace_parent
        self.info = devinfo.collect(attributes)
        self.host = host
        self.session_queue_s = session_queue_s
        self.cc = cc
        self.tls_files = (tls_cert, tls_key)  # the data connection is TLS when gRPC is
        self._sessions: Dict[str, Session] = {}
        self._ended: Dict[str, tuple] = {}
        self._ending: Dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._slot_free = threading.Condition(self._lock)
        # A worker process started ahead of the next session (see _take_spare_worker).
        self._spare_lock = threading.Lock()
        self._spare: Optional[WorkerProcess] = self._new_worker()
        self._stop = threading.Event()
        threading.Thread(target=self._expire_loop, name="session-expiry", daemon=True).start()

    def attach_tracker(self, redeem: Callable[[str], None], release: Callable[[str], None]):
        """Require lease tokens: ``redeem`` raises AuthenticationError on a bad one."""
        self._redeem = redeem
        self._release = release

    def close(self):
        self._stop.set()
        with self._spare_lock:
            if self._spare is not None:
                self._spare.stop("SessionEnded", "server stopping")
                self._spare = None
        for session_id in list(self._sessions):
            self._end(session_id, "server stopping")

    # ---------------------------------------------------------- sessions --
    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            ended = self._ended.get(session_id)
            if ended is not None:
                error_class, reason = ended
                raise getattr(errors, error_class, errors.SessionEnded)(
                    f"the session has ended: {reason}; open a new one")
            raise errors.SessionError(
                "unknown or closed session; it may have timed out — open a new one")
        session.last_used = time.monotonic()
        return session

    def _end(self, session_id: str, why: str, error_class: str = "SessionEnded"):
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                ending = self._ending.get(session_id)
            else:
                ending = self._ending[session_id] = threading.Event()
                self._ended[session_id] = (error_class, why)
                while len(self._ended) > ENDED_KEPT:
                    self._ended.pop(next(iter(self._ended)))
        if session is None:
            # Another thread (say, the worker's exit watcher) is ending it: callers
            # such as CloseSession return only once the lease is back.
            if ending is not None:
                ending.wait(30.0)
            return
        try:
            self._finish(session, why, error_class)
        finally:
            with self._lock:
                self._ending.pop(session_id, None)
            ending.set()

    def _finish(self, session: "Session", why: str, error_class: str):
        session_id = session.session_id
        if session.worker is not None:
            session.worker.stop(error_class, why)
            session.worker.proc.wait()
        session.close()
        with self._lock:
            self._slot_free.notify()
        log.info("session %s of %s ended: %s", session_id[:8], session.client, why)
        if session.lease_token and self._release is not None:
            try:
                self._release(session.lease_token)
            except Exception as exc:  # noqa: BLE001 - the tracker frees it on expiry anyway
                log.warning("could not return the lease to the tracker: %s", exc)

    def _expire_loop(self):
        while not self._stop.wait(1.0):
            now = time.monotonic()
            for session in list(self._sessions.values()):
                if session.timeout_s and now - session.opened > session.timeout_s:
                    self._end(session.session_id,
                              f"its session timeout of {session.timeout_s:g} s was reached")
                elif session.worker is None and now - session.last_used > self.idle_timeout_s:
                    # Sessions with a worker: the worker watches its own connection.
                    self._end(session.session_id, f"idle for {self.idle_timeout_s:g} s")

    # -------------------------------------------------------------- RPCs --
    @rpc_method
    def GetInfo(self, request, context):
        return self.info

    @rpc_method
    def OpenSession(self, request, context):
        if self._redeem is not None:
            if not request.lease_token:
                raise errors.AuthenticationError(
                    "this device is behind a tracker: request it through the tracker "
                    "(rpc.connect_tracker(...).request(key)) instead of connecting directly")
            self._redeem(request.lease_token)
        with self._lock:
            deadline = time.monotonic() + self.session_queue_s
            while len(self._sessions) >= self.max_sessions:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    waited = (f" after waiting {self.session_queue_s:g} s"
                              if self.session_queue_s else "")
                    raise errors.DeviceBusy(
                        f"device busy: {len(self._sessions)} session(s) open, at most "
                        f"{self.max_sessions}{waited}; try again later or use a tracker "
                        "to queue (server options --max-sessions, --session-queue)")
                self._slot_free.wait(left)
            session = Session(secrets.token_urlsafe(16), request.client or context.peer(),
                              request.lease_token, request.session_timeout_s,
                              self.workspace_parent)
            self._sessions[session.session_id] = session
        try:
            session.worker_host = self.host
            session.worker = self._take_spare_worker()
            session.worker.assign(session.workspace.root,
                                  functools.partial(self._worker_exited, session.session_id))
        except BaseException:
            self._end(session.session_id, "its worker process could not start", "RemoteError")
            raise
        log.info("session %s opened by %s (worker pid %d)", session.session_id[:8],
                 session.client, session.worker.pid)
        return pb.SessionReply(session_id=session.session_id, info=self.info,
                               data_port=session.worker.port, data_token=session.worker.token,
                               max_upload_bytes=self.max_upload_bytes)

    def _new_worker(self) -> WorkerProcess:
        return WorkerProcess(self.host, self.max_upload_bytes, self.cc, self.idle_timeout_s,
                             *self.tls_files)

    def _take_spare_worker(self) -> WorkerProcess:
        """The worker started ahead of time (or a new one), and start the next spare."""
        with self._spare_lock:
            worker = self._spare
            self._spare = None
            if worker is None or not worker.alive():
                worker = self._new_worker()
            if not self._stop.is_set():
                self._spare = self._new_worker()
        return worker

    def _worker_exited(self, session_id: str, error_class: str, reason: str):
        self._end(session_id, reason, error_class)

    @rpc_method
    def SessionStatus(self, request, context):
        session = self._sessions.get(request.session_id)
        # A client asks when its data connection broke: give a dying worker a
        # moment to be reaped so the answer says why.
        if session is not None and session.worker is not None:
            if not session.worker.wait_exit(3.0):
                return pb.SessionState(open=True)
        ended = self._ended.get(request.session_id)
        if ended is None:
            return pb.SessionState(open=request.session_id in self._sessions,
                                   end_reason="unknown session", end_error="SessionError")
        return pb.SessionState(open=False, end_error=ended[0], end_reason=ended[1])

    @rpc_method
    def CloseSession(self, request, context):
        self._end(request.session_id, "closed by the client")
        return pb.Empty()

    @rpc_method
    def Upload(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None:
            raise errors.InvalidArgument("empty upload: no chunks were sent")
        session = self._session(first.session_id)
        target = session.workspace.path(first.name)
        if first.total_size > self.max_upload_bytes:
            raise errors.InvalidArgument(
                f"upload of {first.name!r} is {first.total_size} bytes; this device accepts "
                f"at most {self.max_upload_bytes} (server option --max-upload-bytes)")
        digest = hashlib.sha256()
        size = 0
        expected_sha = ""
        partial = target + ".part"
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            with open(partial, "wb") as f:
                chunk = first
                while chunk is not None:
                    size += len(chunk.data)
                    if size > self.max_upload_bytes:
                        raise errors.InvalidArgument(
                            f"upload of {first.name!r} exceeds {self.max_upload_bytes} bytes")
                    digest.update(chunk.data)
                    f.write(chunk.data)
                    expected_sha = chunk.sha256 or expected_sha
                    chunk = next(request_iterator, None)
            if first.total_size and size != first.total_size:
                raise errors.InvalidArgument(
                    f"upload of {first.name!r} ended after {size} of {first.total_size} bytes")
            if expected_sha and digest.hexdigest() != expected_sha:
                raise errors.InvalidArgument(
                    f"upload of {first.name!r} is corrupt: sha256 {digest.hexdigest()} "
                    f"does not match the sender's {expected_sha}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return pb.FileInfo(name=first.name, size=size, sha256=digest.hexdigest())

    @rpc_method
    def ListDir(self, request, context):
        session = self._session(request.session_id)
        files = [pb.FileInfo(name=n, size=os.path.getsize(session.workspace.path(n)))
                 for n in session.workspace.listdir()]
        return pb.FileList(files=files)

    @rpc_method
    def Download(self, request, context):
        session = self._session(request.session_id)
        path = session.workspace.existing(request.name)
        f = open(path, "rb")

        def chunks():
            digest = hashlib.sha256()
            with f:
                total = os.fstat(f.fileno()).st_size
                sent = 0
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                    sent += len(block)
                    yield pb.UploadChunk(name=request.name, total_size=total, data=block,
                                         sha256=digest.hexdigest() if sent >= total else "")
                if sent == 0:
                    yield pb.UploadChunk(name=request.name, sha256=digest.hexdigest())
        return chunks()

    @rpc_method
    def Remove(self, request, context):
        session = self._session(request.session_id)
        session.workspace.remove(request.name)
        return pb.Empty()

    # The client sends loads and runs over its data connection; these gRPC
    # forms relay to the same worker for callers that only speak gRPC.
    def _relay(self, session: Session, header, body=()):
        with session.lock:
            link = session.link()
            try:
                link.send(header, body)
                reply = link.recv_header()
            except OSError:
                session.worker.wait_exit(3.0)
                self._session(session.session_id)  # raises why the session ended
                raise errors.SessionEnded("the session's worker process went away")
            if reply.op == "error":
                link.skip(link.body_left)
                raise getattr(errors, reply.error, errors.RemoteError)(reply.text)
            return reply, link

    @rpc_method
    def LoadModule(self, request, context):
        session = self._session(request.session_id)
        reply, _ = self._relay(session, pb.DataFrame(op="load", name=request.name))
        return pb.ModuleInfo(module_id=reply.name, metadata_json=reply.text, load_s=reply.seconds)

    @rpc_method
    def Run(self, request, context):
        session = self._session(request.session_id)
        try:
            inputs = [(t.name, little_endian(from_message(t))) for t in request.inputs]
        except ValueError as exc:
            raise errors.InputError(str(exc))
        header = pb.DataFrame(op="run", name=request.module_id,
                              timeout_s=context.time_remaining() or DEFAULT_RUN_TIMEOUT_S,
                              tensors=[tensor_header(n, a) for n, a in inputs])
        with session.lock:
            reply, link = self._relay(session, header, [a for _, a in inputs])
            outputs = recv_tensors(link, reply.tensors)
        return pb.RunReply(outputs=[pb.Tensor(name=t.name, dtype=t.dtype, shape=t.shape,
                                              data=little_endian(a).tobytes())
                                    for t, a in zip(reply.tensors, outputs)],
                           run_s=reply.seconds)
