"""Instructions per inference on an emulated AVX2 core: ours compiled for
it against onnxruntime's own AVX2 kernels, one thread each.

    python benchmarks/bench_avx2.py [model ...] [--cpu Haswell] [--runs N]

For an x86-64 machine with AVX-512, where bench_models.py times
onnxruntime's AVX-512 kernels only (it picks them from the CPU it runs on):
this machine's Python runs under qemu-x86_64 emulating --cpu (default
Haswell: AVX2 and FMA, 16 vector registers, no AVX-512), ours built for
x86_64 haswell and onnxruntime choosing its kernels for that core (see
deploy_recipes/instruction_count.py, count_on_host_core). Models: the
onnx package's light zoo by name (random parameters, one 1 x 3 x 224 x 224
image; default squeezenet and resnet50).

A count is exact and repeatable, but it is not a time: a load folded into
an FMA counts as one instruction, caches and stalls not at all, and x86
cores retire several instructions a cycle. Use it for the ratio between
AVX2 kernels, and confirm with times: bench_models.py on an AVX2 machine,
or bench_models.py --avx2 on an AVX-512 one.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import onnx
import onnxruntime

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
from deploy_recipes import instruction_count  # noqa: E402
from tests.onnx_models import zoo_model  # noqa: E402

TARGET = "x86_64-linux-gnu/haswell/+avx,+avx2,+fma"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["squeezenet", "resnet50"])
    parser.add_argument("--cpu", default="Haswell", help="qemu's x86 core model (default Haswell)")
    parser.add_argument("--runs", type=int, default=2, help="inferences counted after the first")
    args = parser.parse_args()
    print(f"ours for {TARGET}, onnxruntime {onnxruntime.__version__}, "
          f"both on qemu-x86_64 -cpu {args.cpu}, one thread")
    print(f"{'model':14} {'ours M':>9} {'ort M':>9} {'ours/ort':>8}")
    with tempfile.TemporaryDirectory(prefix="tether-avx2-") as tmp:
        for name in args.models:
            model = zoo_model(name, logits=False)
            constants = {i.name for i in model.graph.initializer}
            inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
                      for i in model.graph.input if i.name not in constants}
            onnx_path = os.path.join(tmp, f"{name}.onnx")
            onnx.save(model, onnx_path)
            module = crosscompile.build(model, target=TARGET).export_library(os.path.join(tmp, f"{name}.so"))
            ours = instruction_count.count_on_host_core("module", module, inputs, args.cpu, runs=args.runs)
            peer = instruction_count.count_on_host_core("onnx", onnx_path, inputs, args.cpu, runs=args.runs)
            print(f"{name:14} {ours.per_inference / 1e6:9.1f} {peer.per_inference / 1e6:9.1f} "
                  f"{ours.per_inference / peer.per_inference:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
