"""The device servers the session, tracker and bench suites run against: the
Python one (``python -m remote.server``) and the native C++ one
(remote/server/native), built for this machine. A client must not be able to
tell them apart, so the same tests run against both.

    @pytest.fixture(scope="module", params=board_servers.KINDS)
    def server_command(request):
        return board_servers.command(request.param)

EMULATED_KINDS are the native server built for the boards' architectures and
run under qemu user-mode emulation, with no root filesystem at all: a static
executable needs none. Their modules come from the matching cross compiler
(``compiler(kind)``), which is also the board's C compiler for module
archives (``server_options(kind)``).
"""
from __future__ import annotations

import functools
import platform
import shutil
from typing import List, NamedTuple, Optional, Tuple

import pytest

from remote.cli.localfarm import python_argv
from tests import session_modules

KINDS = ("python", "native")
EMULATED_KINDS = ("native-aarch64", "native-armv7")


class Machine(NamedTuple):
    """An architecture a device server runs on, as the tests meet it."""
    elf_name: str       # how both servers name its code in messages (minirt.elf.MACHINES)
    bits: int
    triple: str         # how the triple a server reports for it begins
    compiler: str       # the Debian cross compiler that builds modules for it
    qemu: str           # the qemu-user emulator that runs its code elsewhere
    native_target: str  # build_native's name for it


MACHINES = {
    "aarch64": Machine("aarch64", 64, "aarch64", "aarch64-linux-gnu-gcc", "qemu-aarch64", "aarch64"),
    "armv7": Machine("arm", 32, "armv7", "arm-linux-gnueabihf-gcc", "qemu-arm", "armv7l"),
    "x86_64": Machine("x86_64", 64, "x86_64", "x86_64-linux-gnu-gcc", "qemu-x86_64", "x86_64"),
}
# platform.machine() spellings of the architectures above.
_HOST_SPELLINGS = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64",
                   "armv7l": "armv7", "armv8l": "armv7"}
_DEBIAN_PACKAGES = {"aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu",
                    "arm-linux-gnueabihf-gcc": "gcc-arm-linux-gnueabihf",
                    "x86_64-linux-gnu-gcc": "gcc-x86-64-linux-gnu"}


def emulated(kind: str) -> bool:
    return kind in EMULATED_KINDS


def machine(kind: str) -> Optional[Machine]:
    """The architecture a server of ``kind`` runs on (None: this host's, when not listed)."""
    if emulated(kind):
        return MACHINES[kind.split("-", 1)[1]]
    name = _HOST_SPELLINGS.get(platform.machine().lower())
    return MACHINES[name] if name else None


@functools.lru_cache(maxsize=None)
def _native_binary(target: str) -> str:
    from remote.cli.native import NativeBuildError, build_native
    try:
        return build_native(target)
    except NativeBuildError as exc:
        return "skip: " + str(exc)


def _native_argv(target: str) -> List[str]:
    path = _native_binary(target)
    if path.startswith("skip: "):
        pytest.skip(f"the native server cannot be built for {target} here: {path[6:]}")
    return [path]


def command(kind: str) -> List[str]:
    """The argv that starts a device server of ``kind`` (it takes the server's options after it).
    An emulated kind skips the calling test when qemu-user is missing."""
    if kind == "python":
        return python_argv("remote.server")
    if kind == "native":
        return _native_argv(platform.machine())
    arch = machine(kind)
    if shutil.which(arch.qemu) is None:
        pytest.skip(f"the {kind} server runs under {arch.qemu}: apt-get install qemu-user")
    return [arch.qemu, *_native_argv(arch.native_target)]


def compiler(kind: str) -> str:
    """The C compiler that builds test modules (tests/session_modules.py) for a server of ``kind``;
    skips the calling test when it is missing."""
    if not emulated(kind):
        if session_modules.C_COMPILER is None:
            pytest.skip("needs a C compiler (cc) to build test modules")
        return session_modules.C_COMPILER
    return _cross_compiler(machine(kind))


def _cross_compiler(arch: Machine) -> str:
    path = shutil.which(arch.compiler)
    if path is None:
        pytest.skip(f"modules for {arch.triple} boards need {arch.compiler}: "
                    f"apt-get install {_DEBIAN_PACKAGES[arch.compiler]}")
    return path


def server_options(kind: str) -> List[str]:
    """Options every server of ``kind`` starts with: an emulated board links module archives
    with the cross compiler (a host program, which qemu-user runs natively)."""
    return ["--cc", compiler(kind)] if emulated(kind) else []


def foreign_compiler(kind: str) -> Tuple[Machine, str]:
    """(Machine, compiler) for modules a server of ``kind`` cannot run: another
    architecture's, from the first cross compiler installed; skips when there is none."""
    own = machine(kind)
    if own is None:
        pytest.skip(f"no architecture other than {platform.machine()} is known to these tests")
    wanted = [m for m in MACHINES.values() if m.elf_name != own.elf_name]
    for other in wanted:
        path = shutil.which(other.compiler)
        if path is not None:
            return other, path
    pytest.skip("needs a cross compiler for another architecture: apt-get install "
                + " or ".join(_DEBIAN_PACKAGES[m.compiler] for m in wanted))
