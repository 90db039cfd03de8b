"""Export torchvision's classification and segmentation models, random
weights, to ONNX files for benchmarks/bench_torchvision.py.

torch is not one of the project's dependencies: run this with an
environment of its own, e.g.

    python3 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch torchvision onnx onnxscript
    /tmp/torchenv/bin/python benchmarks/export_torchvision.py OUT_DIR [model ...]
        [--max-params 100] [--dynamo] [--opset 17]

Without model names every classification model and every segmentation
model with at most --max-params million parameters is exported, one file
OUT_DIR/NAME.onnx each (a file already there is kept). Weights are
torchvision's random initialisation; BatchNorm's running statistics are
set to random, non-trivial values so that folding them is exercised. Each
model takes one 1 x 3 x S x S image (S = 299 for Inception v3, 224 for the
others); segmentation models give their "out" map only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

SIZES = {"inception_v3": 299}


def names(models) -> list:
    """Every classification and segmentation model torchvision lists."""
    return models.list_models(module=models) + models.list_models(module=models.segmentation)


def build(name: str, models, torch):
    """The model `name` in eval mode, random weights, BatchNorm statistics set."""
    kwargs = {"weights": None}
    if name in models.list_models(module=models.segmentation):
        kwargs.update(weights_backbone=None, aux_loss=False)
        net = models.get_model(name, **kwargs)

        class MapOnly(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, image):
                return self.net(image)["out"]
        model = MapOnly()
    else:
        if name in ("inception_v3", "googlenet"):
            kwargs["aux_logits"] = False
            kwargs["init_weights"] = False
        model = models.get_model(name, **kwargs)
    generator = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
            count = module.running_mean.numel()
            module.running_mean.copy_(0.1 * torch.randn(count, generator=generator))
            module.running_var.copy_(0.5 + torch.rand(count, generator=generator))
    return model.eval()


def main(argv=None) -> int:
    import torch
    from torchvision import models

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the folder to write NAME.onnx files into")
    parser.add_argument("models", nargs="*", help="default: every classification and segmentation model")
    parser.add_argument("--max-params", type=float, default=100.0,
                        help="leave out models with more million parameters than this (default 100)")
    parser.add_argument("--dynamo", action="store_true", help="the dynamo exporter (default: TorchScript's)")
    parser.add_argument("--opset", type=int, default=17)
    args = parser.parse_args(argv)

    known = names(models)
    for name in args.models:
        if name not in known:
            parser.error(f"unknown model {name!r}; torchvision has {', '.join(known)}")
    os.makedirs(args.output, exist_ok=True)
    torch.manual_seed(0)
    # Inference mode's fused attention (aten::_native_multi_head_attention,
    # ViT's) has no ONNX export: keep the ops it is made of.
    torch.backends.mha.set_fastpath_enabled(False)
    for name in args.models or known:
        path = os.path.join(args.output, f"{name}.onnx")
        if os.path.exists(path):
            print(f"{name}: kept {path}", flush=True)
            continue
        with torch.no_grad():
            model = build(name, models, torch)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            if not args.models and params > args.max_params:
                print(f"{name}: left out ({params:.0f} M parameters > --max-params {args.max_params:g})", flush=True)
                continue
            size = SIZES.get(name, 224)
            started = time.perf_counter()
            try:
                torch.onnx.export(model, (torch.rand(1, 3, size, size),), path, opset_version=args.opset,
                                  dynamo=args.dynamo, input_names=["image"], output_names=["output"])
            except Exception as error:  # noqa: BLE001 - an exporter failure is reported, the sweep goes on
                print(f"{name}: export failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}",
                      flush=True)
                if os.path.exists(path):
                    os.remove(path)
                continue
        print(f"{name}: {params:.1f} M parameters, {size}x{size}, exported in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
