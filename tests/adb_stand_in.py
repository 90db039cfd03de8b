"""A stand-in for the ``adb`` program in the tests of ``tether adb``: the "phone"
is this machine, with a temporary folder in place of its /data/local/tmp.

- ``push`` copies into that folder; ``shell`` runs the command here with sh,
  /data/local/tmp rewritten to the folder; ``getprop ro.product.cpu.abi``
  answers $STANDIN_ADB_ABI; ``get-serialno`` answers $STANDIN_ADB_SERIAL;
  ``reverse`` has nothing to do, since the phone's 127.0.0.1 is already this
  machine's.
- With $STANDIN_ADB_RUNNER (say qemu-aarch64) the phone has that CPU: a pushed
  ELF file is kept beside its path (``NAME.elf``) and runs under the runner.
- Every call is appended to $STANDIN_ADB_CALLS, one JSON list per line.

The test writes an ``adb`` script that runs this file first on PATH.
"""
import json
import os
import shutil
import subprocess
import sys

PHONE_TMP = "/data/local/tmp"


def _on_this_machine(path: str) -> str:
    return path.replace(PHONE_TMP, os.environ["STANDIN_ADB_PHONE"])


def _push(source: str, destination: str) -> int:
    local = _on_this_machine(destination)
    runner = os.environ.get("STANDIN_ADB_RUNNER")
    with open(source, "rb") as f:
        is_elf = f.read(4) == b"\x7fELF"
    if runner and is_elf:
        shutil.copy(source, local + ".elf")
        with open(local, "w") as f:
            f.write(f'#!/bin/sh\nexec {runner} "{local}.elf" "$@"\n')
    else:
        shutil.copy(source, local)
    print(f"{source}: 1 file pushed")
    return 0


def main(argv) -> int:
    with open(os.environ["STANDIN_ADB_CALLS"], "a") as f:
        f.write(json.dumps(argv) + "\n")
    serial = os.environ.get("STANDIN_ADB_SERIAL", "standin-phone")
    if argv[:1] == ["-s"]:
        if argv[1] != serial:
            print(f"adb: device '{argv[1]}' not found", file=sys.stderr)
            return 1
        argv = argv[2:]
    command, args = argv[0], argv[1:]
    if command == "get-serialno":
        print(serial)
        return 0
    if command == "reverse":
        return 0
    if command == "push" and len(args) == 2:
        return _push(*args)
    if command == "shell":
        line = " ".join(args)
        if line.strip() == "getprop ro.product.cpu.abi":
            print(os.environ["STANDIN_ADB_ABI"])
            return 0
        return subprocess.run(["sh", "-c", _on_this_machine(line)]).returncode
    print(f"adb: unknown command {command!r}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
