"""``tether check``: does a board compute what the model computes?

Runs N input sets (a folder of .npy/.npz files, or ``--random N``) through the
module on a board of the key and through a reference on this host
(onnxruntime where it is installed, else the model compiled for the host and
run by minirt), and reports per output the measures of remote/accuracy.py
against the tolerances. Exit status 3 when an output is beyond them; the
report is recorded in the farm database like a benchmark.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from typing import Callable, Dict, List, Tuple

import numpy as np

from remote.accuracy import Tolerances, measure, verdict
from remote.cli import modelfile, recording
from remote.cli.bench import (DEFAULT_CALL_TIMEOUT_S, _headline, add_farm_arguments,
                              tool_version)
from remote.cli.progress import say
from remote.cli.run import random_inputs
from remote.client import display
from remote.client.tracker import TrackerClient

SCHEMA = "tether.check/1"
EXIT_BEYOND_TOLERANCE = 3


# -------------------------------------------------------------- inputs --
def folder_inputs(folder: str, spec: List[dict]) -> List[Dict[str, np.ndarray]]:
    """One input set per file of ``folder``, in name order: an .npz keyed by
    input name, or an .npy for a model with one input."""
    from crosscompile.input_sets import read_input_sets
    try:
        found = read_input_sets(folder, [t["name"] for t in spec])
    except ValueError as exc:
        raise ValueError(f"--inputs {exc}; or give --random N") from None
    sets = []
    for path, one in found:
        for t in spec:
            if list(one[t["name"]].shape) != list(t["shape"]):
                raise ValueError(f"{path}: input {t['name']} has shape "
                                 f"{list(one[t['name']].shape)}, the module takes {t['shape']}")
            one[t["name"]] = one[t["name"]].astype(t["dtype"], copy=False)
        sets.append(one)
    return sets


def digest(inputs: Dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(inputs):
        h.update(name.encode() + b"\0" + np.ascontiguousarray(inputs[name]).tobytes())
    return h.hexdigest()


# ----------------------------------------------------------- reference --
def host_reference(model: str, input_shapes) -> Tuple[str, Callable, Callable]:
    """(what it is, run(inputs) -> list of arrays, cleanup) for the model on this host."""
    try:
        import onnxruntime
    except ImportError:
        onnxruntime = None
    if onnxruntime is not None:
        session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
        return (f"onnxruntime {onnxruntime.__version__}",
                lambda inputs: session.run(None, inputs), lambda: None)
    import crosscompile
    import minirt

    folder = tempfile.mkdtemp(prefix="tether-check-")
    path = os.path.join(folder, "reference.so")
    crosscompile.build(model, target="host", input_shapes=input_shapes).export_library(path)
    module = minirt.load(path)
    return (f"tether {tool_version()} host build (onnxruntime not installed)", module.run,
            lambda: shutil.rmtree(folder, ignore_errors=True))


# --------------------------------------------------------------- report --
def outputs_table(record: dict) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    rows = [(o["name"], cell(o["max_abs"], ".3g"), cell(o["max_rel"], ".3g"),
             cell(o["cosine"], ".6f"), cell(o["top1"], ".1%"),
             "-" if o["topk"] is None else f"{o['topk']:.1%} (k={o['k']})",
             cell(o["psnr"], ".1f"), "ok" if o["passed"] else "BEYOND")
            for o in record["outputs"]]
    lines = display.text_table(("OUTPUT", "MAX ABS", "MAX REL", "COSINE", "TOP-1", "TOP-K",
                                "PSNR dB", ""), rows).splitlines()
    for o in record["outputs"]:
        lines += [f"{o['name']}: {why}" for why in o["why"]]
    return _headline(record) + "\n" + "\n".join("  " + line for line in lines)


def run_check(args, tracker_address) -> int:
    if args.inputs and args.random:
        raise ValueError("give --inputs DIR or --random N, not both")
    if not args.model.endswith(".onnx"):
        raise ValueError(f"{args.model!r}: tether check needs the ONNX model (the reference "
                         "runs it on this host); give a module built before with --module")
    tol = Tolerances(atol=args.atol, rtol=args.rtol, min_cosine=args.min_cosine,
                     min_top1=args.min_top1, top_k=args.top_k, min_psnr=args.min_psnr)
    labels = recording.parse_labels(args.label)
    shapes = modelfile.parse_input_shapes(args.input_shape)
    modules = modelfile.ModuleChoice(args.module or args.model, args.target, shapes, say=say)
    what, reference, cleanup = host_reference(args.model, shapes)
    try:
        with TrackerClient(*tracker_address, tls_ca=args.tls_ca) as tracker:
            with tracker.request(args.key, timeout=args.wait,
                                 call_timeout=args.timeout or DEFAULT_CALL_TIMEOUT_S) as sess:
                info = sess.device_info()
                module = modules.for_board(info)
                say(f"leased {sess.address}: checking {os.path.basename(module.path)} "
                    f"against {what}")
                mod = modelfile.load_for_board(sess, sess.upload(module.path), info)
                spec = mod.metadata["inputs"]
                sets = (folder_inputs(args.inputs, spec) if args.inputs else
                        [random_inputs(spec, args.seed + n) for n in range(args.random or 4)])
                board = [mod.run(one, timeout=args.timeout or DEFAULT_CALL_TIMEOUT_S)
                         for one in sets]
                device_id, address = sess.device_id, sess.address
            wanted = [reference(one) for one in sets]
            outputs = []
            for i, name in enumerate(mod.output_names):
                m = measure(name, [b[i] for b in board], [w[i] for w in wanted], tol.top_k)
                m["passed"], m["why"] = verdict(m, tol)
                outputs.append(m)
            record = {"device_id": device_id, "key": args.key, "address": address,
                      "device": info, "passed": all(o["passed"] for o in outputs),
                      "outputs": outputs}
            report = {
                "schema": SCHEMA,
                "tool": {"name": "tether", "version": tool_version(),
                         "python": platform.python_version()},
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "command": ["tether", *sys.argv[1:]],
                "model": {**module.describe(), "path": os.path.abspath(args.model),
                          "sha256": modelfile.sha256(args.model)},
                "target": mod.metadata.get("target", {}),
                "compiler": mod.metadata.get("producer") or f"tether {tool_version()}",
                "reference": what,
                "inputs": {"source": args.inputs or f"random (seed {args.seed})",
                           "count": len(sets), "sha256": [digest(one) for one in sets]},
                "tolerances": tol.as_dict(), "labels": labels, "results": [record],
            }
            if not args.no_record:
                recording.record_report(tracker, "check", report, labels, say)
    finally:
        cleanup()
        modules.cleanup()
    print(outputs_table(record))
    print(f"{len(sets)} input set(s), reference {what}: "
          + ("every output within the tolerances" if record["passed"] else
             "BEYOND the tolerances"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        say(f"wrote {args.json}")
    return 0 if record["passed"] else EXIT_BEYOND_TOLERANCE


def add_arguments(p) -> None:
    defaults = Tolerances()
    p.add_argument("model", help="the ONNX model (the reference runs it on this host)")
    p.add_argument("--key", required=True, help="device key of the board to check")
    p.add_argument("--module", metavar="FILE.so",
                   help="check this module built before (tether compile) instead of compiling "
                        "the model")
    p.add_argument("--target", default=None,
                   help="preset to compile the model for (default: the one that fits the board)")
    p.add_argument("--inputs", metavar="DIR",
                   help="a folder of input sets: an .npz per set keyed by input name, or an "
                        ".npy per set for a model with one input")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="N random input sets (the default, with N=4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first random set (default 0)")
    p.add_argument("--atol", type=float, default=defaults.atol,
                   help=f"absolute error allowed (default {defaults.atol:g}) ...")
    p.add_argument("--rtol", type=float, default=defaults.rtol,
                   help="... plus this times the reference's largest magnitude "
                        f"(default {defaults.rtol:g})")
    p.add_argument("--min-cosine", type=float, default=defaults.min_cosine,
                   help=f"lowest cosine similarity allowed (default {defaults.min_cosine:g})")
    p.add_argument("--min-top1", type=float, default=defaults.min_top1,
                   help="share of a classifier's rows whose top class must agree "
                        f"(default {defaults.min_top1:g})")
    p.add_argument("--top-k", type=int, default=defaults.top_k,
                   help=f"k of the top-k agreement reported (default {defaults.top_k})")
    p.add_argument("--min-psnr", type=float, default=defaults.min_psnr,
                   help=f"lowest PSNR of an image output, dB (default {defaults.min_psnr:g})")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an ONNX input's unknown dimensions")
    p.add_argument("--json", metavar="FILE", help="write the report here")
    recording.add_arguments(p)
    add_farm_arguments(p, "seconds any one call on the board may take (default 60)")
