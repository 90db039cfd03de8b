"""The module a command sends to a board: an ONNX model compiled on the spot,
or a module file that was built before (``tether compile``)."""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from remote.cli.progress import stage

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


def prepare(model: str, target: str, input_shapes=None, tuned: bool = True) -> ModuleFile:
    """Compile ``model`` for ``target`` when it is ONNX (with the register
    tiles `tether tune` cached for the target, unless not ``tuned``); take a
    built module as it is."""
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

    with stage(f"compiling {os.path.basename(model)} for {target}"):
        lib = crosscompile.build(model, target=target, input_shapes=input_shapes,
                                 schedules=default_cache() if tuned else None)
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
