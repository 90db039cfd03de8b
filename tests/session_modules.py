"""Tiny modules written in C against docs/module-abi.md, built with the system cc
or a cross compiler for another board's architecture.

They stand in for compiled models where a test needs a module that misbehaves
(crashes, spins) or a plain object file to link on the board.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile

METADATA = {
    "abi_version": 1, "name": "addone",
    "target": {"name": "host", "triple": "", "cpu": "", "features": ""},
    "inputs": [{"name": "x", "shape": [1, 4], "dtype": "float32"}],
    "outputs": [{"name": "y", "shape": [1, 4], "dtype": "float32"}],
    "workspace_bytes": 0, "param_bytes": 0, "ops": ["Add"], "producer": "tests",
}

SOURCE = r"""
#include <stdint.h>
/* No libc (docs/module-abi.md): memset is one of the three symbols a module
   may leave to the loader, and the rest are system calls made here. */
void *memset(void *s, int c, unsigned long n);
#if defined(CHATTY) || defined(SLOW) || defined(FORKER) || defined(NETPROBE) || defined(READ_PATH) || \
    defined(WRITE_PATH)
static long sys3(long n, long a, long b, long c) {
#if defined(__x86_64__)
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return ret;
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2) : "memory");
    return x0;
#elif defined(__arm__)
    register long r7 __asm__("r7") = n;
    register long r0 __asm__("r0") = a;
    register long r1 __asm__("r1") = b;
    register long r2 __asm__("r2") = c;
    __asm__ volatile("svc 0" : "+r"(r0) : "r"(r7), "r"(r1), "r"(r2) : "memory");
    return r0;
#else
#error "no system calls for this architecture"
#endif
}
#if defined(__x86_64__)
enum { SYS_WRITE = 1, SYS_NANOSLEEP = 35, SYS_SETSID = 112, SYS_SOCKET = 41, SYS_CONNECT = 42,
       SYS_READ = 0, SYS_OPENAT = 257, SYS_FCHMOD = 91 };
static long fork_now(void) { return sys3(57, 0, 0, 0); }
#elif defined(__aarch64__)
enum { SYS_WRITE = 64, SYS_NANOSLEEP = 101, SYS_SETSID = 157, SYS_SOCKET = 198, SYS_CONNECT = 203,
       SYS_READ = 63, SYS_OPENAT = 56, SYS_FCHMOD = 52 };
static long fork_now(void) { return sys3(220, 17 /* SIGCHLD */, 0, 0); }   /* clone */
#else
enum { SYS_WRITE = 4, SYS_NANOSLEEP = 162, SYS_SETSID = 66, SYS_SOCKET = 281, SYS_CONNECT = 283,
       SYS_READ = 3, SYS_OPENAT = 322, SYS_FCHMOD = 94 };
static long fork_now(void) { return sys3(2, 0, 0, 0); }
#endif
#if defined(FORKER)
/* A process that outlives its run: it sleeps for good, in C, never returning
   to whatever forked it. */
static long stay(int own_session) {
    long pid = fork_now();
    if (pid == 0) {
        if (own_session) sys3(SYS_SETSID, 0, 0, 0);
        long pause[2] = {1, 0};
        for (;;) sys3(SYS_NANOSLEEP, (long)pause, 0, 0);
    }
    return pid;
}
#endif
#endif

int32_t tether_abi_version(void) { return 1; }
const char *tether_metadata(void) { return METADATA; }

int32_t tether_run(void *const *inputs, void *const *outputs, void *workspace) {
    const float *x = (const float *)inputs[0];
    float *y = (float *)outputs[0];
#if defined(CRASH)
    volatile int *nowhere = 0;
    *nowhere = 1;
#elif defined(HANG)
    volatile unsigned long spin = 0;
    for (;;) spin++;
#elif defined(SLOW)
    long pause[2] = {0, 300000000};   /* a board that needs 0.3 s per run */
    sys3(SYS_NANOSLEEP, (long)pause, 0, 0);
#elif defined(FORKER)
    /* Two processes left behind: one in the session's process group, one that
       leaves it for a session of its own. Their pids are the output. */
    y[0] = (float)stay(0);
    y[1] = (float)stay(1);
    y[2] = y[3] = 0.0f;
    return 0;
#elif defined(NETPROBE)
    /* A TCP connection to 127.0.0.1, port x[0]: y[0] is connect's result
       (0, or minus the error number). */
    long fd = sys3(SYS_SOCKET, 2 /* AF_INET */, 1 /* SOCK_STREAM */, 0);
    unsigned port = (unsigned)x[0];
    unsigned char addr[16] = {2, 0, (unsigned char)(port >> 8), (unsigned char)port, 127, 0, 0, 1};
    y[0] = fd < 0 ? (float)fd : (float)sys3(SYS_CONNECT, fd, (long)addr, sizeof addr);
    y[1] = y[2] = y[3] = 0.0f;
    return 0;
#elif defined(READ_PATH)
    /* Reads the file READ_PATH: y[0] is how many bytes its first read gave
       (or minus the error number of the open or the read). */
    static char data[4096];
    long fd = sys3(SYS_OPENAT, -100 /* AT_FDCWD */, (long)READ_PATH, 0 /* O_RDONLY */);
    y[0] = fd < 0 ? (float)fd : (float)sys3(SYS_READ, fd, (long)data, sizeof data);
    y[1] = y[2] = y[3] = 0.0f;
    return 0;
#elif defined(WRITE_PATH)
    /* Writes "written by a module" to the file WRITE_PATH, made readable by
       all (fchmod 0644: openat's mode would be a fourth argument): y[0] is
       how many bytes went (or minus the error number). */
    static const char text[] = "written by a module";
    long fd = sys3(SYS_OPENAT, -100 /* AT_FDCWD */, (long)WRITE_PATH,
                   01 | 0100 | 01000 /* O_WRONLY | O_CREAT | O_TRUNC */);
    if (fd >= 0) sys3(SYS_FCHMOD, fd, 0644, 0);
    y[0] = fd < 0 ? (float)fd : (float)sys3(SYS_WRITE, fd, (long)text, sizeof text - 1);
    y[1] = y[2] = y[3] = 0.0f;
    return 0;
#elif defined(CHATTY)
    static char line[1 << 16];
    memset(line, 'x', sizeof line);
    line[sizeof line - 1] = '\n';
    for (int i = 0; i < 1024; i++) sys3(SYS_WRITE, 1, (long)line, sizeof line);   /* 64 MiB */
#endif
    for (int i = 0; i < 4; i++) y[i] = x[i] + 1.0f;
    return 0;
}
"""

C_COMPILER = shutil.which("cc") or shutil.which("gcc")
# A module needs nothing from the C library (docs/module-abi.md); the native
# board server's loader refuses one that does.
NO_LIBC = ["-nostdlib", "-ffreestanding", "-fno-stack-protector", "-fno-builtin"]


def _write_source(folder: str) -> str:
    path = os.path.join(folder, "addone.c")
    literal = json.dumps(json.dumps(METADATA))
    with open(path, "w") as f:
        f.write(f"#define METADATA {literal}\n" + SOURCE)
    return path


def build(folder: str, kind: str = "ok", compiler: str = None, read_path: str = "",
          write_path: str = "") -> str:
    """A shared object: kind 'ok' (y = x + 1), 'crash' (segfaults), 'hang' (spins) or
    'chatty' (prints 64 MiB to stdout, then y = x + 1) or 'slow' (0.3 s a run) or
    'forker' (leaves two processes that sleep for good, one in a session of its own;
    y holds their pids) or 'netprobe' (y[0]: connect's result for 127.0.0.1, port x[0])
    or 'reader' (y[0]: bytes read from the file ``read_path``, or minus the error)
    or 'writer' (y[0]: bytes written to the file ``write_path``, or minus the error)."""
    source = _write_source(folder)
    out = os.path.join(folder, f"{kind}.so")
    if kind == "reader":
        out = os.path.join(folder, f"reader-{abs(hash(read_path))}.so")
    if kind == "writer":
        out = os.path.join(folder, f"writer-{abs(hash(write_path))}.so")
    flags = {"ok": [], "crash": ["-DCRASH"], "hang": ["-DHANG"], "chatty": ["-DCHATTY"],
             "slow": ["-DSLOW"], "forker": ["-DFORKER"], "netprobe": ["-DNETPROBE"],
             "reader": [f"-DREAD_PATH={json.dumps(read_path)}"],
             "writer": [f"-DWRITE_PATH={json.dumps(write_path)}"]}[kind]
    subprocess.run([compiler or C_COMPILER, "-shared", "-fPIC", "-O1", *NO_LIBC, *flags, "-o", out,
                    source], check=True)
    return out


def build_tar(folder: str, compiler: str = None) -> str:
    """A module archive as the board links it: addone.o plus metadata.json."""
    source = _write_source(folder)
    obj = os.path.join(folder, "addone.o")
    subprocess.run([compiler or C_COMPILER, "-c", "-fPIC", "-O1", *NO_LIBC, "-o", obj, source], check=True)
    meta = os.path.join(folder, "metadata.json")
    with open(meta, "w") as f:
        json.dump(METADATA, f)
    out = os.path.join(folder, "addone.tar")
    with tarfile.open(out, "w") as tar:
        tar.add(obj, "addone.o")
        tar.add(meta, "metadata.json")
    return out
