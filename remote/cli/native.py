"""Build the C++ board server (remote/server/native) into one static executable per
architecture, for boards without Python: ``tether native build``.

zig's C++ compiler (the ``ziglang`` wheel, already a dependency) cross-compiles
every ``remote/server/native/*.cpp`` against musl and links it fully
statically, so one file runs on every Linux board of its architecture,
Android included. Builds are cached under ``$TETHER_CACHE/native`` (default
``~/.cache/tether/native``), keyed by the sources, the flags and zig's version.

    >>> path = build_native("rasp4b64")        # doctest: +SKIP
    >>> path                                   # doctest: +SKIP
    '/home/me/.cache/tether/native/3f1c…/aarch64-linux-musl/tether-server'
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

from remote.defaults import cache_dir
from remote.errors import TetherError

SOURCE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "server", "native")
BINARY_NAME = "tether-server"

COMMON_FLAGS = ["-std=c++17", "-Os", "-static", "-fno-exceptions", "-fno-rtti", "-s"]
# No -mcpu for aarch64 and x86_64: zig's baseline CPU of the architecture, so
# that one file runs on every board of it. For 32-bit ARM the baseline is what
# 32-bit Android guarantees, ARMv7-A with VFPv3-D16 (zig's own arm baseline
# uses NEON and 32 double registers, which armeabi-v7a leaves optional); it
# also covers every Raspberry Pi from the 2 on.
TRIPLE_FLAGS: Dict[str, List[str]] = {
    "aarch64-linux-musl": [],
    "arm-linux-musleabihf": ["-mcpu=generic+v7a+vfp3d16-neon-d32"],
    "x86_64-linux-musl": [],
}
# What ``uname -m`` says on boards (and Debian's names), to the LLVM
# architecture of the triple built for them.
MACHINES = {"aarch64": "aarch64", "arm64": "aarch64", "armv7l": "arm", "armv8l": "arm",
            "armv7": "arm", "armhf": "arm", "x86_64": "x86_64", "amd64": "x86_64"}
_ARCH_TRIPLES = {"aarch64": "aarch64-linux-musl", "arm": "arm-linux-musleabihf",
                 "x86_64": "x86_64-linux-musl"}
# A build that takes longer reports that it is still going this often.
_STILL_BUILDING_S = 15.0

Progress = Optional[Callable[[str], None]]


class NativeBuildError(TetherError):
    """The native server could not be built; the message says why and what to do."""


def musl_triple(target: str) -> str:
    """The zig triple the native server is built for, from a target preset, an
    explicit triple or a board's machine name (``uname -m``).

    >>> musl_triple("rasp4b"), musl_triple("android-arm64"), musl_triple("armv8l")
    ('arm-linux-musleabihf', 'aarch64-linux-musl', 'arm-linux-musleabihf')
    """
    if target in TRIPLE_FLAGS:
        return target
    if target in MACHINES:
        return _ARCH_TRIPLES[MACHINES[target]]
    from crosscompile import BuildError
    from crosscompile.target import TARGETS, resolve_target
    try:
        arch = resolve_target(target).arch
    except BuildError:
        arch = None
    if arch is None:
        raise NativeBuildError(
            f"unknown target {target!r} for the native server: give a preset "
            f"({', '.join(TARGETS)}), a board's machine name ({', '.join(MACHINES)}), "
            f"or a triple of {', '.join(sorted(_ARCH_TRIPLES))}")
    if arch not in _ARCH_TRIPLES:
        raise NativeBuildError(f"the native server is built for "
                               f"{', '.join(sorted(_ARCH_TRIPLES))}; target {target!r} is {arch}")
    return _ARCH_TRIPLES[arch]


def native_sources() -> List[str]:
    """The server's C++ sources (tools/ holds test drivers, not the server)."""
    return sorted(glob.glob(os.path.join(SOURCE_DIR, "*.cpp")))


def _zig() -> List[str]:
    if importlib.util.find_spec("ziglang") is None:
        raise NativeBuildError("building the native server needs zig's compiler: "
                               "pip install ziglang")
    return [sys.executable, "-m", "ziglang"]


def _zig_version(zig: List[str]) -> str:
    out = subprocess.run([*zig, "version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True)
    if out.returncode != 0:
        raise NativeBuildError(f"zig does not run ({out.stderr.strip()[:500]}); "
                               f"reinstall it: pip install --force-reinstall ziglang")
    return out.stdout.strip()


def build_key(zig_version: str) -> str:
    """sha256 of the sources (headers too), every build flag and zig's version."""
    digest = hashlib.sha256()
    files = sorted(p for p in glob.glob(os.path.join(SOURCE_DIR, "*"))
                   if os.path.isfile(p) and p.endswith((".cpp", ".hpp", ".h")))
    for path in files:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    digest.update(repr((COMMON_FLAGS, sorted(TRIPLE_FLAGS.items()), zig_version)).encode())
    return digest.hexdigest()


def build_native(target: str, progress: Progress = None) -> str:
    """Build (once per change of the sources) the native server for ``target``
    and return the path of the cached executable.

    >>> build_native("aarch64")                  # doctest: +SKIP
    '/home/me/.cache/tether/native/3f1c…/aarch64-linux-musl/tether-server'
    """
    say = progress or (lambda _msg: None)
    triple = musl_triple(target)
    sources = native_sources()
    if not sources:
        raise NativeBuildError(f"no C++ sources in {SOURCE_DIR}: this copy of Tether lacks "
                               f"the native server")
    zig = _zig()
    folder = os.path.join(cache_dir(), "native", build_key(_zig_version(zig)), triple)
    path = os.path.join(folder, BINARY_NAME)
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    # Two processes building the same binary wait for each other.
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            _compile(zig, triple, sources, path, say)
    return path


def _compile(zig: List[str], triple: str, sources: List[str], path: str, say):
    partial = f"{path}.{os.getpid()}.part"
    argv = [*zig, "c++", "-target", triple, *COMMON_FLAGS, *TRIPLE_FLAGS[triple],
            *sources, "-o", partial]
    say(f"building the native server for {triple} from {len(sources)} sources (the first "
        f"build for an architecture also builds its C library: a few minutes)")
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True, cwd=SOURCE_DIR)
    try:
        while True:
            try:
                output = proc.communicate(timeout=_STILL_BUILDING_S)[0]
                break
            except subprocess.TimeoutExpired:
                say(f"still building the native server for {triple} "
                    f"({time.monotonic() - start:.0f} s)")
    except BaseException:
        proc.kill()
        proc.wait()
        _remove(partial)
        raise
    if proc.returncode != 0:
        _remove(partial)
        raise NativeBuildError(f"compiling the native server for {triple} failed "
                               f"(exit {proc.returncode}):\n{_first_errors(output)}")
    os.chmod(partial, 0o755)
    os.replace(partial, path)
    say(f"built {path} ({os.path.getsize(path) / 1024:.0f} KiB, "
        f"{time.monotonic() - start:.0f} s)")


def _first_errors(output: str, lines: int = 25) -> str:
    """The compiler's output from its first error on (warnings before it are noise)."""
    all_lines = output.strip().splitlines()
    first = next((i for i, line in enumerate(all_lines) if "error:" in line), 0)
    return "\n".join(all_lines[first:first + lines])


def _remove(path: str):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def add_arguments(p):
    """``tether native build|path``."""
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    build = actions.add_parser(
        "build", help="build the native server and print its path and size",
        epilog="example: tether native build --target rasp4b64 --output tether-server")
    build.add_argument("--target", default="host",
                       help="preset (host, rasp3b, rasp4b, rasp4b64, rasp5, android-arm64, "
                            "android-armv7), triple, or a board's uname -m (default host)")
    build.add_argument("--output", "-o", help="also copy the executable to this path")
    where = actions.add_parser(
        "path", help="print the cached executable's path (building it if needed)",
        epilog="example: scp $(tether native path --target rasp4b64) pi@board:")
    where.add_argument("--target", required=True, help="as for build")


def run_native(args) -> int:
    """``tether native``: progress on stderr, the result on stdout."""
    from remote.cli.progress import say
    path = build_native(args.target, progress=say)
    if args.action == "path":
        print(path)
        return 0
    if args.output:
        shutil.copyfile(path, args.output)
        os.chmod(args.output, 0o755)
        path = args.output
    print(f"{path} ({os.path.getsize(path)} bytes, {musl_triple(args.target)}, static)")
    return 0
