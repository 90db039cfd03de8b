"""Compilation targets: presets for the boards Tether supports, and parsing of
explicit "triple[/cpu[/features]]" strings.

Example:
    >>> from crosscompile.target import resolve_target
    >>> resolve_target("rasp4b").triple
    'armv7l-unknown-linux-gnueabihf'
    >>> resolve_target("armv7l-linux-gnueabihf/cortex-a7/+neon").triple
    'armv7l-unknown-linux-gnueabihf'
"""
from __future__ import annotations

from dataclasses import dataclass

import llvmlite.binding as llvm

from .errors import BuildError

# Names LLVM accepts in the OS position of a triple. A three-part triple whose
# second part is one of these has left out the vendor.
_KNOWN_OS = {
    "linux", "none", "windows", "darwin", "macos", "ios", "freebsd", "netbsd",
    "openbsd", "fuchsia", "wasi", "emscripten", "android", "haiku", "solaris",
}

# LLVM architecture names modules can be built for: the ARM boards and x86
# hosts. Others need their ld.lld support and code generation checked first.
SUPPORTED_ARCHES = {"aarch64", "arm", "x86_64", "i386"}


@dataclass(frozen=True)
class Target:
    """What code is generated for: an LLVM triple, CPU and feature string.

    vector_bits is the SIMD register width kernels may assume.
    """

    name: str
    triple: str
    cpu: str = "generic"
    features: str = ""
    vector_bits: int = 128

    @staticmethod
    def parse(spec: str) -> "Target":
        """Parse "triple[/cpu[/features]]", normalising the triple.

        >>> Target.parse("aarch64-linux-gnu/cortex-a72").triple
        'aarch64-unknown-linux-gnu'
        """
        parts = spec.split("/")
        if len(parts) > 3 or not parts[0]:
            raise BuildError(
                f"bad target {spec!r}: expected a preset ({', '.join(TARGETS)}) "
                "or 'triple[/cpu[/features]]'"
            )
        triple = normalize_triple(parts[0])
        cpu = parts[1] if len(parts) > 1 and parts[1] else "generic"
        features = parts[2] if len(parts) > 2 else ""
        return Target(spec, triple, cpu, features, _vector_bits(triple, features))

    @property
    def feature_flags(self) -> frozenset:
        """The LLVM features switched on in ``features`` (without their '+').

        >>> sorted(resolve_target("rasp5").feature_flags)
        ['dotprod', 'fullfp16', 'neon']
        """
        return frozenset(f[1:] for f in self.features.split(",") if f.startswith("+"))

    @property
    def has_fp16_arithmetic(self) -> bool:
        """Whether the core computes in half precision (ARM's FEAT_FP16,
        LLVM's +fullfp16: Cortex-A55, A76 and later): what
        ``build(..., precision="fp16")`` needs. x86's AVX512-FP16 is not
        used.

        >>> resolve_target("rasp5").has_fp16_arithmetic, resolve_target("rasp4b64").has_fp16_arithmetic
        (True, False)
        """
        return self.arch in ("aarch64", "arm") and "fullfp16" in self.feature_flags

    @property
    def has_dot_product(self) -> bool:
        """Whether the core has 8-bit dot products: ARM's sdot/udot (+dotprod,
        named in the features or implied by a core that always has them, unless
        the features say -dotprod) or x86's VNNI (vpdpbusd).

        >>> resolve_target("rasp5").has_dot_product, resolve_target("rasp4b64").has_dot_product
        (True, False)
        """
        if self.arch in ("aarch64", "arm"):
            if "-dotprod" in self.features.split(","):
                return False
            return "dotprod" in self.feature_flags or self.cpu in _DOTPROD_CORES
        return self.has_vnni

    @property
    def has_i8mm(self) -> bool:
        """Whether the core has ARM's 8-bit matrix multiply (smmla, +i8mm:
        ARMv8.6, Cortex-A510/A710 and later; not the A55 or A76)."""
        return self.arch in ("aarch64", "arm") and "i8mm" in self.feature_flags

    @property
    def has_vnni(self) -> bool:
        """Whether an x86 core has VNNI dot products (+avx512vnni or +avxvnni)."""
        return self.arch in ("x86_64", "i386") and bool({"avx512vnni", "avxvnni"} & self.feature_flags)

    @property
    def lanes(self) -> int:
        """float32 lanes in one vector register.

        >>> Target.parse("x86_64-linux-gnu/skylake-avx512/+avx512f").lanes
        16
        """
        return max(1, self.vector_bits // 32)

    @property
    def vector_registers(self) -> int:
        """SIMD registers kernels may keep live: 32 on AArch64 and with
        AVX-512, 16 on 32-bit ARM NEON and with SSE/AVX."""
        if self.arch == "aarch64" or (self.arch == "x86_64" and self.vector_bits >= 512):
            return 32
        return 16

    @property
    def multiplies_by_lane(self) -> bool:
        """Whether a vector multiply-add can take one lane of another vector
        register as its multiplier (the by-element forms of AArch64 and ARM
        NEON). Kernels then load values to broadcast a vector at a time and
        pick their lanes in registers; x86 broadcasts straight from memory
        into the FMA instead.

        >>> resolve_target("rasp4b64").multiplies_by_lane
        True
        """
        return self.arch in ("aarch64", "arm")

    @property
    def winograd(self) -> bool:
        """Whether dense 3x3 stride-1 convolutions may run as Winograd
        (see winograd_tiles) where crosscompile.winograd.choose says it saves work.
        On every target: on ARM instruction counts on emulated cores
        measured it, on x86 with AVX2 times against onnxruntime did (single
        convolutions of ResNet-50, VGG-19 and SqueezeNet 0.63 - 0.91 of
        onnxruntime's time, against 1.05 - 1.62 with the direct GEMM).

        >>> resolve_target("rasp4b64").winograd
        True
        """
        return True

    @property
    def winograd_tiles(self) -> tuple:
        """The output tiles of the Winograd variants crosscompile.winograd.choose
        weighs: F(2x2, 3x3) and F(4x4, 3x3) on every target.

        >>> resolve_target("rasp4b64").winograd_tiles
        (2, 4)
        """
        return (2, 4) if self.winograd else ()

    @property
    def reduction_unroll(self) -> int:
        """Steps per trip of a GEMM micro-kernel's reduction loop.

        - Two on ARM, where the loop's counter, compare and branch were a
          sixth of a step's instructions and the by-lane FMAs leave
          registers for the next step's loads.
        - Four on x86 with 256-bit AVX (AVX2), where a step is
          about 20 instructions and the loop took 4 more. Counted on an
          emulated Haswell, ResNet-50 went 837.9 -> 750.2 M instructions
          per inference (776.4 M with two) and SqueezeNet 69.5 -> 64.2 M.
          Its time with AVX2 on AMD Zen 5 stayed within noise (54.4 -
          56.0 ms with one step per trip or four).
        - One with AVX-512, whose steps fold their broadcasts into the
          FMAs: unrolling by four kept its times and made ResNet-50
          compile 1.1 s longer. One with SSE, which was not measured.

        >>> resolve_target("rasp4b64").reduction_unroll
        2
        """
        if self.multiplies_by_lane:
            return 2
        return 4 if self.vector_bits == 256 else 1

    @property
    def arch(self) -> str:
        """LLVM's architecture name of the triple ('x86_64', 'aarch64', 'arm', ...).

        >>> resolve_target("rasp4b").arch
        'arm'
        """
        return llvm.get_triple_parts(self.triple).Arch

    @property
    def long_bits(self) -> int:
        """Width of the C `long` (and of a pointer) on the target's Linux ABI."""
        return 64 if self.arch in ("x86_64", "aarch64") else 32

    @property
    def futex_syscall(self) -> "int | None":
        """Linux system call number of futex, or None where it is not known
        (the barrier then only spins)."""
        return _FUTEX_NUMBER.get(self.arch)

    @property
    def spins_before_sleep(self) -> int:
        """Spin-wait rounds before a barrier's waiter sleeps on a futex
        (see emit.barrier_function).

        >>> resolve_target("rasp4b64").spins_before_sleep
        10000
        """
        return _SPINS_BEFORE_SLEEP.get(self.arch, _SPINS_BEFORE_SLEEP_DEFAULT)

    @property
    def spin_hint(self) -> "tuple[str, tuple[int, ...]] | None":
        """(LLVM intrinsic, its i32 arguments) of the CPU's spin-wait hint:
        pause (x86-64) or yield (ARM), which lets a sibling hardware thread
        run and saves power while spinning; None where there is none."""
        return _SPIN_HINT.get(self.arch)

    def to_dict(self) -> dict:
        return {"name": self.name, "triple": self.triple, "cpu": self.cpu,
                "features": self.features}


# AArch64 cores whose every implementation has the dot-product instructions
# (ARMv8.2 and later with FEAT_DotProd; LLVM's CPU models enable them).
_DOTPROD_CORES = {"cortex-a55", "cortex-a65", "cortex-a75", "cortex-a76", "cortex-a76ae", "cortex-a77",
                  "cortex-a78", "cortex-a78c", "cortex-x1", "cortex-x2", "cortex-a510", "cortex-a710",
                  "cortex-a715", "cortex-a720", "neoverse-n1", "neoverse-n2", "neoverse-v1", "apple-m1"}

# Linux system call numbers of futex.
_FUTEX_NUMBER = {"x86_64": 202, "aarch64": 98, "arm": 240, "i386": 240}
# Spin-wait rounds before a barrier's waiter sleeps: tens of
# microseconds, which most waits between the kernels of a run on idle
# cores end within. Spinning longer took the core from the thread
# everybody waited for on a busy machine; sleeping at once cost a kernel
# wake-up per barrier (tens of microseconds to milliseconds on a virtual
# machine). x86's pause takes tens of cycles, ARM's yield about one,
# hence more rounds there.
_SPINS_BEFORE_SLEEP = {"x86_64": 2000, "i386": 2000}
_SPINS_BEFORE_SLEEP_DEFAULT = 10000
# The spin-wait hint per architecture: x86-64's pause, ARM's yield (hint #1).
_SPIN_HINT = {"x86_64": ("llvm.x86.sse2.pause", ()), "aarch64": ("llvm.aarch64.hint", (1,)),
              "arm": ("llvm.arm.hint", (1,))}


def normalize_triple(triple: str) -> str:
    """Return the triple in LLVM's arch-vendor-os[-env] form.

    LLVM reads "armv7l-linux-gnueabihf" as vendor "linux", OS "gnueabihf": the
    hard-float environment is lost and the object comes out soft-float, which
    a hard-float glibc refuses to load. Inserting the vendor fixes that.

    >>> normalize_triple("armv7l-linux-gnueabihf")
    'armv7l-unknown-linux-gnueabihf'
    """
    parts = triple.strip().lower().split("-")
    if len(parts) in (2, 3) and parts[1] in _KNOWN_OS:
        parts.insert(1, "unknown")
    arch = llvm.get_triple_parts("-".join(parts)).Arch
    if arch == "unknown":
        raise BuildError(f"bad target triple {triple!r}: unknown architecture {parts[0]!r}")
    if arch not in SUPPORTED_ARCHES:
        raise BuildError(f"target triple {triple!r}: architecture {arch!r} is not supported; "
                         f"supported: {', '.join(sorted(SUPPORTED_ARCHES))}")
    return "-".join(parts)


def _vector_bits(triple: str, features: str) -> int:
    flags = set(features.split(","))
    if "+avx512f" in flags:
        return 512
    if "+avx" in flags:
        return 256
    return 128


def _host_target() -> Target:
    triple = normalize_triple(llvm.get_process_triple())
    features = llvm.get_host_cpu_features().flatten()
    return Target("host", triple, llvm.get_host_cpu_name(), features,
                  _vector_bits(triple, features))


TARGETS: dict[str, Target] = {
    "host": _host_target(),
    "rasp3b": Target("rasp3b", "armv7l-unknown-linux-gnueabihf", "cortex-a53", "+neon"),
    "rasp4b": Target("rasp4b", "armv7l-unknown-linux-gnueabihf", "cortex-a72", "+neon"),
    "rasp4b64": Target("rasp4b64", "aarch64-unknown-linux-gnu", "cortex-a72", "+neon"),
    # The Cortex-A76 is ARMv8.2 with FP16 arithmetic and dot products (no i8mm).
    "rasp5": Target("rasp5", "aarch64-unknown-linux-gnu", "cortex-a76", "+neon,+fullfp16,+dotprod"),
    # Phones of the A55/A76 class (big.LITTLE pairs of ARMv8.2 cores); an
    # older phone (Cortex-A53) gets its own target from target_for_board.
    "android-arm64": Target("android-arm64", "aarch64-unknown-linux-android", "generic",
                            "+neon,+fullfp16,+dotprod"),
    "android-armv7": Target("android-armv7", "armv7-unknown-linux-androideabi", "generic", "+neon"),
}


def resolve_target(target: "str | Target") -> Target:
    """A Target unchanged, a preset by name, or a parsed triple string."""
    if isinstance(target, Target):
        return target
    if not isinstance(target, str):
        raise BuildError(f"target must be a preset name, a triple string or a Target, not {type(target).__name__}")
    if target in TARGETS:
        return TARGETS[target]
    if "-" not in target.split("/")[0]:
        raise BuildError(f"unknown target {target!r}: the presets are {', '.join(TARGETS)}; "
                         "or give 'triple[/cpu[/features]]', e.g. aarch64-linux-gnu/cortex-a72")
    return Target.parse(target)


# ARM's CPU part numbers (/proc/cpuinfo "CPU part") of the cores boards carry.
ARM_PARTS = {"0xd03": "cortex-a53", "0xd04": "cortex-a35", "0xd05": "cortex-a55",
             "0xd07": "cortex-a57", "0xd08": "cortex-a72", "0xd09": "cortex-a73",
             "0xd0a": "cortex-a75", "0xd0b": "cortex-a76", "0xd0d": "cortex-a77",
             "0xd41": "cortex-a78", "0xd46": "cortex-a510", "0xd47": "cortex-a710"}


def target_for_board(info: dict) -> str:
    """The preset (or 'triple/cpu/features') that fits a board as the tracker
    describes it (``device_info()``: triple, cpu_model, cpu_features, and the
    ``cpu_part`` attribute a board reports from /proc/cpuinfo).

    >>> target_for_board({"triple": "aarch64-unknown-linux-gnu", "cpu_model": "",
    ...                   "attributes": {"cpu_part": "0xd0b"}})
    'rasp5'
    >>> target_for_board({"triple": "armv7l-unknown-linux-gnueabihf", "cpu_model": "BCM2835"})
    'rasp3b'
    """
    triple = normalize_triple(info.get("triple") or "")
    arch = triple.split("-")[0]
    attributes = info.get("attributes") or {}
    cpu = ARM_PARTS.get(str(attributes.get("cpu_part", "")).lower(), "")
    model = (info.get("cpu_model") or "").lower()
    for name in ARM_PARTS.values():
        if not cpu and name in model.replace(" ", "-"):
            cpu = name
    host = TARGETS["host"]
    flags = set(info.get("cpu_features") or ())
    if arch == "aarch64":
        if "android" in triple:
            preset = "android-arm64"
        else:
            preset = {"cortex-a76": "rasp5", "cortex-a72": "rasp4b64", "": "rasp4b64"}.get(cpu, "")
        # An AArch64 kernel lists every core's "asimd"; without it (a board
        # that reported no flags, or qemu-user showing its host's) the
        # preset of the core stands.
        if "asimd" not in flags:
            return preset or f"{triple}/{cpu}/+neon"
        features = ",".join(["+neon"] + [f"+{feature}" for hwcap, feature in ARM_HWCAP_FEATURES
                                         if hwcap in flags])
        if preset and TARGETS[preset].feature_flags == set(features.replace("+", "").split(",")):
            return preset
        return f"{triple}/{cpu or 'generic'}/{features}"
    if arch.startswith("arm"):
        if "android" in triple:
            return "android-armv7"
        return "rasp4b" if cpu == "cortex-a72" else "rasp3b"
    if triple == host.triple and flags >= _host_flags():
        return "host"
    vnni = "".join(f",+{feature}" for name, feature in X86_VNNI_FEATURES if name in flags)
    if arch == "x86_64" and "avx512f" in flags:
        return f"{triple}/x86-64-v4/+avx512f,+avx512bw,+avx512dq,+avx512vl,+avx2,+fma{vnni}"
    if arch == "x86_64" and "avx2" in flags:
        return f"{triple}/x86-64-v3/+avx2,+fma{vnni}"
    return triple


# /proc/cpuinfo "Features" of an AArch64 core -> the LLVM feature it shows:
# FP16 arithmetic (asimdhp), dot products (asimddp), 8-bit matrix multiply.
ARM_HWCAP_FEATURES = (("asimdhp", "fullfp16"), ("asimddp", "dotprod"), ("i8mm", "i8mm"))
# /proc/cpuinfo "flags" of an x86 core -> the LLVM feature of its VNNI.
X86_VNNI_FEATURES = (("avx512_vnni", "avx512vnni"), ("avx_vnni", "avxvnni"))
_X86_VECTOR_FLAGS = {"avx2": "avx2", "avx512f": "avx512f", "fma": "fma",
                     **{feature: name for name, feature in X86_VNNI_FEATURES}}


def _host_flags() -> set:
    """The host's vector flags, as /proc/cpuinfo spells them."""
    return {_X86_VECTOR_FLAGS[f] for f in TARGETS["host"].feature_flags if f in _X86_VECTOR_FLAGS}
