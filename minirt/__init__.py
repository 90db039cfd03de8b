"""The device runtime: load a module compiled by crosscompile and run it.

Runs on the board with only the standard library and numpy (Python 3.9+,
numpy 1.19+).

>>> import minirt
>>> m = minirt.load("net.so")        # doctest: +SKIP
>>> outputs = m.run({"input": x})    # doctest: +SKIP
"""
from .errors import InputError, MinirtError, ModuleLoadError, ProfilingUnsupported, RunError
from .module import ABI_VERSION, Module, TensorSpec, load

__all__ = ["load", "Module", "TensorSpec", "ABI_VERSION", "MinirtError", "ModuleLoadError",
           "InputError", "RunError", "ProfilingUnsupported"]
