"""Put the device server on a board over SSH and keep it running.

``bootstrap`` probes the board, copies only the device-side files, installs
missing packages when allowed, starts the server as a systemd unit (or as a
background process with a pid file where systemd is absent) and waits until
the tracker lists the board. Running it again upgrades in place;
``uninstall`` removes everything it put there. With ``native=True`` the board
needs no Python: it is probed with POSIX sh alone and gets the static C++
server built for its architecture (remote/cli/native.py) instead.

    >>> report = bootstrap("pi@192.168.1.20", tracker="192.168.1.2:9190",
    ...                    key="rasp4b64", install_deps=True)      # doctest: +SKIP
    >>> report.device["address"]                                   # doctest: +SKIP
    '192.168.1.20:9090'
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shlex
import socket
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Union

from deploy_recipes.devicecode import PROJECT_ROOT, device_files
from remote.address import split_address
from remote.defaults import SERVER_PORT, TRACKER_ENV, TRACKER_PORT
from remote.errors import TetherError

MIN_PYTHON = (3, 9)
UNIT_NAME = "tether-server.service"
# Debian package and pip distribution for each module the server imports.
DEPENDENCIES = {"numpy": ("python3-numpy", "numpy"),
                "google.protobuf": ("python3-protobuf", "protobuf")}

Progress = Optional[Callable[[str], None]]


class BootstrapError(TetherError):
    """The board could not be set up; the message says why and what to do."""


class SSHAuthenticationFailed(BootstrapError):
    """The board refused our SSH login."""


class HostKeyError(BootstrapError):
    """The board's SSH host key is unknown or differs from the recorded one."""


class BoardNotReady(BootstrapError):
    """The board lacks something the server needs (python3, packages, the tracker)."""


# Runs on the board with any Python 2.7/3.x, so that even a too-old Python is
# described rather than crashing on syntax.
PROBE = r'''
import json, os, platform, socket, sys
out = {"machine": platform.machine(), "python": platform.python_version(),
       "python_path": sys.executable, "uid": os.getuid(), "home": os.path.expanduser("~"),
       "systemd": os.path.isdir("/run/systemd/system"),
       "android": "ANDROID_ROOT" in os.environ, "modules": {}}
for name in ("numpy", "google.protobuf"):
    try:
        out["modules"][name] = getattr(__import__(name, fromlist=["__version__"]), "__version__", "?")
    except Exception as exc:
        out["modules"][name] = None
def read(path):
    try:
        with open(path) as f:
            return f.read()
    except Exception:
        return ""
os_release = dict(l.split("=", 1) for l in read("/etc/os-release").splitlines() if "=" in l)
out["os"] = os_release.get("PRETTY_NAME", platform.platform()).strip('"')
out["os_id"] = os_release.get("ID", "").strip('"')
out["board_model"] = read("/proc/device-tree/model").strip("\0 \n")
cpu = {}
for line in read("/proc/cpuinfo").splitlines():
    k, _, v = line.partition(":")
    cpu.setdefault(k.strip().lower(), v.strip())
out["cpu_model"] = cpu.get("model name") or cpu.get("hardware") or cpu.get("cpu model") or ""
out["cpu_part"] = cpu.get("cpu part", "")
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), 5).close()
    out["tracker"] = "ok"
except Exception as exc:
    out["tracker"] = str(exc) or type(exc).__name__
print(json.dumps(out))
'''

# The same facts from POSIX sh alone, for boards without Python (key=value lines).
# bash's /dev/tcp tests the tracker's port where bash exists; elsewhere the
# server's own log says whether it reached the tracker.
SHELL_PROBE = r"""
echo "machine=$(uname -m)"
echo "uid=$(id -u)"
echo "home=$HOME"
if [ -d /run/systemd/system ]; then echo systemd=1; else echo systemd=0; fi
if [ -n "$ANDROID_ROOT" ]; then echo android=1; else echo android=0; fi
if [ -r /etc/os-release ]; then
  (. /etc/os-release; echo "os=${PRETTY_NAME:-$NAME}"; echo "os_id=$ID")
fi
if [ -r /proc/device-tree/model ]; then
  echo "board_model=$(tr -d '\000' < /proc/device-tree/model)"
fi
cpu() {
  grep -i "^$1[[:space:]]*:" /proc/cpuinfo 2>/dev/null | head -n 1 | sed 's/^[^:]*:[[:space:]]*//'
}
model=$(cpu 'model name')
[ -n "$model" ] || model=$(cpu hardware)
[ -n "$model" ] || model=$(cpu 'cpu model')
echo "cpu_model=$model"
echo "cpu_part=$(cpu 'cpu part')"
if command -v sha256sum >/dev/null 2>&1; then echo sha256sum=1; else echo sha256sum=0; fi
if command -v bash >/dev/null 2>&1; then
  limit=; if command -v timeout >/dev/null 2>&1; then limit="timeout 5"; fi
  if out=$($limit bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>&1); then echo tracker=ok
  else echo "tracker=$(echo "${out:-no answer within 5 s}" | tail -n 1 | sed 's/.*: //')"; fi
else
  echo tracker=unchecked
fi
"""

# "CPU part" numbers of ARM cores in /proc/cpuinfo.
_CPU_PARTS = {"0xd03": "cortex-a53", "0xd08": "cortex-a72", "0xd0b": "cortex-a76",
              "0xd07": "cortex-a57", "0xd05": "cortex-a55", "0xd42": "cortex-a78ae"}


def suggest_target(probe: Dict) -> str:
    """The crosscompile target preset (or triple/cpu) that fits a probed board.

    >>> suggest_target({"machine": "aarch64", "board_model": "Raspberry Pi 4 Model B Rev 1.4"})
    'rasp4b64'
    >>> suggest_target({"machine": "armv7l", "board_model": "Raspberry Pi 3 Model B Plus Rev 1.3"})
    'rasp3b'
    """
    machine = probe.get("machine", "")
    model = probe.get("board_model", "") + " " + probe.get("cpu_model", "")
    is64 = machine in ("aarch64", "arm64")
    if probe.get("android"):
        return "android-arm64" if is64 else "android-armv7"
    if "Raspberry Pi 5" in model:
        return "rasp5" if is64 else "rasp4b"
    if "Raspberry Pi 4" in model or "Raspberry Pi 400" in model:
        return "rasp4b64" if is64 else "rasp4b"
    if "Raspberry Pi 3" in model or "Raspberry Pi Zero 2" in model:
        return "aarch64-unknown-linux-gnu/cortex-a53/+neon" if is64 else "rasp3b"
    if machine in ("x86_64", "amd64"):
        return "host"
    cpu = _CPU_PARTS.get(probe.get("cpu_part", "").lower(), "generic")
    if is64:
        return f"aarch64-unknown-linux-gnu/{cpu}/+neon"
    if machine.startswith("armv7") or machine == "armv8l":
        return f"armv7l-unknown-linux-gnueabihf/{cpu}/+neon"
    return f"{machine}-unknown-linux-gnu"


class BoardLogin(NamedTuple):
    user: Optional[str]
    host: str
    port: int


def parse_board(text: str) -> BoardLogin:
    """``user@host[:port]`` to its parts.

    >>> parse_board("pi@raspberrypi.local:2222")
    BoardLogin(user='pi', host='raspberrypi.local', port=2222)
    """
    user, sep, rest = text.rpartition("@")
    host, port = split_address(rest, 22)
    if not host:
        raise ValueError(f"board {text!r} must look like user@host or user@host:port")
    return BoardLogin(user if sep else None, host, port)


class _AskToAccept:
    """Missing-host-key policy: refuse, or (first contact only, when asked) record it."""

    def __init__(self, accept_new: bool, known_hosts: str):
        self.accept_new = accept_new
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        fingerprint = _fingerprint(key)
        if not self.accept_new:
            raise HostKeyError(
                f"the SSH host key of {hostname} is unknown ({key.get_name()} {fingerprint}). "
                f"Check the fingerprint on the board (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) "
                f"and run again with --accept-new-host-key to record it in {self.known_hosts}")
        client.get_host_keys().add(hostname, key.get_name(), key)
        os.makedirs(os.path.dirname(self.known_hosts) or ".", exist_ok=True)
        client.save_host_keys(self.known_hosts)


def _fingerprint(key) -> str:
    import base64
    import hashlib
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class Board:
    """An SSH connection to a board, with the few remote operations bootstrap needs."""

    def __init__(self, login: BoardLogin, identity: Optional[str] = None,
                 password: Optional[str] = None, known_hosts: Optional[str] = None,
                 accept_new_host_key: bool = False, timeout: float = 15.0):
        import paramiko
        self.login = login
        known_hosts = known_hosts or os.path.expanduser("~/.ssh/known_hosts")
        self.client = paramiko.SSHClient()
        if os.path.exists(known_hosts):
            self.client.load_host_keys(known_hosts)
        self.client.set_missing_host_key_policy(_AskToAccept(accept_new_host_key, known_hosts))
        where = f"{login.user + '@' if login.user else ''}{login.host}:{login.port}"
        try:
            self.client.connect(
                login.host, port=login.port, username=login.user, key_filename=identity,
                password=password, look_for_keys=identity is None and password is None,
                allow_agent=identity is None and password is None, timeout=timeout,
                banner_timeout=timeout, auth_timeout=timeout)
        except paramiko.BadHostKeyException as exc:
            raise HostKeyError(
                f"the SSH host key of {where} has CHANGED since it was recorded in {known_hosts} "
                f"(now {exc.key.get_name()} {_fingerprint(exc.key)}). Someone may be "
                f"intercepting the connection, or the board was reinstalled; if you are sure "
                f"it is the latter, run: ssh-keygen -f {known_hosts} -R "
                f"'{_known_hosts_name(login)}'") from None
        except paramiko.AuthenticationException as exc:
            how = f"key {identity}" if identity else ("the password" if password else
                                                       "your SSH agent and ~/.ssh keys")
            raise SSHAuthenticationFailed(
                f"{where} refused the login with {how} ({exc}); pass --identity FILE with a "
                f"key listed in the board's ~/.ssh/authorized_keys (ssh-copy-id helps)") from None
        except (socket.error, paramiko.SSHException) as exc:
            if isinstance(exc, HostKeyError):
                raise
            raise BootstrapError(f"cannot reach {where} over SSH: {exc}") from None

    def run(self, command: str, stdin: Union[str, bytes, None] = None, timeout: float = 600.0):
        """(exit status, stdout, stderr) of a shell command on the board."""
        chan_in, chan_out, chan_err = self.client.exec_command(command, timeout=timeout)
        if stdin is not None:
            chan_in.write(stdin)
            chan_in.channel.shutdown_write()
        out = chan_out.read().decode(errors="replace")
        err = chan_err.read().decode(errors="replace")
        return chan_out.channel.recv_exit_status(), out, err

    def check(self, command: str, what: str, timeout: float = 600.0) -> str:
        status, out, err = self.run(command, timeout=timeout)
        if status != 0:
            raise BootstrapError(f"{what} failed on {self.login.host} (exit {status}): "
                                 f"{(err or out).strip()[-2000:]}")
        return out

    def put_files(self, local_root: str, files: List[str], remote_root: str):
        sftp = self.client.open_sftp()
        try:
            made = set()
            for rel in files:
                target = posixpath.join(remote_root, rel)
                folder = posixpath.dirname(target)
                if folder not in made:
                    self.check(f"mkdir -p {shlex.quote(folder)}", "mkdir")
                    made.add(folder)
                sftp.put(os.path.join(local_root, *rel.split("/")), target)
        finally:
            sftp.close()

    def write_file(self, path: str, text: str, mode: int = 0o644):
        self.write_bytes(path, text.encode(), mode)

    def write_bytes(self, path: str, data: bytes, mode: int = 0o644):
        """Write ``data`` through the shell (boards with dropbear often lack SFTP);
        a running executable at ``path`` is replaced, not overwritten."""
        part = shlex.quote(path + ".part")
        status, out, err = self.run(f"cat > {part} && chmod {mode:o} {part} && "
                                    f"mv -f {part} {shlex.quote(path)}", stdin=data)
        if status != 0:
            raise BootstrapError(f"writing {path} failed on {self.login.host} (exit {status}): "
                                 f"{(err or out).strip()[-2000:]}")

    def close(self):
        self.client.close()


def _known_hosts_name(login: BoardLogin) -> str:
    return login.host if login.port == 22 else f"[{login.host}]:{login.port}"


class Layout(NamedTuple):
    """Where bootstrap puts things on the board."""
    root: str          # e.g. /home/pi/.tether
    code: str          # device-side files, on PYTHONPATH
    log: str
    pid: str
    manifest: str
    unit: str          # systemd unit path ("" for background)
    user_unit: bool    # systemctl --user


def _layout(probe: Dict, remote_dir: str, service: str) -> Layout:
    root = remote_dir.replace("~", probe["home"], 1) if remote_dir.startswith("~") else remote_dir
    unit = ""
    user_unit = False
    if service == "systemd":
        if probe["uid"] == 0:
            unit = f"/etc/systemd/system/{UNIT_NAME}"
        else:
            unit = posixpath.join(probe["home"], ".config/systemd/user", UNIT_NAME)
            user_unit = True
    return Layout(root, posixpath.join(root, "code"), posixpath.join(root, "server.log"),
                  posixpath.join(root, "server.pid"), posixpath.join(root, "installed.json"),
                  unit, user_unit)


def server_command(program: List[str], tracker: str, key: str, port: int,
                   advertise: Optional[str]) -> List[str]:
    """``program`` (``[python, "-m", "remote.server"]`` or the native executable)
    with the options both servers take."""
    argv = [*program, "--host", "0.0.0.0", "--port", str(port), "--tracker", tracker, "--key", key]
    if advertise:
        argv += ["--advertise", advertise]
    return argv


def python_environment(layout: Layout) -> Dict[str, str]:
    """What the Python server needs in its environment (the native one needs nothing)."""
    return {"PYTHONPATH": layout.code, "PYTHONUNBUFFERED": "1"}


def systemd_unit(argv: List[str], layout: Layout, env: Dict[str, str]) -> str:
    """The unit file that keeps the server running (see deploy_recipes/tether-server.service)."""
    return (
        "[Unit]\n"
        "Description=Tether device server\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n\n"
        "[Service]\n"
        + "".join(f"Environment={name}={value}\n" for name, value in env.items()) +
        f"WorkingDirectory={layout.root}\n"
        f"ExecStart={' '.join(shlex.quote(a) for a in argv)}\n"
        "Restart=always\n"
        "RestartSec=3\n\n"
        "[Install]\n"
        f"WantedBy={'default.target' if layout.user_unit else 'multi-user.target'}\n")


def stop_commands(layout: Layout) -> str:
    """Shell that stops whatever an earlier bootstrap started (systemd unit or pid file)."""
    pid = shlex.quote(layout.pid)
    parts = [f"if [ -f {pid} ]; then p=$(cat {pid}); kill $p 2>/dev/null; "
             f"for i in $(seq 50); do kill -0 $p 2>/dev/null || break; sleep 0.2; done; "
             f"kill -9 $p 2>/dev/null; rm -f {pid}; fi"]
    if layout.unit:
        ctl = "systemctl --user" if layout.user_unit else "systemctl"
        parts.insert(0, f"{ctl} disable --now {UNIT_NAME} >/dev/null 2>&1")
    return "; ".join(parts) + "; true"


class BootstrapReport(NamedTuple):
    probe: Dict
    target: str
    key: str
    layout: Layout
    service: str
    device: Dict
    installed: Dict  # what the manifest records of the install (files, or the native build)
    sandbox: List[str]  # what the server said at start of its sessions' sandbox


def _probe(board: Board, python: str, tracker: str) -> Dict:
    host, port = split_address(tracker, TRACKER_PORT)
    status, out, err = board.run(f"{shlex.quote(python)} - {shlex.quote(host)} {port}",
                                 stdin=PROBE, timeout=60)
    if status == 127 or "not found" in err and not out:
        raise BoardNotReady(
            f"{board.login.host} has no {python!r} ({err.strip()}); install Python 3.9 or newer "
            f"(Debian/Raspberry Pi OS: sudo apt-get install python3; Termux: pkg install python) "
            f"or name it with --python")
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BoardNotReady(f"probing {board.login.host} with {python} failed "
                            f"(exit {status}): {(err or out).strip()[-1000:]}") from None


def _check_python(probe: Dict, python: str):
    version = tuple(int(p) for p in probe["python"].split(".")[:2])
    if version < MIN_PYTHON:
        raise BoardNotReady(
            f"{python} on the board is Python {probe['python']}; the server needs "
            f"{'.'.join(map(str, MIN_PYTHON))} or newer (Debian bullseye and later ship it); "
            f"install one and pass it with --python")


def _missing_modules(probe: Dict) -> List[str]:
    return [name for name, version in probe["modules"].items() if not version]


def _install_deps(board: Board, probe: Dict, python: str, missing: List[str], say):
    if probe["uid"] == 0 and probe["os_id"] in ("debian", "raspbian", "ubuntu") \
            and board.run("command -v apt-get")[0] == 0:
        pkgs = " ".join(DEPENDENCIES[m][0] for m in missing)
        say(f"installing {pkgs} with apt-get")
        board.check(f"DEBIAN_FRONTEND=noninteractive apt-get install -y -q {pkgs}",
                    "apt-get install", timeout=1800)
    else:
        pkgs = " ".join(DEPENDENCIES[m][1] for m in missing)
        say(f"installing {pkgs} with pip --user")
        board.check(f"{shlex.quote(python)} -m pip install --user -q {pkgs}",
                    "pip install --user", timeout=1800)


def bootstrap(board: str, tracker: str, key: Optional[str] = None, *,
              identity: Optional[str] = None, password: Optional[str] = None,
              known_hosts: Optional[str] = None, accept_new_host_key: bool = False,
              service: str = "auto", install_deps: bool = False, python: str = "python3",
              remote_dir: str = "~/.tether", port: int = SERVER_PORT, advertise: Optional[str] = None,
              tracker_from_here: Optional[str] = None, timeout: float = 60.0,
              native: bool = False, progress: Progress = None) -> BootstrapReport:
    """Install (or upgrade) and start the device server on ``board``; wait for the tracker.

    ``native``: the board needs no Python; it gets the static C++ server instead.
    """
    say = progress or (lambda _msg: None)
    login = parse_board(board)
    say(f"connecting to {login.host}:{login.port}")
    conn = Board(login, identity, password, known_hosts, accept_new_host_key)
    try:
        if native:
            probe = _probe_shell(conn, tracker)
            target = suggest_target(probe)
            say(f"board: {probe['machine']}, {probe['os'] or 'unknown OS'}, CPU "
                f"{probe['board_model'] or probe['cpu_model'] or '?'} -> target {target}; "
                f"the native server needs no Python")
        else:
            probe = _probe(conn, python, tracker)
            _check_python(probe, python)
            target = suggest_target(probe)
            say(f"board: {probe['machine']}, {probe['os']}, Python {probe['python']}, "
                f"CPU {probe['board_model'] or probe['cpu_model'] or '?'} -> target {target}")
            _check_modules(conn, probe, python, install_deps, say)
        key = key or target.split("/")[0]
        if probe["tracker"] == "unchecked":
            say("the board has no bash to test the tracker's port with; the server's log "
                "will say whether it reached the tracker")
        elif probe["tracker"] != "ok":
            raise BoardNotReady(
                f"the board cannot reach the tracker at {tracker} ({probe['tracker']}); start "
                f"the tracker with --host 0.0.0.0 and pass the address the board sees")
        if service == "auto":
            service = "systemd" if probe["systemd"] else "background"
        if service == "systemd" and not probe["systemd"]:
            raise BoardNotReady(f"{login.host} does not run systemd; use --service background")
        layout = _layout(probe, remote_dir, service)
        previous = _read_manifest(conn, layout)
        if previous:
            say("stopping the server installed earlier")
            conn.run(stop_commands(_layout(probe, remote_dir, previous.get("service", service))))
        if native:
            program, env, installed = _install_native(conn, probe, layout, say)
        else:
            program, env, installed = _install_python(conn, probe, layout, python, say)
        argv = server_command(program, tracker, key, port, advertise)
        if service == "systemd":
            _start_systemd(conn, layout, argv, env)
        else:
            start_background(conn, layout, argv, env)
        conn.write_file(layout.manifest, json.dumps({
            "service": service, "unit": layout.unit, "user_unit": layout.user_unit,
            "key": key, "tracker": tracker, "port": port, **installed,
            "installed": time.time()}, indent=1))
        say(f"server started ({service}); waiting for the tracker to list it")
        device = _wait_for_tracker(tracker_from_here or tracker, key, login.host, port,
                                   timeout, lambda: _server_log(conn, layout))
        sandbox = [line.split("sandbox: ", 1)[1] for line in _server_log(conn, layout).splitlines()
                   if "sandbox: " in line]
        return BootstrapReport(probe, target, key, layout, service, device, installed, sandbox)
    finally:
        conn.close()


def _probe_shell(board: Board, tracker: str) -> Dict:
    """What ``_probe`` finds, found with POSIX sh (no Python on the board)."""
    host, port = split_address(tracker, TRACKER_PORT)
    status, out, err = board.run(f"sh -s {shlex.quote(host)} {port}", stdin=SHELL_PROBE,
                                 timeout=60)
    facts = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if status != 0 or not facts.get("machine"):
        raise BoardNotReady(f"probing {board.login.host} with sh failed "
                            f"(exit {status}): {(err or out).strip()[-1000:]}")
    flags = {name: facts.get(name) == "1" for name in ("systemd", "android", "sha256sum")}
    texts = {name: facts.get(name, "") for name in ("os", "os_id", "board_model", "cpu_model",
                                                     "cpu_part")}
    return {**facts, **texts, **flags, "uid": int(facts["uid"]), "python": None, "modules": {}}


def _check_modules(conn: Board, probe: Dict, python: str, install_deps: bool, say):
    missing = _missing_modules(probe)
    if missing:
        if not install_deps:
            debs = " ".join(DEPENDENCIES[m][0] for m in missing)
            raise BoardNotReady(
                f"the board's Python lacks {', '.join(missing)}; run again with "
                f"--install-deps, or on the board: sudo apt-get install {debs}")
        _install_deps(conn, probe, python, missing, say)


def native_binary(layout: Layout) -> str:
    """Where ``bootstrap(native=True)`` puts the server's executable."""
    return posixpath.join(layout.root, "tether-server")


def _install_python(conn: Board, probe: Dict, layout: Layout, python: str, say):
    """Copy the device-side files; (program, environment, manifest entries)."""
    files = device_files()
    say(f"copying {len(files)} device-side files to {layout.code}")
    conn.check(f"rm -f {shlex.quote(native_binary(layout))} && rm -rf {shlex.quote(layout.code)} "
               f"&& mkdir -p {shlex.quote(layout.code)}", "preparing the install folder")
    conn.put_files(PROJECT_ROOT, files, layout.code)
    program = [probe["python_path"] or python, "-m", "remote.server"]
    return program, python_environment(layout), {"files": files}


def _install_native(conn: Board, probe: Dict, layout: Layout, say):
    """Build the native server for the board's machine and upload it, checked by its
    sha256 where the board has sha256sum; (program, environment, manifest entries)."""
    from remote.cli.native import build_native, musl_triple
    triple = musl_triple(probe["machine"])
    # The connection idles while the server builds (minutes, the first time).
    conn.client.get_transport().set_keepalive(30)
    with open(build_native(triple, progress=say), "rb") as f:
        data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    binary = native_binary(layout)
    say(f"uploading the native server ({len(data) / 1024:.0f} KiB, {triple}) to {binary}")
    conn.check(f"rm -rf {shlex.quote(layout.code)} && mkdir -p {shlex.quote(layout.root)}",
               "preparing the install folder")
    conn.write_bytes(binary, data, 0o755)
    if probe["sha256sum"]:
        found = conn.check(f"sha256sum {shlex.quote(binary)}", "sha256sum").split()[:1]
        if found != [digest]:
            raise BootstrapError(f"the server arrived damaged on {conn.login.host} (sha256 "
                                 f"{found[0] if found else '?'}, sent {digest}); run again")
        say(f"sha256 checked on the board: {digest[:16]}…")
    else:
        say("the board has no sha256sum: the upload was not checked")
    return [binary], {}, {"native": triple, "sha256": digest}


def _read_manifest(conn: Board, layout: Layout) -> Optional[Dict]:
    status, out, _ = conn.run(f"cat {shlex.quote(layout.manifest)}")
    if status != 0:
        return None
    try:
        return json.loads(out)
    except ValueError:
        return {}


def _start_systemd(conn: Board, layout: Layout, argv: List[str], env: Dict[str, str]):
    ctl = "systemctl --user" if layout.user_unit else "systemctl"
    conn.check(f"mkdir -p {shlex.quote(posixpath.dirname(layout.unit))}", "mkdir")
    conn.write_file(layout.unit, systemd_unit(argv, layout, env))
    conn.check(f"{ctl} daemon-reload && {ctl} enable {UNIT_NAME} && {ctl} restart {UNIT_NAME}",
               "starting the systemd unit")
    if layout.user_unit:
        # Without lingering a user unit stops when the SSH session ends.
        conn.run("loginctl enable-linger \"$(id -un)\"")


def start_background(conn: Board, layout: Layout, argv: List[str], env: Dict[str, str]):
    command = " ".join(shlex.quote(a) for a in argv)
    assignments = "".join(f"{name}={shlex.quote(value)} " for name, value in env.items())
    conn.check(
        f"cd {shlex.quote(layout.root)} || exit 1; {assignments}"
        f"nohup {command} > {shlex.quote(layout.log)} 2>&1 < /dev/null & "
        f"echo $! > {shlex.quote(layout.pid)}", "starting the server")


def _server_log(conn: Board, layout: Layout) -> str:
    if layout.unit:
        flag = "--user " if layout.user_unit else ""
        return conn.run(f"journalctl {flag}-u {UNIT_NAME} -n 20 --no-pager")[1]
    return conn.run(f"tail -n 20 {shlex.quote(layout.log)}")[1]


def _wait_for_tracker(tracker: str, key: str, board_host: str, port: int, timeout: float,
                      server_log: Callable[[], str]) -> Dict:
    try:
        board_ips = {info[4][0] for info in socket.getaddrinfo(board_host, None)}
    except OSError:
        board_ips = {board_host}
    loopback = any(ip.startswith("127.") or ip == "::1" for ip in board_ips)

    def ours(device: Dict) -> bool:
        address_host, address_port = split_address(device["address"], 0)
        return device["key"] == key and address_port == port and (
            loopback or address_host in board_ips or address_host == board_host)

    return wait_for_device(tracker, ours, f"the board under key {key!r}", timeout, server_log)


def wait_for_device(tracker: str, ours: Callable[[Dict], bool], what: str, timeout: float,
                    server_log: Callable[[], str]) -> Dict:
    """The first device of the tracker's summary for which ``ours`` holds, once it is listed."""
    from remote.client.tracker import TrackerClient
    host, tport = split_address(tracker, TRACKER_PORT)
    deadline = time.monotonic() + timeout
    with TrackerClient(host, tport) as client:
        while time.monotonic() < deadline:
            for device in client.summary()["devices"]:
                if ours(device):
                    return device
            time.sleep(0.5)
    raise BootstrapError(f"the tracker {tracker} did not list {what} within {timeout:g} s; "
                         f"the server's log says:\n{server_log()}")


def uninstall(board: str, *, identity: Optional[str] = None, password: Optional[str] = None,
              known_hosts: Optional[str] = None, python: str = "python3",
              remote_dir: str = "~/.tether", progress: Progress = None) -> List[str]:
    """Stop the server and remove what ``bootstrap`` installed; returns the removed paths."""
    say = progress or (lambda _msg: None)
    conn = Board(parse_board(board), identity, password, known_hosts, False)
    try:
        home = conn.check("echo $HOME", "reading $HOME").strip()
        root = remote_dir.replace("~", home, 1) if remote_dir.startswith("~") else remote_dir
        probe = {"home": home, "uid": int(conn.check("id -u", "id").strip())}
        layout = _layout(probe, root, "background")
        manifest = _read_manifest(conn, layout)
        if manifest is None:
            raise BootstrapError(f"nothing to uninstall: no {layout.manifest} on the board")
        if manifest.get("unit"):
            layout = layout._replace(unit=manifest["unit"], user_unit=manifest.get("user_unit"))
        say("stopping the server")
        conn.run(stop_commands(layout))
        removed = [layout.root]
        if layout.unit:
            ctl = "systemctl --user" if layout.user_unit else "systemctl"
            conn.check(f"rm -f {shlex.quote(layout.unit)} && {ctl} daemon-reload", "removing the unit")
            removed.insert(0, layout.unit)
        conn.check(f"rm -rf {shlex.quote(layout.root)}", "removing the install folder")
        say(f"removed {', '.join(removed)}")
        return removed
    finally:
        conn.close()


def run_bootstrap(args) -> int:
    """``tether bootstrap``."""
    import sys

    def say(msg):
        print(msg, file=sys.stderr, flush=True)

    common = dict(identity=args.identity, password=args.password, known_hosts=args.known_hosts,
                  python=args.python, remote_dir=args.remote_dir, progress=say)
    if args.uninstall:
        removed = uninstall(args.board, **common)
        print(f"uninstalled the Tether server from {args.board} (removed {', '.join(removed)}); "
              f"Python packages installed with --install-deps were left in place")
        return 0
    if not args.tracker:
        raise ValueError(f"--tracker HOST:PORT is needed (or set {TRACKER_ENV})")
    if args.native and args.install_deps:
        raise ValueError("--install-deps is for the Python server; the native one needs nothing")
    report = bootstrap(args.board, args.tracker, args.key, accept_new_host_key=args.accept_new_host_key,
                       service=args.service, install_deps=args.install_deps, port=args.port,
                       advertise=args.advertise, timeout=args.timeout, native=args.native,
                       **common)
    p = report.probe
    if args.native:
        built = report.installed
        print(f"board {args.board}: {p['machine']}, {p['os'] or 'unknown OS'}; native server "
              f"({built['native']}, sha256 {built['sha256'][:16]}…)")
    else:
        mods = ", ".join(f"{m} {v}" for m, v in p["modules"].items())
        print(f"board {args.board}: {p['machine']}, {p['os']}, Python {p['python']} ({mods})")
    print(f"cpu: {p['board_model'] or p['cpu_model'] or 'unknown'}; suggested target: {report.target}")
    print(f"installed in {report.layout.root} as a {report.service} service")
    d = report.device
    print(f"tracker lists {d['device_id']} key={d['key']} address={d['address']} state={d['state']}")
    # What the board keeps its sessions from, and what it cannot (the server
    # found out at start): docs/security.md, "The session sandbox".
    print(f"isolation of its sessions: {d.get('attributes', {}).get('isolation', 'not reported')}")
    for line in report.sandbox:
        if not line.startswith("sessions are isolated by"):
            print(f"  {line}")
    return 0
