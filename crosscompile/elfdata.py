"""A relocatable ELF object holding the model's parameters.

LLVM reads weights only as IR text, which costs seconds and gigabytes for a
500 MB model; the bytes do not need LLVM at all. This writes them straight
into an object with one read-only section and one hidden global symbol per
parameter, for the same machine, class and flags as the code object, and the
linker joins the two.
"""
from __future__ import annotations

import struct

ET_REL = 1
SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB = 1, 2, 3
SHF_ALLOC = 0x2
STB_GLOBAL, STT_OBJECT, STV_HIDDEN = 1, 1, 2
SECTION = ".rodata.tether_params"


def data_object(like: bytes, symbols: "list[tuple[str, bytes]]", alignment: int = 64) -> bytearray:
    """An ELF relocatable object defining each (name, data) as a hidden,
    read-only global, with the class, byte order, machine and flags of the
    object `like` (a bytearray: the parameters are not copied once more
    into a bytes object)."""
    if like[:4] != b"\x7fELF":
        raise ValueError("not an ELF object")
    is64, little = like[4] == 2, like[5] == 1
    end = "<" if little else ">"
    machine = struct.unpack_from(end + "H", like, 18)[0]
    flags = struct.unpack_from(end + "I", like, 48 if is64 else 36)[0]

    # The data section is laid out first and written once, into the
    # output itself (a 500 MB model's parameters copied piece by piece
    # into growing buffers took seconds).
    offsets, data_size = [], 0
    for _, blob in symbols:
        data_size += -data_size % alignment
        offsets.append(data_size)
        data_size += len(blob)

    strtab = bytearray(b"\0")
    name_offsets = []
    for name, _ in symbols:
        name_offsets.append(len(strtab))
        strtab.extend(name.encode() + b"\0")
    shstrtab = bytearray(b"\0")
    sh_names = {}
    for sec in (SECTION, ".symtab", ".strtab", ".shstrtab"):
        sh_names[sec] = len(shstrtab)
        shstrtab.extend(sec.encode() + b"\0")

    sym_fmt = end + ("IBBHQQ" if is64 else "IIIBBH")
    symtab = bytearray(struct.calcsize(sym_fmt))  # the null symbol
    info = (STB_GLOBAL << 4) | STT_OBJECT
    for name_off, off, (_, blob) in zip(name_offsets, offsets, symbols):
        if is64:
            symtab += struct.pack(sym_fmt, name_off, info, STV_HIDDEN, 1, off, len(blob))
        else:
            symtab += struct.pack(sym_fmt, name_off, off, len(blob), info, STV_HIDDEN, 1)

    ehsize = 64 if is64 else 52
    shentsize = 64 if is64 else 40
    layout, cursor = [], ehsize
    for size, align in ((data_size, alignment), (len(symtab), 8), (len(strtab), 1), (len(shstrtab), 1)):
        cursor += -cursor % align
        layout.append((cursor, size))
        cursor += size
    shoff = cursor + (-cursor % 8)

    header = bytearray(b"\x7fELF" + bytes([2 if is64 else 1, 1 if little else 2, 1]) + b"\0" * 9)
    if is64:
        header += struct.pack(end + "HHIQQQIHHHHHH", ET_REL, machine, 1, 0, 0, shoff, flags,
                              ehsize, 0, 0, shentsize, 5, 4)
    else:
        header += struct.pack(end + "HHIIIIIHHHHHH", ET_REL, machine, 1, 0, 0, shoff, flags,
                              ehsize, 0, 0, shentsize, 5, 4)

    sh_fmt = end + ("IIQQQQIIQQ" if is64 else "IIIIIIIIII")
    sym_size = struct.calcsize(sym_fmt)
    sections = [struct.pack(sh_fmt, *([0] * 10))]
    specs = [  # name, type, flags, (offset, size), link, info, align, entsize
        (SECTION, SHT_PROGBITS, SHF_ALLOC, layout[0], 0, 0, alignment, 0),
        (".symtab", SHT_SYMTAB, 0, layout[1], 3, 1, 8 if is64 else 4, sym_size),
        (".strtab", SHT_STRTAB, 0, layout[2], 0, 0, 1, 0),
        (".shstrtab", SHT_STRTAB, 0, layout[3], 0, 0, 1, 0),
    ]
    for name, kind, sflags, (offset, size), link, sinfo, align, entsize in specs:
        sections.append(struct.pack(sh_fmt, sh_names[name], kind, sflags, 0, offset, size,
                                    link, sinfo, align, entsize))

    table = b"".join(sections)
    out = bytearray(shoff + len(table))  # zeros: the padding between the parts
    out[:len(header)] = header
    data_at = layout[0][0]
    for at, (_, blob) in zip(offsets, symbols):
        out[data_at + at:data_at + at + len(blob)] = blob
    for (offset, _), part in zip(layout[1:], (symtab, strtab, shstrtab)):
        out[offset:offset + len(part)] = part
    out[shoff:] = table
    return out
