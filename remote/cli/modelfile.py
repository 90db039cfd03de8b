"""The module a command sends to a board: an ONNX model compiled on the spot,
or a module file that was built before (``tether compile``)."""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from remote.cli.progress import stage
from remote.client.display import board_cpu

MODULE_SUFFIXES = (".so", ".tar")


@dataclass
class ModuleFile:
    path: str            # what is uploaded
    source: str          # what the user named
    kind: str            # "onnx" or "module"
    source_sha256: str
    module_sha256: str
    size: int

    def describe(self) -> dict:
        return {"path": os.path.abspath(self.source), "kind": self.kind,
                "sha256": self.source_sha256, "module_sha256": self.module_sha256,
                "module_bytes": self.size}

    def cleanup(self) -> None:
        """Remove a module compiled here (a module the user gave is left alone)."""
        if self.kind == "onnx":
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_input_shapes(specs) -> Optional[Dict[str, Tuple[int, ...]]]:
    shapes = {}
    for spec in specs or ():
        name, _, dims = spec.partition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise ValueError(f"--input-shape {spec!r} must look like name=1,3,224,224") from None
    return shapes or None


def parse_dynamic(specs) -> Optional[Dict[str, Tuple[int, int]]]:
    """--dynamic NAME=MIN:MAX options as build()'s dynamic argument.

    >>> parse_dynamic(["batch=1:16"])
    {'batch': (1, 16)}
    """
    dims = {}
    for spec in specs or ():
        name, _, bounds = spec.partition("=")
        low, _, high = bounds.partition(":")
        try:
            dims[name] = (int(low), int(high))
        except ValueError:
            raise ValueError(f"--dynamic {spec!r} must look like batch=1:16 (the model's symbolic "
                             "dimension, its smallest and largest size)") from None
    return dims or None


def add_dynamic_argument(p) -> None:
    """--dynamic of the commands that compile an ONNX model."""
    p.add_argument("--dynamic", action="append", default=[], metavar="NAME=MIN:MAX",
                   help="compile once for every size of the model's leading symbolic dimension "
                        "NAME from MIN to MAX, e.g. batch=1:16 (see docs/module-abi.md)")


def prepare(model: str, target: str, input_shapes=None, tuned: bool = True,
            precision: str = "fp32", dynamic=None) -> ModuleFile:
    """Compile ``model`` for ``target`` when it is ONNX (with the register
    tiles `tether tune` cached for the target, unless not ``tuned``, in
    ``precision``: see crosscompile.precision; with ``dynamic`` bounds, see
    parse_dynamic); take a built module as it is."""
    if not os.path.isfile(model):
        raise FileNotFoundError(f"{model!r}: no such file; give an .onnx model or a module "
                                f"built with `tether compile`")
    if model.endswith(MODULE_SUFFIXES):
        digest = sha256(model)
        return ModuleFile(model, model, "module", digest, digest, os.path.getsize(model))
    if not model.endswith(".onnx"):
        raise ValueError(f"{model!r} is neither an .onnx model nor a module (.so, .tar); "
                         "rename it or build it with `tether compile`")
    import crosscompile
    from remote.client.tuning import default_cache

    with stage(f"compiling {os.path.basename(model)} for {target}"
               + (f" in {precision}" if precision != "fp32" else "")) as ticker:
        lib = crosscompile.build(model, target=target, input_shapes=input_shapes,
                                 schedules=default_cache() if tuned else None, precision=precision,
                                 progress=ticker.step, dynamic=dynamic)
    folder = tempfile.mkdtemp(prefix="tether-module-")
    # The command removes the folder with ModuleFile.cleanup() when it is done; this
    # covers a command that fails or is interrupted before it gets there.
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    out = os.path.join(folder, os.path.splitext(os.path.basename(model))[0] + ".so")
    try:
        lib.export_library(out)
        return ModuleFile(out, model, "onnx", sha256(model), sha256(out), os.path.getsize(out))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def add_precision_argument(p) -> None:
    """--precision of the commands that compile an ONNX model."""
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="compute convolutions and matrix products in this precision (default "
                        "fp32); fp16 needs a core with FP16 arithmetic (rasp5, android-arm64)")


def board_target(info: dict) -> str:
    """The compile target that fits a board, from what it reported."""
    from crosscompile.target import target_for_board

    return target_for_board(info)


class ModuleChoice:
    """The module each board gets: built for ``--target``, or, without it, for
    the preset that fits each board of the key (one build per distinct preset,
    made the first time a board of it is leased)."""

    def __init__(self, model: str, target: Optional[str], input_shapes=None, tuned: bool = True,
                 say=lambda message: None, precision: str = "fp32", dynamic=None):
        self.model = model
        self.target = target
        self._options = dict(input_shapes=input_shapes, tuned=tuned, precision=precision, dynamic=dynamic)
        self._say = say
        self._built: Dict[str, ModuleFile] = {}
        self._lock = threading.Lock()
        self.fixed = target is not None or model.endswith(MODULE_SUFFIXES)
        if self.fixed:
            self._built[target or ""] = prepare(model, target or "host", **self._options)

    def for_board(self, info: dict) -> ModuleFile:
        if self.fixed:
            return next(iter(self._built.values()))
        target = board_target(info)
        with self._lock:
            if target not in self._built:
                self._say(f"compiling for {target}: the preset that fits {info.get('triple')}, "
                          f"{board_cpu(info)} (--target to choose another)")
                self._built[target] = prepare(self.model, target, **self._options)
            return self._built[target]

    @property
    def first(self) -> Optional[ModuleFile]:
        return next(iter(self._built.values()), None)

    def cleanup(self) -> None:
        for module in self._built.values():
            module.cleanup()


def load_for_board(sess, name: str, info: dict):
    """``sess.load_module(name)``; a module built for another machine is refused
    with the preset that fits this board named."""
    from remote import errors

    try:
        return sess.load_module(name)
    except errors.ModuleLoadError as exc:
        if "build it for this board's target" in str(exc):
            raise errors.ModuleLoadError(f"{exc} (this board fits --target {board_target(info)})") \
                from None
        raise
