"""The device server: sessions, their workspaces, and the processes that run them.

A server either stands alone (any client may open a session) or sits behind a
tracker, when a client must present a lease token that the tracker confirms
over the board's link (remote/server/registration.py).

Every connection to the server's port starts with one frame (board protocol
v2, docs/protocol.md): ``open`` makes it a session, served from then on by the
session's own process; ``status`` asks why a session ended; ``info`` asks what
the board is.
"""
from __future__ import annotations

import logging
import secrets
import socket
import ssl
import threading
import time
from typing import Callable, Dict, Optional

from remote import errors
from remote.errors import TetherError
from remote.proto import pb
from remote.proto.frames import (PROTOCOL_VERSION, FrameSocket, error_frame, looks_like_http2,
                                 splice, version_error)
from remote.server import devinfo
from remote.server.isolation import Sandbox, SessionProcess, Zygote
from remote.server.workspace import Workspace

log = logging.getLogger("tether.server")

DEFAULT_MAX_UPLOAD_BYTES = 1 << 30
DEFAULT_IDLE_TIMEOUT_S = 300.0
# Ended sessions whose reason a client may still ask for.
ENDED_KEPT = 256


class Session:
    def __init__(self, session_id: str, client: str, lease_token: str, timeout_s: float,
                 workspace_parent: Optional[str]):
        self.session_id = session_id
        self.client = client
        self.lease_token = lease_token
        self.timeout_s = timeout_s
        self.opened = time.monotonic()
        self.workspace = Workspace(workspace_parent)
        self.process: Optional[SessionProcess] = None

    def close(self):
        self.workspace.close()


class DeviceService:
    """Sessions on this board, opened by the first frame of a connection."""

    def __init__(self, max_sessions: int = 1,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
                 workspace_parent: Optional[str] = None, attributes=None,
                 session_queue_s: float = 0.0, cc: str = "cc", session_limits=(),
                 sandbox: Optional[Sandbox] = None):
        self._redeem: Optional[Callable[[str], None]] = None
        self._release: Optional[Callable[[str], None]] = None
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_upload_bytes = max_upload_bytes
        self.workspace_parent = workspace_parent
        self.info = devinfo.collect(attributes)
        # How far sessions are isolated: the server's to say, not the operator's.
        self.info.attributes["isolation"] = sandbox.level if sandbox is not None else "processes"
        self.session_queue_s = session_queue_s
        self._sessions: Dict[str, Session] = {}
        self._ended: Dict[str, tuple] = {}
        self._ending: Dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._slot_free = threading.Condition(self._lock)
        self._zygote = Zygote(max_upload_bytes, cc, idle_timeout_s, session_limits, sandbox)
        self._stop = threading.Event()
        threading.Thread(target=self._expire_loop, name="session-expiry", daemon=True).start()

    def attach_tracker(self, redeem: Callable[[str], None], release: Callable[[str], None]):
        """Require lease tokens: ``redeem`` raises AuthenticationError on a bad one."""
        self._redeem = redeem
        self._release = release

    def live_tokens(self):
        with self._lock:
            return sorted(s.lease_token for s in self._sessions.values() if s.lease_token)

    def close(self):
        self._stop.set()
        for session_id in list(self._sessions):
            self._end(session_id, "server stopping")
        self._zygote.close()

    # ---------------------------------------------------------- sessions --
    def _end(self, session_id: str, why: str, error_class: str = "SessionEnded",
             stop_process: bool = True):
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
            # Another thread (say, the process's exit watcher) is ending it:
            # callers such as a close return only once the lease is back.
            if ending is not None:
                ending.wait(30.0)
            return
        try:
            self._finish(session, why, error_class, stop_process)
        finally:
            with self._lock:
                self._ending.pop(session_id, None)
            ending.set()

    def _finish(self, session: Session, why: str, error_class: str, stop_process: bool):
        if session.process is not None and stop_process:
            session.process.stop(error_class, why)
            session.process.wait_gone(10.0)
        session.close()
        with self._lock:
            self._slot_free.notify()
        log.info("session %s of %s ended: %s", session.session_id[:8], session.client, why)
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

    # -------------------------------------------------------- connections --
    def handle(self, sock: socket.socket, peer: str,
               first_read: Callable[[], None] = lambda: None) -> None:
        """Serve a new connection's first frame; ``first_read()`` is called once it
        has arrived (the caller's deadline for it ends there)."""
        fs = FrameSocket(sock)
        fs.max_header = 64 * 1024  # a first frame is small; nothing larger is read
        handed_over = False
        try:
            first = fs.recv_header()
            first_read()
            if first.version != PROTOCOL_VERSION:
                fs.send(error_frame("ConnectionFailed", version_error(first.version, "client")))
            elif first.op == "open":
                handed_over = self._open(fs, first, peer)
            elif first.op == "status":
                fs.send(self._status(first.name))
            elif first.op == "close":
                # From a new connection, when the session's own is busy or stuck;
                # the unguessable session id is what entitles the caller.
                self._end(first.name, "closed by the client")
                fs.send(pb.DataFrame(op="ok"))
            elif first.op == "info":
                fs.send(pb.DataFrame(op="ok", info=self.info))
            else:
                fs.send(error_frame("InvalidArgument", f"a connection must begin with open, "
                                    f"status, close or info, not {first.op!r}"))
        except TetherError as exc:
            _send_quietly(fs, error_frame(type(exc).__name__, str(exc)))
        except ConnectionError as exc:
            if looks_like_http2(exc):
                _answer_v1_client(sock, exc.seen + fs.buffered())
        except (OSError, ValueError) as exc:
            log.info("connection from %s dropped before a session: %s", peer, exc)
        finally:
            if not handed_over:
                fs.close()

    def _open(self, fs: FrameSocket, request, peer: str) -> bool:
        if fs.buffered():
            raise errors.InvalidArgument("send nothing after open before its answer")
        if self._redeem is not None:
            if not request.token:
                raise errors.AuthenticationError(
                    "this device is behind a tracker: request it through the tracker "
                    "(rpc.connect_tracker(...).request(key)) instead of connecting directly")
            self._redeem(request.token)
        with self._lock:
            deadline = time.monotonic() + self.session_queue_s
            while len(self._sessions) >= self.max_sessions:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    waited = (f" after waiting {self.session_queue_s:g} s"
                              if self.session_queue_s else "")
                    error = errors.DeviceBusy(
                        f"device busy: {len(self._sessions)} session(s) open, at most "
                        f"{self.max_sessions}{waited}; try again later or use a tracker "
                        "to queue (server options --max-sessions, --session-queue)")
                    break
                self._slot_free.wait(left)
            else:
                error = None
                session = Session(secrets.token_urlsafe(16), request.client or peer,
                                  request.token, request.session_timeout_s,
                                  self.workspace_parent)
                self._sessions[session.session_id] = session
        if error is not None:
            raise error
        sid = session.session_id
        conn = fs.sock
        try:
            if isinstance(conn, ssl.SSLSocket):
                # TLS state cannot move to another process: this server carries
                # the session's bytes between the TLS socket and the child.
                conn, child_end = socket.socketpair()
                splice(fs.sock, conn, f"tls-{sid[:6]}")
            else:
                child_end = conn
            session.process = self._zygote.spawn(
                sid, child_end, session.workspace.root,
                on_exit=lambda cls, why: self._end(sid, why, cls),
                on_close=lambda: self._end(sid, "closed by the client", stop_process=False))
            if child_end is not fs.sock:
                child_end.close()
            # Logged before the answer: once the client hears "ok", the log says so.
            log.info("session %s opened by %s", sid[:8], session.client)
            fs.send(pb.DataFrame(op="ok", name=sid, info=self.info,
                                 size=self.max_upload_bytes))
        except BaseException:
            self._end(sid, "its process could not start", "RemoteError")
            raise
        if not isinstance(fs.sock, ssl.SSLSocket):
            fs.sock.close()  # the session's process has its own copy
        return True

    def _status(self, session_id: str):
        session = self._sessions.get(session_id)
        # A client asks when its connection broke: give a dying process a
        # moment to be reaped so the answer says why.
        if session is not None and session.process is not None:
            if not session.process.wait_exit(3.0):
                return pb.DataFrame(op="ok", open=True)
        ended = self._ended.get(session_id)
        if ended is None:
            return pb.DataFrame(op="ok", open=session_id in self._sessions,
                                text="unknown session", error="SessionError")
        return pb.DataFrame(op="ok", open=False, error=ended[0], text=ended[1])


def _send_quietly(fs: FrameSocket, frame) -> None:
    try:
        fs.send(frame)
    except OSError:
        pass


def _answer_v1_client(sock, seen: bytes) -> None:
    """A protocol v1 client spoke gRPC to this port: answer in kind, so it
    raises an error that says what to do instead of hanging."""
    from remote.proto.http2 import refuse_grpc

    try:
        refuse_grpc(sock, seen, "this board speaks Tether board protocol v2 and this client "
                          "protocol v1 (gRPC); update Tether on this computer")
    except OSError:
        pass
