"""What each target says its cores can do (FP16 arithmetic, dot products,
i8mm, VNNI), and the target a board gets from its /proc/cpuinfo.

The cpuinfo texts are those of real boards (first core and the lines after
the last one; the other cores repeat the first)."""
import pytest

from crosscompile.target import TARGETS, Target, resolve_target, target_for_board
from remote.server.devinfo import parse_cpuinfo

PI4_64BIT = """\
processor	: 0
BogoMIPS	: 108.00
Features	: fp asimd evtstrm crc32 cpuid
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x0
CPU part	: 0xd08
CPU revision	: 3

Hardware	: BCM2835
Revision	: c03114
Serial		: 100000004f2c3a1e
Model		: Raspberry Pi 4 Model B Rev 1.4
"""

PI5 = """\
processor	: 0
BogoMIPS	: 108.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x4
CPU part	: 0xd0b
CPU revision	: 1

Revision	: c04170
Serial		: 6f1e2c3b4a5d6e7f
Model		: Raspberry Pi 5 Model B Rev 1.0
"""

# A phone of four Cortex-A55 and four Cortex-A76 cores: cpu0 is a little one.
A55_PHONE = """\
processor	: 0
BogoMIPS	: 26.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x1
CPU part	: 0xd05
CPU revision	: 0

processor	: 4
BogoMIPS	: 26.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x1
CPU part	: 0xd0b
CPU revision	: 0
"""

# An older phone of Cortex-A53 cores (ARMv8.0: no FP16 arithmetic, no dot products).
A53_PHONE = """\
processor	: 0
BogoMIPS	: 38.40
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid
CPU implementer	: 0x41
CPU architecture: 8
CPU variant	: 0x0
CPU part	: 0xd03
CPU revision	: 4
"""


def board_info(cpuinfo: str, triple: str) -> dict:
    """What a board server reports (remote.server.devinfo.collect) for a cpuinfo text."""
    model, features, part = parse_cpuinfo(cpuinfo)
    return {"triple": triple, "cpu_model": model, "cpu_features": features,
            "attributes": {"cpu_part": part}}


@pytest.mark.parametrize("preset, fp16, dot, i8mm", [
    ("rasp3b", False, False, False),
    ("rasp4b", False, False, False),
    ("rasp4b64", False, False, False),
    ("rasp5", True, True, False),
    ("android-arm64", True, True, False),
    ("android-armv7", False, False, False),
])
def test_arm_presets_carry_their_cores_features(preset, fp16, dot, i8mm):
    target = TARGETS[preset]
    assert (target.has_fp16_arithmetic, target.has_dot_product, target.has_i8mm) == (fp16, dot, i8mm)
    assert not target.has_vnni


def test_explicit_features_are_the_facts():
    t = Target.parse("aarch64-linux-gnu/cortex-a710/+neon,+fullfp16,+dotprod,+i8mm")
    assert (t.has_fp16_arithmetic, t.has_dot_product, t.has_i8mm) == (True, True, True)
    # A feature switched off is not on.
    assert not Target.parse("aarch64-linux-gnu/generic/+neon,-fullfp16").has_fp16_arithmetic
    vnni = Target.parse("x86_64-linux-gnu/x86-64-v4/+avx512f,+avx512vnni")
    assert vnni.has_vnni and vnni.has_dot_product and not vnni.has_fp16_arithmetic
    assert not Target.parse("x86_64-linux-gnu/x86-64-v3/+avx2,+fma").has_vnni


def test_host_vnni_is_what_llvm_sees_on_this_machine():
    import llvmlite.binding as llvm
    features = llvm.get_host_cpu_features()
    host = resolve_target("host")
    if host.arch != "x86_64":
        pytest.skip("the host is not x86-64")
    assert host.has_vnni == bool(features.get("avx512vnni") or features.get("avxvnni"))


def test_pi4_cpuinfo_picks_rasp4b64():
    assert target_for_board(board_info(PI4_64BIT, "aarch64-unknown-linux-gnu")) == "rasp4b64"


def test_pi5_cpuinfo_picks_rasp5_with_fp16_and_dot_products():
    target = target_for_board(board_info(PI5, "aarch64-unknown-linux-gnu"))
    assert target == "rasp5"
    assert resolve_target(target).has_fp16_arithmetic and resolve_target(target).has_dot_product


def test_a55_phone_cpuinfo_picks_android_arm64():
    target = target_for_board(board_info(A55_PHONE, "aarch64-unknown-linux-android"))
    assert target == "android-arm64"


def test_a53_phone_gets_a_target_without_fp16():
    target = target_for_board(board_info(A53_PHONE, "aarch64-unknown-linux-android"))
    assert target == "aarch64-unknown-linux-android/cortex-a53/+neon"
    assert not resolve_target(target).has_fp16_arithmetic


def test_a76_in_a_board_that_is_not_a_pi_keeps_its_features():
    # A Pi 4's cores with the flags of a core that has FP16 and dot products
    # (say, a kernel that shows what the SoC's other cluster has): the flags win.
    info = board_info(PI5.replace("0xd0b", "0xd08"), "aarch64-unknown-linux-gnu")
    target = target_for_board(info)
    assert target == "aarch64-unknown-linux-gnu/cortex-a72/+neon,+fullfp16,+dotprod"
    assert resolve_target(target).has_fp16_arithmetic


def test_i8mm_flag_reaches_the_target():
    info = board_info(PI5.replace("asimddp", "asimddp i8mm").replace("0xd0b", "0xd47"),
                      "aarch64-unknown-linux-gnu")
    target = resolve_target(target_for_board(info))
    assert target.cpu == "cortex-a710" and target.has_i8mm and target.has_dot_product


def test_x86_board_vnni_flags_become_features():
    # Without avx2 and fma in the list the board is not taken for this host
    # (which has them, unless it is older than Haswell).
    flags = "fpu sse sse2 avx avx512f avx512bw avx512dq avx512vl avx512_vnni".split()
    target = resolve_target(target_for_board({"triple": "x86_64-unknown-linux-gnu", "cpu_model": "Xeon",
                                              "cpu_features": flags}))
    if target.name == "host":
        pytest.skip("this host has no AVX2 or FMA, so the board matches it")
    assert target.has_vnni and target.has_dot_product and target.vector_bits == 512
