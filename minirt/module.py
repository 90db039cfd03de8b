"""Loading a compiled module (docs/module-abi.md) with ctypes and running it."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import queue
import threading
import time
from typing import NamedTuple

import numpy as np

from . import elf
from .errors import InputError, ModuleLoadError, ProfilingUnsupported, RunError

ABI_VERSION = 1
# Threads tether_run_parallel takes at most (docs/module-abi.md).
MAX_THREADS = 255
WORKSPACE_ALIGNMENT = 64
# tether_run return codes (docs/module-abi.md).
RUN_ERRORS = {1: "a required pointer was NULL", 2: "a dynamic dimension's size is outside its range"}
# void mark(void *ctx, int32_t step), called by tether_run_profiled.
MARK_FUNCTION = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)


class TensorSpec(NamedTuple):
    name: str
    shape: tuple  # a dynamic module's at the upper bound
    dtype: str
    dynamic_axes: tuple = ()  # the axes that hold the module's dynamic dimension
    # (axis, workspace byte offset of the int64 size) of an output whose size
    # along that axis depends on the data; shape holds the upper bound.
    count: "tuple | None" = None


def load(path: str | os.PathLike, threads: int | None = None) -> Module:
    """Load a compiled module built for this machine.

    threads: how many threads run() spreads the work over (default: the
    machine's cores); modules without tether_run_parallel run on one.

    >>> m = minirt.load("net.so", threads=2)  # doctest: +SKIP
    >>> m.run({"input": x})[0].shape          # doctest: +SKIP
    (1, 10)
    """
    path = os.path.abspath(os.fspath(path))
    _check_elf(path)
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError as exc:
        raise ModuleLoadError(f"cannot load {path}: {exc}") from None
    try:
        abi_version = lib.tether_abi_version
        metadata_fn = lib.tether_metadata
        run_fn = lib.tether_run
    except AttributeError as exc:
        raise ModuleLoadError(f"{path} is not a Tether module: {exc}") from None
    abi_version.restype = ctypes.c_int32
    abi_version.argtypes = []
    version = abi_version()
    if version != ABI_VERSION:
        raise ModuleLoadError(f"{path} uses module ABI version {version}, but this minirt supports "
                              f"version {ABI_VERSION}; rebuild the module with a matching crosscompile")
    metadata_fn.restype = ctypes.c_char_p
    metadata_fn.argtypes = []
    try:
        metadata = json.loads(metadata_fn().decode("utf-8"))
    except ValueError as exc:
        raise ModuleLoadError(f"{path} has unreadable metadata: {exc}") from None
    run_fn.restype = ctypes.c_int32
    run_fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    # Optional (docs/module-abi.md); modules from before it run on one thread.
    parallel_fn = getattr(lib, "tether_run_parallel", None)
    if parallel_fn is not None:
        parallel_fn.restype = ctypes.c_int32
        parallel_fn.argtypes = run_fn.argtypes + [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]
    profiled_fn = getattr(lib, "tether_run_profiled", None)  # optional as well
    if profiled_fn is not None:
        profiled_fn.restype = ctypes.c_int32
        profiled_fn.argtypes = run_fn.argtypes + [MARK_FUNCTION, ctypes.c_void_p]
    # Modules with a dynamic dimension (metadata "dynamic") take its size here.
    dims_fns = []
    for name, base in (("tether_run_dims", run_fn), ("tether_run_parallel_dims", parallel_fn)):
        fn = getattr(lib, name, None) if base is not None else None
        if fn is not None:
            fn.restype = ctypes.c_int32
            fn.argtypes = base.argtypes[:3] + [ctypes.POINTER(ctypes.c_int64)] + base.argtypes[3:]
        dims_fns.append(fn)
    if metadata.get("dynamic") and dims_fns[0] is None:
        raise ModuleLoadError(f"{path} declares a dynamic dimension but exports no tether_run_dims; "
                              "rebuild it with a matching crosscompile")
    _check_counts(path, metadata)
    module = Module(path, lib, run_fn, metadata, parallel_fn, profiled_fn, *dims_fns)
    module.set_threads(threads)
    return module


def _check_counts(path: str, metadata: dict) -> None:
    """Each output's "count" (docs/module-abi.md) names one of its axes and
    an aligned int64 inside the workspace; ModuleLoadError otherwise."""
    for entry in metadata.get("outputs", ()):
        count = entry.get("count")
        if count is None:
            continue
        try:
            axis, offset = int(count["axis"]), int(count["offset"])
            valid = (0 <= axis < len(entry["shape"]) and offset % 8 == 0
                     and 0 <= offset <= int(metadata["workspace_bytes"]) - 8)
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise ModuleLoadError(f"{path} has unreadable metadata: output {entry.get('name')!r} has a count "
                                  f"{count!r} that is not {{axis, offset}} of one of its axes and an aligned "
                                  "offset inside the workspace; rebuild it with crosscompile")


def _check_elf(path: str) -> None:
    try:
        header = elf.read_header(path)
    except OSError as exc:
        raise ModuleLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    if header is None or header.file_type != elf.ET_DYN:
        raise ModuleLoadError(f"{path} is not an ELF shared object; expected a module "
                              "written by crosscompile's export_library()")
    host = elf.host_machine()
    if host is not None and (header.machine, header.bits) != host:
        this = elf.MACHINES.get(host[0], platform.machine())
        raise ModuleLoadError(
            f"{path} is a {header.bits}-bit {header.machine_name} module, but this machine "
            f"runs {host[1]}-bit {this} code (platform.machine() = {platform.machine()!r}); "
            "build it for this board's target")
    need, size = elf.file_extent(path)
    if need > size:
        raise ModuleLoadError(f"{path} is truncated: its headers describe {need} bytes, the file "
                              f"has {size}; upload it again (or rebuild it)")
    float_abi = elf.running_float_abi()
    module_abi = header.flags & (elf.EF_ARM_ABI_FLOAT_SOFT | elf.EF_ARM_ABI_FLOAT_HARD)
    if header.machine == 40 and float_abi and module_abi and module_abi != float_abi:
        names = {elf.EF_ARM_ABI_FLOAT_SOFT: "soft-float", elf.EF_ARM_ABI_FLOAT_HARD: "hard-float"}
        raise ModuleLoadError(f"{path} is a {names[module_abi]} ARM module, but this Python is "
                              f"{names[float_abi]}; build it for this board's target")


class Module:
    """A loaded module. run() is thread-safe: each concurrent call gets its
    own workspace, and idle workspaces are kept for reuse.

    With threads > 1 (set_threads) a run spreads its large ops over that
    many threads through the module's tether_run_parallel; while one run
    uses the threads, a concurrent run() goes single-threaded.

    A module compiled with a dynamic dimension (crosscompile.build(...,
    dynamic={"batch": (1, 16)})) lists it and its bounds in `dynamic`
    ({"batch": (1, 16)}); the axes of its inputs and outputs that hold it
    are their specs' dynamic_axes, their shapes give the upper bound, and
    run() takes any size within the bounds (the same on every such axis)."""

    def __init__(self, path: str, lib: ctypes.CDLL, run_fn, metadata: dict, parallel_fn=None,
                 profiled_fn=None, dims_fn=None, parallel_dims_fn=None):
        self.path = path
        self.metadata = metadata
        self.inputs = [_spec(t) for t in metadata["inputs"]]
        self.outputs = [_spec(t) for t in metadata["outputs"]]
        # Whether any output's size depends on the data (cut after each run).
        self._any_counted = any(spec.count is not None for spec in self.outputs)
        self._lib = lib  # keeps the shared object loaded while run_fn is in use
        self._run = run_fn
        self._workspace_bytes = int(metadata["workspace_bytes"])
        self._idle_workspaces = [self._new_workspace()]
        self._parallel = parallel_fn
        self._profiled = profiled_fn
        self._run_dims = dims_fn
        self._parallel_dims = parallel_dims_fn
        self.dynamic = {d["name"]: (int(d["min"]), int(d["max"])) for d in metadata.get("dynamic") or ()}
        self._pool: "_ThreadPool | None" = None
        self._pool_lock = threading.Lock()
        self.threads = 1

    def set_threads(self, threads: int | None = None) -> None:
        """Use `threads` threads per run (None: one per core). A module
        without tether_run_parallel always runs on one thread."""
        if threads is None:
            threads = os.cpu_count() or 1
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise InputError(f"threads must be a positive integer, got {threads!r}")
        if threads > MAX_THREADS:
            raise InputError(f"threads must be at most {MAX_THREADS} (the module's barrier counts no "
                             f"more), got {threads}")
        self.threads = threads if self._parallel is not None else 1
        with self._pool_lock:
            if self._pool is not None and self._pool.size != self.threads:
                self._pool.close()
                self._pool = None

    def __repr__(self) -> str:
        return f"<minirt.Module {self.metadata.get('name')!r} from {self.path}>"

    def run(self, inputs) -> list:
        """Run the module on a dict {name: array} or a list in input order;
        returns one numpy array per output."""
        arrays = self._check_inputs(inputs)
        outputs = self._new_outputs(arrays)
        in_ptrs = (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
        out_ptrs = (ctypes.c_void_p * max(len(outputs), 1))(*[a.ctypes.data for a in outputs])
        try:
            workspace = self._idle_workspaces.pop()
        except IndexError:
            workspace = self._new_workspace()
        try:
            status = self._call(in_ptrs, out_ptrs, _aligned_address(workspace), self._dims(arrays))
            if status == 0 and self._any_counted:
                outputs = self._counted(outputs, workspace)
        finally:
            self._idle_workspaces.append(workspace)
        if status != 0:
            reason = RUN_ERRORS.get(status, "unknown error code")
            raise RunError(f"{self.path}: tether_run returned {status} ({reason})")
        return outputs

    def _counted(self, outputs: list, workspace: np.ndarray) -> list:
        """The outputs cut to the sizes the run left in the workspace, for
        outputs whose size depends on the data (docs/module-abi.md, "count")."""
        start = _aligned_address(workspace) - workspace.ctypes.data
        cut = []
        for spec, array in zip(self.outputs, outputs):
            if spec.count is None:
                cut.append(array)
                continue
            axis, offset = spec.count
            size = int(workspace[start + offset:start + offset + 8].view(np.int64)[0])
            if not 0 <= size <= array.shape[axis]:
                raise RunError(f"{self.path}: output {spec.name!r} reports {size} entries along axis {axis}, "
                               f"outside 0..{array.shape[axis]}; the module is damaged, rebuild it")
            cut.append(np.ascontiguousarray(array[(slice(None),) * axis + (slice(0, size),)]))
        return cut

    def profile(self, inputs=None, number: int = 10) -> list:
        """Time each step (kernel call) of a single-threaded run, averaged
        over ``number`` runs after one warm-up run. Inputs default to zeros.

        Returns one dict per step in run order: ``op``, ``name``, ``fused``
        (ops merged into the step), ``inputs`` and ``outputs`` (shapes),
        ``mean_s`` and ``share`` (of the sum over all steps). Each time
        includes the few microseconds of the Python callback that marks it.

        >>> rows = m.profile({"input": x}, number=20)  # doctest: +SKIP
        >>> max(rows, key=lambda r: r["mean_s"])["op"]  # doctest: +SKIP
        'Conv'
        """
        if self._profiled is None:
            raise ProfilingUnsupported(
                f"{self.path} has no tether_run_profiled, so it cannot be profiled per layer; "
                "rebuild it with this crosscompile")
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise InputError(f"number must be a positive integer, got {number!r}")
        if inputs is None:
            inputs = {spec.name: np.zeros(spec.shape, dtype=numpy_dtype(spec.dtype)) for spec in self.inputs}
        arrays = self._check_inputs(inputs)
        size = self._size(arrays)
        for name, (_, high) in self.dynamic.items():
            if size != high:
                raise InputError(f"profiling runs this module at its upper bound {name} {high}; pass inputs "
                                 f"of that size (got {size})")
        outputs = self._new_outputs(arrays)
        in_ptrs = (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
        out_ptrs = (ctypes.c_void_p * max(len(outputs), 1))(*[a.ctypes.data for a in outputs])
        workspace = self._new_workspace()
        clock = time.perf_counter
        marks: list = []

        def mark(ctx, step):
            marks.append((step, clock()))

        callback = MARK_FUNCTION(mark)  # must outlive the calls below
        totals: list = []
        for run in range(number + 1):  # run 0 warms caches and pages in the parameters
            del marks[:]
            status = self._profiled(in_ptrs, out_ptrs, _aligned_address(workspace), callback, None)
            if status != 0:
                reason = RUN_ERRORS.get(status, "unknown error code")
                raise RunError(f"{self.path}: tether_run_profiled returned {status} ({reason})")
            if [s for s, _ in marks] != list(range(len(marks))) or not marks:
                raise RunError(f"{self.path}: tether_run_profiled marked steps "
                               f"{[s for s, _ in marks]}, expected 0, 1, 2, ... in order")
            if run:
                times = [b - a for (_, a), (_, b) in zip(marks, marks[1:])]
                totals = times if not totals else [t + u for t, u in zip(totals, times)]
        steps = self.metadata.get("steps") or []
        if len(steps) != len(totals):  # metadata from another build: describe by number only
            steps = [{"op": "?", "name": f"step {i}"} for i in range(len(totals))]
        whole = sum(totals) or 1.0
        rows = []
        for step, total in zip(steps, totals):
            rows.append({"op": step.get("op", "?"), "name": step.get("name", ""),
                         "fused": list(step.get("fused", [])),
                         "inputs": [list(s) for s in step.get("inputs", [])],
                         "outputs": [list(s) for s in step.get("outputs", [])],
                         "mean_s": total / number, "share": total / whole})
        return rows

    def _call(self, in_ptrs, out_ptrs, workspace: int, dims=None) -> int:
        """Run once; dims (a ctypes int64 array, see _dims) for a dynamic module."""
        args = (in_ptrs, out_ptrs, workspace) + ((dims,) if dims is not None else ())
        parallel = self._parallel if dims is None else self._parallel_dims
        # One parallel run at a time owns the pool; a concurrent run() from
        # another Python thread goes single-threaded instead of waiting.
        if self.threads > 1 and parallel is not None and self._pool_lock.acquire(blocking=False):
            try:
                if self._pool is None or self._pool.size != self.threads:
                    self._pool = _ThreadPool(self.threads)
                return self._pool.run(parallel, args)
            finally:
                self._pool_lock.release()
        return (self._run if dims is None else self._run_dims)(*args)

    def _size(self, arrays: list):
        """The dynamic dimension's size in checked inputs, or None for a
        module without one."""
        for spec, array in zip(self.inputs, arrays):
            if spec.dynamic_axes:
                return int(array.shape[spec.dynamic_axes[0]])
        return None

    def _dims(self, arrays: list):
        """The dims argument of tether_run_dims for checked inputs, or None
        for a module without a dynamic dimension."""
        size = self._size(arrays)
        return None if size is None else (ctypes.c_int64 * 1)(size)

    def _new_outputs(self, arrays: list) -> list:
        """Output arrays for checked inputs (at their dynamic size)."""
        size = self._size(arrays)
        return [np.empty(tuple(size if axis in spec.dynamic_axes and size is not None else d
                               for axis, d in enumerate(spec.shape)), dtype=numpy_dtype(spec.dtype))
                for spec in self.outputs]

    def close(self) -> None:
        """Stop the module's worker threads (they also stop with the process)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def _new_workspace(self) -> np.ndarray:
        return np.zeros(self._workspace_bytes + WORKSPACE_ALIGNMENT, dtype=np.uint8)

    def _check_inputs(self, inputs) -> list:
        names = [spec.name for spec in self.inputs]
        if isinstance(inputs, dict):
            unknown = sorted(set(inputs) - set(names))
            if unknown:
                raise InputError(f"unknown input name(s) {unknown}; this module's inputs are {names}")
            missing = [n for n in names if n not in inputs]
            if missing:
                raise InputError(f"missing input(s) {missing}; this module's inputs are {names}")
            values = [inputs[n] for n in names]
        elif isinstance(inputs, (list, tuple)):
            if len(inputs) != len(names):
                raise InputError(f"got {len(inputs)} input(s), expected {len(names)}: {names}")
            values = list(inputs)
        else:
            raise InputError(f"inputs must be a dict {{name: array}} or a list in the order {names}, "
                             f"not {type(inputs).__name__}")
        arrays = []
        for spec, value in zip(self.inputs, values):
            if isinstance(value, np.ndarray):
                if value.dtype != numpy_dtype(spec.dtype):
                    raise InputError(f"input {spec.name!r}: expected dtype {spec.dtype}, got {value.dtype}")
            else:
                value = np.asarray(value, dtype=numpy_dtype(spec.dtype))
            if self.dynamic:
                self._check_dynamic_shape(spec, tuple(value.shape), self._size(arrays))
            elif tuple(value.shape) != spec.shape:
                raise InputError(f"input {spec.name!r}: expected shape {spec.shape}, "
                                 f"got {tuple(value.shape)}")
            arrays.append(np.ascontiguousarray(value).reshape(value.shape))  # 0-d stays 0-d
        return arrays

    def _check_dynamic_shape(self, spec: TensorSpec, shape: tuple, earlier) -> None:
        """An input of a dynamic module: its size on each dynamic axis within
        the bounds and equal to the earlier inputs' (`earlier`, None before
        the first), the other dimensions as declared."""
        (dim, (low, high)), = self.dynamic.items()
        axes = spec.dynamic_axes
        expected = "(" + ", ".join(f"{dim} {low}..{high}" if axis in axes else str(d)
                                   for axis, d in enumerate(spec.shape)) + ")"
        if len(shape) != len(spec.shape) or any(d != s for axis, (d, s) in enumerate(zip(shape, spec.shape))
                                                if axis not in axes):
            raise InputError(f"input {spec.name!r}: expected shape {expected}, got {shape}")
        for axis in axes:
            if not low <= shape[axis] <= high:
                raise InputError(f"input {spec.name!r}: {dim} (axis {axis}) is {shape[axis]}, outside this "
                                 f"module's range {low}..{high}; run at most {high} at a time, or rebuild the "
                                 f"module with dynamic={{{dim!r}: ({min(low, shape[axis])}, {max(high, shape[axis])})}}")
            if earlier is not None and shape[axis] != earlier:
                raise InputError(f"input {spec.name!r}: {dim} (axis {axis}) is {shape[axis]}, but an earlier "
                                 f"one is {earlier}; every input needs the same {dim}")
            earlier = shape[axis]


# The dtypes numpy lacks, and the unsigned type holding each one's bit
# patterns: bfloat16 (a float32's upper half) and the low-bit types, one
# byte per element, the value's bits in the low bits (float8, float4, int4,
# int2; crosscompile.lowbit).
BIT_PATTERNS = {"bfloat16": "uint16", **dict.fromkeys((
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn",
    "int4", "uint4", "int2", "uint2"), "uint8")}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a module's tensor of dtype name is held in: for the
    types numpy lacks (BIT_PATTERNS), ml_dtypes' where it has given numpy
    them (onnx brings it), elsewhere arrays of their bit patterns."""
    try:
        return np.dtype(name)
    except TypeError:
        if name in BIT_PATTERNS:
            return np.dtype(BIT_PATTERNS[name])
        raise


def _spec(entry: dict) -> TensorSpec:
    count = entry.get("count")
    return TensorSpec(entry["name"], tuple(int(d) for d in entry["shape"]), entry["dtype"],
                      tuple(int(a) for a in entry.get("dynamic_axes") or ()),
                      None if count is None else (int(count["axis"]), int(count["offset"])))


def _aligned_address(buffer: np.ndarray) -> int:
    address = buffer.ctypes.data
    return address + (-address) % WORKSPACE_ALIGNMENT


class _SyncState(ctypes.Structure):
    """struct tether_sync (docs/module-abi.md): the module's barrier state,
    zeroed per run, and libc's syscall() for sleeping on a futex."""

    _fields_ = [("arrived", ctypes.c_int32), ("generation", ctypes.c_int32),
                ("syscall", ctypes.c_void_p)]


def _libc_syscall():
    try:
        return ctypes.cast(ctypes.CDLL(None).syscall, ctypes.c_void_p).value
    except (AttributeError, OSError):  # not Linux: the barrier only spins
        return None


_LIBC_SYSCALL = _libc_syscall() if platform.system() == "Linux" else None


class _ThreadPool:
    """size - 1 worker threads plus the caller, all entering
    tether_run_parallel together. ctypes releases the GIL for the call, so
    they run in parallel inside the module, which synchronises them with its
    own barrier on a shared int32[2] state.

    The caller does not wait for the workers to return: by the time its own
    call returns, every thread has passed the barrier after the last op
    they shared (the rest run on the caller's thread), so the outputs are
    complete, and a worker has nothing left to do but return. Waiting would
    put the caller to sleep and cost a wake-up per run (tens of
    microseconds on a virtual machine). All threads return the same status;
    a worker's exception is raised by the next run()."""

    def __init__(self, size: int):
        self.size = size
        self._jobs = [queue.Queue() for _ in range(size - 1)]
        self._errors: list = []
        self._workers = [threading.Thread(target=self._work, args=(i + 1,), daemon=True,
                                          name=f"minirt-worker-{i + 1}") for i in range(size - 1)]
        for worker in self._workers:
            worker.start()

    def _work(self, thread: int) -> None:
        jobs = self._jobs[thread - 1]
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, args, state = job  # the tuple keeps the run's buffers alive
            try:
                fn(*args, thread, self.size, ctypes.addressof(state))
            except BaseException as exc:  # raised by the next run(); the worker stays alive
                self._errors.append(exc)

    def run(self, fn, args) -> int:
        if self._errors:
            raise self._errors.pop(0)
        state = _SyncState(0, 0, _LIBC_SYSCALL)
        for jobs in self._jobs:
            jobs.put((fn, args, state))
        return fn(*args, 0, self.size, ctypes.addressof(state))

    def close(self) -> None:
        for jobs in self._jobs:
            jobs.put(None)
