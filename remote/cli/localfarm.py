"""A tracker and device servers as child processes on loopback, for the demo and tests.

    >>> with LocalFarm(keys=["local"]) as farm:              # doctest: +SKIP
    ...     sess = rpc.connect_tracker(*farm.tracker).request("local")

The children's logs live in a temporary folder (``farm.log_dir``) that stopping
the farm removes, unless the ``with`` block ends with an error: then the folder
is kept for the person reading that error.
"""
from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from remote.client.tracker import TrackerClient
from remote.defaults import FARM_SECRET_ENV, TLS_CA_ENV, TOKEN_ENV

STARTUP_TIMEOUT_S = 60.0


class ProcessStartError(RuntimeError):
    pass


class Child:
    """One started process whose first stdout line names its port."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: str, env=None):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, start_new_session=True)
        self.port = self._read_port()

    def _read_port(self) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        line = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    break
            if self.proc.poll() is not None:
                break
        if b"listening on" not in line:
            self.stop()
            raise ProcessStartError(f"{self.name} did not start (log {self.log_path}): "
                                    f"{self.log_tail()}")
        self.first_line = line.decode("utf-8", "replace").strip()
        return int(line.split(b"listening on", 1)[1].split()[0].rsplit(b":", 1)[1])

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def log_tail(self, lines: int = 20) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: Optional[int] = None):
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._log.close()


def python_argv(module: str, *args: str) -> List[str]:
    return [sys.executable, "-m", module, *args]


class LocalFarm:
    """A tracker plus one device server per key, all on 127.0.0.1.

    ``server_command`` starts a device server (default: the Python one,
    ``python -m remote.server``); the native one is its executable's path.
    """

    def __init__(self, keys: Sequence[str] = ("local",), host: str = "127.0.0.1",
                 tracker_args: Sequence[str] = (), server_args: Sequence[str] = (),
                 env=None, server_command: Optional[Sequence[str]] = None):
        self.keys = list(keys)
        self.server_command = list(server_command or python_argv("remote.server"))
        self.host = host
        self.tracker_args = list(tracker_args)
        self.server_args = list(server_args)
        self.env = env
        self.log_dir = tempfile.mkdtemp(prefix="tether-farm-")
        if not any(a == "--db" or a.startswith("--db=") for a in self.tracker_args):
            # A farm of its own keeps its records with its logs (and a restarted
            # tracker finds them there), not in the user's state folder.
            self.tracker_args += ["--db", "sqlite:///" + os.path.join(self.log_dir,
                                                                     "farm.sqlite")]
        self.tracker_proc: Optional[Child] = None
        self.servers: List[Child] = []
        self._per_key: Dict[str, int] = {}

    @property
    def tracker(self) -> Tuple[str, int]:
        return self.host, self.tracker_proc.port

    def start(self) -> "LocalFarm":
        self.start_tracker(0)
        for i, key in enumerate(self.keys):
            self.add_server(key, name=f"server-{i}-{key}")
        return self

    def start_tracker(self, port: int, name: str = "tracker") -> Child:
        """Start the tracker process (port 0 picks a free port)."""
        self.tracker_proc = Child(name, python_argv(
            "remote.tracker", "--host", self.host, "--port", str(port), *self.tracker_args),
            self.log_dir, self.env)
        return self.tracker_proc

    def restart_tracker(self, down_s: float = 0.0) -> Child:
        """Stop the tracker and start a fresh one on the same port after ``down_s``."""
        port = self.tracker_proc.port
        self.tracker_proc.stop()
        time.sleep(down_s)
        return self.start_tracker(port, name=f"tracker-{port}-again-{time.monotonic_ns()}")

    def add_server(self, key: str, name: Optional[str] = None, extra: Sequence[str] = (),
                   wait: bool = True) -> Child:
        child = Child(name or f"server-{len(self.servers)}-{key}", [
            *self.server_command, "--host", self.host, "--port", "0",
            "--tracker", f"{self.host}:{self.tracker_proc.port}", "--key", key,
            *self.server_args, *extra], self.log_dir, self.env)
        self.servers.append(child)
        self._per_key[key] = self._per_key.get(key, 0) + 1
        if wait:
            self.wait_for_devices(key, self._per_key[key])
        return child

    def client(self) -> TrackerClient:
        """A client of this farm's tracker, with the farm's TLS trust, secret and token."""
        env = self.env if self.env is not None else os.environ
        return TrackerClient(*self.tracker, tls_ca=env.get(TLS_CA_ENV, ""),
                             farm_secret=env.get(FARM_SECRET_ENV, ""),
                             token=env.get(TOKEN_ENV, ""))

    def wait_for_devices(self, key: str, count: int, timeout: float = STARTUP_TIMEOUT_S):
        """Block until the tracker lists ``count`` devices of ``key``."""
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while time.monotonic() < deadline:
                keys = {k["key"]: k["total"] for k in client.summary()["keys"]}
                if keys.get(key, 0) >= count:
                    return
                time.sleep(0.1)
        raise ProcessStartError(f"{count} device(s) of key {key!r} did not register within "
                                f"{timeout:g} s; server logs in {self.log_dir}")

    def stop(self, keep_logs: bool = False):
        """Stop every child; remove the log folder unless ``keep_logs``."""
        for child in self.servers:
            child.stop()
        if self.tracker_proc is not None:
            self.tracker_proc.stop()
        if not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "LocalFarm":
        try:
            return self.start()
        except BaseException as exc:
            self.stop(keep_logs=isinstance(exc, Exception))
            raise

    def __exit__(self, exc_type, exc, tb):
        # Ctrl-C (KeyboardInterrupt) is no failure to investigate: nothing is kept.
        self.stop(keep_logs=exc_type is not None and issubclass(exc_type, Exception))
