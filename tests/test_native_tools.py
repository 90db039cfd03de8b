"""The native board server's tooling: static builds for every architecture
(`tether native`), `tether adb` against a stand-in adb (tests/adb_stand_in.py)
and `tether bootstrap --native` against a real sshd, each with a real tracker
and a real session on the server it started."""
import getpass
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys

import pytest

from remote.cli import native
from tests.ssh_board import free_port, known_hosts_line, pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHES = ("x86_64", "aarch64", "armv7l")
ELF_MACHINES = {"x86_64": "EM_X86_64", "aarch64": "EM_AARCH64", "armv7l": "EM_ARM"}
QEMU = {"x86_64": "qemu-x86_64", "aarch64": "qemu-aarch64", "armv7l": "qemu-arm"}
HOST = platform.machine() if platform.machine() in ARCHES else None
# The Android ABI of a phone with this machine's CPU, and of one whose CPU qemu
# stands for.
HOST_ABI = {"x86_64": "x86_64", "aarch64": "arm64-v8a"}.get(platform.machine())
MAX_BYTES = 2 * 1024 * 1024
EF_ARM_ABI_FLOAT_HARD = 0x400


def _skip_without_zig():
    if importlib.util.find_spec("ziglang") is None:
        pytest.skip("building the native server needs zig's compiler: pip install ziglang")


@pytest.fixture(scope="module")
def builds():
    """The cached native server of every architecture (built once per change of its sources)."""
    _skip_without_zig()
    return {arch: native.build_native(arch) for arch in ARCHES}


def _cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "remote.cli", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, timeout=timeout)


def _on_this_machine(arch):
    """argv prefix that runs an ``arch`` executable here: nothing, or qemu (no root
    filesystem: the server is static); skips when qemu is missing."""
    if arch == HOST:
        return []
    qemu = shutil.which(QEMU[arch])
    if qemu is None:
        pytest.skip(f"running {arch} executables here needs {QEMU[arch]}: "
                    f"apt-get install qemu-user")
    return [qemu]


@pytest.fixture(scope="module")
def tracker():
    from remote.cli.localfarm import LocalFarm
    with LocalFarm(keys=[], env={**os.environ, "PYTHONPATH": ROOT}) as farm:
        yield farm


def _session_works(farm, key):
    """A session through the tracker: a file goes up and is listed."""
    from remote import rpc
    with rpc.connect_tracker(*farm.tracker).request(key, timeout=30) as sess:
        assert sess.device_info()["machine"]
        sess.upload(b"sent to a board without Python\n", "note.txt")
        assert "note.txt" in sess.listdir()


@pytest.mark.parametrize("arch", ARCHES)
def test_build_is_static_and_small(builds, arch):
    from elftools.elf.elffile import ELFFile
    path = builds[arch]
    assert os.path.getsize(path) <= MAX_BYTES
    with open(path, "rb") as f:
        elf = ELFFile(f)
        assert elf["e_machine"] == ELF_MACHINES[arch]
        kinds = [segment["p_type"] for segment in elf.iter_segments()]
        assert "PT_INTERP" not in kinds, "a static executable needs no program loader"
        needed = [tag.needed for segment in elf.iter_segments() if segment["p_type"] == "PT_DYNAMIC"
                  for tag in segment.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
        assert needed == []
        assert elf.get_section_by_name(".symtab") is None, "the executable is stripped"
        if arch == "armv7l":
            # hard-float ARMv7-A with VFPv3-D16 and no NEON: what 32-bit Android guarantees
            assert elf["e_flags"] & EF_ARM_ABI_FLOAT_HARD
            attributes = _arm_attributes(elf)
            assert attributes["TAG_CPU_ARCH"] == 10 and attributes["TAG_FP_ARCH"] == 4
            assert "TAG_ADVANCED_SIMD_ARCH" not in attributes


def _arm_attributes(elf):
    section = elf.get_section_by_name(".ARM.attributes")
    return {a.tag: a.value for sub in section.iter_subsections()
            for subsub in sub.iter_subsubsections() for a in subsub.iter_attributes()}


@pytest.mark.parametrize("arch", ARCHES)
def test_version_runs_with_no_root_filesystem(builds, arch):
    out = subprocess.run([*_on_this_machine(arch), builds[arch], "--version"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "tether-server" in out.stdout and "native" in out.stdout


@pytest.mark.skipif(HOST is None, reason="no native build runs on this machine's CPU")
def test_a_bad_poll_setting_stops_the_server_with_what_to_do(builds):
    out = subprocess.run([builds[HOST], "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True, timeout=60,
                         env={**os.environ, "TETHER_POLL_US": "fast"})
    assert out.returncode == 2
    assert "TETHER_POLL_US='fast' is not a number of microseconds" in out.stderr
    assert "0 turns polling off" in out.stderr


def test_cli_builds_for_presets_and_prints_paths(builds, tmp_path):
    out = _cli("native", "build", "--target", "rasp4b64", "--output", str(tmp_path / "server"))
    assert out.returncode == 0, out.stderr
    cached_path = _current_build("aarch64")
    size = os.path.getsize(cached_path)
    assert out.stdout.strip() == f"{tmp_path / 'server'} ({size} bytes, aarch64-linux-musl, static)"
    with open(tmp_path / "server", "rb") as copy, open(cached_path, "rb") as cached:
        assert copy.read() == cached.read()
    assert os.access(tmp_path / "server", os.X_OK)
    out = _cli("native", "path", "--target", "android-armv7")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _current_build("armv7l")
    assert "building" not in out.stderr, "a cached build is not built again"


def test_unknown_target_lists_the_known_ones():
    out = _cli("native", "build", "--target", "mips")
    assert out.returncode == 1
    assert "unknown target 'mips'" in out.stderr
    for name in ("rasp4b64", "android-armv7", "armv7l", "x86_64"):
        assert name in out.stderr


def test_build_follows_its_sources(monkeypatch, tmp_path):
    """An unchanged source is taken from the cache; a change of any source, a
    header too, builds anew; a compiler error shows its first lines. (A small
    program stands in for the server here: test_build_is_static_and_small
    builds the server itself.)"""
    _skip_without_zig()
    sources = tmp_path / "native"
    sources.mkdir()
    (sources / "server.cpp").write_text('#include "answer.hpp"\nint main() { return ANSWER; }\n')
    (sources / "answer.hpp").write_text("#define ANSWER 0\n")
    monkeypatch.setattr(native, "SOURCE_DIR", str(sources))
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path / "cache"))
    said = []
    first = native.build_native("host", progress=said.append)
    assert first.startswith(str(tmp_path / "cache" / "native"))
    assert any("building the native server" in line for line in said)
    said.clear()
    assert native.build_native("host", progress=said.append) == first and said == []
    assert subprocess.run([first]).returncode == 0

    (sources / "answer.hpp").write_text("#define ANSWER 3\n")
    second = native.build_native("host")
    assert second != first and subprocess.run([second]).returncode == 3

    with open(sources / "server.cpp", "a") as f:
        f.write("\nint broken = ;\n")
    with pytest.raises(native.NativeBuildError) as failure:
        native.build_native("host")
    assert "server.cpp" in str(failure.value) and "error:" in str(failure.value)


# ------------------------------------------------------------------ tether adb --
@pytest.fixture
def phone(tmp_path):
    """The stand-in adb first on PATH; yields (env for tether, phone folder, calls file).
    Stops the server a failed test left running."""
    phone_dir = tmp_path / "phone-tmp"
    phone_dir.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    adb = bin_dir / "adb"
    adb.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT}/tests/adb_stand_in.py "$@"\n')
    adb.chmod(0o755)
    calls = tmp_path / "adb-calls.jsonl"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "STANDIN_ADB_PHONE": str(phone_dir), "STANDIN_ADB_CALLS": str(calls)}
    yield env, phone_dir, calls
    pid_file = phone_dir / "tether-server.pid"
    if pid_file.exists() and pid_file.read_text().strip().isdigit():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _calls(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _current_build(arch):
    """The cached build of the sources as they are now (others may edit them while
    the tests run; the fixture's build is then an older one)."""
    return native.build_native(arch)


def _adb_round_trip(phone, tracker, abi, arch, key, reverse, runner=None):
    env, phone_dir, calls = phone
    env = {**env, "STANDIN_ADB_ABI": abi, **({"STANDIN_ADB_RUNNER": runner} if runner else {})}
    tport = tracker.tracker[1]
    port = free_port()
    args = ["adb", "--tracker", f"127.0.0.1:{tport}", "--key", key, "--port", str(port)]
    args += ["--reverse"] if reverse else []
    out = _cli(*args, env=env)
    assert out.returncode == 0, out.stderr
    assert f"key={key}" in out.stdout
    assert ("relay" in out.stdout) == reverse

    made = _calls(calls)
    build = _current_build(arch)
    assert ["shell", "getprop ro.product.cpu.abi"] in made
    assert ["push", build, "/data/local/tmp/tether-server"] in made
    assert ["shell", "chmod 755 /data/local/tmp/tether-server"] in made
    start = [c[1] for c in made
             if c[0] == "shell" and "nohup /data/local/tmp/tether-server" in c[1]]
    assert len(start) == 1
    assert f"--key {key}" in start[0] and "> /data/local/tmp/tether-server.log" in start[0]
    if reverse:
        assert ["reverse", f"tcp:{tport}", f"tcp:{tport}"] in made
        assert f"--tracker 127.0.0.1:{tport}" in start[0] and "--relay" in start[0]
    else:
        assert not any(c[0] == "reverse" for c in made)
        assert f"--port {port}" in start[0] and "--relay" not in start[0]
    pushed = phone_dir / ("tether-server.elf" if runner else "tether-server")
    with open(pushed, "rb") as f, open(build, "rb") as g:
        assert f.read() == g.read()
    pid = int((phone_dir / "tether-server.pid").read_text())
    assert pid_alive(pid)

    _session_works(tracker, key)

    gone = _cli("adb", "--uninstall", *(["--reverse", "--tracker", f"127.0.0.1:{tport}"]
                                         if reverse else []), env=env)
    assert gone.returncode == 0, gone.stderr
    assert not (phone_dir / "tether-server").exists()
    assert not pid_alive(pid)
    if reverse:
        assert ["reverse", "--remove", f"tcp:{tport}"] in _calls(calls)


@pytest.mark.parametrize("reverse", [True, False], ids=["reverse", "wifi"])
def test_adb_starts_the_server_on_a_phone(builds, tracker, phone, reverse):
    if HOST_ABI is None:
        pytest.skip(f"no Android ABI runs on this machine's {platform.machine()}")
    _adb_round_trip(phone, tracker, HOST_ABI, HOST, f"phone-{HOST_ABI}-{reverse}", reverse)


def test_adb_picks_the_build_of_an_arm64_phone(builds, tracker, phone):
    """arm64-v8a gets the aarch64 build, which the stand-in phone runs under qemu."""
    runner = _on_this_machine("aarch64")
    _adb_round_trip(phone, tracker, "arm64-v8a", "aarch64", "phone-arm64", True,
                    runner=runner[0] if runner else None)


def test_adb_refuses_an_abi_without_a_build(phone):
    env, _, _ = phone
    out = _cli("adb", "--tracker", "127.0.0.1:9", "--key", "k",
               env={**env, "STANDIN_ADB_ABI": "mips"})
    assert out.returncode == 1
    assert "the phone's ABI is 'mips'" in out.stderr and "arm64-v8a" in out.stderr


# ---------------------------------------------------- tether bootstrap --native --
def test_bootstrap_native_installs_serves_and_uninstalls(builds, sshd, tracker, tmp_path,
                                                         stop_leftover_server):
    if HOST is None:
        pytest.skip(f"the native server has no build for this machine's {platform.machine()}")
    known = tmp_path / "known_hosts"
    known.write_text(known_hosts_line(sshd))
    remote_dir = tmp_path / "board-home" / ".tether"
    port = free_port()
    args = [f"{getpass.getuser()}@127.0.0.1:{sshd.port}", "--native", "--tracker",
            f"127.0.0.1:{tracker.tracker[1]}", "--key", "ssh-native", "--identity",
            str(sshd.user_key), "--known-hosts", str(known), "--service", "background",
            "--remote-dir", str(remote_dir), "--port", str(port)]
    out = _cli("bootstrap", *args)
    assert out.returncode == 0, out.stderr
    assert f"native server ({native.musl_triple(HOST)}" in out.stdout
    assert f"key=ssh-native address=127.0.0.1:{port}" in out.stdout
    assert "sha256 checked on the board" in out.stderr
    with open(remote_dir / "tether-server", "rb") as f, open(_current_build(HOST), "rb") as g:
        assert f.read() == g.read()
    assert not (remote_dir / "code").exists(), "no Python files for the native server"
    manifest = json.loads((remote_dir / "installed.json").read_text())
    assert manifest["native"] == native.musl_triple(HOST)
    pid = int((remote_dir / "server.pid").read_text())
    assert pid_alive(pid)

    _session_works(tracker, "ssh-native")

    # again: the server is replaced by a new process
    again = _cli("bootstrap", *args)
    assert again.returncode == 0, again.stderr
    new_pid = int((remote_dir / "server.pid").read_text())
    assert new_pid != pid and not pid_alive(pid) and pid_alive(new_pid)

    gone = _cli("bootstrap", "--uninstall", *args)
    assert gone.returncode == 0, gone.stderr
    assert not remote_dir.exists()
    assert not pid_alive(new_pid)


def test_bootstrap_native_reports_an_unreachable_tracker(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(known_hosts_line(sshd))
    closed = free_port()
    out = _cli("bootstrap", f"{getpass.getuser()}@127.0.0.1:{sshd.port}", "--native",
               "--tracker", f"127.0.0.1:{closed}", "--identity", str(sshd.user_key),
               "--known-hosts", str(known), "--remote-dir", str(tmp_path / "never"))
    assert out.returncode == 1
    assert f"cannot reach the tracker at 127.0.0.1:{closed}" in out.stderr
    assert not (tmp_path / "never").exists()
