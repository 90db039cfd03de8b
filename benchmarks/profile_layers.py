"""Per-layer times of ours against onnxruntime's profiler, one thread.

    python benchmarks/profile_layers.py squeezenet [resnet50 ...] [--rounds N] [--top N]

For each light-zoo model (random parameters, as in tests/test_zoo.py),
a model of benchmarks/bench_modern.py by its name there (vit_block, unet128,
kws_lstm, ...), or an .onnx file (e.g. one of export_torchvision.py's):
Module.profile's steps and onnxruntime's node events (SessionOptions.
enable_profiling), each the minimum over --rounds rounds taken in turn, so
that load from other processes hits both alike. Steps are matched to
onnxruntime's nodes by name (see step_candidates); what is left unmatched
is listed by op. The machine's 1-minute load average is printed beside the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import onnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
import minirt  # noqa: E402
from benchmarks.bench_modern import MODELS  # noqa: E402
from tests.onnx_models import sample_input, zoo_input, zoo_model  # noqa: E402


def ort_profile(model, feeds, tmp: str, runs: int) -> dict:
    """{node name: (op, microseconds)}: the minimum per node over `runs` runs."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tmp, "ort")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for _ in range(runs + 1):
        session.run(None, feeds)
    with open(session.end_profiling()) as f:
        events = json.load(f)
    seen: dict = {}
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        name = event["name"][:-len("_kernel_time")]
        seen.setdefault(name, (event["args"].get("op_name", "?"), []))[1].append(event["dur"])
    return {name: (op, min(durs[1:] or durs)) for name, (op, durs) in seen.items()}


def step_candidates(model, step: dict) -> list:
    """Names an onnxruntime node doing the step's work may carry: its
    optimised nodes are named after the ONNX node or its output tensor
    (with suffixes such as "_nchwc"), the output of the last op fused."""
    consumers: dict = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    (first,) = [n for n in model.graph.node if n.name == step["name"]] or [None]
    if first is None:
        return [step["name"]]
    names, frontier = [first.name, *first.output], list(first.output)
    for _ in range(len(step.get("fused", []))):
        frontier = [out for t in frontier for n in consumers.get(t, []) for out in (n.name, *n.output)]
        names += frontier
    return names[::-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of ours then onnxruntime")
    parser.add_argument("--number", type=int, default=5, help="runs per round")
    parser.add_argument("--top", type=int, default=25, help="rows shown, largest gap first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-profile-") as tmp:
        for name in args.models:
            if name in MODELS:
                build_model, make_feeds = MODELS[name]
                model = build_model()
                feeds = make_feeds(model)
            elif name.endswith(".onnx"):
                model = onnx.load(name)
                feeds = sample_input(model)
                name = os.path.splitext(os.path.basename(name))[0]
            else:
                model = zoo_model(name, logits=False)
                feeds = zoo_input(model)
            module = minirt.load(crosscompile.build(model, target="host").export_library(
                os.path.join(tmp, f"{name}.so")), threads=1)
            ours: list = []
            theirs: dict = {}
            loads = []
            for _ in range(args.rounds):
                rows = module.profile(feeds, number=args.number)
                ours = rows if not ours else [dict(r, mean_s=min(r["mean_s"], o["mean_s"]))
                                              for r, o in zip(rows, ours)]
                for node, (op, us) in ort_profile(model, feeds, tmp, args.number).items():
                    theirs[node] = (op, min(us, theirs.get(node, (op, us))[1]))
                loads.append(os.getloadavg()[0])
            module.close()
            steps = module.metadata.get("steps") or []
            matched = []
            used = set()
            for row, step in zip(ours, steps):
                node = None
                for candidate in step_candidates(model, step):
                    node = next((n for n in theirs if n not in used and (n == candidate or n.startswith(candidate + "_"))),
                                None)
                    if node is not None:
                        break
                peer = theirs[node][1] if node is not None else 0.0
                if node is not None:
                    used.add(node)
                matched.append((row, node, peer))
            ours_us = sum(r["mean_s"] for r in ours) * 1e6
            ort_us = sum(us for _, us in theirs.values())
            print(f"\n{name}: ours {ours_us / 1e3:.2f} ms of steps, onnxruntime {ort_us / 1e3:.2f} ms of nodes "
                  f"(minimum per layer over {args.rounds} rounds; load average {min(loads):.2f} - {max(loads):.2f})")
            print(f"{'ours us':>8} {'ort us':>8} {'gap us':>7}  {'op':12} {'in -> out':40} step / onnxruntime node")
            for row, node, peer in sorted(matched, key=lambda m: -(m[0]["mean_s"] * 1e6 - m[2]))[:args.top]:
                us = row["mean_s"] * 1e6
                shapes = f"{row['inputs'][0] if row['inputs'] else ''} -> {row['outputs'][0] if row['outputs'] else ''}"
                print(f"{us:8.0f} {peer:8.0f} {us - peer:7.0f}  {row['op'][:12]:12} {shapes[:40]:40} "
                      f"{row['name']} / {node}")
            left: dict = {}
            for node, (op, us) in theirs.items():
                if node not in used:
                    left[op] = left.get(op, 0.0) + us
            print("onnxruntime nodes not matched, by op (us): "
                  + ", ".join(f"{op} {us:.0f}" for op, us in sorted(left.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
