"""Exceptions raised by crosscompile.

Every failure a user can cause (a bad file, an unsupported op, a missing
shape, a missing linker) surfaces as a BuildError subclass whose message says
what happened and what to do; nothing escapes as a crash inside LLVM.
"""
from __future__ import annotations


class BuildError(Exception):
    """Compiling a model failed for a reason the user can act on."""


class UnsupportedOpError(BuildError):
    """The model uses an ONNX op that crosscompile cannot lower."""

    def __init__(self, node_name: str, op_type: str, supported: list[str]):
        self.node_name = node_name
        self.op_type = op_type
        self.supported = sorted(supported)
        super().__init__(
            f"unsupported op {op_type!r} in node {node_name!r}; "
            f"supported ops: {', '.join(self.supported)}"
        )


class ShapeError(BuildError):
    """Tensor shapes are unknown or do not fit an op."""


class LinkError(BuildError):
    """The linker could not be found or failed to produce the shared object."""
