"""The native board server's module loader (remote/server/native/elf_loader.cpp,
module.cpp): its test driver tools/module_check.cpp, built with zig as a static
musl executable for x86_64, aarch64 and 32-bit ARM, runs real modules (natively,
or under qemu user-mode emulation, which a static binary needs no root
filesystem for) and must give onnxruntime's outputs; corrupted modules must be
refused with a message that names the file and what is wrong."""
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import struct
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import pytest

import crosscompile
from remote.cli import native
from remote.defaults import cache_dir
from tests.audio_models import kws_lstm
from tests.onnx_models import mlp, reference, sample_input
from tests.test_profile import residual_cnn
from tests.test_threads import small_cnn
from tests.transformer_models import bert_encoder, bert_feeds

NATIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "remote", "server", "native")
SOURCES = ["module.cpp", "elf_loader.cpp", "json.cpp", "string_printf.cpp", "tools/module_check.cpp"]
FLAGS = ["-std=c++17", "-Os", "-static", "-fno-exceptions", "-fno-rtti"]
TIMEOUT_S = 300  # only catches a hang: qemu on a loaded 2-core machine is slow


class Arch(NamedTuple):
    zig_target: str
    qemu: str
    presets: tuple  # the crosscompile targets whose modules this build runs


ARCHES = {
    "x86_64": Arch("x86_64-linux-musl", "qemu-x86_64", ("x86_64-linux-gnu",)),
    "aarch64": Arch("aarch64-linux-musl", "qemu-aarch64", ("rasp4b64",)),
    # android-armv7 modules use the soft-float calling convention; the server
    # is hard-float, and runs them all the same (docs/module-abi.md).
    "armv7": Arch("arm-linux-musleabihf", "qemu-arm", ("rasp4b", "android-armv7")),
}
ARCH_OF_PRESET = {preset: arch for arch, a in ARCHES.items() for preset in a.presets}

MODELS = {
    "mlp": mlp,
    "cnn": small_cnn,              # convolutions split over threads (tether_run_parallel)
    "residual_cnn": residual_cnn,  # steps metadata, profiled
    "bert": bert_encoder,          # int64 inputs; on 32-bit ARM it imports __aeabi_l2f
    "lstm": kws_lstm,              # imports memcpy: a JUMP_SLOT relocation on every target
}
# (preset, model, driver options)
CASES = [(preset, model, options) for preset in ARCH_OF_PRESET for model, options in [
    ("mlp", []), ("cnn", ["--threads", "3", "--repeat", "3"]), ("residual_cnn", ["--profile"]),
    ("bert", ["--threads", "2"]), ("lstm", [])]]


def runs_natively(arch: str) -> bool:
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    return machine == arch and sys.maxsize > 2**32


def driver_folder() -> str:
    """Where the drivers of these sources are kept: in Tether's cache, keyed
    like the native servers (their sources, flags and zig's version) and by
    the driver's own source and flags."""
    zig = native._zig()
    digest = hashlib.sha256(native.build_key(native._zig_version(zig)).encode())
    with open(os.path.join(NATIVE, "tools", "module_check.cpp"), "rb") as f:
        digest.update(f.read())
    digest.update(repr(FLAGS).encode())
    return os.path.join(cache_dir(), "module-check", digest.hexdigest()[:16])


def build_drivers(folder=None) -> dict:
    """{arch: path of module_check}, built once per change of their sources
    (tests/warmup.py builds them in the background of a full run); the
    missing builds run side by side."""
    if importlib.util.find_spec("ziglang") is None:
        pytest.skip("building the native server needs zig: pip install ziglang")
    folder = folder or driver_folder()
    os.makedirs(folder, exist_ok=True)
    drivers = {arch: os.path.join(folder, f"module_check-{arch}") for arch in ARCHES}
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building them: wait for it
        procs = {}
        for arch, out in drivers.items():
            if os.path.exists(out):
                continue
            # The server's own flags per triple: the builds of musl and libc++
            # that zig makes first (minutes on a fresh machine) serve both.
            command = [sys.executable, "-m", "ziglang", "c++", "-target", ARCHES[arch].zig_target, *FLAGS,
                       *native.TRIPLE_FLAGS[ARCHES[arch].zig_target],
                       *[os.path.join(NATIVE, s) for s in SOURCES], "-o", out + ".part"]
            procs[arch] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for arch, proc in procs.items():
            # zig's first build for a target also builds musl and libc++ (minutes).
            log, _ = proc.communicate(timeout=1800)
            assert proc.returncode == 0, f"zig c++ for {ARCHES[arch].zig_target} failed:\n{log}"
            os.replace(drivers[arch] + ".part", drivers[arch])
    return drivers


@pytest.fixture(scope="module")
def drivers():
    return build_drivers()


@pytest.fixture(scope="module")
def module_for(tmp_path_factory):
    """module_for(preset, model) -> (onnx model, path of the compiled .so, its metadata), built once."""
    folder = tmp_path_factory.mktemp("native-modules")
    built = {}

    def build(preset, name):
        if (preset, name) not in built:
            model = MODELS[name]()
            path = str(folder / f"{name}-{preset}.so")
            lib = crosscompile.build(model, target=preset)
            lib.export_library(path)
            built[preset, name] = (model, path, lib.metadata)
        return built[preset, name]
    return build


def run_driver(drivers, arch, *args) -> subprocess.CompletedProcess:
    command = [drivers[arch], *map(str, args)]
    if not runs_natively(arch):
        qemu = shutil.which(ARCHES[arch].qemu)
        if qemu is None:
            pytest.skip(f"running the {arch} build here needs {ARCHES[arch].qemu}: apt-get install qemu-user")
        command.insert(0, qemu)  # no -L: a static executable needs no root filesystem
    # Strict UTF-8: the server sends these messages in protobuf strings.
    return subprocess.run(command, capture_output=True, text=True, encoding="utf-8", errors="strict",
                          timeout=TIMEOUT_S)


@pytest.mark.parametrize("preset,name,options", CASES, ids=[f"{p}-{m}" for p, m, _ in CASES])
def test_outputs_match_onnxruntime(drivers, module_for, tmp_path, preset, name, options):
    model, so, metadata = module_for(preset, name)
    feeds = bert_feeds(model) if name == "bert" else sample_input(model)
    inputs = []
    for key, value in feeds.items():
        inputs.append(tmp_path / f"{key}.bin")
        np.ascontiguousarray(value).tofile(inputs[-1])
    proc = run_driver(drivers, ARCH_OF_PRESET[preset], so, *inputs, "-o", tmp_path / "out", *options)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    threads = int(options[options.index("--threads") + 1]) if "--threads" in options else 1
    assert lines[0] == f"threads {threads}"
    for i, want in enumerate(reference(model, feeds)):
        got = np.fromfile(tmp_path / f"out{i}.bin", dtype=want.dtype).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if "--profile" in options:
        steps = metadata["steps"]
        rows = [line.split() for line in lines[1:]]
        assert [(r[0], int(r[1]), r[2], r[3]) for r in rows] == [
            ("step", i, s["op"], s["name"]) for i, s in enumerate(steps)]
        seconds = [float(r[4]) for r in rows]
        assert min(seconds) >= 0 and sum(seconds) > 0


@pytest.mark.parametrize("threads", [1, 3])
def test_a_module_error_code_is_reported_as_minirt_does(drivers, module_for, tmp_path, threads):
    model, so, _ = module_for("x86_64-linux-gnu", "cnn")
    x = tmp_path / "x.bin"
    sample_input(model)["x"].tofile(x)
    proc = run_driver(drivers, "x86_64", so, x, "-o", tmp_path / "out", "--null-inputs", "--threads", threads)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{so}: tether_run returned 1 (a required pointer was NULL)"


# --- refusals: real modules for x86_64, corrupted the way files get corrupted ---

def refusal(drivers, path) -> str:
    proc = run_driver(drivers, "x86_64", path, "-o", str(path) + ".out")
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    message = proc.stderr.strip()
    assert str(path) in message
    return message


def sections(data: bytes) -> dict:
    """{name: (address, file offset, size)} of a little-endian ELF64 file."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    return {data[names + h[0]:data.index(b"\0", names + h[0])].decode(): (h[3], h[4], h[5]) for h in headers}


def patched(module_for, tmp_path, name, patch) -> str:
    """A copy of the x86_64 module of `name`, changed by patch(bytearray, sections)."""
    _, so, _ = module_for("x86_64-linux-gnu", name)
    data = bytearray(open(so, "rb").read())
    patch(data, sections(bytes(data)))
    path = tmp_path / f"{name}.so"
    path.write_bytes(bytes(data))
    return str(path)


def test_a_module_for_another_machine_names_both(drivers, module_for):
    for preset, module_machine in [("rasp4b64", "64-bit aarch64"), ("rasp4b", "32-bit arm")]:
        _, so, _ = module_for(preset, "mlp")
        message = refusal(drivers, so)
        assert f"is a {module_machine} module, but this server runs 64-bit x86_64 code" in message
        assert "rebuild it for this board's target" in message


def test_a_truncated_module_is_refused_at_any_length(drivers, module_for, tmp_path):
    _, so, _ = module_for("x86_64-linux-gnu", "mlp")
    data = open(so, "rb").read()
    for size in [0, 10, 63, 64, 200, len(data) // 3, len(data) // 2, len(data) - 1]:
        path = tmp_path / f"cut{size}.so"
        path.write_bytes(data[:size])
        message = refusal(drivers, path)
        if size < 20:
            assert "is not an ELF shared object; expected a module" in message
        else:
            assert "is truncated: its headers describe" in message and f"the file has {size};" in message
            assert "upload it again" in message


@pytest.mark.parametrize("tag,cause", [
    (1, "needs the shared library mlp.so (DT_NEEDED), but a module must need none"),
    (12, "has an initialisation function (DT_INIT)"),
    (25, "has initialisation functions (DT_INIT_ARRAY)"),
    (22, "relocates its code (DT_TEXTREL)"),
])
def test_dynamic_entries_a_module_must_not_have(drivers, module_for, tmp_path, tag, cause):
    def retag_soname(data, found):
        _, offset, size = found[".dynamic"]
        for at in range(offset, offset + size, 16):
            if struct.unpack_from("<q", data, at)[0] == 14:  # DT_SONAME
                struct.pack_into("<q", data, at, tag)
                return
        raise AssertionError("no DT_SONAME")
    message = refusal(drivers, patched(module_for, tmp_path, "mlp", retag_soname))
    assert cause in message


def test_an_undefined_symbol_other_than_memcpy_memset_memmove(drivers, module_for, tmp_path):
    def rename_memcpy(data, found):
        _, offset, size = found[".dynstr"]
        at = data.index(b"\0memcpy\0", offset, offset + size) + 1
        data[at:at + 6] = b"strcpy"
    message = refusal(drivers, patched(module_for, tmp_path, "lstm", rename_memcpy))
    assert "needs symbol strcpy, which this server does not provide" in message
    assert "only memcpy, memset and memmove" in message


def test_an_unknown_relocation_type(drivers, module_for, tmp_path):
    def irelative(data, found):
        _, offset, size = found[".rela.plt"]
        info, = struct.unpack_from("<Q", data, offset + 8)
        assert info & 0xffffffff == 7  # R_X86_64_JUMP_SLOT
        struct.pack_into("<Q", data, offset + 8, (info >> 32) << 32 | 37)  # R_X86_64_IRELATIVE
    message = refusal(drivers, patched(module_for, tmp_path, "lstm", irelative))
    assert "has a relocation of type 37" in message and "does not apply" in message


def test_another_abi_version(drivers, module_for, tmp_path):
    def version_2(data, found):
        (_, symbols, size), (_, strings, _) = found[".dynsym"], found[".dynstr"]
        text_address, text_offset, _ = found[".text"]
        for at in range(symbols, symbols + size, 24):
            name, _, _, _, value, _ = struct.unpack_from("<IBBHQQ", data, at)
            if data[strings + name:data.index(b"\0", strings + name)] == b"tether_abi_version":
                code = value - text_address + text_offset
                assert data[code:code + 6] == b"\xb8\x01\x00\x00\x00\xc3"  # mov eax, 1; ret
                data[code + 1] = 2
                return
        raise AssertionError("no tether_abi_version")
    message = refusal(drivers, patched(module_for, tmp_path, "mlp", version_2))
    assert "uses module ABI version 2, but this server supports version 1" in message


@pytest.mark.parametrize("text,replacement,cause", [
    (b'"workspace_bytes"', b'"workspace_bytez"', 'no "workspace_bytes" count'),
    (b'"producer":"t', b'"producer":"\xff', "invalid UTF-8 in string"),
    (b'"outputs"', b'"outputz"', 'no "outputs" list'),
], ids=["no-workspace-size", "not-utf8", "no-outputs"])
def test_unreadable_metadata(drivers, module_for, tmp_path, text, replacement, cause):
    def rewrite(data, found):
        _, offset, size = found[".rodata"]
        at = data.index(text, offset, offset + size)
        data[at:at + len(text)] = replacement
    message = refusal(drivers, patched(module_for, tmp_path, "mlp", rewrite))
    assert f"has unreadable metadata: {cause}" in message and "rebuild it with crosscompile" in message


def test_corrupt_headers_and_tables_never_crash_the_loader(drivers, module_for, tmp_path):
    """Random bytes and words written over the ELF header, the program headers
    and the dynamic tables: the loader (--map-only: no module code runs, since
    a corrupt symbol may point anywhere in the code) maps the file or refuses
    it with a UTF-8 message naming it, and never dies of a signal."""
    _, so, _ = module_for("x86_64-linux-gnu", "lstm")
    data = open(so, "rb").read()
    found = sections(data)
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phnum, = struct.unpack_from("<H", data, 0x38)
    ranges = [(0, 64), (phoff, phoff + 56 * phnum)] + [
        (offset, offset + size) for name, (_, offset, size) in found.items()
        if name in (".dynsym", ".dynstr", ".gnu.hash", ".hash", ".rela.plt", ".dynamic")]
    rng = np.random.default_rng(7)
    path = tmp_path / "corrupt.so"
    for _ in range(200):
        corrupt = bytearray(data)
        for _ in range(rng.integers(1, 5)):
            low, high = ranges[rng.integers(len(ranges))]
            at = int(rng.integers(low, high))
            if rng.random() < 0.5:
                corrupt[at] = int(rng.integers(256))
            else:  # a whole field: offsets, addresses and sizes out of range
                at -= at % 8
                value = [0, 2**63, 2**64 - 1, len(data), int(rng.integers(2**63))][rng.integers(5)]
                corrupt[at:at + 8] = struct.pack("<Q", value)
        path.write_bytes(bytes(corrupt))
        proc = run_driver(drivers, "x86_64", path, "--map-only")
        assert proc.returncode in (0, 2), (proc.returncode, proc.stderr)
        assert proc.returncode == 0 or str(path) in proc.stderr


def test_files_that_are_not_modules(drivers, tmp_path):
    text = tmp_path / "notes.so"
    text.write_text("hello, board\n" * 10)
    assert "is not an ELF shared object; expected a module" in refusal(drivers, text)
    assert "cannot read" in refusal(drivers, tmp_path / "missing.so")
    program = drivers["x86_64"]  # a static executable: ET_EXEC
    assert "is not an ELF shared object (e_type 2)" in refusal(drivers, program)


def test_an_object_tar_linked_on_the_board(drivers, tmp_path):
    """What the server does with a module .tar: the board's cc links it. With
    -nostdlib the result needs nothing and loads (DT_GNU_HASH alone, as GNU
    ld writes by default); a plain `cc -shared` adds libc and its start-up
    files, which the loader refuses, saying how to link instead."""
    arch = next((a for a in ARCHES if runs_natively(a)), None)
    cc = shutil.which("cc")
    if arch is None or cc is None:
        pytest.skip("needs a C compiler (cc) for this machine, an x86_64 or aarch64 one")
    model = mlp()
    lib = crosscompile.build(model, target="host")
    lib.export_library(str(tmp_path / "net.tar"))
    subprocess.run(["tar", "xf", "net.tar"], cwd=tmp_path, check=True)
    objects = sorted(str(p) for p in tmp_path.glob("*.o"))
    feeds = sample_input(model)
    np.ascontiguousarray(feeds["input"]).tofile(tmp_path / "x.bin")
    subprocess.run([cc, "-shared", "-nostdlib", "-o", tmp_path / "lean.so", *objects], check=True,
                   capture_output=True)
    proc = run_driver(drivers, arch, tmp_path / "lean.so", tmp_path / "x.bin", "-o", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    want = reference(model, feeds)[0]
    got = np.fromfile(tmp_path / "out0.bin", dtype=want.dtype).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    subprocess.run([cc, "-shared", "-o", tmp_path / "libc.so", *objects], check=True, capture_output=True)
    proc = run_driver(drivers, arch, tmp_path / "libc.so", tmp_path / "x.bin", "-o", tmp_path / "out")
    assert proc.returncode == 2
    # GNU ld drops libc when nothing uses it (--as-needed); crti's _init stays.
    assert f"{tmp_path / 'libc.so'} needs the shared library libc." in proc.stderr or (
        f"{tmp_path / 'libc.so'} has an initialisation function (DT_INIT)" in proc.stderr)
    assert "or link an object tar with `cc -shared -nostdlib -o net.so *.o`" in proc.stderr
