"""The training losses ONNX defines, for models exported with their loss
(evaluation graphs): NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss
with per-class weights, ignore_index and every reduction."""
from __future__ import annotations

import math

from .errors import BuildError, ShapeError
from .emit import Kernel
from .op_base import Op, _check_choice, _prod

REDUCTIONS = ("none", "sum", "mean")


def _loss_attributes(raw: dict) -> dict:
    reduction = raw.get("reduction", "mean")
    _check_choice("reduction", reduction, REDUCTIONS)
    ignore = raw.get("ignore_index")
    return {"reduction": reduction, "ignore_index": None if ignore is None else int(ignore)}


def _loss_shape(op_type: str, scores, labels, weights, attrs):
    if len(scores) < 2 or tuple(labels) != (scores[0], *scores[2:]):
        raise ShapeError(f"{op_type}: labels of shape {tuple(labels)} do not fit scores of shape {tuple(scores)} "
                         "(N, C, d1, ...): they should be (N, d1, ...)")
    if weights is not None and tuple(weights) != (scores[1],):
        raise ShapeError(f"{op_type}: weights of shape {tuple(weights)} should be ({scores[1]},)")
    return tuple(labels) if attrs["reduction"] == "none" else ()


def _loss_dtypes(op_type: str, inputs) -> None:
    bad = [t for t in inputs[:1] + inputs[2:] if t.dtype != "float32"]
    if bad or inputs[1].dtype not in ("int64", "int32"):
        shown = ", ".join(f"{t.name!r} {t.dtype}" for t in inputs)
        raise BuildError(f"{op_type} takes float32 scores and weights and int64 or int32 labels; got dtype {shown}")


def negative_log_likelihood(k: Kernel, log_prob, inputs, attrs, loss) -> None:
    """loss = -log_prob[n, label, d] * weight[label] (0 for ignore_index),
    per element (reduction none), summed, or summed and divided by the sum
    of the weights used (mean)."""
    b = k.builder
    shape, weighted = inputs[0].shape, len(inputs) == 3
    n, classes, inner = shape[0], shape[1], _prod(shape[2:])
    labels = k.typed(k.inputs[1], inputs[1].dtype)
    total, weight_sum = k.variable(k.f32(0.0)), k.variable(k.f32(0.0))
    with k.loop(n) as i, k.loop(inner) as d:
        at = k.index((i, inner), (d, 1))
        label = k.load(labels, at)
        if label.type.width < 64:
            label = b.sext(label, k.i64(0).type)
        inside = k.in_range(label, classes)
        keep = inside
        if attrs["ignore_index"] is not None:
            keep = b.and_(keep, b.icmp_signed("!=", label, k.i64(attrs["ignore_index"])))
        c = b.select(inside, label, k.i64(0))
        weight = k.load(k.inputs[2], c) if weighted else k.f32(1.0)
        weight = b.select(keep, weight, k.f32(0.0))
        value = b.fmul(b.fsub(k.f32(0.0), k.load(log_prob, k.index((i, classes * inner), (c, inner), (d, 1)))), weight)
        value = b.select(keep, value, k.f32(0.0))
        if attrs["reduction"] == "none":
            k.store(value, loss, at)
        else:
            b.store(b.fadd(b.load(total), value), total)
            b.store(b.fadd(b.load(weight_sum), weight), weight_sum)
    if attrs["reduction"] == "sum":
        k.store(b.load(total), loss, k.i64(0))
    elif attrs["reduction"] == "mean":
        k.store(b.fdiv(b.load(total), b.load(weight_sum)), loss, k.i64(0))


class NegativeLogLikelihoodLoss(Op):
    """Inputs: log-probabilities (N, C, d1, ...), labels (N, d1, ...) and
    optional weights (C)."""

    op_type = "NegativeLogLikelihoodLoss"

    def attributes(self, raw, constants, opset):
        return _loss_attributes(raw)

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise ShapeError(f"{self.op_type} takes input, target and optional weight; got {len(inputs)} inputs")
        return [_loss_shape(self.op_type, inputs[0], inputs[1], inputs[2] if len(inputs) == 3 else None, attrs)]

    def output_dtype(self, inputs, attrs):
        _loss_dtypes(self.op_type, inputs)
        return "float32"

    def lower(self, k, inputs, outputs, attrs):
        negative_log_likelihood(k, k.inputs[0], inputs, attrs, k.outputs[0])
        k.activated = True


class SoftmaxCrossEntropyLoss(NegativeLogLikelihoodLoss):
    """NegativeLogLikelihoodLoss of the log-softmax of the scores over axis
    1, with that log-softmax as the optional second output."""

    op_type = "SoftmaxCrossEntropyLoss"
    counts_outputs = True

    def infer(self, inputs, attrs):
        loss = super().infer(inputs, attrs)
        return loss + [inputs[0]] if attrs.get("outputs", 1) > 1 else loss

    def scratch_bytes(self, inputs, outputs, attrs):
        return 0 if len(outputs) > 1 else 4 * inputs[0].size

    def lower(self, k, inputs, outputs, attrs):
        shape = inputs[0].shape
        log_prob = k.outputs[1] if len(outputs) > 1 else k.builder.bitcast(k.scratch, k.outputs[0].type)
        _log_softmax(k, k.inputs[0], log_prob, shape)
        negative_log_likelihood(k, log_prob, inputs, attrs, k.outputs[0])
        k.activated = True


def _log_softmax(k: Kernel, scores, out, shape) -> None:
    """out = scores - max - log(sum(exp(scores - max))) over axis 1."""
    b = k.builder
    classes, inner = shape[1], _prod(shape[2:])
    with k.loop(shape[0]) as i, k.loop(inner) as d:
        base = k.index((i, classes * inner), (d, 1))
        peak = k.variable(k.f32(-math.inf))
        with k.loop(classes) as c:
            b.store(k.maximum(b.load(peak), k.load(scores, k.index((base, 1), (c, inner)))), peak)
        total = k.variable(k.f32(0.0))
        with k.loop(classes) as c:
            shifted = b.fsub(k.load(scores, k.index((base, 1), (c, inner))), b.load(peak))
            b.store(b.fadd(b.load(total), k.exp(shifted)), total)
        log_total = k.log(b.load(total))
        with k.loop(classes) as c:
            at = k.index((base, 1), (c, inner))
            k.store(b.fsub(b.fsub(k.load(scores, at), b.load(peak)), log_total), out, at)
