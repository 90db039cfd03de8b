"""Ops that select elements, so that how many they give depends on the
data: NonZero (the coordinates of nonzero elements), NonMaxSuppression
(a detector's boxes kept per class) and Compress with a condition computed
at run time (its kernel is here; the op is ops.Compress).

Each output holds its upper bound (crosscompile/bounded.py): the kernel
writes the selected entries first, zeros after them, and the actual count
into its last output, an int64 (1,) tensor the frontend adds.
"""
from __future__ import annotations

from llvmlite import ir

from .emit import I8, Kernel
from .extents import extent
from .errors import BuildError, ShapeError
from .op_base import ALL_DTYPES, Op, _axis, _const_float, _const_ints, _prod


def _nonzero(k: Kernel, value: ir.Value) -> ir.Value:
    """value != 0 as an i1; NaN counts as nonzero, as in numpy."""
    if isinstance(value.type, ir.IntType):
        return k.builder.icmp_unsigned("!=", value, ir.Constant(value.type, 0))
    return k.builder.fcmp_unordered("!=", value, ir.Constant(value.type, 0.0))


def _zero_rest(k: Kernel, out: ir.Value, start: ir.Value, end: int) -> None:
    """out[start:end] = 0 (int64), so the rows past the count hold valid indices."""
    with k.loop(end, start=start) as j:
        k.store(k.i64(0), out, j)


class NonZero(Op):
    """The indices of the nonzero elements, int64 [rank, count], in C order
    of the elements; count is at most the element count, the size planned."""

    op_type = "NonZero"
    data_dtypes = ALL_DTYPES
    count_axes = {0: 1}

    def infer(self, inputs, attrs):
        if not inputs[0]:
            raise ShapeError("NonZero of a scalar is not supported; give it a tensor of rank 1 or more")
        return [(len(inputs[0]), _prod(inputs[0]))]

    def output_dtype(self, inputs, attrs):
        if inputs[0].dtype not in ALL_DTYPES:
            raise BuildError(f"NonZero of dtype {inputs[0].dtype} is not supported; "
                             f"supported: {', '.join(ALL_DTYPES)}")
        return ["int64", "int64"]

    def lower(self, k, inputs, outputs, attrs):
        bld = k.builder
        shape = inputs[0].shape
        bound = _prod(shape)
        data = k.typed(k.inputs[0], inputs[0].dtype)
        out, count = k.typed(k.outputs[0], "int64"), k.typed(k.outputs[1], "int64")
        found = k.variable(k.i64(0))
        flat = k.variable(k.i64(0))
        with k.nested_loops(shape) as idx:
            here = bld.load(flat)
            with bld.if_then(_nonzero(k, k.load(data, here))):
                n = bld.load(found)
                for dim, i in enumerate(idx):
                    k.store(i, out, k.index((dim * bound, 1), (n, 1)))
                bld.store(bld.add(n, k.i64(1)), found)
            bld.store(bld.add(here, k.i64(1)), flat)
        n = bld.load(found)
        for dim in range(len(shape)):
            _zero_rest(k, out, bld.add(n, k.i64(dim * bound)), (dim + 1) * bound)
        k.store(n, count, k.i64(0))
        k.activated = True


class NonMaxSuppression(Op):
    """ONNX NonMaxSuppression: per batch and class, boxes taken best score
    first (the lower index first among equal scores) when their score is
    above score_threshold (if given) and their IoU with every box already
    taken for the class is at most iou_threshold, up to
    max_output_boxes_per_class. Output int64 [count, 3] rows (batch, class,
    box) by batch, class, then selection order; count is at most batches x
    classes x min(max_output_boxes_per_class, boxes), the rows planned.

    The three thresholds must be constants. center_point_box 0 reads boxes
    as [y1, x1, y2, x2] (either corner first), 1 as [x centre, y centre,
    width, height]. The candidates are sorted once (a heap sort), then
    each box kept checks the candidates after it: O(boxes x kept) per
    class at worst. Boxes past the count of counted boxes and scores are
    never candidates."""

    op_type = "NonMaxSuppression"
    compile_time_inputs = (2, 3, 4)
    count_axes = {0: 0}

    def attributes(self, raw, constants, opset):
        center = int(raw.get("center_point_box", 0))
        if center not in (0, 1):
            raise BuildError(f"center_point_box={center} is not supported; it is 0 or 1")
        most = _const_ints(constants, 2)
        threshold = _const_float(constants, 4)
        return {"center_point_box": center, "max_boxes": max(most[0], 0) if most else 0,
                "iou_threshold": _const_float(constants, 3) or 0.0,
                "score_threshold": threshold}

    def infer(self, inputs, attrs):
        if len(inputs) != 2:
            raise ShapeError(f"NonMaxSuppression takes boxes and scores at run time, got {len(inputs)} inputs")
        boxes, scores = inputs
        if len(boxes) != 3 or boxes[2] != 4 or len(scores) != 3 or scores[0] != boxes[0] or scores[2] != boxes[1]:
            raise ShapeError(f"NonMaxSuppression needs boxes [batches, boxes, 4] and scores "
                             f"[batches, classes, boxes], got {boxes} and {scores}")
        rows = boxes[0] * scores[1] * min(attrs["max_boxes"], boxes[1])
        return [(max(rows, 1), 3)]  # room for one row even when none can be selected

    def output_dtype(self, inputs, attrs):
        super().output_dtype(inputs, attrs)
        return ["int64", "int64"]

    def scratch_bytes(self, inputs, outputs, attrs):
        # A byte per box (still a candidate) and the candidates' indices, best first.
        boxes_n = inputs[0].shape[1]
        return -(-boxes_n // 8) * 8 + 8 * boxes_n

    def lower(self, k, inputs, outputs, attrs):
        bld = k.builder
        batches, boxes_n, _ = inputs[0].shape
        classes = inputs[1].shape[1]
        most = min(attrs["max_boxes"], boxes_n)
        boxes, scores = k.inputs[:2]
        out, count = k.typed(k.outputs[0], "int64"), k.typed(k.outputs[1], "int64")
        alive = bld.bitcast(k.scratch, I8.as_pointer())
        order = bld.bitcast(bld.gep(alive, [k.i64(-(-boxes_n // 8) * 8)]), ir.IntType(64).as_pointer())
        rows = k.variable(k.i64(0))
        one, zero = ir.Constant(I8, 1), ir.Constant(I8, 0)
        # Boxes past a count (crosscompile/extents.py) are never candidates.
        counted = [extent(k, inputs, attrs, pos, axis) for pos, axis in ((0, 1), (1, 2))
                   if (pos, axis) in attrs.get("extents", ())]
        center = attrs["center_point_box"]
        with k.loop(batches if most else 0) as b, k.loop(classes) as c:
            row = k.index((b, classes * boxes_n), (c, boxes_n))
            found = k.variable(k.i64(0))  # candidates, listed in order
            with k.loop(boxes_n) as j:
                live = [bld.icmp_signed("<", j, n) for n in counted]
                if attrs["score_threshold"] is not None:
                    live.append(bld.fcmp_ordered(">", k.load(scores, bld.add(row, j)),
                                                 k.f32(attrs["score_threshold"])))
                flag = one
                for check in live:
                    flag = bld.select(check, flag, zero)
                k.store(flag, alive, j)
                with bld.if_then(bld.icmp_unsigned("!=", flag, zero)):
                    m = bld.load(found)
                    k.store(j, order, m)
                    bld.store(bld.add(m, k.i64(1)), found)
            m = bld.load(found)
            _heap_sort(k, order, m, lambda i, j: _ranks_before(k, scores, row, i, j))
            # Best first: a candidate still in the running is kept and
            # suppresses the later ones it overlaps (ONNX words it as each
            # candidate checked against those kept before it; IoU is symmetric).
            chosen = k.variable(k.i64(0))
            with k.loop(m) as p:
                i = k.load(order, p)
                keep = bld.and_(bld.icmp_unsigned("!=", k.load(alive, i), zero),
                                bld.icmp_signed("<", bld.load(chosen), k.i64(most)))
                with bld.if_then(keep):
                    bld.store(bld.add(bld.load(chosen), k.i64(1)), chosen)
                    r = bld.load(rows)
                    for col, value in enumerate((b, c, i)):
                        k.store(value, out, k.index((r, 3), (col, 1)))
                    bld.store(bld.add(r, k.i64(1)), rows)
                    kept = _extent(k, boxes, k.index((b, boxes_n * 4), (i, 4)), center)
                    with k.loop(m, start=bld.add(p, k.i64(1))) as q:
                        j = k.load(order, q)
                        with bld.if_then(bld.icmp_unsigned("!=", k.load(alive, j), zero)):
                            other = _extent(k, boxes, k.index((b, boxes_n * 4), (j, 4)), center)
                            # Most pairs lie apart along x: the IoU only for the others.
                            apart = bld.fcmp_unordered("<=", k.minimum(kept[1], other[1]), k.maximum(kept[0], other[0]))
                            with bld.if_then(bld.not_(apart)):
                                with bld.if_then(self._overlaps(k, kept, other, attrs)):
                                    k.store(zero, alive, j)
        n = bld.load(rows)
        _zero_rest(k, out, bld.mul(n, k.i64(3)), outputs[0].shape[0] * 3)
        k.store(n, count, k.i64(0))
        k.activated = True

    @staticmethod
    def _overlaps(k: Kernel, a, b, attrs) -> ir.Value:
        """IoU of two boxes (their extents) above iou_threshold (an i1);
        boxes that do not intersect or have no area never suppress, as in
        ONNX's reference."""
        bld = k.builder
        low_x, high_x = k.maximum(a[0], b[0]), k.minimum(a[1], b[1])
        low_y, high_y = k.maximum(a[2], b[2]), k.minimum(a[3], b[3])
        inter = bld.fmul(bld.fsub(high_x, low_x), bld.fsub(high_y, low_y))
        area_a = bld.fmul(bld.fsub(a[1], a[0]), bld.fsub(a[3], a[2]))
        area_b = bld.fmul(bld.fsub(b[1], b[0]), bld.fsub(b[3], b[2]))
        union = bld.fsub(bld.fadd(area_a, area_b), inter)
        checks = [bld.fcmp_ordered(">", high_x, low_x), bld.fcmp_ordered(">", high_y, low_y),
                  bld.fcmp_ordered(">", inter, k.f32(0.0)), bld.fcmp_ordered(">", area_a, k.f32(0.0)),
                  bld.fcmp_ordered(">", area_b, k.f32(0.0)), bld.fcmp_ordered(">", union, k.f32(0.0)),
                  bld.fcmp_ordered(">", bld.fdiv(inter, union), k.f32(attrs["iou_threshold"]))]
        result = checks[0]
        for check in checks[1:]:
            result = bld.and_(result, check)
        return result


def _ranks_before(k: Kernel, scores, row, i: ir.Value, j: ir.Value) -> ir.Value:
    """Box i comes before box j: a higher score, or an equal one and a lower index."""
    bld = k.builder
    a, b = k.load(scores, bld.add(row, i)), k.load(scores, bld.add(row, j))
    return bld.or_(bld.fcmp_ordered(">", a, b), bld.and_(bld.fcmp_ordered("==", a, b), bld.icmp_signed("<", i, j)))


def _heap_sort(k: Kernel, items, length: ir.Value, before) -> None:
    """Sort the i64 items[0:length] in place so that before(items[p],
    items[q]) holds for p < q (before is a strict total order): a heap
    whose root comes last, its root moved to the end one at a time.
    O(length log length) without recursion or a stack."""
    bld = k.builder

    def sift(root: ir.Value, end: ir.Value) -> None:
        node = k.variable(root)
        with k.loop(64):  # deeper than any heap of 2**63 items
            at = bld.load(node)
            child = bld.add(bld.mul(at, k.i64(2)), k.i64(1))
            with bld.if_then(bld.icmp_signed("<", child, end)):
                right = bld.add(child, k.i64(1))
                has_right = bld.icmp_signed("<", right, end)
                left_item = k.load(items, child)
                right_item = k.load(items, bld.select(has_right, right, child))
                later = bld.select(bld.and_(has_right, before(left_item, right_item)), right, child)
                later_item = k.load(items, later)
                here = k.load(items, at)
                with bld.if_else(before(here, later_item)) as (swap, stop):
                    with swap:
                        k.store(later_item, items, at)
                        k.store(here, items, later)
                        bld.store(later, node)
                    with stop:
                        bld.store(end, node)

    with k.loop(bld.sdiv(length, k.i64(2))) as step:
        sift(bld.sub(bld.sub(bld.sdiv(length, k.i64(2)), k.i64(1)), step), length)
    with k.loop(bld.sub(length, k.i64(1))) as step:
        end = bld.sub(bld.sub(length, k.i64(1)), step)
        first = k.load(items, k.i64(0))
        k.store(k.load(items, end), items, k.i64(0))
        k.store(first, items, end)
        sift(k.i64(0), end)


def _extent(k: Kernel, boxes, at, center_point_box: int):
    """(x min, x max, y min, y max) of the box at boxes[at:at + 4]."""
    bld = k.builder
    v = [k.load(boxes, bld.add(at, k.i64(i))) for i in range(4)]
    if center_point_box:
        half_w, half_h = bld.fdiv(v[2], k.f32(2.0)), bld.fdiv(v[3], k.f32(2.0))
        return bld.fsub(v[0], half_w), bld.fadd(v[0], half_w), bld.fsub(v[1], half_h), bld.fadd(v[1], half_h)
    return k.minimum(v[1], v[3]), k.maximum(v[1], v[3]), k.minimum(v[0], v[2]), k.maximum(v[0], v[2])


def compressed_shape(x, condition, axis) -> tuple:
    """The upper bound of Compress's output for a run-time condition: every
    slice the condition can reach (at least one, for the zeros)."""
    if len(condition) != 1:
        raise ShapeError(f"Compress condition must be 1-D, got shape {condition}")
    if axis is None:
        return (max(min(condition[0], _prod(x)), 1),)
    axis = _axis(axis, len(x))
    return (*x[:axis], max(min(condition[0], x[axis]), 1), *x[axis + 1:])


def compressed_dtype(inputs) -> str:
    if inputs[1].dtype != "bool":
        raise BuildError(f"Compress condition {inputs[1].name!r} has dtype {inputs[1].dtype}; it must be bool")
    return inputs[0].dtype


def compress(k: Kernel, inputs, outputs, axis) -> None:
    """Compress by a run-time condition: the slices whose entry is true,
    in order, then zeros up to the bound; the count into output 1."""
    bld = k.builder
    x = inputs[0].shape
    if axis is None:
        outer, size, inner = 1, _prod(x), 1
    else:
        axis = _axis(axis, len(x))
        outer, size, inner = _prod(x[:axis]), x[axis], _prod(x[axis + 1:])
    reach = min(inputs[1].shape[0], size)
    bound = outputs[0].shape[0 if axis is None else axis]
    dtype = inputs[0].dtype
    data, out = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
    condition = k.typed(k.inputs[1], "bool")
    count = k.typed(k.outputs[1], "int64")
    kept = k.variable(k.i64(0))
    with k.loop(reach) as j:
        with bld.if_then(bld.icmp_unsigned("!=", k.load(condition, j), ir.Constant(I8, 0))):
            n = bld.load(kept)
            with k.loop(outer) as o, k.loop(inner) as i:
                value = k.load(data, k.index((o, size * inner), (j, inner), (i, 1)))
                k.store(value, out, k.index((o, bound * inner), (n, inner), (i, 1)))
            bld.store(bld.add(n, k.i64(1)), kept)
    n = bld.load(kept)
    zero = ir.Constant(out.type.pointee, 0)
    with k.loop(outer) as o, k.loop(bound, start=n) as j, k.loop(inner) as i:
        k.store(zero, out, k.index((o, bound * inner), (j, inner), (i, 1)))
    k.store(n, count, k.i64(0))
    k.activated = True


class Unique(Op):
    """ONNX Unique: the distinct elements (or slices along axis) Y, sorted
    ascending (lexicographically for slices) or, with sorted=0, in the
    order they first appear; indices, the first position of each in the
    input; inverse_indices, for each input element or slice the position
    of its value in Y; counts, how often each appears. Y, indices and
    counts are counted (at most every element or slice); inverse_indices
    has the input's length. Slices are compared element by element:
    O(slices^2 x slice size)."""

    op_type = "Unique"
    data_dtypes = ("float32", "int64", "int32", "int8", "uint8")
    counts_outputs = True

    def attributes(self, raw, constants, opset):
        return {"axis": int(raw["axis"]) if "axis" in raw else None, "sorted": int(raw.get("sorted", 1))}

    def counted(self, attrs):
        axis = 0 if attrs["axis"] is None else attrs["axis"]
        return {pos: axis if pos == 0 else 0 for pos in (0, 1, 3) if pos < attrs["outputs"]}

    def _geometry(self, x, attrs):
        """(outer, slices, inner) of the input around axis (flat without one)."""
        if attrs["axis"] is None:
            return 1, _prod(x), 1
        axis = _axis(attrs["axis"], len(x))
        return _prod(x[:axis]), x[axis], _prod(x[axis + 1:])

    def infer(self, inputs, attrs):
        x = inputs[0]
        _, slices, _ = self._geometry(x, attrs)
        y = (slices,) if attrs["axis"] is None else tuple(
            slices if a == _axis(attrs["axis"], len(x)) else d for a, d in enumerate(x))
        return [y, (slices,), (slices,), (slices,)][:attrs["outputs"]]

    def output_dtype(self, inputs, attrs):
        return [super().output_dtype(inputs, attrs), "int64", "int64", "int64"][:attrs["outputs"]]

    def scratch_bytes(self, inputs, outputs, attrs):
        return 8 * self._geometry(inputs[0].shape, attrs)[1]  # the first position of each distinct slice

    def lower(self, k, inputs, outputs, attrs):
        bld = k.builder
        outer, slices, inner = self._geometry(inputs[0].shape, attrs)
        wanted = attrs["outputs"]
        data = k.typed(k.inputs[0], inputs[0].dtype)
        reps = bld.bitcast(k.scratch, ir.IntType(64).as_pointer())

        def element(j, e):
            o, i = bld.udiv(e, k.i64(inner)), bld.urem(e, k.i64(inner))
            return k.load(data, k.index((o, slices * inner), (j, inner), (i, 1)))

        def compare(a, b, less: bool):
            """Slice a equals (or, with less, sorts before) slice b, an i1."""
            decided = k.variable(ir.Constant(I8, 0))
            result = k.variable(ir.Constant(I8, 0 if less else 1))
            with k.loop(outer * inner) as e:
                va, vb = element(a, e), element(b, e)
                if isinstance(va.type, ir.IntType):
                    differ, below = bld.icmp_signed("!=", va, vb), bld.icmp_signed("<", va, vb)
                else:
                    differ, below = bld.fcmp_ordered("!=", va, vb), bld.fcmp_ordered("<", va, vb)
                first = bld.and_(differ, bld.icmp_unsigned("==", bld.load(decided), ir.Constant(I8, 0)))
                with bld.if_then(first):
                    bld.store(ir.Constant(I8, 1), decided)
                    bld.store(bld.zext(below, I8) if less else ir.Constant(I8, 0), result)
            return bld.icmp_unsigned("!=", bld.load(result), ir.Constant(I8, 0))

        distinct = k.variable(k.i64(0))
        with k.loop(slices) as j:
            seen = k.variable(ir.Constant(I8, 0))
            with k.loop(bld.load(distinct)) as v:
                same = compare(k.load(reps, v), j, less=False)
                bld.store(bld.or_(bld.load(seen), bld.zext(same, I8)), seen)
            with bld.if_then(bld.icmp_unsigned("==", bld.load(seen), ir.Constant(I8, 0))):
                u = bld.load(distinct)
                k.store(j, reps, u)
                bld.store(bld.add(u, k.i64(1)), distinct)
        u = bld.load(distinct)
        if attrs["sorted"]:
            # Insertion sort of the first positions by their slices.
            with k.loop(u, start=1) as v:
                moving = k.load(reps, v)
                place = k.variable(v)
                with k.loop(v) as step:
                    q = bld.sub(v, step)
                    above = k.load(reps, bld.sub(q, k.i64(1)))
                    with bld.if_then(bld.and_(bld.icmp_signed("==", bld.load(place), q),
                                              compare(moving, above, less=True))):
                        k.store(above, reps, q)
                        bld.store(bld.sub(q, k.i64(1)), place)
                k.store(moving, reps, bld.load(place))
        def first_position(v):
            """Where the v-th distinct slice first appears; 0 past the distinct ones."""
            return bld.select(bld.icmp_signed("<", v, u), k.load(reps, v), k.i64(0))

        # Past the distinct ones: slice 0's position, and zeros in Y.
        y = k.typed(k.outputs[0], inputs[0].dtype)
        zero = ir.Constant(y.type.pointee, 0)
        with k.loop(outer) as o, k.loop(slices) as v, k.loop(inner) as i:
            source = k.load(data, k.index((o, slices * inner), (first_position(v), inner), (i, 1)))
            k.store(bld.select(bld.icmp_signed("<", v, u), source, zero), y,
                    k.index((o, slices * inner), (v, inner), (i, 1)))
        outs = [k.typed(p, "int64") for p in k.outputs[1:wanted]]
        if wanted > 1:
            with k.loop(slices) as v:
                k.store(first_position(v), outs[0], v)
        if wanted > 2:
            if wanted > 3:
                with k.loop(slices) as v:
                    k.store(k.i64(0), outs[2], v)
            with k.loop(slices) as j, k.loop(u) as v:
                with bld.if_then(compare(k.load(reps, v), j, less=False)):
                    k.store(v, outs[1], j)
                    if wanted > 3:
                        k.store(bld.add(k.load(outs[2], v), k.i64(1)), outs[2], v)
        k.store(u, k.typed(k.outputs[wanted], "int64"), k.i64(0))
        k.activated = True
