"""Put the native board server on an Android phone over adb: ``tether adb``.

Android has no Python to run ``remote.server``, so the phone gets the static
C++ server (remote/cli/native.py) built for its ABI, in /data/local/tmp (the
one folder adb's shell user may write and execute in). It runs in the
background with a pid file, as ``bootstrap`` starts a server where systemd is
absent, and registers with the tracker under the key given.

With ``reverse=True`` the phone reaches the tracker through the USB cable
(``adb reverse``: the phone's 127.0.0.1:PORT is this machine's PORT) and takes
its sessions through the tracker's relay, since nothing can dial the phone.

    >>> report = deploy("192.168.1.2:9190", "pixel7")                 # doctest: +SKIP
    >>> report.device["address"]                                      # doctest: +SKIP
    '192.168.1.37:9090'
"""
from __future__ import annotations

import posixpath
import shlex
import shutil
import subprocess
from typing import Dict, List, NamedTuple, Optional

from deploy_recipes.bootstrap import (Layout, Progress, start_background, stop_commands,
                                      server_command, wait_for_device)
from remote.address import split_address
from remote.defaults import SERVER_PORT, TRACKER_PORT
from remote.errors import TetherError

PHONE_DIR = "/data/local/tmp"
PHONE_LAYOUT = Layout(root=PHONE_DIR, code="", log=posixpath.join(PHONE_DIR, "tether-server.log"),
                      pid=posixpath.join(PHONE_DIR, "tether-server.pid"), manifest="", unit="",
                      user_unit=False)
PHONE_BINARY = posixpath.join(PHONE_DIR, "tether-server")
# ro.product.cpu.abi to the machine the native server is built for. 32-bit
# x86 phones are left out: the native server has no i386 build.
ABI_MACHINES = {"arm64-v8a": "aarch64", "armeabi-v7a": "armv7l", "x86_64": "x86_64"}
ADB_TIMEOUT_S = 120.0


class AdbError(TetherError):
    """adb failed, or the phone cannot run the server; the message says what to do."""


class Phone:
    """One phone (or emulator) as adb reaches it."""

    def __init__(self, adb: str = "adb", serial: Optional[str] = None):
        found = shutil.which(adb)
        if found is None:
            raise AdbError(f"no {adb!r} found: install Android's platform tools "
                           f"(apt-get install adb) or pass --adb PATH")
        self.argv = [found, *(["-s", serial] if serial else [])]
        self.serial = serial or self.adb("get-serialno").strip()

    def adb(self, *args: str, timeout: float = ADB_TIMEOUT_S) -> str:
        """adb's stdout; AdbError when it fails."""
        try:
            out = subprocess.run([*self.argv, *args], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, universal_newlines=True,
                                 timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AdbError(f"adb {' '.join(args)} did not finish within {timeout:g} s") from None
        if out.returncode != 0:
            raise AdbError(f"adb {' '.join(args)} failed (exit {out.returncode}): "
                           f"{(out.stderr or out.stdout).strip()[-1000:]}; is the phone plugged "
                           f"in with USB debugging allowed? (adb devices lists it)")
        return out.stdout

    def check(self, command: str, what: str) -> str:
        """Run ``command`` in the phone's shell (what ``bootstrap``'s Board does over SSH)."""
        try:
            return self.adb("shell", command)
        except AdbError as exc:
            raise AdbError(f"{what} failed on the phone: {exc}") from None

    def run(self, command: str):
        """(exit status, stdout, stderr) of a shell command on the phone."""
        out = subprocess.run([*self.argv, "shell", command], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, universal_newlines=True,
                             timeout=ADB_TIMEOUT_S)
        return out.returncode, out.stdout, out.stderr


class AdbReport(NamedTuple):
    serial: str
    abi: str
    triple: str
    tracker: str    # the tracker's address as the phone dials it
    relay: bool
    device: Dict


def deploy(tracker: str, key: str, *, serial: Optional[str] = None, adb: str = "adb",
           reverse: bool = False, port: int = SERVER_PORT, timeout: float = 60.0,
           progress: Progress = None) -> AdbReport:
    """Push the native server to the phone, start it and wait until the tracker lists it."""
    from remote.cli.native import build_native, musl_triple
    say = progress or (lambda _msg: None)
    phone = Phone(adb, serial)
    abi = phone.check("getprop ro.product.cpu.abi", "reading the phone's ABI").strip()
    if abi not in ABI_MACHINES:
        raise AdbError(f"the phone's ABI is {abi or 'unknown'!r}; the native server is built "
                       f"for {', '.join(ABI_MACHINES)}")
    triple = musl_triple(ABI_MACHINES[abi])
    say(f"phone {phone.serial}: {abi} -> {triple}")
    binary = build_native(triple, progress=say)
    tracker_host, tracker_port = split_address(tracker, TRACKER_PORT)
    phone_tracker = f"{tracker_host}:{tracker_port}"
    if reverse:
        phone.adb("reverse", f"tcp:{tracker_port}", f"tcp:{tracker_port}")
        phone_tracker = f"127.0.0.1:{tracker_port}"
        say(f"the phone reaches the tracker at {phone_tracker} (adb reverse)")
    phone.run(stop_commands(PHONE_LAYOUT))
    say(f"pushing {binary} to {PHONE_BINARY}")
    phone.adb("push", binary, PHONE_BINARY, timeout=600)
    phone.check(f"chmod 755 {PHONE_BINARY}", "chmod")
    argv = server_command([PHONE_BINARY], phone_tracker, key, 0 if reverse else port, None)
    argv += ["--attr", f"adb_serial={phone.serial}", *(["--relay"] if reverse else [])]
    start_background(phone, PHONE_LAYOUT, argv, {})
    say(f"server started; waiting for the tracker to list it (log {PHONE_LAYOUT.log})")

    def ours(device: Dict) -> bool:
        return device["key"] == key and \
            (device.get("attributes") or {}).get("adb_serial") == phone.serial

    device = wait_for_device(tracker, ours, f"the phone {phone.serial} under key {key!r}",
                             timeout, lambda: phone.run(f"tail -n 20 {PHONE_LAYOUT.log}")[1])
    return AdbReport(phone.serial, abi, triple, phone_tracker, reverse, device)


def remove(*, serial: Optional[str] = None, adb: str = "adb",
           reverse_port: Optional[int] = None) -> List[str]:
    """Stop the phone's server and delete its files; the paths removed."""
    phone = Phone(adb, serial)
    phone.run(stop_commands(PHONE_LAYOUT))
    removed = [PHONE_BINARY, PHONE_LAYOUT.log]
    phone.check(f"rm -f {' '.join(shlex.quote(p) for p in removed)}", "removing the server")
    if reverse_port:
        phone.adb("reverse", "--remove", f"tcp:{reverse_port}")
    return removed


def run_adb(args) -> int:
    """``tether adb``."""
    from remote.cli.progress import say
    if args.uninstall:
        port = split_address(args.tracker, TRACKER_PORT)[1] if args.reverse and args.tracker \
            else None
        removed = remove(serial=args.serial, adb=args.adb, reverse_port=port)
        print(f"removed {', '.join(removed)} from the phone")
        return 0
    if not args.tracker or not args.key:
        raise ValueError("tether adb needs --tracker HOST:PORT and --key KEY")
    report = deploy(args.tracker, args.key, serial=args.serial, adb=args.adb,
                    reverse=args.reverse, port=args.port, timeout=args.timeout, progress=say)
    d = report.device
    how = "sessions through the tracker's relay" if report.relay else f"address {d['address']}"
    print(f"phone {report.serial} ({report.abi}): native server {report.triple} in {PHONE_DIR}, "
          f"tracker {report.tracker} as the phone dials it")
    print(f"tracker lists {d['device_id']} key={d['key']} {how} state={d['state']}")
    return 0
