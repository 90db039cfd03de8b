"""What this board is: triple, CPU, memory, OS and runtime versions."""
from __future__ import annotations

import os
import platform

import numpy as np

import remote
from remote.defaults import EMULATED_ENV
from remote.proto import pb

# platform.machine() -> (LLVM arch, ABI suffix) of the triple the board runs.
_TRIPLES = {
    "x86_64": "x86_64-unknown-linux-gnu",
    "amd64": "x86_64-unknown-linux-gnu",
    "aarch64": "aarch64-unknown-linux-gnu",
    "arm64": "aarch64-unknown-linux-gnu",
    "armv7l": "armv7l-unknown-linux-gnueabihf",
    "armv8l": "armv7l-unknown-linux-gnueabihf",
    "armv6l": "armv6l-unknown-linux-gnueabihf",
}


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def parse_cpuinfo(text: str):
    """(model, feature flags, ARM "CPU part") from the text of /proc/cpuinfo:
    the first core's, which on big.LITTLE phones is a little one (the
    flags are the same on every core: the kernel shows what all share).

    >>> parse_cpuinfo("Features : fp asimd asimdhp")[1]
    ['fp', 'asimd', 'asimdhp']
    """
    model, features, part = "", [], ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip()
        if name in ("model name", "hardware", "cpu model", "processor") and not model \
                and not value.isdigit():
            model = value
        elif name in ("flags", "features") and not features:
            features = value.split()
        elif name == "cpu part" and not part:
            part = value  # ARM cores: which core (0xd08 is a Cortex-A72)
    return model, features, part


def _cpuinfo():
    model, features, part = parse_cpuinfo(_read("/proc/cpuinfo"))
    if not model:
        model = platform.processor() or platform.machine()
    return model, features, part


def _memory_bytes() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _os_name() -> str:
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return f"{platform.system()} {platform.release()}"


def _triple(machine: str) -> str:
    if "ANDROID_ROOT" in os.environ:
        arch = "aarch64" if machine in ("aarch64", "arm64") else "armv7"
        return f"{arch}-unknown-linux-android" + ("" if arch == "aarch64" else "eabi")
    return _TRIPLES.get(machine, f"{machine}-unknown-linux-gnu")


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name, fromlist=["__version__"])
    except ImportError:
        return ""
    return getattr(module, "__version__", "")


def collect(attributes=None) -> "pb.DeviceInfo":
    """Describe the machine this process runs on.

    >>> collect({"board": "rpi4"}).attributes["board"]
    'rpi4'
    """
    machine = platform.machine()
    model, features, part = _cpuinfo()
    attributes = dict(attributes or {})
    if part and machine.startswith(("arm", "aarch")):
        attributes.setdefault("cpu_part", part)

    return pb.DeviceInfo(
        triple=_triple(machine), machine=machine, cpu_model=model, cpu_features=features,
        cores=os.cpu_count() or 1, memory_bytes=_memory_bytes(), os=_os_name(),
        python_version=platform.python_version(), numpy_version=np.__version__,
        grpcio_version=_version("grpc"), protobuf_version=_version("google.protobuf"),
        attributes=attributes, server_version=remote.__version__,
        emulated=os.environ.get(EMULATED_ENV, ""),
    )
