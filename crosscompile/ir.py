"""A small graph IR: the data the passes and code generator work on.

A Graph holds tensors by name (float32, or int64, int32 and bool ids,
indices and masks), nodes in topological order, and constants as numpy
arrays. Node inputs are runtime tensors only: inputs an op needs at compile
time (Reshape's shape, Dropout's ratio) are folded into the node's
attributes by the frontend.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclass
class Node:
    op_type: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)


@dataclass
class Graph:
    name: str
    inputs: list[str]
    outputs: list[str]
    nodes: list[Node]
    tensors: dict[str, Tensor]
    constants: dict[str, np.ndarray]
    # Tensors whose size along one axis depends on the data (NonZero's
    # count, NonMaxSuppression's selected boxes): name -> (the int64 (1,)
    # tensor holding the actual size at run time, the axis). Their shape is
    # the upper bound; see crosscompile/bounded.py.
    counts: dict[str, tuple[str, int]] = field(default_factory=dict)
