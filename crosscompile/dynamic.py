"""Dynamic dimensions: one module that runs any size of a symbolic
dimension within bounds.

A model whose inputs lead with a symbolic dimension (``batch`` in
``[batch, 3, 224, 224]``) compiles, when every op maps batch rows to batch
rows, into plans for a few fixed chunk sizes: the powers of two up to the
upper bound, and the bound itself. At run time the module's
tether_run_dims takes the actual size and runs the largest plans first
(greedy, so 13 of at most 16 runs 8 + 4 + 1, and 16 runs the 16-plan once);
all plans share the parameters, and the workspace is the largest plan's,
since the chunks run one after another.

Any other symbolic dimension (a sequence length), or a leading one whose
rows the graph mixes, gets one plan per size instead ("specialized"), for
at most MAX_SPECIALIZED sizes; tether_run_dims runs the plan of the size.

Plain data and functions only; build() (compiler.py) compiles the plans and
codegen.generate_dynamic writes the entry points.

Example:
    >>> spec = dynamic_spec(model, {"batch": (1, 16)})  # doctest: +SKIP
    >>> plan_sizes(1, 16)
    [16, 8, 4, 2, 1]
    >>> chunks(13, plan_sizes(1, 16))
    [8, 4, 1]
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import BuildError
from .ir import Graph

# Batch sizes build() imports the model at to prove it separable: two
# different sizes, so a dimension that only happens to equal the batch at
# one of them is found.
CHECK_SIZES = (2, 3)
# Ops that step along their input's leading axis when their layout
# attribute is 0 (ONNX's default: [sequence, batch, ...]).
SEQUENCE_FIRST = {"LSTM", "GRU", "RNN"}
# A dimension compiled one plan per size takes at most this many sizes:
# each is a whole compiled model.
MAX_SPECIALIZED = 16


@dataclass(frozen=True)
class DynamicSpec:
    """The one dynamic dimension of a module: its name (the model's symbolic
    dim), its bounds, the axes holding it in each model input (in order;
    empty for an input without it), and whether it runs in chunks (a
    separable leading dimension) or one plan per size."""

    name: str
    low: int
    high: int
    axes: tuple
    chunked: bool = True

    @property
    def sizes(self) -> list:
        """The sizes compiled as plans, largest first."""
        return plan_sizes(self.low, self.high) if self.chunked else list(range(self.high, self.low - 1, -1))

    def specialized(self) -> "DynamicSpec":
        """The same dimension compiled one plan per size; BuildError when
        the range has more than MAX_SPECIALIZED sizes."""
        count = self.high - self.low + 1
        if count > MAX_SPECIALIZED:
            raise BuildError(f"dynamic dimension {self.name!r} needs one compiled plan per size here, and "
                             f"{self.low}..{self.high} is {count} sizes, more than the {MAX_SPECIALIZED} a "
                             f"module takes; narrow the range to at most {MAX_SPECIALIZED} sizes, or give it a "
                             "fixed size with input_shapes")
        return DynamicSpec(self.name, self.low, self.high, self.axes, chunked=False)

    def to_dict(self) -> dict:
        """The module metadata's description (docs/module-abi.md, "dynamic")."""
        if self.chunked:
            return {"name": self.name, "min": self.low, "max": self.high, "axis": 0, "chunks": self.sizes}
        return {"name": self.name, "min": self.low, "max": self.high, "sizes": self.sizes}


def dynamic_spec(proto, dynamic: dict) -> DynamicSpec:
    """Check build()'s dynamic= argument against the model (an
    onnx.ModelProto): one symbolic dimension of its inputs, with integer
    bounds 1 <= low <= high. It runs in chunks when it leads every input
    (check_separable decides the rest), else one plan per size.

    >>> dynamic_spec(model, {"batch": (1, 16)}).high  # doctest: +SKIP
    16
    """
    if not isinstance(dynamic, dict) or not dynamic:
        raise BuildError(f"dynamic must be a dict {{dimension name: (min, max)}}, e.g. "
                         f"{{'batch': (1, 16)}}; got {dynamic!r}")
    symbolic = _symbolic_dims(proto)
    unknown = sorted(set(dynamic) - {name for dims in symbolic.values() for name in dims if name})
    if unknown:
        shown = {inp: list(dims) for inp, dims in symbolic.items()}
        raise BuildError(f"dynamic names {unknown}, which no model input has as a symbolic dimension; "
                         f"the inputs' dimensions are {shown}")
    if len(dynamic) > 1:
        raise BuildError(f"dynamic names {sorted(dynamic)}, but a module has at most one dynamic "
                         "dimension; give the others fixed sizes with input_shapes")
    (name, bounds), = dynamic.items()
    try:
        low, high = (int(b) for b in bounds)
        valid = low == bounds[0] and high == bounds[1] and 1 <= low <= high
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise BuildError(f"dynamic[{name!r}] must be (min, max) integers with 1 <= min <= max, got {bounds!r}")
    axes = tuple(tuple(axis for axis, dim in enumerate(dims) if dim == name) for dims in symbolic.values())
    spec = DynamicSpec(name, low, high, axes)
    return spec if all(a == (0,) for a in axes) else spec.specialized()


def plan_sizes(low: int, high: int) -> list:
    """The chunk sizes compiled for bounds [low, high], largest first: the
    powers of two up to high, and high itself (any size decomposes into
    them, and the sizes 1, 2, 4, ... and high run a single plan)."""
    sizes = {high}
    size = 1
    while size < high:
        sizes.add(size)
        size *= 2
    return sorted(sizes, reverse=True)


def chunks(size: int, sizes: list) -> list:
    """The plans a run of `size` rows calls, in order (greedy, largest first)."""
    out = []
    for chunk in sizes:
        while size >= chunk:
            out.append(chunk)
            size -= chunk
    return out


def input_shapes_at(proto, spec: DynamicSpec, size: int, input_shapes: "dict | None") -> dict:
    """input_shapes for importing the model with the dynamic dimension at
    `size`: the user's shapes (for other symbolic dims), or the declared ones,
    with the dimension's axes set to size."""
    given = dict(input_shapes or {})
    shapes = {}
    for (inp, dims), axes in zip(_symbolic_dims(proto).items(), spec.axes):
        base = list(given.get(inp, dims))
        shapes[inp] = tuple(size if axis in axes else d for axis, d in enumerate(base))
    for inp in given:
        shapes.setdefault(inp, given[inp])  # not an input: import_onnx names it
    return shapes


def output_axes(graphs: "dict[int, Graph]", name: str) -> list:
    """The axes of each graph output that hold the dynamic dimension, from
    the model imported at every size in `graphs` (two sizes or more): an
    output's shape must be one shape with those axes set to the size.
    BuildError for an output whose shape depends on the size otherwise."""
    sizes = sorted(graphs)
    first = graphs[sizes[0]]
    found = []
    for output in first.outputs:
        shapes = {size: graphs[size].tensors[output].shape for size in sizes}
        base = shapes[sizes[-1]]
        axes = [axis for axis, d in enumerate(base) if all(
            len(shape) == len(base) and shape[axis] == size for size, shape in shapes.items())]
        if any(len(shape) != len(base) or any(d != (size if axis in axes else base[axis])
                                              for axis, d in enumerate(shape))
               for size, shape in shapes.items()):
            shown = " and ".join(f"{shape} at {name} {size}" for size, shape in shapes.items())
            raise BuildError(f"graph output {output!r} has shape {shown}, which is not one shape with {name} "
                             "in some of its dimensions; compile with fixed shapes instead (input_shapes)")
        found.append(axes)
    return found


def check_separable(graphs: "dict[int, Graph]", name: str) -> None:
    """Refuse a graph whose ops mix rows of the dynamic (leading) dimension.

    `graphs` maps each batch size to the model imported at it (at least two
    sizes). Separable means: every runtime tensor a node reads or writes
    leads with the batch at every size and has the same other dimensions
    (so reshapes keep whole rows, broadcasts do not spread one row over
    the others, matrix products do not contract over it), no op works
    along axis 0 of runtime data (Softmax, reductions, Concat, Slice,
    Gather, CumSum, ... along it) or moves it (Transpose), and recurrent
    ops run batch-first (layout 1). Raises BuildError naming the node.
    """
    sizes = sorted(graphs)
    first = graphs[sizes[0]]
    for pos, node in enumerate(first.nodes):
        where = f"node {node.name!r} ({node.op_type})"
        reason = _mixing_reason(node, first)
        if reason:
            raise BuildError(f"{where} is not separable along {name!r}: it {reason}, which mixes rows "
                             f"of different {name} entries; compile with fixed shapes instead (input_shapes)")
        for size in sizes[1:]:
            if pos >= len(graphs[size].nodes) or graphs[size].nodes[pos].name != node.name:
                raise BuildError(f"the model's graph differs between {name} sizes {sizes[0]} and {size} "
                                 f"at {where}, so it cannot be compiled once for every size")
        for tensor in node.inputs + node.outputs:
            if tensor in first.constants:
                continue
            shapes = {size: graphs[size].tensors[tensor].shape for size in sizes}
            if any(not shape or shape[0] != size or shape[1:] != shapes[sizes[0]][1:]
                   for size, shape in shapes.items()):
                shown = " and ".join(f"{shape} at {name} {size}" for size, shape in shapes.items())
                raise BuildError(
                    f"{where} is not separable along {name!r}: its tensor {tensor!r} has shape {shown} (a "
                    f"separable tensor leads with {name} and keeps its other dimensions); compile with "
                    f"fixed shapes instead (input_shapes)")


def _mixing_reason(node, graph: Graph) -> str:
    """Why a node with batch-leading tensors still mixes batch rows, or ''."""
    data = node.inputs[0] if node.inputs else None
    if data is None or data in graph.constants:
        return ""  # e.g. a Gather from a constant table: rows index it independently
    rank = len(graph.tensors[data].shape)
    attrs = node.attrs
    if node.op_type in SEQUENCE_FIRST and int(attrs.get("layout", 0)) == 0:
        return "runs along axis 0 (its layout is sequence-first; export it batch-first, layout=1)"
    if attrs.get("perm") and attrs["perm"][0] != 0:
        return f"moves axis 0 (perm {list(attrs['perm'])})"
    axes = []
    if isinstance(attrs.get("axis"), int):
        axes.append(attrs["axis"])
    if isinstance(attrs.get("axes"), (list, tuple)):
        axes.extend(a for a in attrs["axes"] if isinstance(a, int))
    elif node.op_type == "Slice" and attrs.get("starts"):
        axes.extend(range(len(attrs["starts"])))  # no axes: the starts begin at axis 0
    if rank and any(a % rank == 0 for a in axes):
        return "works along axis 0"
    return ""


def _symbolic_dims(proto) -> dict:
    """{input name: declared dims (ints, symbolic names, or None)} of a
    ModelProto's runtime inputs (initializers listed as inputs skipped)."""
    initializers = {init.name for init in proto.graph.initializer}
    dims = {}
    for vi in proto.graph.input:
        if vi.name in initializers:
            continue
        shape = vi.type.tensor_type.shape
        dims[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                              for d in shape.dim)
    return dims
