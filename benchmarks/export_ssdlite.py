"""Export torchvision's SSDlite320-MobileNetV3-Large, random weights, with
its post-processing (NonMaxSuppression included), for
benchmarks/bench_detection.py.

torch is not one of the project's dependencies: run this with an
environment of its own, e.g.

    python3 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch torchvision onnx onnxruntime onnxscript
    /tmp/torchenv/bin/python benchmarks/export_ssdlite.py ssdlite.onnx [--dynamo]

then `python benchmarks/bench_detection.py ssdlite.onnx` with the
project's. The model takes one 3x320x320 image (values in [0, 1]) and
gives boxes [n, 4], scores [n] and labels [n] of the n detections kept.
--dynamo uses torch.onnx.export's dynamo exporter, otherwise the
TorchScript one (dynamo=False).
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    import torch
    import torchvision

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the .onnx file to write")
    parser.add_argument("--dynamo", action="store_true", help="the dynamo exporter (default: TorchScript's)")
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    detector = torchvision.models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None).eval()

    class Single(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.detector = detector

        def forward(self, image):
            found = self.detector([image[0]])[0]
            return found["boxes"], found["scores"], found["labels"]

    image = torch.rand(1, 3, 320, 320)
    torch.onnx.export(Single().eval(), (image,), args.output, opset_version=args.opset, dynamo=args.dynamo,
                      input_names=["image"], output_names=["boxes", "scores", "labels"])
    print(f"wrote {args.output} ({'dynamo' if args.dynamo else 'TorchScript'} exporter, opset {args.opset})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
