"""Arguments of ``tether emulate`` and ``tether bootstrap`` (kept apart so ``--help`` is quick)."""
from __future__ import annotations

import os

from remote.defaults import SERVER_PORT, SSH_PASSWORD_ENV, TRACKER_ENV, TRACKER_HELP


def add_emulate_arguments(p):
    p.add_argument("--arch", choices=("arm64", "armhf"), default="arm64",
                   help="arm64 (Pi 4/5 64-bit OS) or armhf (32-bit Raspberry Pi OS)")
    p.add_argument("--release", choices=("bullseye", "bookworm", "trixie"), default="bookworm",
                   help="Debian release whose python3, numpy and protobuf the board runs")
    p.add_argument("--tracker", help=TRACKER_HELP)
    p.add_argument("--key", help="device key to register under (default qemu-ARCH)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    p.add_argument("--build-only", action="store_true",
                   help="only build the cached root filesystem and print its path")


def add_bootstrap_arguments(p):
    p.add_argument("board", metavar="USER@HOST[:PORT]", help="SSH login on the board")
    p.add_argument("--tracker", default=os.environ.get(TRACKER_ENV),
                   help=f"tracker HOST:PORT as the board reaches it (default: ${TRACKER_ENV}; "
                        f"no fallback: on the board, 127.0.0.1 is the board itself)")
    p.add_argument("--key", help="device key (default: the suggested target preset)")
    p.add_argument("--identity", "-i", help="private key file for SSH")
    p.add_argument("--password", default=os.environ.get(SSH_PASSWORD_ENV),
                   help=f"SSH password (default ${SSH_PASSWORD_ENV}); keys are preferred")
    p.add_argument("--known-hosts", help="known_hosts file (default ~/.ssh/known_hosts)")
    p.add_argument("--accept-new-host-key", action="store_true",
                   help="on first contact, trust and record the board's host key")
    p.add_argument("--service", choices=("auto", "systemd", "background"), default="auto",
                   help="how the server keeps running (auto: systemd when the board has it)")
    p.add_argument("--install-deps", action="store_true",
                   help="install missing numpy/protobuf (apt as root, else pip --user)")
    p.add_argument("--native", action="store_true",
                   help="install the static C++ server built for the board's architecture "
                        "(for boards without Python; needs only sh on the board)")
    p.add_argument("--uninstall", action="store_true", help="stop the server and remove it")
    p.add_argument("--python", default="python3", help="Python on the board (default python3)")
    p.add_argument("--remote-dir", default="~/.tether", help="where the server lives on the board")
    p.add_argument("--port", type=int, default=SERVER_PORT, help="port the server listens on")
    p.add_argument("--advertise", help="HOST[:PORT] clients should dial (default: found)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for the board to appear at the tracker")


def add_adb_arguments(p):
    p.add_argument("--serial", "-s", help="the phone, as adb devices lists it (default: the one)")
    p.add_argument("--tracker", default=os.environ.get(TRACKER_ENV),
                   help=f"tracker HOST:PORT (default ${TRACKER_ENV}); with --reverse it runs "
                        f"on this machine")
    p.add_argument("--key", help="device key to register the phone under, e.g. android-arm64")
    p.add_argument("--adb", default="adb", help="the adb program (default adb on PATH)")
    p.add_argument("--reverse", action="store_true",
                   help="reach the tracker through the USB cable (adb reverse) and take "
                        "sessions through the tracker's relay")
    p.add_argument("--port", type=int, default=SERVER_PORT,
                   help="port the server listens on (without --reverse)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for the phone to appear at the tracker")
    p.add_argument("--uninstall", action="store_true",
                   help="stop the phone's server and remove it (and the reverse with --reverse)")
