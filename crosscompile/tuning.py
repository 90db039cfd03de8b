"""The tuning cache and the choices made from measurements: which register
tile each convolution of a model runs fastest with on a board, per (target,
convolution shape).

This module decides and records; it measures nothing (no boards, clocks or
runtime here). The caller that times candidates on a board (`tether tune`
and its Python API) builds one module per candidate tile with
candidate_module(), hands the measured samples to shape_entry(), which
picks the fastest, and stores the entry in a TuningCache.
build(..., schedules=TuningCache(folder)) then uses the cached tiles; the
folder is the caller's to choose.

Example:
    >>> cache = TuningCache("/tmp/tuning")                               # doctest: +SKIP
    >>> lib = crosscompile.build("model.onnx", "rasp4b64", schedules=cache)  # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import List, Optional

import numpy as np

from .compiler import CompiledModule, build, tiled_graph
from .errors import BuildError
from .gemm import GemmTile
from .metadata import gemm_convs
from .schedule import ConvShape
from .target import Target, resolve_target

SCHEMA = "tether.tuning/1"
# A candidate whose output differs from the default tile's by more than this
# (relative to the output's largest magnitude) is wrong, not slow: it is
# recorded with the error and never chosen.
OUTPUT_TOLERANCE = 1e-4

# Another tile replaces the default only when its median is at least this
# fraction faster.
MIN_GAIN = 0.03
# What a candidate's samples measure: "s", seconds per run on a board (or
# this machine), or "instructions", guest instructions per run on an
# emulated core where no board was in reach. Records keep them as
# samples_<unit> and median_<unit>; an entry says "cost": "instructions"
# when counted (entries without it were timed).
UNITS = ("s", "instructions")


def entry_unit(entry: dict) -> str:
    """The unit of a cache entry's samples (see UNITS)."""
    return "instructions" if entry.get("cost") == "instructions" else "s"


class TuningCacheError(BuildError):
    """A tuning cache file cannot be read; the message names it and says what to do."""


def target_key(target: Target) -> dict:
    """What a tuned tile depends on: the normalised triple, CPU and features
    (not the preset's name: two names for one machine share answers)."""
    return {"triple": target.triple, "cpu": target.cpu, "features": target.features}


class TuningCache:
    """Tuned tiles, one JSON file per target in `directory`. Pass it to
    build(schedules=...) to use them.

    >>> cache = TuningCache(os.path.expanduser("~/.cache/tether/tuning"))  # doctest: +SKIP
    >>> cache.tiles_for(resolve_target("rasp4b64"))                      # doctest: +SKIP
    {'x1x64x56x56-w64x64x3x3-s1x1-p1x1x1x1-d1x1-g1': {...}}
    """

    def __init__(self, directory: "str | os.PathLike"):
        self.directory = os.fspath(directory)
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
        no longer the compiler's (see schedule.assign_tiles) is stale."""
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
    imported, _, tiled = tiled_graph(model, resolve_target(target), input_shapes, {})
    found: dict = {}
    for node in gemm_convs(imported, tiled):
        found.setdefault(node.attrs["conv_shape"].key, node.attrs["conv_shape"])
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


# ------------------------------------------------------------- choice --
def candidate_module(model, shape: ConvShape, target: Target, tile: GemmTile) -> CompiledModule:
    """`model` (conv_model(shape)) built with `tile` for its one convolution."""
    lib = build(model, target, schedules={shape.key: tile})
    used = [t["tile"] for t in lib.metadata["gemm_tiles"]]
    if used != [tile.spec]:
        raise BuildError(f"internal error: the module for {shape.key} used tiles {used}, "
                         f"not {tile.label}")
    return lib


def output_mismatch(reference: np.ndarray, output: np.ndarray) -> Optional[str]:
    """Why a candidate's output is wrong next to the default tile's, or None."""
    scale = max(float(np.abs(reference).max()), 1.0)
    error = float(np.abs(output - reference).max()) / scale
    if not np.isfinite(error) or error > OUTPUT_TOLERANCE:
        return f"output differs from the default tile's (relative {error:.3g})"
    return None


def shape_entry(shape: ConvShape, candidates: List[dict], device: dict, number: int,
                repeat: int, measured: str, unit: str = "s") -> dict:
    """The cache entry of one measured shape. candidates are {"tile": spec,
    "samples_s": [...]} (samples_instructions with unit "instructions"; plus
    "error" when its output was wrong), the default tile first; each gets
    its median, and the cheapest valid one is "best" when it beats the
    default by MIN_GAIN.

    >>> shape = ConvShape((1, 8, 6, 6), (12, 8, 3, 3), (1, 12, 6, 6), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    >>> entry = shape_entry(shape, [{"tile": [8, 1, 4], "samples_s": [2.0, 2.1]},
    ...                             {"tile": [4, 2], "samples_s": [1.0, 1.1]}],
    ...                     {"address": "local"}, 10, 2, "2024-01-01T00:00:00+00:00")
    >>> entry["default"], entry["best"]
    ([8, 1, 4], [4, 2])
    """
    if unit not in UNITS:
        raise ValueError(f"unit {unit!r}: one of {', '.join(UNITS)}")
    median = f"median_{unit}"
    for record in candidates:
        record[median] = float(np.median(record[f"samples_{unit}"]))
    valid = [c for c in candidates if "error" not in c]
    fastest = min(valid, key=lambda c: c[median])
    default = candidates[0]
    # Noise on a shared board moves medians by a few per cent, and a count
    # leaves out caches and stalls: the default tile stays unless another
    # is clearly cheaper.
    best = fastest if fastest[median] < default[median] * (1 - MIN_GAIN) else default
    entry = {"shape": shape.to_dict(), "gemm": list(shape.gemm),
             "default": default["tile"], "best": best["tile"], "candidates": candidates,
             "device": device, "number": number, "repeat": repeat, "measured": measured}
    if unit == "instructions":
        entry["cost"] = "instructions"
    return entry
