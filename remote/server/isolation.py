"""The device server's side of a session's worker process (remote/server/worker.py)."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable, Optional, Tuple

import remote

# The folder that holds the `remote` and `minirt` packages, so the worker
# imports the same code as the server whatever its working directory.
_CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(remote.__file__)))


class WorkerProcess:
    """A started worker: a child process that will serve one session's data connection.

    The server starts one ahead of need, so that opening a session does not
    wait for Python and numpy to start; ``assign`` gives it its session.
    ``on_exit(error_class, reason)`` is called once, from a watcher thread, when
    the process has ended for any reason.
    """

    def __init__(self, host: str, max_bytes: int, cc: str, idle_timeout_s: float,
                 tls_cert: str = "", tls_key: str = ""):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # The server owns the listening socket, so the port is known (and
        # connectable) before the child has finished importing numpy.
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(8)
            self.port = listener.getsockname()[1]
            self.token = secrets.token_urlsafe(24)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (_CODE_ROOT, env.get("PYTHONPATH", "")) if p)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "remote.server.worker",
                 "--listen-fd", str(listener.fileno()),
                 "--max-bytes", str(max_bytes), "--cc", cc,
                 "--idle-timeout", str(idle_timeout_s),
                 "--tls-cert", tls_cert, "--tls-key", tls_key],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(listener.fileno(),),
                env=env, cwd=_CODE_ROOT)
        finally:
            listener.close()
        self._stop_reason: Optional[Tuple[str, str]] = None
        self._on_exit: Callable[[str, str], None] = lambda error_class, reason: None
        self._reported = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name=f"worker-{self.proc.pid}", daemon=True).start()

    def assign(self, workspace_root: str, on_exit: Callable[[str, str], None]) -> None:
        """Hand the worker its session: the workspace folder; the token goes with it."""
        self._on_exit = on_exit
        try:
            # stdin stays open: the worker ends when it closes, that is when
            # this server process ends, however it ends.
            self.proc.stdin.write(f"{self.token}\n{workspace_root}\n".encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it died while waiting; the watcher reports why

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, error_class: str, reason: str) -> None:
        """End the worker (the server decided: close, timeout, shutdown)."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = (error_class, reason)
        if self.proc.poll() is None:
            self.proc.kill()

    def wait_exit(self, timeout: float) -> bool:
        """True once the worker has ended and ``on_exit`` has run."""
        return self._reported.wait(timeout)

    def _watch(self):
        out = self.proc.stdout.read()
        code = self.proc.wait()
        self.proc.stdout.close()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        error_class, reason = self._describe(code, out)
        try:
            self._on_exit(error_class, reason)
        finally:
            self._reported.set()

    def _describe(self, code: int, out: bytes) -> Tuple[str, str]:
        with self._lock:
            if self._stop_reason is not None:
                return self._stop_reason
        lines = out.decode("utf-8", "replace").strip().splitlines()
        if lines and "\t" in lines[-1]:
            error_class, _, reason = lines[-1].partition("\t")
            return error_class, reason
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return ("ModuleCrashed",
                    f"the process running this session's modules was killed by {name}; "
                    "a module it ran crashed (or it ran out of memory)")
        return ("SessionEnded",
                f"the process running this session's modules exited with code {code}")
