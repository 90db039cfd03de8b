"""benchmarks/onnxruntime_avx2.py: onnxruntime's AVX2 kernels on an AVX-512
machine. A program's own CPUID and XGETBV instructions, patched and run
with the SIGILL handler, answer as before except for the AVX-512 bits;
and the patched onnxruntime, in a process of its own, computes what the
installed one does."""
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import onnxruntime_avx2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not shutil.which("objdump") or not shutil.which("cc"),
    reason="x86-64 only, with objdump and cc")

PROBE_C = r"""
#include <cpuid.h>
#include <stdio.h>
int main(void) {
    unsigned a, b, c, d, lo, hi;
    for (unsigned leaf = 0; leaf < 2; leaf++) {
        __cpuid_count(leaf, 0, a, b, c, d);
        printf("%u %08x %08x %08x %08x\n", leaf, a, b, c, d);
    }
    __cpuid_count(7, 0, a, b, c, d);
    printf("7 %08x %08x %08x %08x\n", a, b, c, d);
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    printf("xcr0 %08x %08x\n", lo, hi);
    return 0;
}
"""


def _answers(program, env=None) -> dict:
    out = subprocess.run([program], capture_output=True, text=True, check=True, env=env).stdout
    return {line.split()[0]: [int(v, 16) for v in line.split()[1:]] for line in out.splitlines()}


def test_patched_cpuid_and_xgetbv_hide_avx512_only(tmp_path):
    source, program = tmp_path / "probe.c", tmp_path / "probe"
    source.write_text(PROBE_C)
    subprocess.run(["cc", "-O1", "-o", str(program), str(source)], check=True)
    plain = _answers(program)
    handler_c = tmp_path / "hide.c"
    handler_c.write_text(onnxruntime_avx2.HANDLER_C)
    handler = tmp_path / "hide.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(handler), str(handler_c)], check=True)
    # One CPUID per leaf printed (the loop may be unrolled or not) and one XGETBV.
    assert onnxruntime_avx2.patch_library(str(program)) >= 3
    hidden = _answers(program, env=dict(os.environ, LD_PRELOAD=str(handler)))
    # Vendor and leaf 1 (SSE ... AVX, FMA, OSXSAVE) are untouched, but for
    # leaf 1's top byte of EBX: the APIC ID of whichever core ran the program.
    assert hidden["0"] == plain["0"]
    assert [v & 0x00FFFFFF if i == 1 else v for i, v in enumerate(hidden["1"])] == \
        [v & 0x00FFFFFF if i == 1 else v for i, v in enumerate(plain["1"])]
    eax, ebx, ecx, edx = plain["7"]
    assert hidden["7"] == [eax, ebx & ~0xDC230000, ecx & ~0x5842, edx & ~0x03C0010C]
    assert hidden["7"][1] & (1 << 5) == ebx & (1 << 5)  # AVX2 stays as the CPU reports it
    assert hidden["7"][1] & (1 << 16) == 0               # AVX512F is gone
    assert hidden["xcr0"] == [plain["xcr0"][0] & ~0x600E0, plain["xcr0"][1]]
    # Without the handler the patched instruction is what it now is: illegal.
    crashed = subprocess.run([program], capture_output=True)
    assert crashed.returncode == -4  # SIGILL
    # With it, any other illegal instruction still kills the process.
    trap_c, trap = tmp_path / "trap.c", tmp_path / "trap"
    trap_c.write_text("int main(void) { __builtin_trap(); return 0; }\n")
    subprocess.run(["cc", "-o", str(trap), str(trap_c)], check=True)
    trapped = subprocess.run([str(trap)], capture_output=True, env=dict(os.environ, LD_PRELOAD=str(handler)))
    assert trapped.returncode == -4


RUN = """
import sys
sys.path.insert(0, {root!r})
if sys.argv[1] == "avx2":
    from benchmarks.onnxruntime_avx2 import use_avx2_onnxruntime
    print(use_avx2_onnxruntime({cache!r}), file=sys.stderr)
import numpy as np, onnxruntime
from tests.onnx_models import conv_relu_model, rand
model = conv_relu_model((1, 24, 20, 20), (40, 24, 3, 3), {{"pads": [1, 1, 1, 1]}})
session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
print(onnxruntime.__file__, file=sys.stderr)
np.save(sys.argv[2], session.run(None, {{"x": rand(1, 24, 20, 20, seed=4)}})[0])
"""


@pytest.mark.peer_tools  # patching onnxruntime's library takes minutes on 2 cores
def test_patched_onnxruntime_computes_what_the_installed_one_does(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN.format(root=ROOT, cache=str(tmp_path / "cache")))
    runs = {}
    for kind in ("plain", "avx2"):
        done = subprocess.run([sys.executable, str(script), kind, str(tmp_path / f"{kind}.npy")],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[kind] = done.stderr
    assert "AVX-512 hidden" in runs["avx2"] and str(tmp_path / "cache") in runs["avx2"]
    np.testing.assert_allclose(np.load(tmp_path / "avx2.npy"), np.load(tmp_path / "plain.npy"),
                               rtol=1e-5, atol=1e-5)


def test_use_after_import_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", object())
    with pytest.raises(onnxruntime_avx2.Avx2Unavailable, match="already imported"):
        onnxruntime_avx2.use_avx2_onnxruntime()
