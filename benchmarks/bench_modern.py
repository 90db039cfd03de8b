"""Compile time and one-thread latency of ours and onnxruntime side by side
for the modern model families the tests build (tests/transformer_models.py,
tests/segmentation_models.py, tests/audio_models.py): a ViT block, a
ConvNeXt block, a pair of Swin blocks (windows, then shifted windows),
BERT-style encoders (16 and 128 tokens, scores by MatMul and by Einsum),
a U-Net, DeepLabV3's ASPP head, an LSTM keyword spotter and a CTC speech model.

    python benchmarks/bench_modern.py [model ...] [--repeat N] [--avx2]

Latencies are medians in ms, ours and onnxruntime run interleaved (see
bench_models.interleaved_medians); ratios are ours / onnxruntime (> 1: we
are slower). --avx2 times AVX2 against AVX2 on an AVX-512 machine, as
bench_models.py --avx2 does.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
import minirt  # noqa: E402
from benchmarks.bench_models import host_target_and_peer, interleaved_medians, machine_description, ort_session  # noqa: E402
from tests.audio_models import kws_lstm, speech_ctc  # noqa: E402
from tests.onnx_models import sample_input  # noqa: E402
from tests.segmentation_models import aspp, unet  # noqa: E402
from tests.transformer_models import bert_encoder, bert_feeds, convnext_block, swin_block, vit_block  # noqa: E402

# name -> (model builder, inputs for the model)
MODELS = {
    "vit_block": (lambda: vit_block(opset=17), sample_input),
    "convnext_block": (lambda: convnext_block(opset=17), sample_input),
    "swin_block": (lambda: swin_block(opset=17), sample_input),
    "bert16": (bert_encoder, bert_feeds),
    "bert16_einsum": (lambda: bert_encoder(einsum=True), bert_feeds),
    "bert128": (lambda: bert_encoder(tokens=128, width=64), bert_feeds),
    "bert128_einsum": (lambda: bert_encoder(tokens=128, width=64, einsum=True), bert_feeds),
    "unet": (unet, sample_input),
    "aspp": (aspp, sample_input),
    "unet128": (lambda: unet(size=128, channels=(16, 32, 64)), sample_input),
    "kws_lstm": (kws_lstm, sample_input),
    "speech_ctc": (speech_ctc, sample_input),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS), help=f"default: all of {', '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--avx2", action="store_true",
                        help="AVX2 against AVX2 on an AVX-512 machine (see bench_models.py --avx2)")
    args = parser.parse_args()
    target, peer = host_target_and_peer(parser, args.avx2)
    print(f"machine: {machine_description()}; ours compiled for {target}; {peer}")
    print(f"{'model':16} {'compile s':>9} {'ours ms':>9} {'ort ms':>9} {'ours/ort':>8}")
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        for name in args.models:
            build_model, make_feeds = MODELS[name]
            model = build_model()
            feeds = make_feeds(model)
            started = time.perf_counter()
            lib = crosscompile.build(model, target=target)
            compile_s = time.perf_counter() - started
            module = minirt.load(lib.export_library(os.path.join(tmp, f"{name}.so")), threads=1)
            session = ort_session(model, 1)
            ours, peer = interleaved_medians([lambda: module.run(feeds), lambda: session.run(None, feeds)],
                                             args.repeat)
            module.close()
            print(f"{name:16} {compile_s:9.2f} {ours * 1e3:9.3f} {peer * 1e3:9.3f} {ours / peer:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
