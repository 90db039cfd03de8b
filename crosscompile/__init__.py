"""Cross-compile ONNX models into one ELF shared object per board.

>>> import crosscompile
>>> lib = crosscompile.build("model.onnx", target="rasp4b64")  # doctest: +SKIP
>>> lib.export_library("net.so")                                # doctest: +SKIP
"""
from .compiler import PRODUCER, CompiledModule, __version__, build
from .errors import BuildError, LinkError, ShapeError, UnsupportedOpError
from .frontend import supported_ops
from .target import TARGETS, Target

__all__ = ["build", "CompiledModule", "Target", "TARGETS", "BuildError", "UnsupportedOpError",
           "ShapeError", "LinkError", "PRODUCER", "__version__", "supported_ops"]
