"""Linking an object file into the module's shared object with LLD.

The module needs no libc at link time: it calls nothing but memcpy/memset,
which the board's dynamic loader resolves from the process.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from .errors import LinkError

# The compiler's one environment variable: the ld.lld to link with. Named
# here rather than with the device farm's variables, since the compiler
# imports nothing outside itself.
LINKER_ENV = "TETHER_LD"


def find_linker() -> list[str]:
    """The ld.lld command: $TETHER_LD, else ld.lld on PATH, else the copy
    shipped in the `ziglang` PyPI package."""
    if os.environ.get(LINKER_ENV):
        return [os.environ[LINKER_ENV]]
    on_path = shutil.which("ld.lld")
    if on_path:
        return [on_path]
    try:
        import ziglang  # noqa: F401  (only to learn whether it is installed)
    except ImportError:
        raise LinkError(f"no linker found: set {LINKER_ENV} to an ld.lld binary, install LLD "
                        "(apt-get install lld) or `pip install ziglang`") from None
    return [sys.executable, "-m", "ziglang", "ld.lld"]


def link_shared(objects: "list[bytes]", soname: str, linker: "list[str] | None" = None) -> bytes:
    """Link ELF objects into a shared object and return its bytes."""
    command = list(linker or find_linker())
    with tempfile.TemporaryDirectory(prefix="tether-link-") as tmp:
        paths = []
        for i, obj in enumerate(objects):
            paths.append(os.path.join(tmp, f"part{i}.o"))
            with open(paths[-1], "wb") as f:
                f.write(obj)
        so_path = os.path.join(tmp, soname)
        args = command + ["-shared", "--hash-style=both", "-z", "noexecstack", "--build-id",
                          "-soname", soname, "-o", so_path, *paths]
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
        except FileNotFoundError:
            raise LinkError(f"linker {command[0]!r} not found; set {LINKER_ENV} to an ld.lld "
                            "binary") from None
        except subprocess.TimeoutExpired:
            raise LinkError(f"linker {' '.join(command)} timed out after 300 s") from None
        if proc.returncode != 0:
            how = (f"crashed with signal {-proc.returncode}" if proc.returncode < 0
                   else f"failed (exit {proc.returncode})")
            detail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[:20])
            raise LinkError(f"linking {soname} with {' '.join(command)} {how}; "
                            f"linker output:\n{detail}")
        with open(so_path, "rb") as f:
            return f.read()
