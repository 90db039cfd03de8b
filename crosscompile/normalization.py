"""Ops that normalise rows of a tensor by statistics of the row:
LayerNormalization, InstanceNormalization and GroupNormalization. Each
row is read three times: its mean, its spread about the mean, then the
output; both statistics are summed in vector accumulators by
reduce.reduce_row."""
from __future__ import annotations

from .elementwise import _merge_dims
from .emit import Kernel
from .errors import BuildError, ShapeError
from .op_base import Op, _axis, _broadcast_strides, _check_choice, _prod
from .reduce import broadcast_scalar, reduce_row


def row_statistics(k: Kernel, base, length: int, epsilon: float):
    """(mean, 1 / sqrt(variance + epsilon)) of X[base : base + length]; the
    variance is taken about the mean in a second pass (a one-pass
    E[x^2] - E[x]^2 cancels badly for rows far from 0)."""
    bld = k.builder
    X = k.inputs[0]
    mean = bld.fmul(reduce_row(k, X, base, length, bld.fadd, 0.0), k.f32(1.0 / length))

    def square_deviation(value):
        d = bld.fsub(value, broadcast_scalar(k, mean, value))
        return bld.fmul(d, d)
    spread = reduce_row(k, X, base, length, bld.fadd, 0.0, square_deviation)
    variance = bld.fmul(spread, k.f32(1.0 / length))
    return mean, bld.fdiv(k.f32(1.0), k.sqrt(bld.fadd(variance, k.f32(epsilon))))


class LayerNormalization(Op):
    """Y = (X - mean) / sqrt(var + epsilon) * Scale + B over the axes from
    `axis` on (opset 17), with the optional outputs Mean and InvStdDev
    (shape X's up to axis, then 1s). patterns.fuse_layer_norm turns the
    ReduceMean ... Div, Mul, Add chain exporters write before opset 17 into
    this op."""

    op_type = "LayerNormalization"
    counts_outputs = True

    def attributes(self, raw, constants, opset):
        return {"axis": int(raw.get("axis", -1)), "epsilon": float(raw.get("epsilon", 1e-5))}

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise ShapeError(f"LayerNormalization takes X, Scale and an optional B; got {len(inputs)} inputs")
        x = inputs[0]
        normalized = x[_axis(attrs["axis"], len(x)):]
        for name, shape in zip(("Scale", "B"), inputs[1:]):
            if len(shape) > len(normalized) or any(d not in (1, n) for d, n in zip(shape[::-1], normalized[::-1])):
                raise ShapeError(f"LayerNormalization {name} of shape {shape} does not broadcast to the "
                                 f"normalized shape {normalized} of X {x} (axis {attrs['axis']})")
        statistics = x[:len(x) - len(normalized)] + (1,) * len(normalized)
        return [x, statistics, statistics][:max(1, attrs.get("outputs", 1))]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        axis = _axis(attrs["axis"], len(x))
        normalized = x[axis:] or (1,)
        length = _prod(normalized)
        bld = k.builder
        row_strides = _broadcast_strides(normalized, normalized)
        shape, (strides, *affine) = _merge_dims(
            normalized, [row_strides] + [_broadcast_strides(t.shape, normalized) for t in inputs[1:]])
        with k.loop(_prod(x[:axis])) as o:
            base = k.index((o, length))
            mean, rstd = self.statistics(k, base, length, attrs["epsilon"])
            for statistic, ptr in zip((mean, rstd), k.outputs[1:]):
                k.store(statistic, ptr, o)
            with k.nested_loops(shape) as idx:
                at = k.index((base, 1), *zip(idx, strides))
                value = bld.fmul(bld.fsub(k.load(k.inputs[0], at), mean), rstd)
                value = bld.fmul(value, k.load(k.inputs[1], k.index(*zip(idx, affine[0]))))
                if len(affine) == 2:
                    value = bld.fadd(value, k.load(k.inputs[2], k.index(*zip(idx, affine[1]))))
                k.store(k.activate(value), k.outputs[0], at)

    def statistics(self, k: Kernel, base, length: int, epsilon: float):
        """(the value subtracted, the factor) of one row."""
        return row_statistics(k, base, length, epsilon)


class RMSNormalization(LayerNormalization):
    """Y = X / sqrt(mean(X^2) + epsilon) * Scale over the axes from `axis`
    on (opset 23); statistics are kept in float32 whatever stash_type says."""

    op_type = "RMSNormalization"
    counts_outputs = False

    def infer(self, inputs, attrs):
        if len(inputs) != 2:
            raise ShapeError(f"RMSNormalization takes X and Scale; got {len(inputs)} inputs")
        return super().infer(inputs, attrs)[:1]

    def statistics(self, k, base, length, epsilon):
        bld = k.builder
        squares = reduce_row(k, k.inputs[0], base, length, bld.fadd, 0.0, lambda v: bld.fmul(v, v))
        mean_square = bld.fmul(squares, k.f32(1.0 / length))
        return k.f32(0.0), bld.fdiv(k.f32(1.0), k.sqrt(bld.fadd(mean_square, k.f32(epsilon))))


def _per_channel_rows(k: Kernel, x, groups: int, epsilon: float, scale_of, bias_of) -> None:
    """Normalise each of the N * groups rows of X (N, C, spatial...), a row
    being C / groups whole channels, and scale and shift each channel c by
    scale_of(c), bias_of(c)."""
    bld = k.builder
    channels, spatial = x[1], _prod(x[2:])
    per_group = channels // groups
    length = per_group * spatial
    with k.loop(x[0] * groups) as row:
        base = k.index((row, length))
        mean, rstd = row_statistics(k, base, length, epsilon)
        with k.loop(per_group) as j:
            c = k.index((bld.urem(row, k.i64(groups)), per_group), (j, 1))
            a = bld.fmul(rstd, scale_of(c))
            b = bld.fsub(bias_of(c), bld.fmul(mean, a))
            with k.loop(spatial) as i:
                at = k.index((base, 1), (j, spatial), (i, 1))
                k.store(k.activate(bld.fadd(bld.fmul(k.load(k.inputs[0], at), a), b)), k.outputs[0], at)


class InstanceNormalization(Op):
    """Y = (X - mean) / sqrt(var + epsilon) * scale[c] + B[c], the
    statistics taken over the spatial axes of each image and channel."""

    op_type = "InstanceNormalization"

    def attributes(self, raw, constants, opset):
        return {"epsilon": float(raw.get("epsilon", 1e-5))}

    def infer(self, inputs, attrs):
        if len(inputs) != 3 or len(inputs[0]) < 3:
            raise ShapeError(f"InstanceNormalization takes X (N, C, spatial...), scale and B; got {inputs}")
        channels = inputs[0][1]
        if any(tuple(s) != (channels,) for s in inputs[1:]):
            raise ShapeError(f"InstanceNormalization scale and B of shapes {inputs[1:]} should be ({channels},)")
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        _per_channel_rows(k, x, x[1], attrs["epsilon"],
                          lambda c: k.load(k.inputs[1], c), lambda c: k.load(k.inputs[2], c))


class GroupNormalization(Op):
    """InstanceNormalization over groups of num_groups channels. The scale
    and bias are per channel (opset 21) or, in the opset-18 form, per group."""

    op_type = "GroupNormalization"

    def attributes(self, raw, constants, opset):
        if "num_groups" not in raw:
            raise BuildError("GroupNormalization needs the num_groups attribute")
        if int(raw.get("stash_type", 1)) != 1:
            raise BuildError(f"stash_type={raw['stash_type']} is not supported (statistics are float32)")
        return {"num_groups": int(raw["num_groups"]), "epsilon": float(raw.get("epsilon", 1e-5)),
                "per_group": opset < 21}

    def infer(self, inputs, attrs):
        if len(inputs) != 3 or len(inputs[0]) < 3:
            raise ShapeError(f"GroupNormalization takes X (N, C, spatial...), scale and bias; got {inputs}")
        channels, groups = inputs[0][1], attrs["num_groups"]
        if groups < 1 or channels % groups:
            raise ShapeError(f"num_groups={groups} does not divide the {channels} channels of {inputs[0]}")
        want = groups if attrs["per_group"] else channels
        if any(tuple(s) != (want,) for s in inputs[1:]):
            raise ShapeError(f"GroupNormalization scale and bias of shapes {inputs[1:]} should be ({want},)")
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        groups = attrs["num_groups"]
        per_group = x[1] // groups

        def param(pos):
            if attrs["per_group"]:
                return lambda c: k.load(k.inputs[pos], k.builder.udiv(c, k.i64(per_group)))
            return lambda c: k.load(k.inputs[pos], c)
        _per_channel_rows(k, x, groups, attrs["epsilon"], param(1), param(2))


class LpNormalization(Op):
    """x / ||x||_p along axis (default -1) for p = 1 or 2 (default 2); where
    the norm is 0 the result is 0 (ONNX's reference)."""

    op_type = "LpNormalization"

    def attributes(self, raw, constants, opset):
        p = int(raw.get("p", 2))
        _check_choice("p", p, (1, 2))
        return {"axis": int(raw.get("axis", -1)), "p": p}

    def infer(self, inputs, attrs):
        _axis(attrs["axis"], len(inputs[0]))
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        shape = inputs[0].shape
        axis = _axis(attrs["axis"], len(shape))
        outer, length, inner = _prod(shape[:axis]), shape[axis], _prod(shape[axis + 1:])
        b, X = k.builder, k.inputs[0]
        with k.loop(outer) as o, k.loop(inner) as r:
            base = k.index((o, length * inner), (r, 1))
            total = k.variable(k.f32(0.0))
            with k.loop(length) as j:
                x = k.load(X, k.index((base, 1), (j, inner)))
                term = b.fmul(x, x) if attrs["p"] == 2 else k.maximum(x, b.fsub(k.f32(0.0), x))
                b.store(b.fadd(b.load(total), term), total)
            norm = k.sqrt(b.load(total)) if attrs["p"] == 2 else b.load(total)
            zero = b.fcmp_ordered("==", norm, k.f32(0.0))
            with k.loop(length) as j:
                at = k.index((base, 1), (j, inner))
                value = b.select(zero, k.f32(0.0), b.fdiv(k.load(X, at), norm))
                k.store(k.activate(value), k.outputs[0], at)
