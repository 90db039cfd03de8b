"""Tensors whose size depends on the data, with an upper bound known when
the model is compiled.

NonZero's output has one column per nonzero element, NonMaxSuppression's
one row per selected box: sizes a module learns only when it runs. Such an
op declares which axis of which output is counted (Op.counted); its
output tensor gets the upper bound as its shape (NonZero: every element;
NonMaxSuppression: batches x classes x min(max boxes, boxes)), so memory is
planned for the bound, and the frontend gives the node one more output, an
int64 (1,) tensor, into which the kernel writes the actual size. The
kernel fills the rest of the buffer, past the count, with zeros, so a
downstream op may compute on it (zeros are valid indices) and the rows it
computes there are simply never read.

A counted tensor may flow, through ops that keep its rows apart, to graph
outputs: element-wise ops, comparisons, Cast, Where, Identity, Gather (by
counted indices, or along another axis of counted data), GatherND (by
counted indices), Slice, Transpose/Squeeze/Unsqueeze/Flatten, Concat and
Split that keep the counted axis whole. The output of such an op is
counted by the same count, on the axis where the counted one lands.

A count is a run-time scalar in the workspace, and an op that works along
a counted axis reads it as that axis's extent (along_count,
crosscompile/extents.py): TopK over it (k = min(k, count)), Concat along
it (the counts add up), a Slice keeping its first rows, a Gather choosing
along it (negative indices count from the count), NonMaxSuppression of
counted boxes, and reductions (over a copy whose rows past the count hold
the reduction's identity). The Shape of a counted tensor is computed at
run time from its count, and upper bounds of the values computed from it
(MONOTONE) bound a TopK's k at compile time; a ConstantOfShape of it is
counted by the same count. Nodes whose counts are made of the same counts
(boxes and labels concatenated class by class) share one. Any other op
reading a counted tensor (ReduceMean, Softmax, Reshape, Size, ...) is
refused, naming the node and the tensor. The module's metadata gives each
counted graph output its axis and the workspace offset of its count
(docs/module-abi.md, "count"), and the loaders return the outputs cut to
that size.

Plain functions over shapes and attributes; the frontend calls them.

Example:
    >>> counted_axes("Cast", {}, ["nz"], [(7, 3)], [(7, 3)], {0: 0}, lambda s: [s[0]])
    {0: 0}
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import BuildError, ShapeError

# Ops that compute each output element from the input elements at the same
# (or broadcast) position, or that move whole rows: with the counted axis
# left alone, the rows past the count stay apart from the counted ones.
ROW_KEEPING = frozenset({
    "Abs", "Add", "Ceil", "Celu", "Clip", "Div", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid",
    "HardSwish", "IsInf", "IsNaN", "LeakyRelu", "Log", "Max", "Mean", "Min", "Mish", "Mod", "Mul", "Neg",
    "PRelu", "Pow", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Softplus",
    "Softsign", "Sqrt", "Sub", "Sum", "Swish", "Tanh", "ThresholdedRelu",
    "And", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "Cast", "CastLike", "Equal",
    "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not", "Or", "Where", "Xor",
    "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Cos", "Cosh", "Sin", "Sinh", "Tan",
    "Identity", "Dropout", "Gather", "GatherND", "Slice", "Transpose", "Squeeze", "Unsqueeze", "Flatten",
    "Concat", "Split",
})


def counted_axes(op_type: str, attrs: dict, names: list, shapes: list, out_shapes: list, counted: dict,
                 infer) -> dict:
    """{output position: counted axis} for a node whose runtime inputs
    (names and shapes, in order) include counted ones (counted: {input position:
    axis}, all sharing one count), or BuildError when the op would mix
    the rows past the count into the others.

    infer(shapes) gives the op's output shapes for other input shapes: the
    counted axes are set one larger, and an output axis that grows by one
    with them is the counted one.
    """
    where = ", ".join(f"input {names[pos]!r} along axis {axis}" for pos, axis in sorted(counted.items()))
    refusal = (f"its {where} has a size that depends on the data, and {op_type} on such a tensor "
               "is not supported (element-wise ops, Cast, Where, Gather, GatherND, Slice, Transpose, Squeeze, "
               "Unsqueeze, Flatten, Concat and Split that keep that axis whole pass it on; TopK, Concat, Slice, "
               "Gather, NonMaxSuppression, ArgMax, ArgMin and the reductions but ReduceMean "
               "work along it; see docs/operators.md)")
    if op_type not in ROW_KEEPING:
        raise BuildError(refusal)
    if _works_along(op_type, attrs, shapes, counted):
        raise BuildError(f"{refusal}; this one works along the counted axis")
    probe = [tuple(d + 1 if counted.get(pos) == axis else d for axis, d in enumerate(shape))
             for pos, shape in enumerate(shapes)]
    try:
        grown = infer(probe)
    except (BuildError, ShapeError):
        raise BuildError(f"{refusal}; with another size on that axis its shapes do not fit") from None
    found = {}
    for pos, (before, after) in enumerate(zip(out_shapes, grown)):
        changed = [axis for axis, (a, b) in enumerate(zip(before, after)) if a != b]
        if len(before) != len(after) or len(changed) != 1 or after[changed[0]] != before[changed[0]] + 1:
            raise BuildError(f"{refusal}; its output {pos} ({before}) does not keep that axis whole")
        found[pos] = changed[0]
    return found


def _works_along(op_type: str, attrs: dict, shapes: list, counted: dict) -> bool:
    """A Slice along the counted axis of its data, a Gather choosing along
    it (its indices would count from the bound, not the count), or a
    GatherND of counted data."""
    if 0 not in counted:
        return False
    rank = len(shapes[0])
    if op_type == "Slice":
        axes = attrs.get("axes") or tuple(range(len(attrs.get("starts") or ())))
        return any(a % rank == counted[0] for a in axes)
    if op_type == "Gather":
        return attrs.get("axis", 0) % rank == counted[0]
    return op_type == "GatherND"  # its indices would reach past the count


@dataclass
class AlongCount:
    """How a node works along counted axes (crosscompile/extents.py).

    extents: (input position, axis) of the counts the kernel reads, in the
    order they are appended to its inputs; new: {output position: axis} of
    outputs counted by a count the kernel writes (its last output);
    passed: {output position: (input position, axis)} of outputs counted by
    an input's count; fill: the value a reduction needs past the count of
    its input 0 (the frontend copies the input with FillPastCount first)."""
    extents: tuple = ()
    new: dict = field(default_factory=dict)
    passed: dict = field(default_factory=dict)
    fill: object = None


# Ops whose output count follows from their inputs' counts and k alone
# (not from their data): two of them over the same counts have one count.
SIZES_ONLY = frozenset({"Concat", "TopK", "Slice"})

# Ops whose output elements never decrease when their inputs' do (with
# constant indices, shapes and axes): run on the upper bounds of their
# inputs' values, they give their output's. The Shape of a counted tensor
# starts such bounds (its bound shape), so that a TopK's k = min(300,
# count) is known to be at most 300 when the model is compiled.
MONOTONE = frozenset({"Gather", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Concat", "Slice",
                      "ReduceMin", "ReduceMax", "Min", "Max", "Add", "Cast"})
# Those of them that are monotone in every input, not only in their data.
MONOTONE_IN_ALL = frozenset({"Concat", "Min", "Max", "Add"})

# Reductions over a counted axis: a copy whose entries past the count hold
# the identity is reduced over the whole bound.
REDUCTIONS = ("ReduceMax", "ReduceMin", "ReduceSum", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare",
              "ReduceLogSum", "ReduceLogSumExp", "ArgMax", "ArgMin")


def along_count(op_type: str, attrs: dict, shapes: list, counted: dict, identity) -> "AlongCount | None":
    """The plan for a node that works along a counted axis of its runtime
    inputs (counted: {input position: axis}), or None when it does not
    (counted_axes then decides whether it keeps the rows apart).
    identity(op_type) is a reduction's value past the count, or None.

    >>> along_count("Concat", {"axis": 0}, [(5,), (7,)], {0: 0, 1: 0}, None)
    AlongCount(extents=((0, 0), (1, 0)), new={0: 0}, passed={}, fill=None)
    """
    rank = len(shapes[0])
    axis0 = counted.get(0)
    if op_type == "TopK" and axis0 is not None and attrs["axis"] % rank == axis0:
        return AlongCount(extents=((0, axis0),), new={0: axis0, 1: axis0})
    if op_type == "Gather" and axis0 is not None and attrs["axis"] % rank == axis0:
        if "indices" in attrs:
            if any(i < 0 for i in attrs["indices"]):
                raise BuildError(f"its input along axis {axis0} has a size that depends on the data, and "
                                 f"Gather's constant indices {attrs['indices']} count from its end, which is "
                                 "only known when the model runs")
            return AlongCount()
        passed = {0: (1, axis0 + counted[1])} if 1 in counted else {}
        return AlongCount(extents=((0, axis0),), passed=passed)
    if op_type == "Concat":
        axis = attrs["axis"] % rank
        if axis in counted.values():
            if set(counted.values()) != {axis}:
                raise BuildError("its inputs are counted along different axes, which Concat cannot line up")
            return AlongCount(extents=tuple((pos, axis) for pos in sorted(counted)), new={0: axis})
    if op_type == "Slice" and axis0 is not None:
        return _slice_plan(attrs, shapes[0], axis0)
    if op_type == "NonMaxSuppression":
        want = {0: 1, 1: 2}
        if any(want.get(pos) != axis for pos, axis in counted.items()):
            raise BuildError("its boxes or scores are counted along another axis than the boxes'")
        return AlongCount(extents=tuple(sorted(counted.items())))
    if op_type in REDUCTIONS and axis0 is not None and _reduces(op_type, attrs, rank, axis0):
        value = identity(op_type)
        if value is None:
            raise BuildError(f"it reduces along a counted axis {axis0}, and {op_type} has no value that "
                             "leaves its result unchanged past the count")
        return AlongCount(fill=value)
    return None


def _reduces(op_type: str, attrs: dict, rank: int, axis: int) -> bool:
    if op_type in ("ArgMax", "ArgMin"):
        return attrs["axis"] % rank == axis
    axes = attrs.get("axes")
    return not axes and not attrs.get("noop_with_empty_axes") or axis in {a % rank for a in axes or ()}


def _slice_plan(attrs: dict, shape: tuple, axis: int) -> "AlongCount | None":
    """A Slice along a counted axis: a step of 1 from a start >= 0 keeps the
    first rows (a count of its own, unless it keeps the whole bound)."""
    starts = attrs["starts"]
    axes = [a % len(shape) for a in (attrs.get("axes") or range(len(starts)))]
    if axis not in axes:
        return None
    i = axes.index(axis)
    start, end = starts[i], attrs["ends"][i]
    step = (attrs.get("steps") or (1,) * len(starts))[i]
    if step != 1 or start < 0 or end < 0:
        raise BuildError(f"its input along axis {axis} has a size that depends on the data; a Slice along it "
                         f"must start at 0 or later and step by 1 (got start {start}, end {end}, step {step}), "
                         "since its end is only known when the model runs")
    if start == 0 and end >= shape[axis]:
        return AlongCount(passed={0: (0, axis)})
    return AlongCount(extents=((0, axis),), new={0: axis})
