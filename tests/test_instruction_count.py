"""The instruction count of an inference on an emulated ARM core is a number
to compare from one build to the next (benchmarks/bench_arm.py prints it for
whole models): counting the same module twice gives the same count, and a
module with more work counts more. The same holds on an emulated AVX2 x86
core (benchmarks/bench_avx2.py), where onnxruntime picks that core's kernels.
"""
import shutil

import pytest

import crosscompile
from deploy_recipes import emulate, instruction_count
from tests.emulated_boards import skip_without_tools
from tests.onnx_models import conv_relu_model

RELEASE, ARCH, CORE = "bookworm", "arm64", "cortex-a72"
# Counts of one module differ by well under this share from run to run:
# a run's start-up varies by a few thousand instructions, a few millionths
# of an inference of the convolution below.
TOLERANCE = 1e-3
X_SHAPE = (1, 32, 56, 56)


def _count(tmp_path, channels: int) -> float:
    model = conv_relu_model(X_SHAPE, (channels, X_SHAPE[1], 3, 3), {"pads": [1, 1, 1, 1]})
    so = crosscompile.build(model, target="rasp4b64").export_library(tmp_path / f"conv{channels}.so")
    # Over 4 inferences a start-up's few thousand instructions more or less
    # move the count per inference by well under TOLERANCE (over 2, one run
    # in a loaded full suite came to 1.08e-3).
    return instruction_count.count_module(so, {"x": X_SHAPE}, RELEASE, ARCH, CORE,
                                          runs=4).per_inference


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_instruction_count_of_an_inference_is_reproducible(tmp_path):
    skip_without_tools()
    missing = instruction_count.missing_tools(ARCH)
    if missing:
        pytest.skip(f"counting instructions needs: apt-get install {' '.join(missing)}")
    try:
        emulate.build_rootfs(RELEASE, ARCH)
    except emulate.MirrorError as exc:
        pytest.skip(f"no {RELEASE} {ARCH} root filesystem, and the Debian mirror did not serve one: {exc}")
    first, second = _count(tmp_path, 32), _count(tmp_path, 32)
    assert first > 0
    assert abs(first - second) <= TOLERANCE * first, (first, second)
    # Four times the output channels: about four times the FMAs.
    assert _count(tmp_path, 128) > 2 * first


AVX2_TARGET = "x86_64-linux-gnu/haswell/+avx,+avx2,+fma"


def _avx2_module(tmp_path):
    """The convolution built for AVX2, its model, and what counting it on this
    host needs and lacks (the count runs this machine's own Python under
    qemu-x86_64 as a Haswell, whatever the host's vector width)."""
    model = conv_relu_model(X_SHAPE, (32, X_SHAPE[1], 3, 3), {"pads": [1, 1, 1, 1]})
    so = crosscompile.build(model, target=AVX2_TARGET).export_library(tmp_path / "conv.so")
    missing = [tool for tool in ("qemu-x86_64", "cc") if shutil.which(tool) is None]
    return model, so, missing


def test_counts_on_an_emulated_avx2_core_are_reproducible_and_need_its_instructions(tmp_path):
    """Our AVX2 module counts alike twice on an emulated Haswell and dies of
    an illegal instruction on one without AVX2 and FMA."""
    import platform
    model, so, missing = _avx2_module(tmp_path)
    if platform.machine() != "x86_64":
        with pytest.raises(instruction_count.CountError, match="x86-64 host only"):
            instruction_count.count_on_host_core("module", so, {"x": X_SHAPE})
        return
    if missing:
        pytest.skip(f"counting instructions needs {', '.join(missing)}: apt-get install qemu-user gcc")
    first, second = (instruction_count.count_on_host_core("module", so, {"x": X_SHAPE}, runs=4).per_inference
                     for _ in range(2))
    assert first > 0 and abs(first - second) <= TOLERANCE * first, (first, second)
    with pytest.raises(instruction_count.CountError, match=r"signal 4 \(Illegal instruction\)"):
        instruction_count.count_on_host_core("module", so, {"x": X_SHAPE}, cpu="Haswell,-avx2,-fma")


@pytest.mark.peer_tools
def test_onnxruntime_counted_on_an_emulated_core_picks_that_cores_kernels(tmp_path):
    """onnxruntime chooses its kernels from the emulated core: it executes
    more instructions once AVX2 and FMA are taken away from it. (Each count
    imports onnxruntime under qemu: minutes on 2 cores, so not in the
    default run: pytest -m peer_tools tests/test_instruction_count.py)"""
    import onnx
    import platform
    if platform.machine() != "x86_64":
        pytest.skip("onnxruntime is counted on an emulated x86-64 core from an x86-64 host only")
    model, _, missing = _avx2_module(tmp_path)
    if missing:
        pytest.skip(f"counting instructions needs {', '.join(missing)}: apt-get install qemu-user gcc")
    onnx_path = str(tmp_path / "conv.onnx")
    onnx.save(model, onnx_path)
    avx2 = instruction_count.count_on_host_core("onnx", onnx_path, {"x": X_SHAPE}).per_inference
    older = instruction_count.count_on_host_core("onnx", onnx_path, {"x": X_SHAPE},
                                                 cpu="Haswell,-avx2,-fma").per_inference
    assert older > 1.2 * avx2, (avx2, older)
