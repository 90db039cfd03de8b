"""Exceptions raised by crosscompile.

Every failure a user can cause (a bad file, an unsupported op, a missing
shape, a missing linker) surfaces as a BuildError subclass whose message says
what happened and what to do; nothing escapes as a crash inside LLVM.
"""
from __future__ import annotations


class BuildError(Exception):
    """Compiling a model failed for a reason the user can act on."""


class UnsupportedOpError(BuildError):
    """The model uses ONNX ops that crosscompile cannot lower.

    unsupported maps each such op type to the names of the nodes using it,
    in model order; op_type and node_name are the first of them. refused
    holds what other nodes of the model were refused for (their attributes
    or shapes). The message names them all; `tether ops` lists the
    supported ops.
    """

    def __init__(self, unsupported: "dict[str, list[str]]", refused: "list[str]" = ()):
        self.unsupported = {op: list(names) for op, names in unsupported.items()}
        self.op_type, names = next(iter(self.unsupported.items()))
        self.node_name = names[0]
        parts = []
        for op, names in self.unsupported.items():
            shown = ", ".join(repr(n) for n in names[:3])
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            count = f"{len(names)} node{'s' * (len(names) > 1)}"
            parts.append(f"{op!r} ({count}: {shown}{more})")
        kinds = len(parts)
        super().__init__(
            f"unsupported op{'s' * (kinds > 1)} {'; '.join(parts)}. "
            "`tether ops` (or crosscompile.supported_ops()) lists the supported ones"
            + "".join(f"; also {reason}" for reason in refused))


class ShapeError(BuildError):
    """Tensor shapes are unknown or do not fit an op."""


class LinkError(BuildError):
    """The linker could not be found or failed to produce the shared object."""
