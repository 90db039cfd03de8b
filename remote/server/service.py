"""The device server: sessions, their workspaces, and the modules they run.

A server either stands alone (any client may open a session) or sits behind a
tracker, when a client must present a lease token that the tracker confirms.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import threading
import time
import traceback
from typing import Callable, Dict, Optional

import minirt
from remote import errors
from remote.errors import TetherError, abort
from remote.proto import pb
from remote.proto.tensors import from_message, to_message
from remote.server import devinfo
from remote.server.workspace import Workspace

log = logging.getLogger("tether.server")

DEFAULT_MAX_UPLOAD_BYTES = 1 << 30
DEFAULT_IDLE_TIMEOUT_S = 300.0


class Session:
    def __init__(self, session_id: str, client: str, lease_token: str, timeout_s: float,
                 workspace_parent: Optional[str]):
        self.session_id = session_id
        self.client = client
        self.lease_token = lease_token
        self.timeout_s = timeout_s
        self.opened = self.last_used = time.monotonic()
        self.workspace = Workspace(workspace_parent)
        self.modules: Dict[str, object] = {}
        self.lock = threading.Lock()

    def close(self):
        self.modules.clear()
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
                 workspace_parent: Optional[str] = None, attributes=None):
        self._redeem: Optional[Callable[[str], None]] = None
        self._release: Optional[Callable[[str], None]] = None
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_upload_bytes = max_upload_bytes
        self.workspace_parent = workspace_parent
        self.info = devinfo.collect(attributes)
        self._sessions: Dict[str, Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._expire_loop, name="session-expiry", daemon=True).start()

    def attach_tracker(self, redeem: Callable[[str], None], release: Callable[[str], None]):
        """Require lease tokens: ``redeem`` raises AuthenticationError on a bad one."""
        self._redeem = redeem
        self._release = release

    def close(self):
        self._stop.set()
        for session_id in list(self._sessions):
            self._end(session_id, "server stopping")

    @property
    def busy(self) -> bool:
        return bool(self._sessions)

    # ---------------------------------------------------------- sessions --
    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise errors.SessionError(
                "unknown or closed session; it may have timed out — open a new one")
        session.last_used = time.monotonic()
        return session

    def _end(self, session_id: str, why: str):
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return
        with session.lock:
            session.close()
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
                    self._end(session.session_id, f"session timeout of {session.timeout_s:g} s")
                elif now - session.last_used > self.idle_timeout_s:
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
            if len(self._sessions) >= self.max_sessions:
                raise errors.DeviceBusy(
                    f"device busy: {len(self._sessions)} session(s) open, at most "
                    f"{self.max_sessions}; try again later or use a tracker to queue")
            session = Session(secrets.token_urlsafe(16), request.client or context.peer(),
                              request.lease_token, request.session_timeout_s,
                              self.workspace_parent)
            self._sessions[session.session_id] = session
        log.info("session %s opened by %s", session.session_id[:8], session.client)
        return pb.SessionReply(session_id=session.session_id, info=self.info)

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
    def LoadModule(self, request, context):
        session = self._session(request.session_id)
        path = session.workspace.existing(request.name)
        start = time.perf_counter()
        module = minirt.load(path)
        load_s = time.perf_counter() - start
        module_id = f"{request.name}#{len(session.modules)}"
        session.modules[module_id] = module
        return pb.ModuleInfo(module_id=module_id, metadata_json=json.dumps(module.metadata),
                             load_s=load_s)

    @rpc_method
    def Run(self, request, context):
        session = self._session(request.session_id)
        module = session.modules.get(request.module_id)
        if module is None:
            raise errors.InvalidArgument(
                f"no module {request.module_id!r} loaded in this session; call load_module first")
        try:
            inputs = {t.name: from_message(t) for t in request.inputs}
        except ValueError as exc:
            raise errors.InputError(str(exc))
        with session.lock:
            start = time.perf_counter()
            outputs = module.run(inputs)
            run_s = time.perf_counter() - start
        names = [spec.name for spec in module.outputs]
        return pb.RunReply(outputs=[to_message(n, a) for n, a in zip(names, outputs)],
                           run_s=run_s)
