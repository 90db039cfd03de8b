"""The compiler's cross targets as the tests check them: what each preset's
ELF file must be, and how to run a module under qemu user-mode emulation
(a small C driver, a cross compiler and the target's sysroot).

    qemu, gcc, sysroot = emulated_tools("rasp4b64")   # skips the test without them
    y = run_emulated(lib, "rasp4b64", x, (1, 1000), tmp_path)
"""
import os
import shutil
import subprocess

import numpy as np
import pytest

ALLOWED_UNDEFINED = {"memcpy", "memset", "memmove"}
CROSS_TARGETS = {  # preset -> (EI_CLASS, e_machine, hard-float)
    "rasp3b": ("ELFCLASS32", "EM_ARM", True),
    "rasp4b": ("ELFCLASS32", "EM_ARM", True),
    "rasp4b64": ("ELFCLASS64", "EM_AARCH64", None),
    "rasp5": ("ELFCLASS64", "EM_AARCH64", None),
    "android-arm64": ("ELFCLASS64", "EM_AARCH64", None),
    "android-armv7": ("ELFCLASS32", "EM_ARM", False),
}

DRIVER_C = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* driver MODULE.so WORKSPACE_BYTES IN.bin N_IN OUT.bin N_OUT */
int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage\n"); return 2; }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 3; }
    int32_t (*abi)(void) = (int32_t (*)(void))dlsym(lib, "tether_abi_version");
    const char *(*meta)(void) = (const char *(*)(void))dlsym(lib, "tether_metadata");
    int32_t (*run)(void *const *, void *const *, void *) =
        (int32_t (*)(void *const *, void *const *, void *))dlsym(lib, "tether_run");
    if (!abi || !meta || !run) { fprintf(stderr, "missing symbol\n"); return 4; }
    size_t ws = strtoul(argv[2], NULL, 10), n_in = strtoul(argv[4], NULL, 10), n_out = strtoul(argv[6], NULL, 10);
    void *workspace = aligned_alloc(64, ws ? ws : 64);
    float *in = malloc(n_in * sizeof(float)), *out = malloc(n_out * sizeof(float));
    FILE *f = fopen(argv[3], "rb");
    if (!f || fread(in, sizeof(float), n_in, f) != n_in) { fprintf(stderr, "read\n"); return 5; }
    fclose(f);
    void *ins[1] = {in}, *outs[1] = {out};
    int32_t status = run(ins, outs, workspace);
    if (status != 0) { fprintf(stderr, "tether_run: %d\n", status); return 6; }
    f = fopen(argv[5], "wb");
    fwrite(out, sizeof(float), n_out, f);
    fclose(f);
    printf("%d\n%s\n", abi(), meta());
    return 0;
}
"""

EMULATED = {  # preset -> (qemu, cross gcc, sysroot)
    "rasp4b64": ("qemu-aarch64", "aarch64-linux-gnu-gcc", "/usr/aarch64-linux-gnu"),
    "rasp5": ("qemu-aarch64", "aarch64-linux-gnu-gcc", "/usr/aarch64-linux-gnu"),
    "rasp4b": ("qemu-arm", "arm-linux-gnueabihf-gcc", "/usr/arm-linux-gnueabihf"),
    "rasp3b": ("qemu-arm", "arm-linux-gnueabihf-gcc", "/usr/arm-linux-gnueabihf"),
}


def emulated_tools(preset):
    """(qemu, cross gcc, sysroot) of an EMULATED preset; skips the test when one is missing."""
    qemu, gcc, sysroot = EMULATED[preset]
    if not (shutil.which(qemu) and shutil.which(gcc) and os.path.isdir(sysroot)):
        pytest.skip(f"needs {qemu}, {gcc} and {sysroot}: "
                    "apt-get install qemu-user gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf")
    # gcc finds cc1 from where it was started: without PATH (env -i) a bare
    # name resolves through /bin, beside which Debian's usrmerge has no cc1.
    return qemu, os.path.realpath(shutil.which(gcc)), sysroot


def run_emulated(lib, preset: str, x: np.ndarray, out_shape, folder, cpu: "str | None" = None) -> np.ndarray:
    """Run a compiled module of one float32 input and output (lib, from
    crosscompile.build for preset) under qemu with DRIVER_C; its output.
    cpu is qemu's -cpu (the core emulated; qemu's default, which runs every
    instruction it knows, unless given). Skips the test without the tools."""
    qemu, gcc, sysroot = emulated_tools(preset)
    so = lib.export_library(os.path.join(folder, "module.so"))
    driver, data_in, data_out = (os.path.join(folder, name) for name in ("driver", "in.bin", "out.bin"))
    with open(driver + ".c", "w") as f:
        f.write(DRIVER_C)
    subprocess.run([gcc, "-O1", "-o", driver, driver + ".c", "-ldl"], check=True, capture_output=True)
    np.ascontiguousarray(x, np.float32).tofile(data_in)
    size = int(np.prod(out_shape))
    proc = subprocess.run([qemu, *(["-cpu", cpu] if cpu else []), "-L", sysroot, driver, so, str(lib.metadata["workspace_bytes"]), data_in,
                           str(x.size), data_out, str(size)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return np.fromfile(data_out, dtype=np.float32).reshape(out_shape)
