"""Reading just enough of an ELF header to tell whether a shared object can
load on this machine, so a module built for another board fails with a clear
message instead of the dynamic loader's "wrong ELF class" or "cannot open"."""
from __future__ import annotations

import os
import platform
import struct
import sys
from typing import NamedTuple

ELF_MAGIC = b"\x7fELF"
ET_DYN = 3
EF_ARM_ABI_FLOAT_SOFT = 0x200
EF_ARM_ABI_FLOAT_HARD = 0x400

MACHINES = {3: "x86", 62: "x86_64", 40: "arm", 183: "aarch64", 243: "riscv", 8: "mips",
            20: "ppc", 21: "ppc64", 22: "s390x"}

# platform.machine() spellings -> (e_machine, bits) of native code.
_HOST_MACHINES = {
    "x86_64": (62, 64), "amd64": (62, 64), "i386": (3, 32), "i486": (3, 32),
    "i586": (3, 32), "i686": (3, 32), "aarch64": (183, 64), "arm64": (183, 64),
    "armv6l": (40, 32), "armv7l": (40, 32), "armv8l": (40, 32), "riscv64": (243, 64),
    "ppc64le": (21, 64), "s390x": (22, 64),
}
# A 64-bit kernel can run a 32-bit userland (32-bit Raspberry Pi OS on a Pi 4
# reports aarch64), so the interpreter's own pointer size decides.
_COMPAT_32 = {183: 40, 62: 3}


class ElfHeader(NamedTuple):
    bits: int
    machine: int
    file_type: int
    flags: int

    @property
    def machine_name(self) -> str:
        return MACHINES.get(self.machine, f"e_machine {self.machine}")


def read_header(path: str) -> ElfHeader | None:
    """The file's ELF header, or None if it is not an ELF file."""
    with open(path, "rb") as f:
        ident = f.read(64)
    if len(ident) < 52 or ident[:4] != ELF_MAGIC or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        return None
    bits = 32 if ident[4] == 1 else 64
    endian = "<" if ident[5] == 1 else ">"
    file_type, machine = struct.unpack_from(endian + "HH", ident, 16)
    flags_offset = 36 if bits == 32 else 48
    (flags,) = struct.unpack_from(endian + "I", ident, flags_offset)
    return ElfHeader(bits, machine, file_type, flags)


class Segment(NamedTuple):
    vaddr: int   # where the loader maps it, from the object's base
    offset: int  # where it starts in the file
    filesz: int  # bytes of it the file holds


def _layout(path: str):
    """(bytes the ELF headers say the file holds, its size, its PT_LOAD
    segments or None where the program header table cannot be read)."""
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
        if len(head) < 64:
            return 64, size, None  # shorter than any shared object's headers
        bits = 32 if head[4] == 1 else 64
        endian = "<" if head[5] == 1 else ">"
        if bits == 64:
            phoff, shoff = struct.unpack_from(endian + "QQ", head, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(endian + "HHHH", head, 54)
        else:
            phoff, shoff = struct.unpack_from(endian + "II", head, 28)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(endian + "HHHH", head, 42)
        need = max(phoff + phentsize * phnum, shoff + shentsize * shnum if shoff else 0)
        if need > size:
            return need, size, None
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    if phentsize < (56 if bits == 64 else 32):
        return need, size, None  # no program headers to read; the loader refuses such a file
    segments = []
    for i in range(phnum):
        entry = table[i * phentsize:(i + 1) * phentsize]
        if bits == 64:
            p_type, _flags, offset, vaddr, _p, filesz = struct.unpack_from(endian + "IIQQQQ", entry)
        else:
            p_type, offset, vaddr, _p, filesz = struct.unpack_from(endian + "IIIII", entry)
        if p_type == 1:  # PT_LOAD
            segments.append(Segment(vaddr, offset, filesz))
    return need, size, segments


def file_extent(path: str) -> tuple[int, int]:
    """(bytes the ELF headers say the file holds, bytes it holds): the loaded
    segments and the section header table must lie inside the file, or the
    loader maps pages past its end and the process dies of SIGBUS."""
    need, size, segments = _layout(path)
    return max([need] + [s.offset + s.filesz for s in segments or ()]), size


def load_segments(path: str) -> list:
    """The PT_LOAD segments of an ELF file, or [] where its headers do not
    hold them (see file_extent)."""
    return _layout(path)[2] or []


def host_machine() -> tuple[int, int] | None:
    """(e_machine, bits) that this Python process runs as, if known."""
    native = _HOST_MACHINES.get(platform.machine().lower())
    if native is None:
        return None
    machine, bits = native
    if bits == 64 and sys.maxsize < 2**32:
        return _COMPAT_32.get(machine, machine), 32
    return machine, bits


def running_float_abi() -> int | None:
    """On 32-bit ARM, the float-ABI flag of the running interpreter binary."""
    try:
        header = read_header(sys.executable)
    except OSError:
        return None
    if header is None or header.machine != 40:
        return None
    return header.flags & (EF_ARM_ABI_FLOAT_SOFT | EF_ARM_ABI_FLOAT_HARD) or None
