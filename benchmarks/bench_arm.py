"""Instructions per inference on emulated ARM cores: ours against onnxruntime's
own aarch64 wheel, one thread each, in the same Debian root filesystem.

    python benchmarks/bench_arm.py [model ...] [--targets rasp4b64,rasp5,rasp3b] [--runs N]
                                   [--precisions fp32,fp16] [--int8]

Models: squeezenet and resnet50 from the onnx package's light zoo (random
parameters, as in tests/test_zoo.py), resnet18, mobilenetv2,
efficientnet_b0 and regnet_x_400mf (grouped 3x3 convolutions) built by tests/architectures.py; one 1 x 3 x 224 x 224 image
each; and vit_block, the ViT encoder block of tests/transformer_models.py
(17 tokens, its attention one fused kernel); or .onnx files (e.g.
benchmarks/export_torchvision.py's, whose ResNet-50 folds each
BatchNormalization into its convolution where the light zoo's keeps it
apart). Counts come from
deploy_recipes/instruction_count.py (a qemu plugin, R and R + N inferences).
A count is exact and repeatable where wall time under emulation means
nothing, but it is not a time: use the ratios, and confirm on a board.

Per target: rasp4b64 on a Cortex-A72, rasp5 on a Cortex-A76 (both aarch64,
against onnxruntime); rasp3b is 32-bit ARM, for which there is no onnxruntime
wheel, so its count (qemu-arm's "max" core: it has no Cortex-A53) is printed
beside ours for aarch64 on the A72.

With --precisions fp32,fp16, targets with FP16 arithmetic (rasp5) also get a
row of ours built with precision="fp16", against onnxruntime's float32 count
on the same core. Every row's output is checked: "cos" is the cosine of
our output against onnxruntime's (the same input).

With --int8 each model is first quantized (crosscompile.quantizer: QDQ,
uint8 activations, int8 weights per channel, 4 random calibration samples)
and both count the same quantized model. The counted run's output is then
held against onnxruntime's int8 output of the same model and input (its
counted run on the same core; with --no-ort, onnxruntime on the host
without graph optimizations): "steps" is the share of elements within one
quantization step of the output (the scale of its DequantizeLinear), and a
count whose output has fewer than 99.9 % of them there, or any element two
steps off, is marked WRONG: it counts a wrong computation.

The onnxruntime wheel for the root filesystem's Python is fetched once with
pip (``pip download --platform manylinux_2_28_aarch64``) and unpacked under
$TETHER_CACHE/onnxruntime-aarch64/.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
from crosscompile.quantizer import quantize_model  # noqa: E402
from deploy_recipes import emulate, instruction_count  # noqa: E402
from crosscompile.target import resolve_target  # noqa: E402
from remote.defaults import cache_dir  # noqa: E402
from tests.architectures import efficientnet_b0, mobilenet_v2, regnet_x_400mf, resnet  # noqa: E402
from tests.onnx_models import conv_relu_model, zoo_model  # noqa: E402
from tests.quantized_models import output_step  # noqa: E402
from tests.segmentation_models import aspp  # noqa: E402
from tests.transformer_models import vit_block  # noqa: E402

RELEASE = "bookworm"
MODELS = {
    "squeezenet": lambda: zoo_model("squeezenet", logits=False),
    "resnet18": lambda: resnet(18),
    "resnet50": lambda: zoo_model("resnet50", logits=False),
    "mobilenetv2": mobilenet_v2,
    "efficientnet_b0": efficientnet_b0,
    "regnet_x_400mf": regnet_x_400mf,
    "vit_block": lambda: vit_block(opset=17),
    "aspp": aspp,
    # DeepLabV3-ResNet's dilated 3x3 convolutions (output stride 8), at 128
    # channels to keep the emulated runs short, and the same one undilated.
    "dilated_3x3": lambda: conv_relu_model((1, 128, 28, 28), (128, 128, 3, 3), {"pads": [2] * 4,
                                                                               "dilations": [2, 2]}),
    "plain_3x3": lambda: conv_relu_model((1, 128, 28, 28), (128, 128, 3, 3), {"pads": [1] * 4}),
}
# preset: (Debian architecture, qemu core, whether onnxruntime has a wheel for it).
TARGETS = {
    "rasp4b64": ("arm64", "cortex-a72", True),
    "rasp5": ("arm64", "cortex-a76", True),
    "rasp3b": ("armhf", "max", False),
}


def onnxruntime_site(release: str = RELEASE) -> str:
    """A folder holding onnxruntime's aarch64 wheel, unpacked, for the guest's Python."""
    root = emulate.build_rootfs(release, "arm64")
    version = re.search(r"(\d+)\.(\d+)$", emulate.guest_python(root)).groups()
    tag = "".join(version)
    site = os.path.join(cache_dir(), "onnxruntime-aarch64", f"cp{tag}")
    if glob.glob(os.path.join(site, "onnxruntime", "capi", "onnxruntime_pybind11_state*.so")):
        return site
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux_2_28_aarch64", "--python-version", ".".join(version),
                        "--implementation", "cp", "-d", download, "onnxruntime"],
                       check=True, stdout=subprocess.DEVNULL)
        (wheel,) = glob.glob(os.path.join(download, "onnxruntime-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    return site


def model_inputs(model: onnx.ModelProto) -> dict:
    inits = {i.name for i in model.graph.initializer}
    return {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in model.graph.input if vi.name not in inits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS),
                        help=f"default: all of {', '.join(MODELS)}; or .onnx files")
    parser.add_argument("--targets", default="rasp4b64",
                        help=f"comma-separated presets of {', '.join(TARGETS)} (default rasp4b64)")
    parser.add_argument("--runs", type=int, default=3, help="inferences counted after the first")
    parser.add_argument("--no-ort", action="store_true", help="count ours only")
    parser.add_argument("--precisions", default="fp32",
                        help="comma-separated precisions of ours: fp32, fp16 (fp16 on targets with "
                             "FP16 arithmetic only; default fp32)")
    parser.add_argument("--int8", action="store_true", help="count the models quantized to int8 (QDQ)")
    args = parser.parse_args()
    targets = args.targets.split(",")
    precisions = args.precisions.split(",")
    for precision in precisions:
        if precision not in ("fp32", "fp16"):
            parser.error(f"unknown precision {precision!r}; choose from fp32, fp16")
    for name in targets:
        if name not in TARGETS:
            parser.error(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
    for name in args.models:
        if name not in MODELS and not (name.endswith(".onnx") and os.path.exists(name)):
            parser.error(f"unknown model {name!r}; choose from {', '.join(MODELS)} or give an .onnx file")
    site = None if args.no_ort else onnxruntime_site()

    print(f"{'model':15} {'target':9} {'core':11} {'prec':4} {'ours M':>9} {'ort M':>9} {'ours/ort':>8} "
          f"{'cos':>8}" + (f" {'steps':>8}" if args.int8 else ""))
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            if name in MODELS:
                model = MODELS[name]()
            else:  # an .onnx file, e.g. one of export_torchvision.py's
                model = onnx.load(name)
                name = os.path.splitext(os.path.basename(name))[0]
            inputs = model_inputs(model)
            onnx_path = os.path.join(folder, f"{name}.onnx")
            onnx.save(model, onnx_path)
            if args.int8:
                quantize_model(model, onnx_path, random=4)
                model = onnx.load(onnx_path)
                name = f"{name}-int8"
            peer = {}  # onnxruntime's count and output per core, measured once
            host_reference = host_output(onnx_path, inputs) if args.int8 else None
            for target, precision in [(t, p) for t in targets for p in precisions]:
                arch, cpu, has_ort = TARGETS[target]
                if precision == "fp16" and not resolve_target(target).has_fp16_arithmetic:
                    print(f"{name:15} {target:9} {cpu:11} fp16 (no FP16 arithmetic on this target)", flush=True)
                    continue
                so = crosscompile.build(model, target=target, precision=precision).export_library(
                    os.path.join(folder, f"{name}-{target}-{precision}.so"))
                saved = os.path.join(folder, f"{name}-{target}-{precision}.npy")
                ours = instruction_count.count_module(so, inputs, RELEASE, arch, cpu, runs=args.runs,
                                                      save=saved).per_inference
                theirs = None
                if site and has_ort:
                    if cpu not in peer:
                        reference = os.path.join(folder, f"{name}-ort-{cpu}.npy")
                        peer[cpu] = (instruction_count.count_onnx(
                            onnx_path, inputs, site, RELEASE, arch, cpu, runs=args.runs,
                            save=reference).per_inference, np.load(reference))
                    theirs, want = peer[cpu]
                else:
                    want = host_reference
                ratio = f"{ours / theirs:8.2f}" if theirs else f"{'-':>8}"
                their_text = f"{theirs / 1e6:9.1f}" if theirs else f"{'-':>9}"
                got = np.load(saved)
                agreement = f"{cosine(got, want):8.5f}" if want is not None else f"{'-':>8}"
                if args.int8:
                    within, right = within_one_step(got, want, output_step(model))
                    agreement += f" {within:8.2%}" + ("" if right else "  WRONG")
                print(f"{name:15} {target:9} {cpu:11} {precision:4} {ours / 1e6:9.1f} {their_text} {ratio} "
                      f"{agreement}", flush=True)
    return 0


def host_output(onnx_path: str, inputs: dict) -> np.ndarray:
    """onnxruntime's first output on the host, without graph optimizations
    (the QDQ arithmetic as ONNX defines it), for the input the counted runs
    take (instruction_count's: one normal draw per input from seed 0, in order)."""
    import onnxruntime

    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in inputs.items()}
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def within_one_step(got: np.ndarray, want: np.ndarray, step: "float | None") -> "tuple[float, bool]":
    """(share of elements within one quantization step of want, whether
    that is right: at least 99.9 % of them, and none two steps off). A
    float output after the last quantized op (no step) gets 1 % of want's
    largest magnitude."""
    if step is None:
        step = 0.01 * float(np.abs(want).max())
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    within = float(np.mean(diff <= step * 1.001))
    return within, within >= 0.999 and float(diff.max()) <= 2.001 * step


def cosine(got: np.ndarray, want: np.ndarray) -> float:
    """Cosine of two outputs' values (1.0: the same direction)."""
    a, b = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


if __name__ == "__main__":
    sys.exit(main())
