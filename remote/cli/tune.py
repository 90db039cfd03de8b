"""``tether tune``: find the fastest register tile for each convolution shape
of a model on a board of a key, and cache it for the target. Where no board
of an ARM target is in the farm (or no farm is named), each tile's cost is
the instructions one run executes on an emulated core of the target instead.

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
# Cost columns by what the rows measured: milliseconds per run on a board,
# millions of guest instructions per run on an emulated core, or both (a
# count run keeps shapes a board timed before), each value with its unit.
COST_HEADERS = {"s": ("DEFAULT MS", "BEST MS"), "instructions": ("DEFAULT M INSTR", "BEST M INSTR"),
                "mixed": ("DEFAULT", "BEST")}
UNIT_NAMES = {"s": "ms", "instructions": "M instr"}


def _units(result) -> str:
    units = {s.unit for s in result.shapes} or {"s"}
    return units.pop() if len(units) == 1 else "mixed"


def headers(result) -> tuple:
    return HEADERS[:4] + COST_HEADERS[_units(result)] + HEADERS[6:]


def _cost(value: float, unit: str, mixed: bool) -> str:
    text = f"{value / 1e6:.4f}" if unit == "instructions" else f"{value * 1e3:.4f}"
    return f"{text} {UNIT_NAMES[unit]}" if mixed else text


def result_rows(result) -> list:
    mixed = _units(result) == "mixed"
    rows = []
    for s in result.shapes:
        rows.append((s.shape.key, "x".join(str(d) for d in s.shape.gemm),
                     "x".join(map(str, s.default)), "x".join(map(str, s.best)),
                     _cost(s.default_s, s.unit, mixed), _cost(s.best_s, s.unit, mixed), f"{s.speedup:.2f}x",
                     "(cached)" if s.cached else ""))
    return rows


def _count_note(target) -> str:
    from deploy_recipes.instruction_count import emulated_core

    if target.name == "host":
        return "tuning on this machine"

    arch, core = emulated_core(target)
    return (f"costing each tile by the instructions one run executes on an emulated {core} core "
            f"(qemu user mode, Debian bookworm {arch}; the first count builds its root filesystem): "
            "exact and repeatable, but not a time; tune on a board of the target (--key) to "
            "confirm, which replaces these counts")


def _target_without_board(args) -> str:
    """--target, else a --key that names a preset."""
    from crosscompile.target import TARGETS

    if args.target is not None:
        return args.target
    if args.key in TARGETS:
        return args.key
    raise ValueError(f"no board of key {args.key!r} is in the farm, and without a board the "
                     "target cannot be read from one: give --target (a preset such as "
                     "rasp4b64) to tune by counting instructions on an emulated core, or start "
                     "a board of that key")


def run_tune(args, tracker_address) -> int:
    from crosscompile.target import resolve_target
    from remote.client import tuning

    if args.number < 1 or args.repeat < 1:
        raise ValueError(f"--number ({args.number}) and --repeat ({args.repeat}) must be at "
                         "least 1")
    shapes = parse_input_shapes(args.input_shape)
    options = dict(progress=say, number=args.number, repeat=args.repeat, force=args.force,
                   input_shapes=shapes, timeout=args.timeout or DEFAULT_CALL_TIMEOUT_S)
    if args.key is None:
        if args.target in (None, "host"):
            say("tuning on this machine")
            result = tuning.tune(args.model, "host", None, **options)
        else:
            target = resolve_target(args.target)
            say(f"no --key: {_count_note(target)}")
            result = tuning.tune(args.model, target, None, **options)
    else:
        with TrackerClient(*tracker_address, tls_ca=args.tls_ca) as tracker:
            boards = [d for d in tracker.summary()["devices"] if d["key"] == args.key]
            if not boards:
                target = resolve_target(_target_without_board(args))
                say(f"no board of key {args.key!r} is in the farm: {_count_note(target)}")
            else:
                with tracker.request(args.key, timeout=args.wait) as sess:
                    target = args.target
                    if target is None:
                        target = board_target(sess.device_info())
                        say(f"tuning for {target}, the preset that fits this board "
                            "(--target to choose another)")
                    say(f"tuning on {sess.address} (key {args.key})")
                    result = tuning.tune(args.model, target, sess, **options)
        if not boards:
            result = tuning.tune(args.model, target, None, **options)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        cost = {"s": "medians per run", "instructions": "guest instructions per run on the emulated core",
                "mixed": "medians per run on a board (ms) or instructions per run on the emulated core "
                         "(M instr)"}[_units(result)]
        print(f"target {result.target.name} ({result.target.triple}, {result.target.cpu}): "
              f"{len(result.shapes)} convolution shape(s); register tile MRxNV (MRxNVxPIXELS: transposed), "
              + cost)
        print(display.text_table(headers(result), result_rows(result)))
        print(f"cache: {result.cache_path}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("model", help="ONNX model whose convolutions are tuned")
    p.add_argument("--target", default=None,
                   help="preset or triple[/cpu[/features]] the boards of --key run (default: "
                        "the one that fits the leased board; host without --key)")
    p.add_argument("--key", default=None,
                   help="device key of the board to tune on (without it, or with no board of "
                        "it in the farm, an ARM --target is tuned by counting instructions on an "
                        "emulated core, and host on this machine)")
    p.add_argument("--number", type=int, default=10, help="runs averaged into one sample")
    p.add_argument("--repeat", type=int, default=5, help="samples per candidate (default 5)")
    p.add_argument("--force", action="store_true",
                   help="measure shapes that are already in the cache again")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an ONNX input's unknown dimensions")
    p.add_argument("--json", action="store_true",
                   help="print the result (every candidate's median) as JSON")
    add_farm_arguments(p, "seconds any one call on the board may take (default 60)")
