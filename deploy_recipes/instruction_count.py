"""Guest instructions per inference on an emulated ARM core.

Wall time under qemu says nothing about a board, but the number of guest
instructions a run executes is exact and the same from run to run whatever
the host's load. A qemu plugin (guest_instructions.c, built here with the
host's C compiler) counts them while the release's own python3 runs a model
in a cached Debian root filesystem (deploy_recipes/emulate.py). The model
runs twice, ``warmup`` and ``warmup + runs`` times; the difference over
``runs`` is one inference, with interpreter start-up, imports and loading
cancelled out.

It is a count, not a time: caches, stalls and dual issue are not in it. Use
it for ratios between implementations of the same work on the same core.

    >>> count = count_module("net.so", {"data": (1, 3, 224, 224)},
    ...                      release="bookworm", arch="arm64", cpu="cortex-a72")  # doctest: +SKIP
    >>> round(count.per_inference / 1e6, 1)                                      # doctest: +SKIP
    169.3

On an x86-64 host, ``count_on_host_core`` counts the same way on an
emulated x86 core of another vector width (qemu's "Haswell": AVX2 without
AVX-512), running this machine's own Python, minirt and onnxruntime, which
then picks that core's kernels.

onnxruntime's CPU probe reads /proc/cpuinfo, and under qemu 7.2 that is the
host's (x86) text, which it cannot parse; ``count_onnx`` therefore runs the
guest in a private mount namespace (util-linux's unshare; root, or
unprivileged user namespaces) with the emulated core's cpuinfo bound over it.
"""
from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, NamedTuple, Optional, Sequence

from deploy_recipes import emulate
from deploy_recipes.devicecode import PROJECT_ROOT

PLUGIN_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guest_instructions.c")

# ARM's part numbers of the cores the board presets name, as Linux prints them.
CORE_PARTS = {"cortex-a53": 0xd03, "cortex-a72": 0xd08, "cortex-a76": 0xd0b}

# Runs in the guest: argv is kind, path, inferences, then NAME=DxDxD per
# input, then optionally --save PATH (the first output of the last run, .npy).
GUEST_SCRIPT = r'''
import sys
import numpy as np

kind, path, inferences = sys.argv[1], sys.argv[2], int(sys.argv[3])
specs, save = sys.argv[4:], None
if "--save" in specs:
    specs, save = specs[:specs.index("--save")], specs[specs.index("--save") + 1]
rng = np.random.default_rng(0)
feeds = {}
for spec in specs:
    name, dims = spec.rsplit("=", 1)
    feeds[name] = rng.standard_normal([int(d) for d in dims.split("x")]).astype(np.float32)
if kind == "module":
    import minirt
    run = minirt.load(path, threads=1).run
else:
    import onnxruntime
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    run = lambda f: session.run(None, f)
# Each run's outputs are dropped before the next run, the last one's after
# it: holding one run's arrays through the next changes how the allocator
# serves them, and the counts of the two runs would no longer cancel.
for _ in range(inferences - 1):
    run(feeds)
outputs = run(feeds)
if save is not None:
    np.save(save, outputs[0])
'''


# The cores qemu user mode emulates, per Debian architecture, that a
# target's CPU may name (qemu 7.2); any other CPU is counted on qemu's "max".
QEMU_CORES = {"arm64": ("cortex-a35", "cortex-a53", "cortex-a57", "cortex-a72", "cortex-a76",
                        "neoverse-n1", "a64fx"),
              "armhf": ("cortex-a7", "cortex-a8", "cortex-a9", "cortex-a15")}


class CountError(emulate.EmulationError):
    """A counted run could not be made; the message says what to install or fix."""


def emulated_core(target) -> "tuple[str, str]":
    """(Debian architecture, qemu core) on which a target's modules are
    counted: its own CPU where qemu has that core, else qemu's "max" (a
    32-bit Cortex-A53 or A72 board, for instance: qemu-arm has neither).

    >>> from crosscompile.target import resolve_target
    >>> emulated_core(resolve_target("rasp4b64")), emulated_core(resolve_target("rasp3b"))
    (('arm64', 'cortex-a72'), ('armhf', 'max'))
    """
    arch_name = target.triple.split("-", 1)[0]
    if arch_name in ("aarch64", "arm64"):
        arch = "arm64"
    elif arch_name.startswith(("arm", "thumb")):
        arch = "armhf"
    else:
        raise CountError(f"target {target.name} ({target.triple}) is not ARM: instructions are "
                         "counted on emulated ARM cores only; tune an x86 machine on itself "
                         "(--target host) or on a board of it (--key)")
    return arch, target.cpu if target.cpu in QEMU_CORES[arch] else "max"


class Count(NamedTuple):
    per_inference: float  # guest instructions of one inference
    startup: int          # guest instructions of the run with ``warmup`` inferences
    runs: int


def missing_tools(arch: str) -> list:
    """Debian packages to install before instructions can be counted on ``arch``."""
    need = [(emulate.ARCHES[arch].qemu, "qemu-user"), ("cc", "gcc")]
    return [pkg for tool, pkg in need if shutil.which(tool) is None]


def cpuinfo(cpu: str) -> str:
    """/proc/cpuinfo of a one-core board with ``cpu`` (a key of CORE_PARTS)."""
    return ("processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n"
            "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\n"
            f"CPU part\t: {CORE_PARTS[cpu]:#x}\nCPU revision\t: 3\n\n")


def _build_plugin(folder: str) -> str:
    plugin = os.path.join(folder, "guest_instructions.so")
    proc = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", plugin, PLUGIN_SOURCE],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise CountError(f"the instruction-count plugin did not build:\n{proc.stderr[-2000:]}")
    return plugin


def _shape_args(inputs: Dict[str, Sequence[int]]) -> list:
    return [f"{name}={'x'.join(str(int(d)) for d in shape)}" for name, shape in inputs.items()]


class _Runs:
    """Runs the guest script under qemu with the plugin, in one scratch
    folder; subclasses say how (_env, _python, _wrap)."""
    where = ""

    def count(self, folder: str, plugin: str, kind: str, path: str, inferences: int,
              inputs: Dict[str, Sequence[int]], save: Optional[str] = None) -> int:
        out = os.path.join(folder, f"count-{inferences}.txt")
        script = os.path.join(folder, "guest_run.py")
        with open(script, "w") as f:
            f.write(GUEST_SCRIPT)
        # setarch -R: the same addresses in every run, so that nothing keyed
        # by an address (allocators, hash tables of pointers) costs differently.
        argv = ["setarch", "-R", *self._python(plugin, out),
                script, kind, os.path.abspath(path), str(inferences), *_shape_args(inputs)]
        if save is not None:
            argv += ["--save", os.path.abspath(save)]
        proc = subprocess.run(self._wrap(folder, argv), env=self._env(folder), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise CountError(f"the counted run of {os.path.basename(path)}{self.where} failed "
                             f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return int(f.read())

    def _wrap(self, folder: str, argv: list) -> list:
        return argv


class _Counter(_Runs):
    """Counts in a cached Debian root filesystem of an ARM architecture."""

    def __init__(self, release: str, arch: str, cpu: str, python_path: Sequence[str],
                 fake_cpuinfo: bool):
        missing = missing_tools(arch)
        if missing:
            raise CountError(f"counting instructions needs: apt-get install {' '.join(missing)}")
        self.root = emulate.build_rootfs(release, arch)
        self.qemu = emulate.ARCHES[arch].qemu
        self.cpu = cpu
        self.python_path = list(python_path)
        self.fake_cpuinfo = fake_cpuinfo
        if fake_cpuinfo and cpu not in CORE_PARTS:
            raise ValueError(f"no cpuinfo for {cpu!r}; choose one of {', '.join(CORE_PARTS)}")

    def _env(self, folder: str) -> dict:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                "PYTHONHOME": self.root + "/usr", "HOME": self.root + "/root",
                "TMPDIR": folder, "PYTHONPATH": os.pathsep.join(self.python_path),
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                # Both runs compile the same sources (the first would otherwise
                # write .pyc files that the second only reads) and hash strings alike.
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}

    def _python(self, plugin: str, out: str) -> list:
        return [shutil.which(self.qemu), "-cpu", self.cpu, "-L", self.root,
                "-plugin", f"{plugin},out={out}", self.root + emulate.guest_python(self.root)]

    def _wrap(self, folder: str, argv: list) -> list:
        return self._with_cpuinfo(folder, argv) if self.fake_cpuinfo else argv

    def _with_cpuinfo(self, folder: str, argv: list) -> list:
        fake = os.path.join(folder, "cpuinfo")
        with open(fake, "w") as f:
            f.write(cpuinfo(self.cpu))
        if shutil.which("unshare") is None:
            raise CountError("onnxruntime needs a Cortex cpuinfo in a private mount namespace: "
                             "apt-get install util-linux")
        # Non-root users get the namespace through a user namespace of their own.
        unshare = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "-r", "--mount"]
        inner = f"mount --bind {shlex.quote(fake)} /proc/cpuinfo && exec \"$@\""
        return unshare + ["sh", "-c", inner, "sh"] + argv


class _HostCounter(_Runs):
    """Runs the guest script with this machine's own Python under qemu
    user mode emulating another x86 core of its architecture (x86-64
    hosts): the same interpreter, numpy and onnxruntime, with the CPU
    features the emulated core reports, so that onnxruntime picks that
    core's kernels."""

    def __init__(self, cpu: str):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise CountError(f"counting on an emulated {cpu} runs this machine's Python under "
                             f"qemu-x86_64: an x86-64 host only, not {platform.machine()}")
        need = [(tool, pkg) for tool, pkg in (("qemu-x86_64", "qemu-user"), ("cc", "gcc"))
                if shutil.which(tool) is None]
        if need:
            raise CountError(f"counting instructions needs: apt-get install {' '.join(p for _, p in need)}")
        self.cpu = cpu
        # A module built for a newer x86 than the core stops with an illegal instruction.
        self.where = f" on an emulated {cpu}"

    def _env(self, folder: str) -> dict:
        return dict(os.environ, PYTHONPATH=PROJECT_ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                    PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0", TMPDIR=folder)

    def _python(self, plugin: str, out: str) -> list:
        return [shutil.which("qemu-x86_64"), "-cpu", self.cpu, "-plugin", f"{plugin},out={out}",
                sys.executable]


def count_on_host_core(kind: str, path: str, inputs: Dict[str, Sequence[int]], cpu: str = "Haswell",
                       warmup: int = 1, runs: int = 3) -> Count:
    """Instructions per inference on an emulated x86 core (qemu's model
    name, e.g. "Haswell": AVX2 and FMA, no AVX-512) of a compiled module
    run by minirt (kind "module", built for that core or an older one) or
    an ONNX model run by this machine's onnxruntime (kind "onnx"), one
    thread: x86 code of one vector width judged on a host of another."""
    return _per_inference(_HostCounter(cpu), kind, path, inputs, warmup, runs)


def _per_inference(counter: _Counter, kind: str, path: str, inputs: Dict[str, Sequence[int]],
                   warmup: int, runs: int, save: Optional[str] = None) -> Count:
    if warmup < 1 or runs < 1:
        raise ValueError("warmup and runs must be at least 1")
    folder = tempfile.mkdtemp(prefix="tether-count-")
    try:
        plugin = _build_plugin(folder)
        # Both runs save, so that saving cancels out of the difference.
        first = counter.count(folder, plugin, kind, path, warmup, inputs, save)
        second = counter.count(folder, plugin, kind, path, warmup + runs, inputs, save)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Count((second - first) / runs, first, runs)


def count_module(path: str, inputs: Dict[str, Sequence[int]], release: str = "bookworm",
                 arch: str = "arm64", cpu: str = "cortex-a72", warmup: int = 1,
                 runs: int = 3, save: Optional[str] = None) -> Count:
    """Instructions per inference of a compiled module (for ``arch``) run by minirt, one thread.

    ``inputs`` maps each input's name to its shape; the values are random
    (the same in every call). With ``save``, the module's first output is
    written there (numpy's .npy), to check what the counted code computed.
    """
    counter = _Counter(release, arch, cpu, [PROJECT_ROOT], fake_cpuinfo=False)
    return _per_inference(counter, "module", path, inputs, warmup, runs, save)


def count_onnx(path: str, inputs: Dict[str, Sequence[int]], site: str, release: str = "bookworm",
               arch: str = "arm64", cpu: str = "cortex-a72", warmup: int = 1,
               runs: int = 3, save: Optional[str] = None) -> Count:
    """Instructions per inference of an ONNX model run by onnxruntime, one thread.

    ``site`` is a folder holding the unpacked onnxruntime wheel for the guest
    (its ``onnxruntime`` package); see benchmarks/bench_arm.py for fetching it.
    With ``save``, the model's first output is written there (.npy), as
    count_module does.
    """
    counter = _Counter(release, arch, cpu, [site], fake_cpuinfo=True)
    return _per_inference(counter, "onnx", path, inputs, warmup, runs, save)
