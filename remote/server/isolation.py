"""The device server's side of the processes that run sessions (remote/server/worker.py).

One zygote process per server imports everything once and forks a child per
session; ``Zygote.spawn`` hands it the client's connection. ``SessionProcess``
is the server's handle on one such child: its pid, why it ended, the tail of
what it printed.
"""
from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable, Dict, Optional, Tuple

import remote
from remote.defaults import FARM_SECRET_ENV

log = logging.getLogger("tether.server")

# The folder that holds the `remote` and `minirt` packages, so the zygote
# imports the same code as the server whatever its working directory.
_CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(remote.__file__)))
# What a session's process printed, kept for its end reason; older output is dropped.
OUTPUT_TAIL_BYTES = 16 * 1024
ZYGOTE_START_S = 120.0


# What a session is kept from, as the tracker shows it among a board's
# capabilities (attribute "isolation"; docs/security.md, "The session
# sandbox"), in this order:
#   processes   all of a session's processes end with it (its process group,
#               and the server or zygote as a subreaper);
#   pids        it runs as pid 1 of a PID namespace of its own: when it ends,
#               the kernel kills every process it started, even when the
#               server was killed with SIGKILL;
#   proc        (with pids and files) a /proc of its own PID namespace: it
#               sees no other process of the board, nor their command lines
#               or environments;
#   files       a mount namespace of its own: its workspace is its /tmp, the
#               other workspaces and the farm secret file are covered, and
#               /dev/shm and /var/tmp are empty folders of its own;
#   user        (a server run as root) a user of its own from --session-uids,
#               with no supplementary group, its workspace mode 0700;
#   no-network  a network namespace of its own with no interface up.
LAYERS = ("processes", "pids", "proc", "files", "user", "no-network")
DEFAULT_SESSION_UIDS = "200000-265535"

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_NAMESPACES = {"pids": _CLONE_NEWPID, "files": _CLONE_NEWNS, "no-network": _CLONE_NEWNET}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
# World-writable folders besides /tmp that sessions would otherwise share:
# each session's are tmpfs of its own, gone with it.
SHARED_FOLDERS = ("/dev/shm", "/var/tmp")


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _failed(what: str) -> str:
    return f"{what} ({os.strerror(ctypes.get_errno())})"


def enter_namespaces(layers) -> str:
    """In a session's process, single-threaded and ahead of its session: the
    namespaces ``layers`` name. Root makes them directly; another user through
    a user namespace of its own that maps its user and group to themselves, so
    that its files stay its own. Mounts made from here on stay in this
    process's namespace. Returns "" once done, else what failed."""
    flags = 0
    for layer, flag in _NAMESPACES.items():
        if layer in layers:
            flags |= flag
    if not flags:
        return ""
    uid, gid = os.geteuid(), os.getegid()
    if uid != 0:
        flags |= _CLONE_NEWUSER
    libc = _libc()
    if libc.unshare(flags) != 0:
        return _failed("this kernel refuses the namespaces here")
    if flags & _CLONE_NEWUSER:
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError as exc:
            return f"cannot map this user in a user namespace ({exc.strerror})"
    if flags & _CLONE_NEWNS and libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return _failed("cannot keep this session's mounts to itself")
    return ""


_OWN_PID_NAMESPACE = []


def fork_into_pid_namespace() -> Optional[int]:
    """Fork, the child as pid 1 of a PID namespace of its own, in one fork:
    this process's next child goes into a new namespace (unshare), then its
    own namespace again (setns). Root only: elsewhere (or refused) None, and
    nothing forked."""
    libc = _libc()
    if os.geteuid() != 0:
        return None
    if not _OWN_PID_NAMESPACE:
        own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        # Going back needs the namespace's owner's privilege: root inside a
        # container's user namespace lacks it.
        _OWN_PID_NAMESPACE.append(own if libc.setns(own, _CLONE_NEWPID) == 0 else None)
    if _OWN_PID_NAMESPACE[0] is None or libc.unshare(_CLONE_NEWPID) != 0:
        return None
    pid = os.fork()
    if pid == 0:
        os.close(_OWN_PID_NAMESPACE.pop())
    elif libc.setns(_OWN_PID_NAMESPACE[0], _CLONE_NEWPID) != 0:
        raise OSError(_failed("cannot go back to this process's PID namespace"))
    return pid


def confine_session(layers, workspace: str, uid: int, hidden, parent_waits: bool = True) -> str:
    """In a session's process, once it knows its workspace, before it serves:
    its workspace becomes its /tmp, the folder holding the other workspaces
    and the files in ``hidden`` are covered, and (layer "user") it takes the
    user ``uid`` with no supplementary group, for good. ``parent_waits``: its
    parent is a process outside its PID namespace that only waits for it.
    Returns the workspace's path as the session sees it."""
    libc = _libc()
    if "files" in layers:
        for path in hidden:
            # The bind fails where the file is already out of sight.
            libc.mount(b"/dev/null", path.encode(), None, _MS_BIND, None)
        if "user" in layers:
            os.chown(workspace, uid, uid)
        os.chmod(workspace, 0o700)
        if libc.mount(workspace.encode(), b"/tmp", None, _MS_BIND, None) != 0:
            raise OSError(_failed("cannot make the session's workspace its /tmp"))
        parent = os.path.dirname(workspace)
        if parent != "/tmp" and not parent.startswith("/tmp/") and _may_cover(parent):
            libc.mount(b"tmpfs", parent.encode(), b"tmpfs",
                       _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"size=4k,mode=0555")
        for folder in SHARED_FOLDERS:
            if os.path.isdir(folder) and _may_cover(folder) and libc.mount(
                    b"tmpfs", folder.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=1777") != 0:
                raise OSError(_failed(f"cannot give the session a {folder} of its own"))
        # Mounted by a process of the session's PID namespace, /proc shows
        # that namespace's processes only.
        if "proc" in layers and libc.mount(b"proc", b"/proc", b"proc",
                                           _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) != 0:
            raise OSError(_failed("cannot give the session a /proc of its own"))
        workspace = "/tmp"
    elif "user" in layers:
        os.chown(workspace, uid, uid)
        os.chmod(workspace, 0o700)
    if "user" in layers:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        # A change of user makes the process undumpable: its /proc files
        # would be root's, not its own user's.
        libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    else:
        _drop_capabilities(libc)
    # No set-user-id program gives a module back what it has left.
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if "pids" in layers and parent_waits:
        # The process outside the namespace that waits for this one: if it is
        # killed, this one goes too, and with it the namespace (set after the
        # change of user, which clears it).
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return workspace


def _may_cover(folder: str) -> bool:
    """Whether the folder of workspaces can be covered: not when it holds this
    server's code or interpreter, which a session still reads."""
    needed = (_CODE_ROOT, sys.prefix, os.path.realpath(sys.executable))
    return not any(p == folder or p.startswith(folder.rstrip("/") + "/") for p in needed)


def _drop_capabilities(libc) -> None:
    """A server that is not root made its namespaces through a user namespace,
    whose every capability this process holds: a module could undo the
    mounts. It keeps none (capset with empty sets)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (ctypes.c_uint32 * 6)()
    libc.capset(header, data)


def _probe(layers, uid: int = -1) -> str:
    """Try ``layers`` in a child process as a session would: "" when they
    work here, else what failed."""
    import tempfile
    workspace = tempfile.mkdtemp(prefix="tether-probe-")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        why = ""
        try:
            os.close(read)
            # As a session's process is (the zygote is a program of its own):
            # the server's setting (hide_from_modules) leaves /proc/self/uid_map to root.
            _libc().prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
            why = enter_namespaces(layers)
            if not why and "pids" in layers:
                # The session's process is the first of its PID namespace,
                # its pid 1: so is the process that tries the rest.
                inner = os.fork()
                if inner != 0:
                    os.waitpid(inner, 0)
                    os._exit(0)
                if os.getpid() != 1:
                    why = "a process in a new PID namespace is not its pid 1"
            if not why:
                confine_session(layers, workspace, uid, ())
        except OSError as exc:
            why = exc.strerror or str(exc)
        finally:
            os.write(write, why.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        why = f.read().decode()
    os.waitpid(pid, 0)
    os.rmdir(workspace)
    return why


def parse_uid_range(text: str) -> range:
    """``FIRST-LAST`` of --session-uids, checked.

    >>> parse_uid_range("200000-200009")
    range(200000, 200010)
    """
    first, _, last = text.partition("-")
    if not (first.isdigit() and last.isdigit() and 0 < int(first) <= int(last) < 2**32 - 1):
        raise ValueError(f"--session-uids {text!r} must be FIRST-LAST, two user ids above 0, "
                         "e.g. " + DEFAULT_SESSION_UIDS)
    return range(int(first), int(last) + 1)


def _uids_taken(uids: range) -> str:
    import pwd
    for entry in pwd.getpwall():
        if entry.pw_uid in uids:
            return (f"user {entry.pw_name} has uid {entry.pw_uid}, inside --session-uids "
                    f"{uids.start}-{uids.stop - 1}: give a range of ids no user has")
    return ""


class Sandbox:
    """What this server's sessions are kept from, found out at start: ``layers``
    in place (LAYERS' names), and a line for each layer missing."""

    def __init__(self, enabled: bool = True, allow_network: bool = False,
                 session_uids: range = None, hidden=()):
        self.uids = session_uids = session_uids or parse_uid_range(DEFAULT_SESSION_UIDS)
        self.hidden = [os.path.realpath(p) for p in hidden]
        self.missing = []
        self.layers = ["processes"]
        if not enabled:
            self.missing.append("no namespaces and no per-session user (--no-sandbox): a module "
                                "sees this board's files, processes and network as this "
                                "server's user")
            return
        wanted = ["pids", "files", "proc"]
        if os.geteuid() == 0:
            taken = _uids_taken(session_uids)
            if taken:
                raise SystemExit(taken)
            wanted.append("user")
        else:
            self.missing.append("no per-session user: this server does not run as root, so "
                                "modules run as its user and read what it can outside the "
                                "files covered for them")
        if allow_network:
            self.missing.append("sessions may use the network (--allow-network)")
        else:
            wanted.append("no-network")
        what = {"pids": "no PID namespace: processes a module starts outlive a server killed "
                        "with SIGKILL",
                "files": "no mount namespace: a module sees the other sessions' workspaces "
                         "(to their modes) and the secret file, and shares /tmp, /dev/shm and "
                         "/var/tmp",
                "proc": "no /proc of its own: a module sees every process of the board in "
                        "/proc, their command lines, and (as the server's user) their "
                        "environments",
                "user": "no per-session user: this root cannot take the ids of --session-uids "
                        "(in a container, map them into its user namespace)",
                "no-network": "no network namespace: a module opens connections from the board"}
        if not _probe(wanted, session_uids.start):
            self.layers += wanted  # all at once, as on most boards: one child tried
            return
        for layer in wanted:
            alone = [layer] + (["files"] if layer == "user" and "files" in self.layers else [])
            if layer == "proc":
                alone = ["pids", "files", "proc"]
            why = _probe(alone, session_uids.start)
            if why:
                self.missing.append(f"{what[layer]} ({why})")
            else:
                self.layers.append(layer)
        # Each works alone; together they must too (one unshare does them all).
        why = _probe(self.layers, session_uids.start) if len(self.layers) > 1 else ""
        if why:
            self.missing.append(f"the namespaces fail together ({why}): sessions keep to "
                                "their processes only")
            self.layers = ["processes"]

    @property
    def level(self) -> str:
        return ",".join(layer for layer in LAYERS if layer in self.layers)


def check_secret_file(path: str, what: str = "--farm-secret-file") -> None:
    """A secret file only the server's user may read: refused otherwise, with
    the command that fixes it."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise SystemExit(f"{what} {path}: cannot read it: {exc.strerror}") from None
    if info.st_mode & 0o077:
        raise SystemExit(f"{what} {path} may be read by others (mode {info.st_mode & 0o777:04o}); "
                         f"make it this user's alone: chmod 600 {path}")
    if info.st_uid != os.geteuid():
        raise SystemExit(f"{what} {path} belongs to uid {info.st_uid}, not to this server's "
                         f"user (uid {os.geteuid()}): chown it to that user, then chmod 600 {path}")


# Resource limits an operator may set on every session's processes
# (--session-limit NAME=VALUE): name -> (resource module's name, what it limits).
SESSION_LIMITS = {
    "as": ("RLIMIT_AS", "bytes of address space"),
    "nproc": ("RLIMIT_NPROC", "processes of the session's user"),
    "fsize": ("RLIMIT_FSIZE", "bytes a file may grow to"),
    "cpu": ("RLIMIT_CPU", "seconds of CPU time"),
}


def parse_session_limit(text: str):
    """``NAME=VALUE`` of --session-limit, checked: (name, value).

    >>> parse_session_limit("cpu=60")
    ('cpu', 60)
    """
    name, _, value = text.partition("=")
    if name not in SESSION_LIMITS or not value.isdigit():
        raise ValueError(f"session limit {text!r} must be NAME=NUMBER with NAME one of "
                         + ", ".join(f"{n} ({what})" for n, (_, what) in SESSION_LIMITS.items()))
    return name, int(value)


def apply_session_limits(limits) -> None:
    """In a session's process, before any of the session runs: the operator's limits."""
    for name, value in limits:
        kind = getattr(resource, SESSION_LIMITS[name][0])
        resource.setrlimit(kind, (value, value))


def read_secret_file(path: str, what: str = "--farm-secret-file") -> str:
    """A secret from the file at ``path`` (its first line): a secret given on
    the command line or in the environment is there for every process of the
    server's user to read, modules included."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    except OSError as exc:
        raise SystemExit(f"{what} {path}: cannot read it: {exc.strerror}") from None


def hide_from_modules() -> None:
    """Make the server's memory and /proc files (environment, open files)
    readable by root only, not by other processes of its user such as the
    modules its sessions run (Linux prctl PR_SET_DUMPABLE 0). The zygote is
    a program of its own (the setting ends at exec) and holds no secret."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class SessionProcess:
    """A session's child process, as the server sees it.

    ``on_exit(error_class, reason)`` runs once, from a watcher thread, when the
    process has ended for any reason; ``on_close()`` runs when the client
    closed the session on purpose, and the child is told once it returns.
    """

    def __init__(self, session_id: str, control: socket.socket, output_fd: int,
                 on_exit: Callable[[str, str], None], on_close: Callable[[], None]):
        self.session_id = session_id
        self.pid = 0
        self.started = threading.Event()
        self._control = control
        self._on_exit = on_exit
        self._on_close = on_close
        self._stop_reason: Optional[Tuple[str, str]] = None
        self._own_reason: Optional[Tuple[str, str]] = None
        self._tail = b""
        self._reported = threading.Event()
        self._gone = threading.Event()
        self._output_done = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._read_control, name=f"session-{session_id[:6]}",
                         daemon=True).start()
        threading.Thread(target=self._read_output, args=(output_fd,), daemon=True,
                         name=f"output-{session_id[:6]}").start()

    # -------------------------------------------------------------- child --
    def _read_control(self):
        buffered = b""
        try:
            while True:
                data = self._control.recv(4096)
                if not data:
                    break
                buffered += data
                while b"\n" in buffered:
                    line, buffered = buffered.split(b"\n", 1)
                    self._message(line.decode("utf-8", "replace"))
        except OSError:
            pass

    def _message(self, line: str):
        if line.startswith("end\t"):
            _, error_class, reason = (line.split("\t", 2) + ["", ""])[:3]
            with self._lock:
                if self._own_reason is None:
                    self._own_reason = (error_class, reason)
        elif line.startswith("log\t"):
            log.info("session %s %s", self.session_id[:8], line[4:])
        elif line == "close":
            try:
                self._on_close()
            finally:
                try:
                    self._control.sendall(b"released\n")
                except OSError:
                    pass

    def _read_output(self, fd: int):
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while True:
                data = pipe.read(65536)
                if not data:
                    break
                self._tail = (self._tail + data)[-OUTPUT_TAIL_BYTES:]
        self._output_done.set()

    # -------------------------------------------------------------- server --
    def stop(self, error_class: str, reason: str) -> None:
        """End the process (the server decided: close, timeout, shutdown)."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = (error_class, reason)
        if self.started.wait(10.0) and not self._gone.is_set():
            try:
                # Its group: what the module started goes too (the zygote also
                # ends what is left once the process has gone).
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass

    def wait_exit(self, timeout: float) -> bool:
        """True once the process has ended and ``on_exit`` has run."""
        return self._reported.wait(timeout)

    def wait_gone(self, timeout: float) -> bool:
        """True once the process has ended (``on_exit`` may still be running)."""
        return self._gone.wait(timeout)

    def exited(self, code: int) -> None:
        """Called by the zygote's reader with the child's exit code (negative: signal)."""
        if self._gone.is_set():
            return
        self._gone.set()
        self._output_done.wait(2.0)
        error_class, reason = self._describe(code)
        try:
            self._control.close()
        except OSError:
            pass
        try:
            self._on_exit(error_class, reason)
        finally:
            self._reported.set()

    def _describe(self, code: int) -> Tuple[str, str]:
        with self._lock:
            if self._stop_reason is not None:
                return self._stop_reason
            if self._own_reason is not None:
                return self._own_reason
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            reason = (f"the process running this session's modules was killed by {name}; "
                      "a module it ran crashed (or it ran out of memory)")
            return "ModuleCrashed", reason + self._output_note()
        return ("SessionEnded",
                f"the process running this session's modules exited with code {code}"
                + self._output_note())

    def _output_note(self) -> str:
        text = self._tail.decode("utf-8", "replace").strip()
        if not text:
            return ""
        lines = text.splitlines()[-5:]
        return "; its last output: " + " | ".join(line[-300:] for line in lines)


class Zygote:
    """The process that forks one child per session (remote/server/worker.py)."""

    def __init__(self, max_bytes: int, cc: str, idle_timeout_s: float, limits=(),
                 sandbox: Optional["Sandbox"] = None):
        self._argv = [sys.executable, "-m", "remote.server.worker",
                      "--max-bytes", str(max_bytes), "--cc", cc,
                      "--idle-timeout", str(idle_timeout_s)]
        for name, value in limits:
            self._argv += ["--session-limit", f"{name}={value}"]
        if sandbox is not None:
            self._argv += ["--sandbox", sandbox.level,
                           "--session-uids", f"{sandbox.uids.start}-{sandbox.uids.stop - 1}"]
            for path in sandbox.hidden:
                self._argv += ["--hide", path]
        self._lock = threading.Lock()
        self._sessions: Dict[str, SessionProcess] = {}
        self._closed = False
        self._start()

    def _start(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The farm secret stays with the server: modules run in the zygote's children.
        env = {k: v for k, v in os.environ.items() if k != FARM_SECRET_ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_CODE_ROOT, env.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen(
                self._argv + ["--control-fd", str(theirs.fileno())], stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), env=env, cwd=_CODE_ROOT)
        finally:
            theirs.close()
        self._control = ours
        self.ready = threading.Event()
        self.failed = ""
        threading.Thread(target=self._read, args=(ours, self.proc), name="zygote",
                         daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def spawn(self, session_id: str, conn: socket.socket, workspace_root: str,
              on_exit: Callable[[str, str], None], on_close: Callable[[], None]) -> SessionProcess:
        """Start the child that serves ``conn`` for a session; ``conn`` stays the caller's."""
        if self.failed:
            with self._lock:
                if self.failed:
                    self._start()  # try once more for this session
        if not self.ready.wait(ZYGOTE_START_S):
            raise RuntimeError(f"the session process starter (pid {self.proc.pid}) did not "
                               f"start within {ZYGOTE_START_S:g} s")
        if self.failed:
            raise RuntimeError(f"the process that starts sessions could not run: {self.failed}")
        control, child_control = socket.socketpair()
        out_r, out_w = os.pipe()
        process = SessionProcess(session_id, control, out_r, on_exit, on_close)
        try:
            with self._lock:
                self._sessions[session_id] = process
                socket.send_fds(self._control, [f"spawn {session_id} {workspace_root}".encode()],
                                [conn.fileno(), child_control.fileno(), out_w])
        except OSError:
            with self._lock:
                self._sessions.pop(session_id, None)
            control.close()
            raise
        finally:
            child_control.close()
            os.close(out_w)
        return process

    def _read(self, control: socket.socket, proc):
        while True:
            try:
                message = control.recv(4096)
            except OSError:
                message = b""
            if not message:
                break
            words = message.decode().split()
            if words[0] == "ready":
                log.info("the session process starter (pid %d) is ready", proc.pid)
                self.ready.set()
                continue
            with self._lock:
                process = self._sessions.get(words[1])
                if words[0] == "exit":
                    self._sessions.pop(words[1], None)
            if process is None:
                continue
            if words[0] == "started":
                process.pid = int(words[2])
                process.started.set()
                log.info("session %s runs in process %d", process.session_id[:8], process.pid)
            elif words[0] == "exit":
                threading.Thread(target=process.exited, args=(int(words[2]),),
                                 daemon=True).start()
        # The zygote itself ended: its children live on (their control sockets
        # tie them to this server), but a new zygote serves the next sessions.
        proc.wait()
        with self._lock:
            orphans = [p for p in self._sessions.values() if not p.started.is_set()]
            for process in orphans:
                del self._sessions[process.session_id]
        for process in orphans:
            process.exited(1)
        if self._closed:
            return
        if not self.ready.is_set():
            # It never started (a broken install, say): say so to the next
            # session rather than start it again in a loop.
            self.failed = f"it exited with code {proc.returncode} while starting; see the server's log"
            log.error("the session process starter (pid %d) %s", proc.pid, self.failed)
            self.ready.set()
            return
        log.error("the session process starter (pid %d) ended with code %s; starting "
                  "another", proc.pid, proc.returncode)
        self._start()

    def close(self):
        self._closed = True
        try:
            # Shut down before closing: while the reader thread is blocked in
            # recv() on it, close() alone leaves the socket open, the zygote
            # never sees its end, and stopping the server waited 10 s for it.
            self._control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._control.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
