"""``tether run``: run a model once on a board of a key and print what came out."""
from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np

from remote.cli import modelfile
from remote.cli.bench import DEFAULT_CALL_TIMEOUT_S, add_farm_arguments
from remote.cli.progress import ByteBar, say
from remote.client import display
from remote.client.tracker import TrackerClient


def read_inputs(specs, module_inputs) -> dict:
    """``--input`` values: ``FILE.npy`` (the only input), ``NAME=FILE.npy``, or one ``.npz``."""
    names = [t["name"] for t in module_inputs]
    inputs = {}
    for spec in specs:
        name, sep, path = spec.rpartition("=")
        if not sep:
            name, path = "", spec
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {spec!r}: no such file {path!r}")
        if path.endswith(".npz"):
            with np.load(path) as archive:
                inputs.update({k: archive[k] for k in archive.files})
            continue
        if not name:
            if len(names) != 1:
                raise ValueError(f"--input {spec!r}: the module has inputs {names}; "
                                 "say which one with --input NAME=FILE.npy")
            name = names[0]
        inputs[name] = np.load(path, allow_pickle=False)
    missing = [n for n in names if n not in inputs]
    if missing:
        given = f"; the values given are for {sorted(inputs)}" if inputs else ""
        raise ValueError(f"no value for input(s) {missing}{given}; give --input NAME=FILE.npy "
                         "for each, or --random")
    return inputs


def random_inputs(module_inputs, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for t in module_inputs:
        dtype = np.dtype(t["dtype"])
        shape = tuple(t["shape"])
        if dtype.kind == "f":
            out[t["name"]] = rng.standard_normal(shape).astype(dtype)
        else:
            out[t["name"]] = rng.integers(0, 10, size=shape).astype(dtype)
    return out


def is_classifier(array: np.ndarray) -> bool:
    """One row of scores: floats along one axis of more than one class, every other
    axis 1 ((classes,), (1, classes), or a convolutional head's (1, classes, 1, 1))."""
    return (array.dtype.kind == "f" and array.size > 1
            and sum(d > 1 for d in array.shape) == 1)


def top_k(array: np.ndarray, k: int):
    scores = array.reshape(-1)
    order = np.argsort(scores, kind="stable")[::-1][:k]
    return [(int(i), float(scores[i])) for i in order]


DEFAULT_TOP_K = 5


def describe_output(name: str, array: np.ndarray, k: Optional[int]) -> str:
    """The output's dtype and shape, then its top-k classes if it is one row of class
    scores, else its values. ``k`` None is the default of 5, and a ``k`` the user gave
    that does not apply is said to be skipped."""
    asked, k = k is not None, DEFAULT_TOP_K if k is None else k
    lines = [f"output {name}: {array.dtype}{list(array.shape)}"]
    if k and is_classifier(array):
        lines.append(f"  top-{min(k, array.size)}:")
        for rank, (index, score) in enumerate(top_k(array, k), 1):
            lines.append(f"  #{rank}  class {index:<6d} {score:.6g}")
    else:
        if asked and k:
            lines.append(f"  (--top-k {k} skipped: {list(array.shape)} is not one row of class scores)")
        flat = array.reshape(-1)
        if flat.size and array.dtype.kind in "fiu":
            lines.append(f"  min {flat.min():.6g}  max {flat.max():.6g}  mean {flat.mean():.6g}")
        lines.append("  " + np.array2string(array, threshold=20, edgeitems=3).replace(
            "\n", "\n  "))
    return "\n".join(lines)


def run_once(args, tracker_address) -> int:
    if bool(args.input) == bool(args.random):
        raise ValueError("give the inputs: --input x.npy (or NAME=x.npy, or a .npz) or --random")
    modules = modelfile.ModuleChoice(args.model, args.target,
                                     modelfile.parse_input_shapes(args.input_shape), say=say,
                                     precision=args.precision, dynamic=modelfile.parse_dynamic(args.dynamic))
    try:
        with TrackerClient(*tracker_address, tls_ca=args.tls_ca) as tracker:
            with tracker.request(args.key, timeout=args.wait) as sess:
                info = sess.device_info()
                say(f"leased {sess.address}: {info['machine']}, {display.board_cpu(info)}")
                module = modules.for_board(info)
                bar = ByteBar(f"upload {os.path.basename(module.path)}")
                try:
                    name = sess.upload(module.path, progress=bar)
                finally:
                    bar.close()
                mod = modelfile.load_for_board(sess, name, info)
                spec = mod.metadata["inputs"]
                inputs = (random_inputs(spec, args.seed) if args.random
                          else read_inputs(args.input, spec))
                start = time.perf_counter()
                outputs = mod.run(inputs, timeout=args.timeout or DEFAULT_CALL_TIMEOUT_S)
                round_trip = time.perf_counter() - start
                device_s = mod.last_run_s
    finally:
        modules.cleanup()
    for name, array in zip(mod.output_names, outputs):
        print(describe_output(name, array, args.top_k))
    print(f"latency: {display.ms(device_s)} on the board, {display.ms(round_trip)} round trip "
          "(one cold run: the module's first, with caches and memory not yet warm; "
          "tether bench times warm runs)")
    if args.output:
        np.savez(args.output, **dict(zip(mod.output_names, outputs)))
        say(f"wrote {args.output}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("model", help="ONNX model (compiled for --target) or a built module .so")
    p.add_argument("--key", required=True, help="device key of the board to use")
    p.add_argument("--target", default=None,
                   help="preset to compile an ONNX model for (default: the one that fits the "
                        "leased board)")
    modelfile.add_precision_argument(p)
    p.add_argument("--input", action="append", default=[], metavar="[NAME=]FILE.npy",
                   help="input values (.npy per input, or one .npz by input name)")
    p.add_argument("--random", action="store_true", help="random inputs of the right shapes")
    p.add_argument("--seed", type=int, default=0, help="seed for --random (default 0)")
    p.add_argument("--top-k", type=int, default=None,
                   help="classes to show for a classifier's output (default 5; 0 shows values)")
    p.add_argument("--output", metavar="FILE.npz", help="save the outputs here")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an ONNX input's unknown dimensions")
    modelfile.add_dynamic_argument(p)
    add_farm_arguments(p, "seconds the run may take on the board (default 60)")
