"""``tether tune``: find the fastest register tile for each convolution shape
of a model on a board of a key, and cache it for the target.

`tether compile`, `tether bench` and `tether run` then build with the cached
tiles for that target (``--no-tuning`` leaves them out).
"""
from __future__ import annotations

import json

from remote.cli.bench import DEFAULT_CALL_TIMEOUT_S, add_farm_arguments
from remote.cli.modelfile import board_target, parse_input_shapes
from remote.cli.progress import say
from remote.client import display
from remote.client.tracker import TrackerClient

HEADERS = ("SHAPE", "GEMM MxKxN", "DEFAULT", "BEST", "DEFAULT MS", "BEST MS", "SPEED-UP", "")


def result_rows(result) -> list:
    rows = []
    for s in result.shapes:
        rows.append((s.shape.key, "x".join(str(d) for d in s.shape.gemm),
                     "x".join(map(str, s.default)), "x".join(map(str, s.best)),
                     f"{s.default_s * 1e3:.4f}", f"{s.best_s * 1e3:.4f}", f"{s.speedup:.2f}x",
                     "(cached)" if s.cached else ""))
    return rows


def run_tune(args, tracker_address) -> int:
    from remote.client import tuning

    if args.number < 1 or args.repeat < 1:
        raise ValueError(f"--number ({args.number}) and --repeat ({args.repeat}) must be at "
                         "least 1")
    shapes = parse_input_shapes(args.input_shape)
    options = dict(progress=say, number=args.number, repeat=args.repeat, force=args.force,
                   input_shapes=shapes, timeout=args.timeout or DEFAULT_CALL_TIMEOUT_S)
    if args.key is None:
        if args.target not in (None, "host"):
            raise ValueError(f"--target {args.target}: give --key of a board to tune on "
                             "(only host can be tuned on this machine)")
        say("tuning on this machine")
        result = tuning.tune(args.model, "host", None, **options)
    else:
        with TrackerClient(*tracker_address, tls_ca=args.tls_ca) as tracker:
            with tracker.request(args.key, timeout=args.wait) as sess:
                target = args.target
                if target is None:
                    target = board_target(sess.device_info())
                    say(f"tuning for {target}, the preset that fits this board "
                        "(--target to choose another)")
                say(f"tuning on {sess.address} (key {args.key})")
                result = tuning.tune(args.model, target, sess, **options)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(f"target {result.target.name} ({result.target.triple}, {result.target.cpu}): "
              f"{len(result.shapes)} convolution shape(s); register tile MRxNV (MRxNVxPIXELS: transposed), "
              "medians per run")
        print(display.text_table(HEADERS, result_rows(result)))
        print(f"cache: {result.cache_path}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("model", help="ONNX model whose convolutions are tuned")
    p.add_argument("--target", default=None,
                   help="preset or triple[/cpu[/features]] the boards of --key run (default: "
                        "the one that fits the leased board; host without --key)")
    p.add_argument("--key", default=None,
                   help="device key of the board to tune on (without it, --target host is "
                        "tuned on this machine)")
    p.add_argument("--number", type=int, default=10, help="runs averaged into one sample")
    p.add_argument("--repeat", type=int, default=5, help="samples per candidate (default 5)")
    p.add_argument("--force", action="store_true",
                   help="measure shapes that are already in the cache again")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an ONNX input's unknown dimensions")
    p.add_argument("--json", action="store_true",
                   help="print the result (every candidate's median) as JSON")
    add_farm_arguments(p, "seconds any one call on the board may take (default 60)")
