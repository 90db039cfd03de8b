"""The ONNX backend node tests shipped in the onnx package, run through
crosscompile on the host: the node cases (generated in memory by
onnx.backend.test.case.node, since wheels do not ship their data files) and
the pytorch-converted and pytorch-operator directories, 2,001 cases with
onnx 1.23.

Every case ends in one of four states: it passes, it is refused with a named
reason (a BuildError: an op, a dtype or a domain crosscompile does not take),
it computes a wrong result (mismatch), or something else fails (crash).
Inputs an op needs at compile time (shapes, axes, pads) and every input of
the ops evaluated at compile time, and the graph inputs such values are
computed from, are given to the compiler as constants: crosscompile
specialises a module on them, as it does for an exporter's initializers.
Every other input stays a runtime input.

A case is in scope when every op in its model is one crosscompile supports
and its floating-point tensors are float32; tests/test_onnx_node_suite.py
runs a few of those per op by default, and every case with --node-suite.

    python -m tests.onnx_node_suite                  # every case: counts, refusals by reason
    python -m tests.onnx_node_suite --op Trilu       # the cases of one op
    python -m tests.onnx_node_suite --shard 1/2 --log a.jsonl &   # a sweep in two processes
    python -m tests.onnx_node_suite --shard 2/2 --log b.jsonl
    python -m tests.onnx_node_suite --board native-aarch64   # on an emulated arm64 board

With --board the cases are compiled for that board's preset (BOARDS) and
run on a real native board server under qemu-user, one session per case,
instead of on this host.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
SUITES = ("pytorch-converted", "pytorch-operator")
# --board: a server of tests/board_servers' emulated kinds, and the preset
# its cases are compiled for (the board that server stands for).
BOARDS = {"native-aarch64": "rasp4b64", "native-armv7": "rasp4b"}


@dataclass
class Case:
    suite: str
    name: str
    ops: list
    path: str = ""       # model.onnx of a directory case
    generated: object = None  # an onnx.backend.test.case TestCase

    def load(self):
        """(model, inputs, expected outputs) of the first data set."""
        if self.generated is not None:
            inputs, outputs = self.generated.data_sets[0]
            model = onnx.ModelProto()
            model.CopyFrom(self.generated.model)
            return model, [_plain(v) for v in inputs], [_plain(v) for v in outputs]
        return (onnx.load(self.path), *_load_data(os.path.dirname(self.path)))


@dataclass
class Result:
    case: Case
    status: str  # "pass", "mismatch", "refused" (a BuildError), "crash"
    detail: str = ""

    @property
    def reason(self) -> str:
        """What a refusal is for, grouped across cases: the op types, the
        dtype or the first words of the message."""
        if self.status != "refused":
            return ""
        if self.detail.startswith("unsupported op"):
            return "unsupported op " + ", ".join(self.unsupported_ops)
        found = re.search(r"dtype (\w+)", self.detail)
        if found:
            return f"dtype {found.group(1)}"
        return re.sub(r"^node '[^']*' ", "", self.detail)[:70]

    @property
    def unsupported_ops(self) -> list:
        """The op types an UnsupportedOpError named."""
        if self.status != "refused" or not self.detail.startswith("unsupported op"):
            return []
        return re.findall(r"'([^']+)' \(\d+ nodes?:", self.detail)


def supported_op_types() -> set:
    from crosscompile.frontend import supported_ops
    return set(supported_ops())


def discover(everything: bool = False, op_type: "str | None" = None) -> list:
    """The cases whose ops are all supported and whose float tensors are
    float32, or with everything=True all of them; with op_type only the
    node cases of that op (onnx generates no others then, which is quicker)."""
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    supported = supported_op_types()
    cases = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generated = collect_testcases(op_type)
    for case in generated:
        model = case.model
        ops = sorted({n.op_type for n in model.graph.node})
        if everything or (ops and all(n.domain in ("", "ai.onnx") for n in model.graph.node)
                          and set(ops) <= supported and _float32_io(model)):
            cases.append(Case("node", case.name, ops, generated=case))
    for suite in SUITES if op_type is None else ():
        for path in sorted(glob.glob(os.path.join(DATA, suite, "*", "model.onnx"))):
            model = onnx.load(path, load_external_data=False)
            ops = sorted({n.op_type for n in model.graph.node})
            if everything:
                cases.append(Case(suite, os.path.basename(os.path.dirname(path)), ops, path=path))
                continue
            if not ops or any(n.domain not in ("", "ai.onnx") for n in model.graph.node):
                continue
            if not set(ops) <= supported or not _float32_io(model):
                continue
            cases.append(Case(suite, os.path.basename(os.path.dirname(path)), ops, path=path))
    return cases


# Model output dtypes a module can have (crosscompile.frontend.SUPPORTED_DTYPES).
OUTPUT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL,
                onnx.TensorProto.INT16, onnx.TensorProto.INT8, onnx.TensorProto.UINT64, onnx.TensorProto.UINT32,
                onnx.TensorProto.UINT16, onnx.TensorProto.UINT8,
                # the low-bit types (crosscompile.lowbit)
                onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2,
                onnx.TensorProto.FLOAT8E5M2FNUZ, onnx.TensorProto.FLOAT8E8M0, onnx.TensorProto.FLOAT4E2M1,
                onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.INT2, onnx.TensorProto.UINT2}
RUNTIME_DTYPES = {np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.bool_)}


def _float32_io(model) -> bool:
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
              onnx.TensorProto.BFLOAT16}
    io = list(model.graph.input) + list(model.graph.output)
    kinds = [vi.type.tensor_type.elem_type for vi in io]
    if not all(vi.type.HasField("tensor_type") for vi in io):
        return False
    out_kinds = [vi.type.tensor_type.elem_type for vi in model.graph.output]
    return (all(k in OUTPUT_TYPES for k in out_kinds)
            and all(k == onnx.TensorProto.FLOAT or k not in floats for k in kinds))


def _plain(value):
    """value as an array, or None for a sequence, map or optional (which
    no module takes). Some cases give their data as TensorProtos (those of
    types numpy lacks, and the float16 ones next to them)."""
    if isinstance(value, (list, tuple, dict)) or value is None:
        return None
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def _load_data(case_dir: str):
    data_dir = os.path.join(case_dir, "test_data_set_0")
    inputs = [numpy_helper.to_array(_read(p)) for p in sorted(glob.glob(os.path.join(data_dir, "input_*.pb")))]
    outputs = [numpy_helper.to_array(_read(p)) for p in sorted(glob.glob(os.path.join(data_dir, "output_*.pb")))]
    return inputs, outputs


def _read(path):
    tensor = onnx.TensorProto()
    with open(path, "rb") as f:
        tensor.ParseFromString(f.read())
    return tensor


# Cases whose expected data (from the ONNX reference) onnxruntime, which
# compiled modules follow, does not reproduce: they are checked against
# onnxruntime instead.
ONNXRUNTIME_DIFFERS = {
    # align_corners with a scale that gives no whole length: onnxruntime (and
    # torch) divide by the rounded length, the reference by in_size * scale.
    "test_resize_downsample_scales_linear_align_corners",
    "test_resize_downsample_scales_cubic_align_corners",
}


# Cases whose expected outputs are numpy's float32 FFTs: where the exact
# value is 0 they hold numpy's rounding (1.9e-7), above the cases' atol of
# 1e-7, so no exact result can pass (onnxruntime's fails by 2e-5). They
# are compared within float32's resolution at the outputs' scale: atol is
# 4 units in the last place of the largest expected value.
FLOAT32_TRANSFORMS = {"test_dft_inverse", "test_dft_inverse_opset19"}


# One unit in the last place of each narrow float type, relative.
NARROW_RTOL = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def run_case(case: Case, workdir: str, rtol=1e-4, atol=1e-5, target: str = "host", run_module=None) -> Result:
    """Compile and run one case. Generated cases carry their own tolerance
    (some expected outputs are rounded to 4 decimals); directory cases use
    rtol/atol. The module is compiled for target and run by
    run_module(path, feeds) -> outputs (by default loaded here with minirt)."""
    import crosscompile
    import minirt
    from crosscompile.frontend import compile_time_inputs
    from crosscompile.lowbit import LOW_BIT_DTYPES

    model, inputs, expected = case.load()
    if case.generated is not None:
        rtol, atol = max(rtol, case.generated.rtol), case.generated.atol
    if case.name in FLOAT32_TRANSFORMS:
        atol = max(atol, 4 * float(np.finfo(np.float32).eps) * max(float(np.abs(w).max()) for w in expected))
    # Inputs an op needs at compile time (Clip's bounds, Pad's value).
    compile_time = {name for node in model.graph.node for name in compile_time_inputs(node)}
    compile_time = _computed_from(model.graph, compile_time)
    graph_inputs = [vi for vi in model.graph.input if vi.name not in {i.name for i in model.graph.initializer}]
    feeds = {}
    for vi, value in zip(graph_inputs, inputs):
        if value is None:
            return Result(case, "refused", f"input {vi.name!r} is not a plain tensor: dtype sequence "
                          "(or an optional or map)")
        if value.dtype == object:
            return Result(case, "refused", f"input {vi.name!r} is not a plain tensor: dtype string")
        if vi.name in compile_time:
            model.graph.initializer.append(numpy_helper.from_array(value, vi.name))
        else:
            feeds[vi.name] = value
    kept = [vi for vi in model.graph.input if vi.name not in {i.name for i in model.graph.initializer}]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    try:
        lib = crosscompile.build(model, target, input_shapes={n: v.shape for n, v in feeds.items()})
    except crosscompile.BuildError as exc:
        return Result(case, "refused", str(exc).splitlines()[0][:300])
    except Exception as exc:  # noqa: BLE001 - any other exception is a compiler bug
        return Result(case, "crash", f"{type(exc).__name__}: {exc}"[:300])
    try:
        path = lib.export_library(os.path.join(workdir, f"{case.name}.so"))
        got = run_module(path, feeds) if run_module else minirt.load(path).run(feeds)
        if case.name in ONNXRUNTIME_DIFFERS:
            from tests.onnx_models import reference
            expected = reference(model, feeds)
        if len(got) != len(expected):
            return Result(case, "mismatch", f"{len(got)} outputs, expected {len(expected)}")
        for i, (g, w) in enumerate(zip(got, expected)):
            if w is None:
                return Result(case, "mismatch", f"output {i}: a tensor, expected a sequence")
            if g.shape != w.shape or g.dtype != w.dtype:
                return Result(case, "mismatch", f"output {i}: {g.dtype}{g.shape}, expected {w.dtype}{w.shape}")
            if w.dtype.name in LOW_BIT_DTYPES:  # one of the few values of the type: exactly that one
                if not np.array_equal(g.astype(np.float32), w.astype(np.float32), equal_nan=True):
                    return Result(case, "mismatch", f"output {i}: {g.reshape(-1)[:8]}..., expected {w.reshape(-1)[:8]}...")
                continue
            # float16 and bfloat16 results within one unit of their last
            # place: the reference rounds intermediate values to the type in
            # an order of its own, which float32 arithmetic rounded per op
            # does not always follow to the last bit.
            rtol_here = max(rtol, NARROW_RTOL.get(w.dtype.name, 0.0))
            if not np.allclose(g.astype(np.float32) if w.dtype.name in NARROW_RTOL else g,
                               w.astype(np.float32) if w.dtype.name in NARROW_RTOL else w,
                               rtol=rtol_here, atol=atol, equal_nan=True):
                err = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
                return Result(case, "mismatch", f"output {i}: max abs error {err:g}")
    except Exception as exc:  # noqa: BLE001 - a module that fails to load or run
        return Result(case, "crash", f"{type(exc).__name__}: {exc}"[:300])
    return Result(case, "pass")


def _computed_from(graph, names: set) -> set:
    """names and every tensor they are computed from, up to the graph's
    inputs: an input that a compile-time value is computed from (a window's
    size, through the Cast and Sub of its expanded body, to Range) is needed
    at compile time too. Shape and Size read only their input's shape, so
    the search stops there."""
    from crosscompile.folding import SHAPE_OPS

    names = set(names)
    for node in reversed(graph.node):  # a graph's nodes come in topological order
        if node.op_type not in SHAPE_OPS and names.intersection(node.output):
            names.update(n for n in node.input if n)
    return names


def board_runner(port: int):
    """run_module for run_case: a session with the board server on loopback
    port uploads the module, loads it and runs it; outputs as numpy arrays."""
    def run_module(path, feeds):
        from remote import rpc
        name = os.path.basename(path)
        with rpc.connect("127.0.0.1", port) as sess:
            sess.upload(path, target=name)
            return sess.load_module(name).run(feeds, timeout=240)
    return run_module


@contextlib.contextmanager
def board_server(kind: str, folder: str):
    """A real board server of kind (BOARDS) started on loopback, stopped on exit."""
    from remote.cli.localfarm import Child
    from tests import board_servers
    try:
        argv = board_servers.command(kind)
    except BaseException as exc:  # pytest's skip: qemu-user or the server's build is missing
        raise SystemExit(f"cannot start a {kind} board server: {exc}") from None
    workspaces = os.path.join(folder, "workspaces")
    os.makedirs(workspaces, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = Child(kind, [*argv, "--host", "127.0.0.1", "--port", "0", "--workspace-dir", workspaces], folder,
                  {**os.environ, "PYTHONPATH": root})
    try:
        yield child
    finally:
        child.stop()


def _fork_case(case: Case, workdir: str, target: str, run_module) -> tuple:
    """run_case in a forked child, its result pickled down a pipe: (pid, read end)."""
    import pickle

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one case, its result pickled down the pipe
        os.close(read_end)
        try:
            result = run_case(case, workdir, target=target, run_module=run_module)
            payload = pickle.dumps((result.status, result.detail))
        except BaseException as exc:  # noqa: BLE001 - reported as a crash by the parent
            payload = pickle.dumps(("crash", f"{type(exc).__name__}: {exc}"[:300]))
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    return pid, read_end


def _case_result(case: Case, pid: int, chunks: list, timed_out: float = 0.0) -> Result:
    """The Result of a forked case from what its pipe gave, once it has ended
    (or, with timed_out, been killed after that many seconds)."""
    import pickle
    import signal

    if timed_out:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return Result(case, "crash", f"no result within {timed_out:g} s")
    _, status = os.waitpid(pid, 0)
    if not chunks:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        return Result(case, "crash", f"the process running it ended with {how}")
    status_name, detail = pickle.loads(b"".join(chunks))
    return Result(case, status_name, detail)


def run_isolated_many(cases, workdir: str, jobs: int = 1, timeout: float = 300.0, target: str = "host",
                      run_module=None, progress=None) -> list:
    """run_case of each case in a forked child, up to jobs at once, so that a
    module which kills its process (a segfault) or never ends is counted as
    a crash and the sweep goes on. The Results come in the cases' order."""
    import select
    import time

    results = [None] * len(cases)
    waiting = list(enumerate(cases))[::-1]
    running = {}  # read end -> (index, pid, chunks, deadline)
    done = 0
    while waiting or running:
        while waiting and len(running) < jobs:
            index, case = waiting.pop()
            pid, fd = _fork_case(case, workdir, target, run_module)
            running[fd] = (index, pid, [], time.monotonic() + timeout)
        left = min(deadline for *_, deadline in running.values()) - time.monotonic()
        ready = select.select(list(running), [], [], max(left, 0))[0]
        now = time.monotonic()
        for fd in list(running):
            index, pid, chunks, deadline = running[fd]
            if fd in ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    chunks.append(chunk)
                    continue
            elif now < deadline:
                continue
            os.close(fd)
            del running[fd]
            results[index] = _case_result(cases[index], pid, chunks, 0.0 if fd in ready else timeout)
            done += 1
            if progress:
                progress(done, len(cases), results[index])
    return results


def run_isolated(case: Case, workdir: str, timeout: float = 300.0, target: str = "host",
                 run_module=None) -> Result:
    """run_case of one case in a forked child (see run_isolated_many)."""
    return run_isolated_many([case], workdir, timeout=timeout, target=target, run_module=run_module)[0]


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_all(cases=None, progress=None, board: "str | None" = None, jobs: "int | None" = None) -> list:
    """Every case's Result, on this host, or with board (a kind of BOARDS)
    compiled for its preset and run on that board server. On the host, jobs
    cases (default: the usable cores) run at once; on a board one at a time."""
    import crosscompile  # noqa: F401 - imported once, before the children fork
    import minirt  # noqa: F401

    cases = discover() if cases is None else cases
    with tempfile.TemporaryDirectory(prefix="tether-node-") as tmp, contextlib.ExitStack() as stack:
        target, run_module = "host", None
        if board is not None:
            server = stack.enter_context(board_server(board, tmp))
            target, run_module, jobs = BOARDS[board], board_runner(server.port), 1
        return run_isolated_many(cases, tmp, jobs=jobs or usable_cores(), target=target,
                                 run_module=run_module, progress=progress)


def per_op(results) -> dict:
    """op -> {status: count}; a case counts for every op in its model."""
    table = defaultdict(lambda: defaultdict(int))
    for r in results:
        for op in r.case.ops:
            table[op][r.status] += 1
    return table


def report(results, out=sys.stdout, per_op_table=False) -> dict:
    """Print the counts out of the total, the refusals grouped by reason
    (most common first) and every mismatch and crash; return the counts."""
    counts = defaultdict(int)
    for r in results:
        counts[r.status] += 1
    if per_op_table:
        table = per_op(results)
        print(f"{'op':22} {'pass':>5} {'refused':>7} {'mismatch':>9} {'crash':>6}", file=out)
        for op in sorted(table):
            row = table[op]
            print(f"{op:22} {row['pass']:5} {row['refused']:7} {row['mismatch']:9} {row['crash']:6}", file=out)
    reasons = defaultdict(int)
    for r in results:
        if r.status == "refused":
            reasons[r.reason] += 1
    print("refusals by reason:", file=out)
    for reason, n in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        print(f"  {n:5}  {reason}", file=out)
    missing = defaultdict(int)
    for r in results:
        for op in r.unsupported_ops:
            missing[op] += 1
    print("unsupported ops by the number of cases refused for them:", file=out)
    for op, n in sorted(missing.items(), key=lambda item: (-item[1], item[0])):
        print(f"  {n:5}  {op}", file=out)
    for r in results:
        if r.status in ("mismatch", "crash"):
            print(f"  {r.status:8} {r.case.suite}/{r.case.name}: {r.detail}", file=out)
    print(f"total: {len(results)} cases: pass {counts['pass']}, refused {counts['refused']}, "
          f"mismatch {counts['mismatch']}, crash {counts['crash']}", file=out)
    return dict(counts)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m tests.onnx_node_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-scope", action="store_true",
                        help="only the cases whose ops crosscompile supports (what the test runs)")
    parser.add_argument("--op", action="append", default=[], metavar="OP_TYPE",
                        help="only the cases using this op (repeatable)")
    parser.add_argument("--per-op", action="store_true", help="also print the counts per op")
    parser.add_argument("--json", metavar="FILE", help="also write every case's result to FILE")
    parser.add_argument("--log", metavar="FILE",
                        help="append each case's result to FILE as one JSON line as soon as it is known")
    parser.add_argument("--shard", metavar="I/N", default="1/1",
                        help="run only every N-th case starting at the I-th (to split a sweep between processes)")
    parser.add_argument("--board", choices=sorted(BOARDS),
                        help="compile for the board's preset and run every case on that board server, "
                             "under qemu-user (default: on this host)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="cases run at once on the host (default: the usable cores; on a board, one)")
    args = parser.parse_args(argv)
    cases = discover(everything=not args.in_scope, op_type=args.op[0] if len(args.op) == 1 else None)
    if args.op:
        cases = [c for c in cases if set(args.op) & set(c.ops)]
    index, count = (int(part) for part in args.shard.split("/"))
    cases = cases[index - 1::count]
    tty = sys.stderr.isatty()

    def progress(number, total, result):
        if args.log:
            import json
            with open(args.log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"suite": result.case.suite, "name": result.case.name, "ops": result.case.ops,
                                    "status": result.status, "detail": result.detail}) + "\n")
        if tty:
            print(f"\r{number}/{total} {result.case.name[:60]:60}", end="", file=sys.stderr, flush=True)
    results = run_all(cases, progress, board=args.board, jobs=args.jobs)
    if tty:
        print(file=sys.stderr)
    counts = report(results, per_op_table=args.per_op)
    if args.json:
        import json
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{"suite": r.case.suite, "name": r.case.name, "ops": r.case.ops, "status": r.status,
                        "detail": r.detail} for r in results], f, indent=1)
    return 0 if not counts.get("mismatch") and not counts.get("crash") else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
