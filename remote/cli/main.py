"""The ``tether`` command."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import traceback

from remote.address import split_address
from remote.defaults import TLS_CA_ENV, TOKEN_ENV, TRACKER_HELP, TRACKER_PORT, default_tracker


def _tracker_address(value):
    return split_address(value or default_tracker(), TRACKER_PORT)


def cmd_tracker(args):
    from remote.tracker.daemon import run
    return run(args)


def cmd_server(args):
    from remote.server.daemon import run
    return run(args)


def cmd_status(args):
    from remote.client import display
    from remote.client.tracker import TrackerClient
    with TrackerClient(*_tracker_address(args.tracker), tls_ca=args.tls_ca) as client:
        data = client.summary()
    print(json.dumps(data, indent=2) if args.json else display.summary_text(data))
    return 0


def cmd_token(args):
    from remote.tracker.tokens import TokenBook
    book = TokenBook(args.tokens)
    if args.action == "add":
        token = book.add(args.name)
        print(f"token for {args.name} (shown once; give it to them as {TOKEN_ENV}):")
        print(token)
    elif args.action == "remove":
        try:
            book.remove(args.name)
        except KeyError as exc:
            raise SystemExit(str(exc.args[0]))
        print(f"removed {args.name}'s token from {args.tokens}")
    else:
        print("\n".join(book.names()) or f"no tokens in {args.tokens}")
    return 0


def cmd_compile(args):
    import crosscompile
    from remote.cli.modelfile import parse_dynamic, parse_input_shapes
    from remote.cli.progress import stage
    from remote.client.tuning import default_cache
    shapes = parse_input_shapes(args.input_shape)
    schedules = None if args.no_tuning else default_cache()
    with stage(f"compiling {os.path.basename(args.model)} for {args.target}") as ticker:
        lib = crosscompile.build(args.model, target=args.target, input_shapes=shapes,
                                 schedules=schedules, progress=ticker.step, precision=args.precision,
                                 dynamic=parse_dynamic(args.dynamic))
    out = args.output or os.path.splitext(os.path.basename(args.model))[0] + ".so"
    lib.export_library(out)
    meta = lib.metadata
    print(f"compiled {args.model} for {meta['target']['name']} ({meta['target']['triple']}) "
          f"-> {out} ({os.path.getsize(out)} bytes)")
    for kind in ("inputs", "outputs"):
        for t in meta[kind]:
            counted = t.get("count")
            bound = (f" (axis {counted['axis']}: at most {t['shape'][counted['axis']]}, the size depends on "
                     "the data)") if counted else ""
            print(f"  {kind[:-1]:6} {t['name']}: {t['dtype']}{list(t['shape'])}{bound}")
    for dim in meta.get("dynamic", ()):
        print(f"  dynamic {dim['name']} (axis 0): any size from {dim['min']} to {dim['max']} "
              f"(shapes above at {dim['max']}; plans for chunks of {', '.join(map(str, dim['chunks']))})")
    s = lib.summary
    print(f"  ops {s['ops']} ({', '.join(meta['ops'])}); kernels {s['kernels']}; "
          f"fused kernels {s['fused_kernels']} ({s['fused_ops']} element-wise ops fused, "
          f"{s['folded_into_conv']} BatchNorm/Mul/Add folded into Conv)")
    print(f"  workspace {s['workspace_bytes']} bytes; parameters {s['param_bytes']} bytes; "
          f"code {s['code_bytes']} bytes")
    if s["fp16_kernels"]:
        print(f"  {s['fp16_kernels']} convolutions and matrix products compute in fp16")
    if s["gemm_convs"] and schedules is None:
        print(f"  default register tiles for {s['gemm_convs']} GEMM convolutions (--no-tuning)")
    elif s["gemm_convs"]:
        print(f"  tuned register tiles for {s['tuned_convs']} of {s['gemm_convs']} GEMM "
              f"convolutions (cache {schedules.path_for(lib.target)})")
    return 0


def cmd_quantize(args):
    from crosscompile.quantizer import quantize_model
    report = quantize_model(args.model, args.output, calibrate=args.calibrate, random=args.random,
                            per_channel=not args.per_tensor)
    print(f"quantized {args.model} -> {args.output} (QDQ: uint8 activations, int8 weights "
          f"{'per tensor' if args.per_tensor else 'per channel'})")
    print("  " + report.text())
    return 0


def cmd_ops(args):
    from crosscompile.operator_table import markdown_table, operator_rows, text_table, updated_document
    rows = operator_rows()
    if args.update_doc:
        with open(args.update_doc, encoding="utf-8") as f:
            text = f.read()
        with open(args.update_doc, "w", encoding="utf-8") as f:
            f.write(updated_document(text, rows))
        print(f"wrote the table of {len(rows)} ops into {args.update_doc}")
        return 0
    print(markdown_table(rows) if args.markdown else text_table(rows), end="")
    return 0


def cmd_bench(args):
    from remote.cli.bench import run_bench
    return run_bench(args, _tracker_address(args.tracker))


def cmd_check(args):
    from remote.cli.check import run_check
    return run_check(args, _tracker_address(args.tracker))


def cmd_history(args):
    from remote.cli.history import run_history
    return run_history(args, _tracker_address(args.tracker))


def cmd_tune(args):
    from remote.cli.tune import run_tune
    return run_tune(args, _tracker_address(args.tracker))


def cmd_run(args):
    from remote.cli.run import run_once
    return run_once(args, _tracker_address(args.tracker))


def cmd_demo(args):
    from remote.cli.demo import run_demo
    return run_demo(key=args.key, runs=args.runs)


def cmd_emulate(args):
    from deploy_recipes.emulate import run_emulated_board
    return run_emulated_board(args)


def cmd_bootstrap(args):
    from deploy_recipes.bootstrap import run_bootstrap
    return run_bootstrap(args)


def cmd_adb(args):
    from deploy_recipes.adb import run_adb
    return run_adb(args)


def cmd_native(args):
    from remote.cli.native import run_native
    return run_native(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="Cross-compile ONNX models for ARM boards and run them on a device farm.",
        epilog="example: tether demo    (a local tracker, a local board, one model end to end)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from remote.server.daemon import build_parser as server_parser
    from remote.tracker.daemon import build_parser as tracker_parser

    p = sub.add_parser("tracker", help="run the tracker that pools boards by key",
                       epilog="example: tether tracker --host 0.0.0.0 --port 9190")
    tracker_parser(p)
    p.set_defaults(func=cmd_tracker)

    p = sub.add_parser("server", help="run the device server on a board",
                       epilog="example: tether server --tracker farm.local:9190 --key rasp4b64")
    server_parser(p)
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("status", help="show the tracker's devices and queue",
                       epilog="example: tether status --tracker farm.local:9190 --json")
    p.add_argument("--tracker", help=TRACKER_HELP)
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--tls-ca", default=None,
                   help=f"PEM certificate to trust when the tracker serves TLS (default ${TLS_CA_ENV})")
    p.set_defaults(func=cmd_status)

    from remote.tracker.tokens import DEFAULT_TOKENS_FILE
    p = sub.add_parser("token", help="issue, list or remove users' tokens (tracker admin)",
                       epilog="example: tether token add alice   (then: tether tracker "
                              "--require-tokens)")
    p.add_argument("action", choices=["add", "list", "remove"])
    p.add_argument("name", nargs="?", help="who the token is for (add, remove)")
    p.add_argument("--tokens", default=DEFAULT_TOKENS_FILE, metavar="FILE",
                   help=f"the tracker's token file (default {DEFAULT_TOKENS_FILE})")
    p.set_defaults(func=cmd_token)

    p = sub.add_parser("compile", help="cross-compile an ONNX model to a module .so",
                       epilog="example: tether compile model.onnx --target rasp4b64 -o net.so")
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--target", default="host",
                   help="preset (host, rasp3b, rasp4b, rasp4b64, rasp5, android-arm64, "
                        "android-armv7) or triple[/cpu[/features]]")
    p.add_argument("-o", "--output", help="output .so (default: MODEL.so)")
    from remote.cli.modelfile import add_dynamic_argument, add_precision_argument
    add_precision_argument(p)
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an input's unknown dimensions")
    add_dynamic_argument(p)
    p.add_argument("--no-tuning", action="store_true",
                   help="use the default register tiles, not those `tether tune` cached")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("quantize", help="quantize an fp32 ONNX model to int8 (QDQ), ready to compile",
                       epilog="examples:\n"
                              "  tether quantize model.onnx --calibrate samples/ -o model_int8.onnx\n"
                              "  tether quantize model.onnx --random 8 -o model_int8.onnx",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="fp32 ONNX model file")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--calibrate", metavar="DIR",
                      help="folder of calibration samples: one .npy per sample (one input) or .npz "
                           "with an array per input name")
    data.add_argument("--random", type=int, metavar="N",
                      help="calibrate on N random normal samples (to try speed; real data gives accuracy)")
    p.add_argument("-o", "--output", required=True, help="the int8 ONNX model to write")
    p.add_argument("--per-tensor", action="store_true", help="one weight scale per tensor, not per channel")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("ops", help="list the ONNX ops the compiler supports",
                       epilog="example: tether ops --markdown")
    p.add_argument("--markdown", action="store_true", help="as a Markdown table")
    p.add_argument("--update-doc", metavar="FILE",
                   help="rewrite the generated table in FILE (docs/operators.md)")
    p.set_defaults(func=cmd_ops)

    from remote.cli import bench, run, tune
    p = sub.add_parser(
        "bench", help="time a model on one or many boards of a key",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  tether bench model.onnx --target rasp4b64 --key rasp4b64 --devices all "
               "--json run.json\n"
               "  tether bench net.so --key rasp4b64 --repeat 20 --min-repeat-ms 200 "
               "--vs run.json --plot latency.png")
    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)

    from remote.cli import check, history
    p = sub.add_parser(
        "check", help="compare a board's outputs with a reference run on this host",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  tether check model.onnx --key rasp4b64 --random 8\n"
               "  tether check model.onnx --key rasp4b64 --module net.so --inputs images/ "
               "--label commit=abc123")
    check.add_arguments(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "history", help="a model's benchmarks on each key over time, from the farm database",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  tether history model.onnx --key rasp4b64\n"
               "  tether history model.onnx --label branch=main --plot trend.png\n"
               "  tether history --json")
    history.add_arguments(p)
    p.set_defaults(func=cmd_history)

    p = sub.add_parser(
        "tune", help="find each convolution's fastest register tile on a board and cache it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  tether tune model.onnx --target rasp4b64 --key rasp4b64\n"
               "  tether tune model.onnx --target host --number 5 --repeat 3 --force")
    tune.add_arguments(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser(
        "run", help="run a model once on a board and print its outputs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  tether run model.onnx --target rasp4b64 --key rasp4b64 --random --top-k 5\n"
               "  tether run net.so --key rasp4b64 --input image.npy")
    run.add_arguments(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("emulate", help="run an emulated ARM board (qemu, Debian's own Python)",
                       epilog="example: tether emulate --arch arm64 --release bookworm "
                              "--tracker 127.0.0.1:9190 --key rasp4b64")
    from deploy_recipes.cli import add_emulate_arguments
    add_emulate_arguments(p)
    p.set_defaults(func=cmd_emulate)

    p = sub.add_parser("bootstrap", help="install and start the device server on a board over SSH",
                       epilog="example: tether bootstrap pi@192.168.1.20 --tracker farm.local:9190 "
                              "--key rasp4b64 --install-deps")
    from deploy_recipes.cli import add_bootstrap_arguments
    add_bootstrap_arguments(p)
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser("adb", help="start the native server on an Android phone over adb",
                       epilog="example: tether adb --tracker 127.0.0.1:9190 --key android-arm64 "
                              "--reverse")
    from deploy_recipes.cli import add_adb_arguments
    add_adb_arguments(p)
    p.set_defaults(func=cmd_adb)

    p = sub.add_parser("native", help="build the C++ board server for boards without Python",
                       epilog="example: tether native build --target rasp4b64")
    from remote.cli.native import add_arguments as add_native_arguments
    add_native_arguments(p)
    p.set_defaults(func=cmd_native)

    p = sub.add_parser("demo", help="run one model end to end on a local farm",
                       epilog="example: tether demo")
    p.add_argument("--key", default="local", help="device key of the local board")
    p.add_argument("--runs", type=int, default=20, help="timed runs on the device")
    p.set_defaults(func=cmd_demo)
    return parser


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM ends a command the way Ctrl-C does, so that it stops what it started and
    removes its temporary folders (the tracker and server daemons set their own handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> int:
    from remote.lifecycle import flush_each_line
    flush_each_line()
    args = build_parser().parse_args(argv)
    try:
        with _sigterm_as_interrupt():
            return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for people, the traceback with --debug
        if args.debug or not _is_user_error(exc):
            traceback.print_exc()
        if not args.debug:
            print(f"tether {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _is_user_error(exc: Exception) -> bool:
    from remote.errors import TetherError
    if isinstance(exc, (TetherError, FileNotFoundError, ValueError, OSError)):
        return True
    try:
        from crosscompile import BuildError
    except ImportError:
        return False
    return isinstance(exc, BuildError)
