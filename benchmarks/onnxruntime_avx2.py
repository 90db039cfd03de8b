"""onnxruntime's AVX2 kernels, timed on a machine with AVX-512.

onnxruntime picks its kernels once, from what the CPUID and XGETBV
instructions report, and offers no setting to pick others. To time its
AVX2 kernels against our AVX2 code on an AVX-512 machine,
use_avx2_onnxruntime() makes the next `import onnxruntime` load a copy of
the installed package in which every CPUID and XGETBV instruction of its
shared libraries (found with objdump) is replaced by an undefined
instruction of the same length. A small SIGILL handler, compiled with the
system's C compiler and loaded into the process, then runs the real
instruction in its place and clears the AVX-512 (and AMX) feature bits
from the answer: CPUID leaf 7's AVX-512 flags and XCR0's opmask, ZMM and
tile state. onnxruntime then sees a CPU with AVX2 and FMA and no AVX-512,
and runs its AVX2 kernels natively, at this CPU's speed.

The copy is made once per onnxruntime version under
~/.cache/tether/onnxruntime-avx2/. x86-64 Linux only; needs objdump
(binutils) and cc.

    from benchmarks.onnxruntime_avx2 import use_avx2_onnxruntime
    print(use_avx2_onnxruntime())
    import onnxruntime  # the copy: its AVX2 kernels
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minirt.elf import load_segments  # noqa: E402

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tether", "onnxruntime-avx2")
# Part of the cached copy's folder name: a copy patched another way is made again.
PATCH_FORMAT = 2

# Replacements of the same length, each starting with an opcode that is
# undefined in 64-bit mode and that no compiler emits there: PUSH ES (06)
# for CPUID (0f a2), POP ES (07) for XGETBV (0f 01 d0), padded with NOPs.
# The handler tells them apart by that byte, and leaves every other
# illegal instruction (ud2 of a failed check, say) to kill the process.
PATCHES = {"cpuid": (b"\x0f\xa2", b"\x06\x90"), "xgetbv": (b"\x0f\x01\xd0", b"\x07\x90\x90")}

HANDLER_C = r"""
#define _GNU_SOURCE
#include <cpuid.h>
#include <signal.h>
#include <string.h>
#include <ucontext.h>

/* CPUID leaf 7 bits of AVX-512 (and AMX) features, by register. */
#define LEAF7_EBX ((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | \
                   (1u << 30) | (1u << 31))
#define LEAF7_ECX ((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14))
#define LEAF7_EDX ((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25))
#define LEAF7_1_EAX ((1u << 4) | (1u << 5))
/* XCR0: opmask, upper ZMM halves, ZMM16-31, AMX tile config and data. */
#define XCR0_AVX512 ((1u << 5) | (1u << 6) | (1u << 7) | (1u << 17) | (1u << 18))

static void on_sigill(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = context;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    if (ip[0] == 0x06) { /* CPUID */
        unsigned a, b, c, d, leaf = (unsigned)g[REG_RAX], sub = (unsigned)g[REG_RCX];
        __cpuid_count(leaf, sub, a, b, c, d);
        if (leaf == 7 && sub == 0) {
            b &= ~LEAF7_EBX;
            c &= ~LEAF7_ECX;
            d &= ~LEAF7_EDX;
        } else if (leaf == 7 && sub == 1) {
            a &= ~LEAF7_1_EAX;
        }
        g[REG_RAX] = a;
        g[REG_RBX] = b;
        g[REG_RCX] = c;
        g[REG_RDX] = d;
        g[REG_RIP] += 2;
        return;
    }
    if (ip[0] == 0x07) { /* XGETBV */
        unsigned lo, hi, which = (unsigned)g[REG_RCX];
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(which));
        if (which == 0)
            lo &= ~XCR0_AVX512;
        g[REG_RAX] = lo;
        g[REG_RDX] = hi;
        g[REG_RIP] += 3;
        return;
    }
    signal(SIGILL, SIG_DFL); /* any other illegal instruction: die of it */
}

__attribute__((constructor)) static void install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigill;
    action.sa_flags = SA_SIGINFO;
    sigaction(SIGILL, &action, 0);
}
"""


class Avx2Unavailable(RuntimeError):
    """This machine or installation cannot run onnxruntime's AVX2 kernels this way."""


def patch_library(path: str) -> int:
    """Replace every CPUID and XGETBV instruction of the shared library at
    path (in place) by its undefined-instruction stand-in; the count."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                             check=True).stdout
    sites = re.findall(r"^\s*([0-9a-f]+):\s+(cpuid|xgetbv)\s*$", listing, re.M)
    data = bytearray(open(path, "rb").read())
    segments = load_segments(path)
    for address, op in sites:
        vaddr = int(address, 16)
        offset = next((s.offset + vaddr - s.vaddr for s in segments if s.vaddr <= vaddr < s.vaddr + s.filesz), None)
        old, new = PATCHES[op]
        if offset is None or data[offset:offset + len(old)] != old:
            raise Avx2Unavailable(f"{path}: objdump lists {op} at {address:s}, but the file does not hold it there")
        data[offset:offset + len(old)] = new
    with open(path, "wb") as f:
        f.write(data)
    return len(sites)


def _prepare(folder: str, package: str) -> int:
    """The patched copy of the package directory and the handler, in folder."""
    staging = folder + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(package, os.path.join(staging, "onnxruntime"))
    capi = os.path.join(staging, "onnxruntime", "capi")
    patched = sum(patch_library(os.path.join(capi, name)) for name in sorted(os.listdir(capi)) if ".so" in name)
    if not patched:
        raise Avx2Unavailable(f"no CPUID instruction found in {package}/capi: nothing to hide AVX-512 from")
    source = os.path.join(staging, "hide_avx512.c")
    with open(source, "w") as f:
        f.write(HANDLER_C)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise Avx2Unavailable("no C compiler (cc) to build the SIGILL handler: apt-get install gcc")
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", os.path.join(staging, "hide_avx512.so"), source],
                   check=True, capture_output=True)
    with open(os.path.join(staging, "patched-sites"), "w") as f:
        f.write(f"{patched}\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(staging, folder)
    return patched


def use_avx2_onnxruntime(cache: str = CACHE) -> str:
    """Make the next `import onnxruntime` in this process load the patched
    copy (see the module's docstring); a line describing what was done."""
    if "onnxruntime" in sys.modules:
        raise Avx2Unavailable("onnxruntime is already imported in this process: call use_avx2_onnxruntime first")
    if platform.machine() not in ("x86_64", "AMD64") or not sys.platform.startswith("linux"):
        raise Avx2Unavailable(f"onnxruntime's AVX2 kernels run this way on x86-64 Linux only, "
                              f"not {platform.machine()} {sys.platform}")
    if shutil.which("objdump") is None:
        raise Avx2Unavailable("objdump is missing: apt-get install binutils")
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise Avx2Unavailable("onnxruntime is not installed: pip install onnxruntime")
    package = list(spec.submodule_search_locations)[0]
    version = importlib.metadata.version("onnxruntime")
    folder = os.path.join(cache, f"{version}-{PATCH_FORMAT}")
    if not os.path.exists(os.path.join(folder, "patched-sites")):
        _prepare(folder, package)
    ctypes.CDLL(os.path.join(folder, "hide_avx512.so"), mode=ctypes.RTLD_GLOBAL)
    sys.path.insert(0, folder)
    with open(os.path.join(folder, "patched-sites")) as f:
        sites = int(f.read())
    return (f"onnxruntime {version} with AVX-512 hidden from its CPU probe ({sites} CPUID/XGETBV "
            f"instructions of its libraries answered by a handler): its AVX2 kernels")
