"""Measure which register tile each convolution of a model runs fastest
with on a board, and remember the answer per (target, convolution shape).

For every distinct GEMM convolution of the model, tune() builds a module
holding that one convolution once per candidate tile
(crosscompile.schedule.candidate_tiles), runs each on the board, checks its
output against the default tile's, times it with the board's own timing
loop and keeps the tile with the lowest median
(crosscompile.tuning.shape_entry). With no board of an ARM target in
reach, the cost is instead the number of guest instructions one run
executes on an emulated core of the target (qemu user mode in a Debian
root filesystem, deploy_recipes.instruction_count): exact and repeatable,
but not a time (no caches or stalls), so a board's timing replaces it
whenever the shape is tuned on a board. The answers go to a
crosscompile.tuning.TuningCache, by default default_cache(): a JSON file
per target in $TETHER_CACHE/tuning (else ~/.cache/tether/tuning), which
build(..., schedules=default_cache()) then uses.

Example:
    >>> from remote import rpc                                           # doctest: +SKIP
    >>> with rpc.connect_tracker("farm.local", 9190).request("rasp4b64") as sess:
    ...     result = tune("model.onnx", "rasp4b64", sess)                # doctest: +SKIP
    >>> lib = crosscompile.build("model.onnx", "rasp4b64", schedules=default_cache())  # doctest: +SKIP
"""
from __future__ import annotations

import datetime
import itertools
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

import minirt
from crosscompile.schedule import ConvShape, candidate_tiles
from crosscompile.target import Target, resolve_target
from crosscompile.tuning import (SCHEMA, TuningCache, candidate_module, conv_model, conv_shapes,
                                 entry_unit, output_mismatch, shape_entry, target_key)
from minirt.timing import bound_call
from remote.defaults import cache_dir

Progress = Optional[Callable[[str], None]]
_module_numbers = itertools.count()


def default_cache() -> TuningCache:
    """The cache `tether tune` writes and `tether compile/bench/run` read:
    $TETHER_CACHE/tuning, else ~/.cache/tether/tuning."""
    return TuningCache(os.path.join(cache_dir(), "tuning"))


# ------------------------------------------------------------- runners --
class SessionRunner:
    """Runs candidates on the board of a remote.client Session."""

    unit = "s"     # what time() returns: seconds per run
    exact = False  # samples vary: take repeat rounds

    def __init__(self, session, timeout: Optional[float] = None):
        self.session = session
        self.timeout = timeout
        info = session.device_info()
        self.device = {"address": getattr(session, "address", ""),
                       **{k: info[k] for k in ("machine", "cpu_model", "cores", "os", "triple")}}

    def load(self, so_bytes: bytes, name: str, inputs: dict):
        """(handle, output of one run on inputs)."""
        sess = self.session
        sess.upload(so_bytes, target=name, timeout=self.timeout)
        module = sess.load_module(name, timeout=self.timeout)
        sess.remove(name)  # loaded: the board no longer needs the file
        return module, module.run(inputs, timeout=self.timeout)[0]

    def time(self, module, number: int) -> float:
        """Seconds per run, the mean of `number` runs timed on the board."""
        return module.benchmark(number=number, repeat=1, timeout=self.timeout).median

    def release(self, module) -> None:
        pass  # the board unloads the session's modules when it ends


class LocalRunner:
    """Runs candidates on this machine with minirt (target "host" only)."""

    unit, exact = "s", False

    def __init__(self, threads: Optional[int] = None):
        self.threads = threads
        self.device = {"address": "local", "machine": platform.machine(),
                       "cpu_model": _cpu_model(), "cores": os.cpu_count(),
                       "os": platform.platform(), "threads": threads}
        self._folder = tempfile.mkdtemp(prefix="tether-tune-")

    def load(self, so_bytes: bytes, name: str, inputs: dict):
        path = os.path.join(self._folder, name)
        with open(path, "wb") as f:
            f.write(so_bytes)
        module = minirt.load(path, threads=self.threads)
        return (module, bound_call(module, inputs)), module.run(inputs)[0]

    def time(self, handle, number: int) -> float:
        call = handle[1]
        started = time.perf_counter()
        for _ in range(number):
            call()
        return (time.perf_counter() - started) / number

    def release(self, handle) -> None:
        handle[0].close()

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)


class CountRunner:
    """Costs candidates by the guest instructions one run executes on an
    emulated core of an ARM target (deploy_recipes.instruction_count), for
    a target with no board in reach. A count varies only by the few
    thousand instructions a start-up more or less takes, spread here over
    RUNS runs, so each candidate is counted once; its output is the one
    computed under emulation, to check against the default tile's there."""

    RUNS = 4

    unit, exact = "instructions", True

    def __init__(self, target: Target, release: str = "bookworm"):
        from deploy_recipes import instruction_count

        self._count = instruction_count.count_module
        self.debian = release
        self.arch, self.cpu = instruction_count.emulated_core(target)
        self.device = {"address": "emulated", "machine": self.arch, "cpu_model": f"qemu {self.cpu}",
                       "cores": 1, "os": f"Debian {release} {self.arch} under qemu user mode",
                       "cost": "instructions"}
        self._folder = tempfile.mkdtemp(prefix="tether-tune-count-")

    def load(self, so_bytes: bytes, name: str, inputs: dict):
        """(instructions of one run, its output under emulation)."""
        path = os.path.join(self._folder, name)
        with open(path, "wb") as f:
            f.write(so_bytes)
        saved = path + ".npy"
        count = self._count(path, {k: v.shape for k, v in inputs.items()}, self.debian, self.arch,
                            self.cpu, warmup=1, runs=self.RUNS, save=saved)
        return count.per_inference, np.load(saved)

    def time(self, handle, number: int) -> float:
        return handle  # counted once by load: the same for any number of runs

    def release(self, handle) -> None:
        pass

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ------------------------------------------------------------- search --
@dataclass
class ShapeTuning:
    """One convolution shape's outcome; times are medians in seconds."""

    shape: ConvShape
    default: tuple
    best: tuple
    default_s: float        # in `unit`: seconds, or instructions when counted
    best_s: float
    cached: bool            # taken from the cache, not measured now
    entry: dict = field(default_factory=dict)
    unit: str = "s"

    @property
    def speedup(self) -> float:
        return self.default_s / self.best_s if self.best_s else 1.0


@dataclass
class TuningResult:
    target: Target
    cache_path: str
    shapes: List[ShapeTuning]

    def as_dict(self) -> dict:
        return {"schema": SCHEMA, "target": {"name": self.target.name, **target_key(self.target)},
                "cache": self.cache_path,
                "shapes": [{"shape": s.shape.key, "gemm": list(s.shape.gemm),
                            "default": list(s.default), "best": list(s.best),
                            f"default_{s.unit}": s.default_s, f"best_{s.unit}": s.best_s,
                            "cost": "instructions" if s.unit == "instructions" else "seconds",
                            "speedup": s.speedup, "cached": s.cached,
                            "candidates": s.entry.get("candidates", [])} for s in self.shapes]}


def tune(model, target: "str | Target" = "host", session=None, progress: Progress = None,
         cache: Optional[TuningCache] = None, number: int = 10, repeat: int = 5,
         force: bool = False, input_shapes: "dict | None" = None,
         threads: Optional[int] = None, timeout: Optional[float] = None) -> TuningResult:
    """Tune every GEMM convolution shape of `model` for `target` on the
    board of `session` (a remote.client Session), or, when session is None,
    on this machine with minirt for target "host" (threads: minirt's) and by
    counting instructions on an emulated core for an ARM target
    (CountRunner). Shapes already in the cache are kept unless `force`,
    except that timing on a board replaces a count. Each measured shape is
    written to the cache at once, so an interrupted run keeps what it
    measured. progress(text) is called before each measurement.

    >>> result = tune("model.onnx", "host", number=5, repeat=3)         # doctest: +SKIP
    >>> [(s.shape.key, s.best, round(s.speedup, 2)) for s in result.shapes]  # doctest: +SKIP
    """
    target = resolve_target(target)
    if number < 1 or repeat < 1:
        raise ValueError(f"number ({number}) and repeat ({repeat}) must be at least 1")
    cache = cache if cache is not None else default_cache()
    if session is not None:
        runner = SessionRunner(session, timeout)
    elif target.name == "host":
        runner = LocalRunner(threads)
    else:
        runner = CountRunner(target)
    shapes = conv_shapes(model, target, input_shapes)
    done = []
    try:
        for index, shape in enumerate(shapes, 1):
            entry = None if force else cache.get(target, shape.key)
            cached = entry is not None and "candidates" in entry
            if cached and runner.unit == "s" and entry_unit(entry) == "instructions":
                cached = False  # counted on an emulated core: a board's timing replaces it
            if not cached:
                if progress is not None:
                    progress(f"shape {index}/{len(shapes)}: {shape.key}")
                entry = tune_shape(shape, target, runner, number, repeat, progress)
                cache.put(target, shape.key, entry)
            done.append(_outcome(shape, entry, cached))
    finally:
        if isinstance(runner, (LocalRunner, CountRunner)):
            runner.close()
    return TuningResult(target, cache.path_for(target), done)


def tune_shape(shape: ConvShape, target: Target, runner, number: int, repeat: int,
               progress: Progress = None) -> dict:
    """Measure every candidate tile on one convolution shape; the cache entry.

    All candidates are loaded first, then timed in turn, one sample of each
    per round, so that load from other work on the board falls on all of
    them alike rather than on whichever ran during a busy second.
    """
    model = conv_model(shape)
    inputs = {"x": np.random.default_rng(1).standard_normal(shape.x).astype(np.float32)}
    samples = f"samples_{runner.unit}"
    rounds = 1 if runner.exact else repeat
    candidates, handles, reference = [], [], None
    try:
        for tile in candidate_tiles(target, shape.gemm[0], shape):
            if progress is not None:
                progress(f"  building and {'counting' if runner.exact else 'loading'} tile {tile.label}")
            lib = candidate_module(model, shape, target, tile)
            # A fresh file name per module: a loaded library must never be
            # overwritten in place, and dlopen would hand back the old one.
            name = f"tune-{os.getpid()}-{next(_module_numbers)}-{tile.label}.so"
            handle, output = runner.load(lib.so_bytes, name, inputs)
            handles.append(handle)
            record = {"tile": tile.spec, samples: []}
            if reference is None:
                reference = output
            else:
                mismatch = output_mismatch(reference, output)
                if mismatch is not None:
                    record["error"] = mismatch
            candidates.append(record)
        if not runner.exact:
            for handle in handles:
                runner.time(handle, 1)  # warm caches, page in the weights
        for round_ in range(rounds):
            if progress is not None and not runner.exact:
                progress(f"  timing round {round_ + 1}/{rounds}")
            for record, handle in zip(candidates, handles):
                record[samples].append(runner.time(handle, number))
    finally:
        for handle in handles:
            runner.release(handle)
    measured = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return shape_entry(shape, candidates, runner.device, 1 if runner.exact else number, rounds,
                       measured, runner.unit)


def _outcome(shape: ConvShape, entry: dict, cached: bool) -> ShapeTuning:
    unit = entry_unit(entry)
    medians = {tuple(c["tile"]): c[f"median_{unit}"] for c in entry["candidates"]}
    default, best = tuple(entry["default"]), tuple(entry["best"])
    return ShapeTuning(shape, default, best, medians[default], medians[best], cached, entry, unit)
