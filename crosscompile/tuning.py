"""Measure which register tile each convolution of a model runs fastest
with on a board, and remember the answer per (target, convolution shape).

For every distinct GEMM convolution of the model, tune() builds a module
holding that one convolution once per candidate tile
(schedule.candidate_tiles), runs each on the board, checks its output
against the default tile's, times it with the board's own timing loop and
keeps the tile with the lowest median. The answers go to a JSON file per
target in the Tether cache directory ($TETHER_CACHE, else ~/.cache/tether),
under tuning/; build(..., schedules=TuningCache()) then uses them.

Example:
    >>> from remote import rpc                                           # doctest: +SKIP
    >>> with rpc.connect_tracker("farm.local", 9190).request("rasp4b64") as sess:
    ...     result = tune("model.onnx", "rasp4b64", sess)                # doctest: +SKIP
    >>> lib = crosscompile.build("model.onnx", "rasp4b64", schedules=TuningCache())  # doctest: +SKIP
"""
from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from .compiler import build, lowered_graph
from .errors import BuildError
from .gemm import tile_for
from .schedule import ConvShape, candidate_tiles, conv_shape
from .target import Target, resolve_target

SCHEMA = "tether.tuning/1"
# A candidate whose output differs from the default tile's by more than this
# (relative to the output's largest magnitude) is wrong, not slow: it is
# recorded with the error and never chosen.
OUTPUT_TOLERANCE = 1e-4

# Another tile replaces the default only when its median is at least this
# fraction faster.
MIN_GAIN = 0.03

Progress = Optional[Callable[[str], None]]
_module_numbers = itertools.count()


class TuningCacheError(BuildError):
    """A tuning cache file cannot be read; the message names it and says what to do."""


def cache_directory() -> str:
    """$TETHER_CACHE/tuning, else ~/.cache/tether/tuning."""
    from deploy_recipes.emulate import cache_dir
    return os.path.join(cache_dir(), "tuning")


def target_key(target: Target) -> dict:
    """What a tuned tile depends on: the normalised triple, CPU and features
    (not the preset's name: two names for one machine share answers)."""
    return {"triple": target.triple, "cpu": target.cpu, "features": target.features}


class TuningCache:
    """Tuned tiles, one JSON file per target in `directory` (default
    cache_directory()). Pass it to build(schedules=...) to use them.

    >>> cache = TuningCache()                                            # doctest: +SKIP
    >>> cache.tiles_for(resolve_target("rasp4b64"))                      # doctest: +SKIP
    {'x1x64x56x56-w64x64x3x3-s1x1-p1x1x1x1-d1x1-g1': {...}}
    """

    def __init__(self, directory: "str | os.PathLike | None" = None):
        self.directory = os.fspath(directory) if directory is not None else cache_directory()
        self._loaded: dict = {}  # path -> entries

    def path_for(self, target: "str | Target") -> str:
        target = resolve_target(target)
        key = target_key(target)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{target.triple}-{target.cpu}")
        return os.path.join(self.directory, f"{stem}-{digest}.json")

    def entries(self, target: "str | Target") -> dict:
        """{shape key: entry} of the target (empty when nothing was tuned)."""
        target = resolve_target(target)
        path = self.path_for(target)
        if path not in self._loaded:
            self._loaded[path] = self._read(path, target)
        return self._loaded[path]

    def tiles_for(self, target: "str | Target") -> dict:
        """{shape key: {"best": tile spec, "default": tile spec}} of the
        target's tuned convolutions (a spec is [mr, nv] or [mr, nv, pixels]).
        The default is the one measured against: an entry whose default is
        no longer the compiler's (see schedule.tile_chooser) is stale."""
        return {key: {"best": list(entry["best"]), "default": entry.get("default")}
                for key, entry in self.entries(target).items()}

    def get(self, target, key: str) -> Optional[dict]:
        return self.entries(target).get(key)

    def put(self, target, key: str, entry: dict) -> str:
        """Record one shape's entry and write the target's file; returns its path."""
        target = resolve_target(target)
        entries = self.entries(target)
        entries[key] = entry
        path = self.path_for(target)
        _write_atomic(path, {"schema": SCHEMA, "target": target_key(target),
                             "entries": dict(sorted(entries.items()))})
        return path

    @staticmethod
    def _read(path: str, target: Target) -> dict:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return {}
        fix = f"delete it (rm {path!r}) and run `tether tune` again"
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise TuningCacheError(f"tuning cache {path} is corrupt ({exc}); {fix}") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA \
                or not isinstance(data.get("entries"), dict):
            raise TuningCacheError(f"tuning cache {path} is not a {SCHEMA} file; {fix}")
        if data.get("target") != target_key(target):
            raise TuningCacheError(f"tuning cache {path} holds tiles for target "
                                   f"{data.get('target')}, not {target_key(target)}; {fix}")
        for key, entry in data["entries"].items():
            best = entry.get("best") if isinstance(entry, dict) else None
            if not (isinstance(best, list) and len(best) in (2, 3)
                    and all(isinstance(v, int) and v > 0 for v in best)):
                raise TuningCacheError(f"tuning cache {path}: entry {key!r} has no valid "
                                       f"'best' tile [mr, nv] or [mr, nv, pixels]; {fix}")
        return data["entries"]


def _write_atomic(path: str, data: dict) -> None:
    """Write JSON next to `path`, then rename over it: a reader never sees
    half a file, and a crash leaves the old one."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ------------------------------------------------------------- shapes --
def conv_shapes(model, target: "str | Target" = "host", input_shapes=None) -> List[ConvShape]:
    """The distinct shapes of the model's convolutions that run as a GEMM
    (so that the register tile matters), in model order."""
    target = resolve_target(target)
    found: dict = {}
    default = tile_for(target)

    def record(graph, node):
        shape = conv_shape(graph, node)
        found.setdefault(shape.key, shape)
        return default

    lowered_graph(model, target, input_shapes, record)
    return list(found.values())


def conv_model(shape: ConvShape, seed: int = 0):
    """An ONNX model of one Conv (with bias) of this shape, random weights:
    input "x", output "y"."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal(shape.w) / np.sqrt(np.prod(shape.w[1:]))).astype(np.float32)
    bias = rng.standard_normal(shape.w[0]).astype(np.float32)
    attrs = {"kernel_shape": list(shape.w[2:]), "strides": list(shape.strides),
             "dilations": list(shape.dilations), "group": shape.group}
    if shape.auto_pad == "NOTSET":
        attrs["pads"] = list(shape.pads)
    else:
        attrs["auto_pad"] = shape.auto_pad
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", **attrs)
    graph = helper.make_graph(
        [node], "conv_" + re.sub(r"[^A-Za-z0-9]", "_", shape.key),
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape.x))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape.y))],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


# ------------------------------------------------------------- runners --
class SessionRunner:
    """Runs candidates on the board of a remote.client Session."""

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

    def __init__(self, threads: Optional[int] = None):
        self.threads = threads
        self.device = {"address": "local", "machine": platform.machine(),
                       "cpu_model": _cpu_model(), "cores": os.cpu_count(),
                       "os": platform.platform(), "threads": threads}
        self._folder = tempfile.mkdtemp(prefix="tether-tune-")

    def load(self, so_bytes: bytes, name: str, inputs: dict):
        import minirt
        from minirt.timing import bound_call

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
    default_s: float
    best_s: float
    cached: bool            # taken from the cache, not measured now
    entry: dict = field(default_factory=dict)

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
                            "default_s": s.default_s, "best_s": s.best_s,
                            "speedup": s.speedup, "cached": s.cached,
                            "candidates": s.entry.get("candidates", [])} for s in self.shapes]}


def tune(model, target: "str | Target" = "host", session=None, progress: Progress = None,
         cache: Optional[TuningCache] = None, number: int = 10, repeat: int = 5,
         force: bool = False, input_shapes: "dict | None" = None,
         threads: Optional[int] = None, timeout: Optional[float] = None) -> TuningResult:
    """Tune every GEMM convolution shape of `model` for `target` on the
    board of `session` (a remote.client Session), or on this machine with
    minirt when session is None and target is "host" (threads: minirt's).
    Shapes already in the cache are kept unless `force`. Each measured
    shape is written to the cache at once, so an interrupted run keeps what
    it measured. progress(text) is called before each measurement.

    >>> result = tune("model.onnx", "host", number=5, repeat=3)         # doctest: +SKIP
    >>> [(s.shape.key, s.best, round(s.speedup, 2)) for s in result.shapes]  # doctest: +SKIP
    """
    target = resolve_target(target)
    if number < 1 or repeat < 1:
        raise ValueError(f"number ({number}) and repeat ({repeat}) must be at least 1")
    cache = cache if cache is not None else TuningCache()
    if session is not None:
        runner = SessionRunner(session, timeout)
    elif target.name == "host":
        runner = LocalRunner(threads)
    else:
        raise BuildError(f"tuning for target {target.name!r} needs a session on a board of that "
                         "target (only 'host' can be tuned on this machine)")
    shapes = conv_shapes(model, target, input_shapes)
    done = []
    try:
        for index, shape in enumerate(shapes, 1):
            entry = None if force else cache.get(target, shape.key)
            cached = entry is not None and "candidates" in entry
            if not cached:
                if progress is not None:
                    progress(f"shape {index}/{len(shapes)}: {shape.key}")
                entry = tune_shape(shape, target, runner, number, repeat, progress)
                cache.put(target, shape.key, entry)
            done.append(_outcome(shape, entry, cached))
    finally:
        if isinstance(runner, LocalRunner):
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
    candidates, handles, reference = [], [], None
    try:
        for tile in candidate_tiles(target, shape.gemm[0], shape):
            label = tile.label
            if progress is not None:
                progress(f"  building and loading tile {label}")
            lib = build(model, target, schedules={shape.key: tile})
            used = [t["tile"] for t in lib.metadata["gemm_tiles"]]
            if used != [tile.spec]:
                raise BuildError(f"internal error: the module for {shape.key} used tiles {used}, "
                                 f"not {label}")
            # A fresh file name per module: a loaded library must never be
            # overwritten in place, and dlopen would hand back the old one.
            name = f"tune-{os.getpid()}-{next(_module_numbers)}-{label}.so"
            handle, output = runner.load(lib.so_bytes, name, inputs)
            handles.append(handle)
            record = {"tile": tile.spec, "samples_s": []}
            if reference is None:
                reference = output
            else:
                scale = max(float(np.abs(reference).max()), 1.0)
                error = float(np.abs(output - reference).max()) / scale
                if not np.isfinite(error) or error > OUTPUT_TOLERANCE:
                    record["error"] = f"output differs from the default tile's (relative {error:.3g})"
            candidates.append(record)
        for handle in handles:
            runner.time(handle, 1)  # warm caches, page in the weights
        for round_ in range(repeat):
            if progress is not None:
                progress(f"  timing round {round_ + 1}/{repeat}")
            for record, handle in zip(candidates, handles):
                record["samples_s"].append(runner.time(handle, number))
    finally:
        for handle in handles:
            runner.release(handle)
    for record in candidates:
        record["median_s"] = float(np.median(record["samples_s"]))
    valid = [c for c in candidates if "error" not in c]
    fastest = min(valid, key=lambda c: c["median_s"])
    default = candidates[0]
    # Noise on a shared board moves medians by a few per cent: the default
    # tile stays unless another is clearly faster.
    best = fastest if fastest["median_s"] < default["median_s"] * (1 - MIN_GAIN) else default
    return {"shape": shape.to_dict(), "gemm": list(shape.gemm),
            "default": default["tile"], "best": best["tile"], "candidates": candidates,
            "device": runner.device, "number": number, "repeat": repeat,
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _outcome(shape: ConvShape, entry: dict, cached: bool) -> ShapeTuning:
    medians = {tuple(c["tile"]): c["median_s"] for c in entry["candidates"]}
    default, best = tuple(entry["default"]), tuple(entry["best"])
    return ShapeTuning(shape, default, best, medians[default], medians[best], cached, entry)
