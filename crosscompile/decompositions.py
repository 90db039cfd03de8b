"""Ops written out at import as nodes of ops that crosscompile lowers,
once their inputs' shapes (and the inputs that set output shapes) are
known: DFT and STFT as a MatMul with a constant matrix of the transform,
Det as the sum of signed products over permutations, MaxUnpool as a
ScatterElements into zeros, ReverseSequence as a GatherElements with
indices computed from the lengths, TensorScatter as a GatherElements from
the update and a Where, BatchNormalization in training mode by the
batch's own statistics, the training optimizers as element-wise ops,
EyeLike as the constant it is, the
Optional ops on tensors (which are never absent) as what they give.

Each entry of DECOMPOSED is one op: the function that writes its nodes,
the inputs it needs at compile time, and what it takes. The nodes it
returns compute the op's outputs under their own names; the tensors they
make in between are named after the node, so that two nodes never
collide.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from .errors import BuildError


@dataclass
class Site:
    """One node being decomposed: its name, the model's opset, the known
    shapes and dtypes of tensors and constants, and a way to add constants."""

    node: onnx.NodeProto
    raw: dict
    name: str
    opset: int
    tensors: dict    # name -> ir.Tensor
    constants: dict  # name -> np.ndarray
    add_constant: Callable

    @property
    def where(self) -> str:
        return f"node {self.name!r} ({self.node.op_type})"

    def input(self, pos: int) -> str:
        return self.node.input[pos] if pos < len(self.node.input) else ""

    def shape(self, pos: int) -> tuple:
        return self.tensors[self.input(pos)].shape

    def constant(self, pos: int, what: str):
        """Input pos's value, None when it is left out; refused when it is
        computed at run time."""
        name = self.input(pos)
        if not name:
            return None
        if name not in self.constants:
            raise BuildError(f"{self.where}: input {name!r} ({what}) must be a constant (an initializer or "
                             "Constant node): it sets the output's shape")
        return np.asarray(self.constants[name])

    def const(self, label: str, value) -> str:
        """A new constant named after the node."""
        name = f"{self.name}/{label}"
        self.add_constant(name, np.asarray(value))
        return name

    def tensor(self, label: str) -> str:
        return f"{self.name}/{label}"

    def make(self, op_type: str, inputs: list, outputs: list, **attrs) -> onnx.NodeProto:
        return helper.make_node(op_type, inputs, outputs, name=f"{self.name}/{outputs[0].rsplit('/', 1)[-1]}",
                                **attrs)


# --- DFT and STFT -------------------------------------------------------

def paired_rows(length: int) -> "tuple[list, int]":
    """How a full-length transform arranges its input's points: the points
    standing alone (0, and length/2 when even), then p pairs (n, length-n)
    as their sums, then as their differences. Real input points then meet
    their mirror images before any multiplication, so a spectrum with
    Hermitian symmetry gives imaginary parts of exactly zero (and a real
    one real parts), not float32's rounding of a cancellation."""
    pairs = (length - 1) // 2 if length > 2 else 0
    return [0] + ([length // 2] if length % 2 == 0 and pairs else []) + \
        (list(range(1, length)) if not pairs else []), pairs


def transform_matrix(length_in: int, channels: int, dft_length: int, *, inverse: bool, onesided: bool) -> np.ndarray:
    """The matrix W with rows @ W = the transform, for rows holding the
    input's points (as paired_rows arranges them when length_in equals
    dft_length) of `channels` (1: real, 2: real and imaginary) interleaved,
    and the result K points of (real, imaginary) interleaved, or for the
    inverse of a one-sided spectrum (numpy's irfft) dft_length real points.

    >>> x = np.random.rand(3, 2); W = transform_matrix(3, 2, 5, inverse=False, onesided=False)
    >>> np.allclose((x.reshape(1, 6) @ W).reshape(5, 2) @ [1, 1j], np.fft.fft(x @ [1, 1j], 5))
    True
    """
    if inverse and onesided:
        # The full spectrum is Hermitian: each point between 0 and the
        # Nyquist one stands for itself and its mirror image.
        k = np.arange(length_in)[:, None]
        m = np.arange(dft_length)[None, :]
        theta = 2 * np.pi * ((k * m) % dft_length) / dft_length
        weight = np.where((k == 0) | (2 * k == dft_length), 1.0, 2.0) / dft_length
        weight = np.where(k < min(length_in, dft_length // 2 + 1), weight, 0.0)
        w = np.zeros((length_in, channels, dft_length, 1))
        w[:, 0, :, 0] = weight * np.cos(theta)
        if channels == 2:
            w[:, 1, :, 0] = -weight * np.sin(theta)
        return w.reshape(length_in * channels, dft_length).astype(np.float32)
    outputs = dft_length // 2 + 1 if onesided else dft_length
    sign, scale = (1.0, 1.0 / dft_length) if inverse else (-1.0, 1.0)
    k = np.arange(outputs)[None, :]

    def angle(n):
        return 2 * np.pi * ((np.asarray(n)[:, None] * k) % dft_length) / dft_length

    if length_in == dft_length:
        alone, pairs = paired_rows(length_in)
        p = np.arange(1, pairs + 1)
        weights = np.concatenate([np.exp(1j * sign * angle(alone)),   # x_n e^{i s theta}
                                  np.cos(angle(p)) + 0j,              # x_p + x_-p: their cos part
                                  1j * sign * np.sin(angle(p))])      # x_p - x_-p: their sin part
    else:
        weights = np.exp(1j * sign * angle(np.arange(length_in)))
        weights[dft_length:] = 0  # points beyond dft_length are cut off
    weights = scale * weights
    weights.real[np.abs(weights.real) < 1e-12] = 0
    weights.imag[np.abs(weights.imag) < 1e-12] = 0
    # (a + ib)(wr + i wi) = (a wr - b wi) + i (a wi + b wr)
    w = np.zeros((length_in, channels, outputs, 2))
    w[:, 0, :, 0], w[:, 0, :, 1] = weights.real, weights.imag
    if channels == 2:
        w[:, 1, :, 0], w[:, 1, :, 1] = -weights.imag, weights.real
    return w.reshape(length_in * channels, outputs * 2).astype(np.float32)


def _transform_along(site: Site, x: str, shape: tuple, axis: int, dft_length: int, *, inverse: bool,
                     onesided: bool, out: str) -> list:
    """Nodes computing the transform of x (shape, its last axis the
    channels) along axis into out."""
    rank, channels = len(shape), shape[-1]
    if channels not in (1, 2):
        raise BuildError(f"{site.where}: the last axis of the input has {channels} elements; it must be 1 (real) "
                         "or 2 (real and imaginary)")
    if not 0 <= axis < rank - 1:
        raise BuildError(f"{site.where}: axis {axis} is out of range for a rank-{rank} input (the last axis holds "
                         "the real and imaginary parts)")
    length = shape[axis]
    w = transform_matrix(length, channels, dft_length, inverse=inverse, onesided=onesided)
    out_channels = 1 if inverse and onesided else 2
    points = w.shape[1] // out_channels
    others = [d for d in range(rank - 1) if d != axis]
    perm = others + [axis, rank - 1]
    moved = [shape[d] for d in others]
    nodes = [site.make("Transpose", [x], [site.tensor("moved")], perm=perm)]
    rows = site.tensor("moved")
    alone, pairs = paired_rows(length)
    if length == dft_length and pairs and not (inverse and onesided):
        lead = len(moved)
        p = np.arange(1, pairs + 1)
        nodes += [site.make("Gather", [rows, site.const("alone_index", np.array(alone, np.int64))], [site.tensor("alone")],
                            axis=lead),
                  site.make("Gather", [rows, site.const("first_index", p)], [site.tensor("first")], axis=lead),
                  site.make("Gather", [rows, site.const("mirror_index", length - p)], [site.tensor("mirror")], axis=lead),
                  site.make("Add", [site.tensor("first"), site.tensor("mirror")], [site.tensor("sums")]),
                  site.make("Sub", [site.tensor("first"), site.tensor("mirror")], [site.tensor("differences")]),
                  site.make("Concat", [site.tensor("alone"), site.tensor("sums"), site.tensor("differences")],
                            [site.tensor("paired")], axis=lead)]
        rows = site.tensor("paired")
    nodes += [site.make("Reshape", [rows, site.const("rows_shape", moved + [w.shape[0]])], [site.tensor("rows")]),
              site.make("MatMul", [site.tensor("rows"), site.const("transform", w)], [site.tensor("transformed")]),
              site.make("Reshape", [site.tensor("transformed"), site.const("points_shape", moved + [points, out_channels])],
                        [site.tensor("points")]),
              site.make("Transpose", [site.tensor("points")], [out], perm=[int(v) for v in np.argsort(perm)])]
    return nodes


def _dft(site: Site) -> list:
    shape = site.shape(0)
    if site.opset >= 20:
        axis_value = site.constant(2, "axis")
        axis = -2 if axis_value is None else int(axis_value.reshape(-1)[0])
    else:
        axis = int(site.raw.get("axis", 1))
    if not -len(shape) <= axis < len(shape):
        raise BuildError(f"{site.where}: axis {axis} is out of range for a rank-{len(shape)} input")
    axis %= len(shape)
    inverse, onesided = bool(site.raw.get("inverse", 0)), bool(site.raw.get("onesided", 0))
    length = site.constant(1, "dft_length")
    if length is not None:
        dft_length = int(length.reshape(-1)[0])
    elif inverse and onesided:
        dft_length = 2 * (shape[axis] - 1)
    else:
        dft_length = shape[axis] if axis < len(shape) else 0
    if dft_length < 1:
        raise BuildError(f"{site.where}: dft_length {dft_length} must be at least 1")
    return _transform_along(site, site.input(0), shape, axis, dft_length, inverse=inverse, onesided=onesided,
                            out=site.node.output[0])


def _stft(site: Site) -> list:
    shape = site.shape(0)
    if len(shape) != 3:
        raise BuildError(f"{site.where}: the signal has shape {shape}; it must be [batch, length, 1 or 2]")
    step = int(site.constant(1, "frame_step").reshape(-1)[0])
    window = site.input(2)
    given_length = site.constant(3, "frame_length")
    if given_length is not None:
        frame_length = int(given_length.reshape(-1)[0])
    elif window:
        frame_length = site.tensors[window].shape[0]
    else:
        frame_length = shape[1]
    if step < 1 or not 1 <= frame_length <= shape[1]:
        raise BuildError(f"{site.where}: frame_step {step} and frame_length {frame_length} do not fit a signal of "
                         f"{shape[1]} points")
    if window and site.tensors[window].shape != (frame_length,):
        raise BuildError(f"{site.where}: the window has shape {site.tensors[window].shape}; it must be "
                         f"({frame_length},), the frame length")
    frames = 1 + (shape[1] - frame_length) // step
    starts = np.arange(frames)[:, None] * step + np.arange(frame_length)[None, :]
    framed = site.tensor("frames")
    nodes = [site.make("Gather", [site.input(0), site.const("frame_points", starts.astype(np.int64))], [framed],
                       axis=1)]
    if window:
        nodes += [site.make("Reshape", [window, site.const("window_shape", [frame_length, 1])],
                            [site.tensor("window")]),
                  site.make("Mul", [framed, site.tensor("window")], [site.tensor("windowed")])]
        framed = site.tensor("windowed")
    onesided = bool(site.raw.get("onesided", 1))
    return nodes + _transform_along(site, framed, (shape[0], frames, frame_length, shape[2]), 2, frame_length,
                                    inverse=False, onesided=onesided, out=site.node.output[0])


# --- the rest -------------------------------------------------------------

# Det's sum over permutations grows as n!; beyond this size it is refused.
MAX_DET_SIZE = 5


def _det(site: Site) -> list:
    shape = site.shape(0)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise BuildError(f"{site.where}: the input has shape {shape}; it must end in a square matrix")
    n, batch = shape[-1], list(shape[:-2])
    if n > MAX_DET_SIZE:
        raise BuildError(f"{site.where}: a {n}x{n} determinant is not supported (up to "
                         f"{MAX_DET_SIZE}x{MAX_DET_SIZE}, computed as a sum over permutations)")
    perms = list(itertools.permutations(range(n)))
    signs = [1.0 if _even(p) else -1.0 for p in perms]
    flat = site.tensor("entries")
    nodes = [site.make("Reshape", [site.input(0), site.const("entries_shape", batch + [n * n])], [flat])]
    product = ""
    for row in range(n):
        picked = site.tensor(f"row_{row}")
        index = site.const(f"row_{row}_index", np.array([row * n + p[row] for p in perms], dtype=np.int64))
        nodes.append(site.make("Gather", [flat, index], [picked], axis=len(batch)))
        if product:
            nodes.append(site.make("Mul", [product, picked], [site.tensor(f"product_{row}")]))
            product = site.tensor(f"product_{row}")
        else:
            product = picked
    nodes.append(site.make("MatMul", [product, site.const("signs", np.array(signs, np.float32)[:, None])],
                           [site.tensor("sum")]))
    nodes.append(site.make("Reshape", [site.tensor("sum"), site.const("out_shape", np.array(batch, np.int64))],
                           [site.node.output[0]]))
    return nodes


def _even(perm) -> bool:
    inversions = sum(a > b for a, b in itertools.combinations(perm, 2))
    return inversions % 2 == 0


def _max_unpool(site: Site) -> list:
    shape = site.shape(0)
    if site.shape(1) != shape:
        raise BuildError(f"{site.where}: the indices have shape {site.shape(1)}, the input {shape}; they must match")
    kernel = [int(v) for v in site.raw.get("kernel_shape", ())]
    spatial = len(shape) - 2
    if len(kernel) != spatial:
        raise BuildError(f"{site.where}: kernel_shape {kernel} must have one entry per spatial axis ({spatial})")
    strides = [int(v) for v in site.raw.get("strides", [1] * spatial)]
    pads = [int(v) for v in site.raw.get("pads", [0] * 2 * spatial)]
    inferred = list(shape[:2]) + [(shape[2 + d] - 1) * strides[d] - pads[d] - pads[spatial + d] + kernel[d]
                                  for d in range(spatial)]
    given = site.constant(2, "output_shape")
    wanted = inferred if given is None else [int(v) for v in given.reshape(-1)]
    if len(wanted) != len(shape) or any(w < i for w, i in zip(wanted, inferred)) or wanted[:2] != inferred[:2]:
        raise BuildError(f"{site.where}: output_shape {wanted} must keep the batch and channels and be at least "
                         f"the unpooled shape {inferred}")
    flat = site.tensor("scattered")
    nodes = [site.make("Reshape", [site.input(0), site.const("flat", [-1])], [site.tensor("values")]),
             site.make("Reshape", [site.input(1), site.const("flat_index", [-1])], [site.tensor("index")]),
             site.make("ScatterElements", [site.const("zeros", np.zeros(math.prod(inferred), np.float32)),
                                           site.tensor("index"), site.tensor("values")], [flat], axis=0)]
    if wanted == inferred:
        return nodes + [site.make("Reshape", [flat, site.const("shape", inferred)], [site.node.output[0]])]
    # The indices address the unpooled shape; a larger output_shape adds
    # zeros after it along each axis.
    nodes.append(site.make("Reshape", [flat, site.const("shape", inferred)], [site.tensor("unpooled")]))
    ends = [0] * len(shape) + [w - i for w, i in zip(wanted, inferred)]
    return nodes + [site.make("Pad", [site.tensor("unpooled"), site.const("pads", ends)], [site.node.output[0]])]


def _reverse_sequence(site: Site) -> list:
    shape = site.shape(0)
    time_axis, batch_axis = int(site.raw.get("time_axis", 0)), int(site.raw.get("batch_axis", 1))
    if {time_axis, batch_axis} != {0, 1} or len(shape) < 2:
        raise BuildError(f"{site.where}: time_axis {time_axis} and batch_axis {batch_axis} must be 0 and 1 in some "
                         f"order, of an input of rank 2 or more (it has shape {shape})")
    steps, batch = shape[time_axis], shape[batch_axis]
    if site.shape(1) != (batch,):
        raise BuildError(f"{site.where}: sequence_lens has shape {site.shape(1)}; it must be ({batch},)")
    # Along the time axis, element t of row b comes from lens[b] - 1 - t
    # while t < lens[b], and from t itself after.
    grid = [1, 1] + [1] * (len(shape) - 2)
    grid[time_axis] = steps
    lens_shape = [1, 1] + [1] * (len(shape) - 2)
    lens_shape[batch_axis] = batch
    t = site.const("time", np.arange(steps, dtype=np.int64).reshape(grid))
    lens, last, index = site.tensor("lens"), site.tensor("last"), site.tensor("index")
    return [site.make("Reshape", [site.input(1), site.const("lens_shape", lens_shape)], [lens]),
            site.make("Sub", [lens, site.const("one", np.array(1, np.int64))], [last]),
            site.make("Sub", [last, t], [site.tensor("reversed")]),
            site.make("Less", [t, lens], [site.tensor("inside")]),
            site.make("Where", [site.tensor("inside"), site.tensor("reversed"), t], [site.tensor("picked")]),
            site.make("Expand", [site.tensor("picked"), site.const("shape", list(shape))], [index]),
            site.make("GatherElements", [site.input(0), index], [site.node.output[0]], axis=time_axis)]


def _tensor_scatter(site: Site) -> list:
    cache, update = site.shape(0), site.shape(1)
    rank = len(cache)
    axis = int(site.raw.get("axis", -2))
    if not -rank <= axis < rank or axis % rank == 0:
        raise BuildError(f"{site.where}: axis {axis} must name a sequence axis after the batch axis of the "
                         f"rank-{rank} cache")
    axis %= rank
    mode = site.raw.get("mode", "linear")
    if mode not in ("linear", "circular"):
        raise BuildError(f"attribute mode={mode!r} is not supported; supported: 'linear', 'circular'")
    if len(update) != rank or any(u != c for d, (u, c) in enumerate(zip(update, cache)) if d != axis) \
            or update[axis] > cache[axis]:
        raise BuildError(f"{site.where}: the update's shape {update} does not fit the cache's {cache} along axis "
                         f"{axis}")
    length, steps = cache[axis], update[axis]
    # Position p of row b along the axis takes update element p - write_indices[b]
    # (modulo the cache's length when circular) when that is within the update.
    grid = [1] * rank
    grid[axis] = length
    position = site.const("position", np.arange(length, dtype=np.int64).reshape(grid))
    nodes = []
    if site.input(2):
        nodes.append(site.make("Reshape", [site.input(2), site.const("start_shape", [cache[0]] + [1] * (rank - 1))],
                               [site.tensor("start")]))
        nodes.append(site.make("Sub", [position, site.tensor("start")], [site.tensor("offset")]))
        offset = site.tensor("offset")
    else:
        offset = position
    if mode == "circular":
        nodes.append(site.make("Mod", [offset, site.const("length", np.array(length, np.int64))],
                               [site.tensor("wrapped")]))
        offset = site.tensor("wrapped")
    pads = [0] * (2 * rank)
    pads[rank + axis] = length - steps
    nodes += [site.make("GreaterOrEqual", [offset, site.const("zero", np.array(0, np.int64))], [site.tensor("after")]),
              site.make("Less", [offset, site.const("steps", np.array(steps, np.int64))], [site.tensor("before")]),
              site.make("And", [site.tensor("after"), site.tensor("before")], [site.tensor("written")]),
              site.make("Where", [site.tensor("written"), offset, site.const("first", np.array(0, np.int64))],
                        [site.tensor("picked")]),
              site.make("Expand", [site.tensor("picked"), site.const("cache_shape", list(cache))],
                        [site.tensor("index")]),
              site.make("Pad", [site.input(1), site.const("pads", pads)], [site.tensor("padded")]),
              site.make("GatherElements", [site.tensor("padded"), site.tensor("index")], [site.tensor("moved")],
                        axis=axis),
              site.make("Where", [site.tensor("written"), site.tensor("moved"), site.input(0)], [site.node.output[0]])]
    return nodes


def _batch_norm_training(site: Site) -> list:
    """training_mode=1: normalised by the batch's own mean and (population)
    variance per channel, and the running statistics moved towards them."""
    shape = site.shape(0)
    if len(shape) < 2:
        raise BuildError(f"{site.where}: the input has shape {shape}; it needs a channel axis")
    channels, axes = shape[1], [0] + list(range(2, len(shape)))
    eps, momentum = float(site.raw.get("epsilon", 1e-5)), float(site.raw.get("momentum", 0.9))
    x, per_channel = site.input(0), site.const("per_channel", [channels] + [1] * (len(shape) - 2))

    def mean(source, out):
        if site.opset >= 18:
            return site.make("ReduceMean", [source, site.const("axes", axes)], [out], keepdims=1)
        return site.make("ReduceMean", [source], [out], axes=axes, keepdims=1)

    def t(label):
        return site.tensor(label)

    nodes = [mean(x, t("mean")),
             site.make("Sub", [x, t("mean")], [t("centred")]),
             site.make("Mul", [t("centred"), t("centred")], [t("squares")]),
             mean(t("squares"), t("var")),
             site.make("Add", [t("var"), site.const("epsilon", np.array(eps, np.float32))], [t("var_eps")]),
             site.make("Sqrt", [t("var_eps")], [t("deviation")]),
             site.make("Div", [t("centred"), t("deviation")], [t("normalised")]),
             site.make("Reshape", [site.input(1), per_channel], [t("scale")]),
             site.make("Reshape", [site.input(2), per_channel], [t("bias")]),
             site.make("Mul", [t("normalised"), t("scale")], [t("scaled")]),
             site.make("Add", [t("scaled"), t("bias")], [site.node.output[0]])]
    kept = site.const("momentum", np.array(momentum, np.float32))
    moved = site.const("moved", np.array(1 - momentum, np.float32))
    for pos, stat, label in ((1, "mean", "running_mean"), (2, "var", "running_var")):
        out = site.node.output[pos] if len(site.node.output) > pos else ""
        if not out:
            continue
        nodes += [site.make("Reshape", [t(stat), site.const(f"{label}_shape", [channels])], [t(f"{stat}_c")]),
                  site.make("Mul", [t(f"{stat}_c"), moved], [t(f"{label}_new")]),
                  site.make("Mul", [site.input(2 + pos), kept], [t(f"{label}_old")]),
                  site.make("Add", [t(f"{label}_old"), t(f"{label}_new")], [out])]
    return nodes


class _Formula:
    """The nodes of an element-wise formula, one named tensor per step."""

    def __init__(self, site: Site):
        self.site, self.nodes = site, []

    def __call__(self, op_type: str, *inputs: str, out: str = "", **attrs) -> str:
        out = out or self.site.tensor(f"step_{len(self.nodes)}")
        self.nodes.append(self.site.make(op_type, list(inputs), [out], **attrs))
        return out

    def number(self, value: float) -> str:
        return self.site.const(f"number_{len(self.nodes)}_{len(self.site.node.input)}_{value!r}",
                               np.array(value, np.float32))


def _optimizer(site: Site, kinds: int) -> "tuple[_Formula, list, list]":
    """(formula, groups, outputs) of an ai.onnx.preview.training optimizer
    node: inputs R, T, then `kinds` lists of n tensors (X, G, and the
    optimizer's states); groups[i] holds the i-th tensor of each list."""
    tensors = list(site.node.input[2:])
    if not tensors or len(tensors) % kinds:
        raise BuildError(f"{site.where}: it takes R, T and {kinds} lists of tensors of one length; got "
                         f"{len(site.node.input)} inputs")
    n = len(tensors) // kinds
    groups = [[tensors[k * n + i] for k in range(kinds)] for i in range(n)]
    return _Formula(site), groups, list(site.node.output)


def _regularised(f: _Formula, norm: float, x: str, g: str) -> str:
    return f("Add", f("Mul", f.number(norm), x), g)


def _adagrad(site: Site) -> list:
    f, groups, outs = _optimizer(site, 3)
    raw, n = site.raw, len(groups)
    decay, eps, norm = (float(raw.get(k, d)) for k, d in (("decay_factor", 0.0), ("epsilon", 0.0),
                                                           ("norm_coefficient", 0.0)))
    steps = f("Cast", site.input(1), to=onnx.TensorProto.FLOAT)
    rate = f("Div", site.input(0), f("Add", f.number(1.0), f("Mul", steps, f.number(decay))))
    for i, (x, g, h) in enumerate(groups):
        g_reg = _regularised(f, norm, x, g)
        h_new = f("Add", h, f("Mul", g_reg, g_reg), out=outs[n + i] if len(outs) > n + i else "")
        scaled = f("Div", f("Mul", rate, g_reg), f("Add", f("Sqrt", h_new), f.number(eps)))
        f("Sub", x, scaled, out=outs[i])
    return f.nodes


def _adam(site: Site) -> list:
    f, groups, outs = _optimizer(site, 4)
    raw, n = site.raw, len(groups)
    alpha, beta, eps, norm, post = (float(raw.get(k, d)) for k, d in (
        ("alpha", 0.9), ("beta", 0.999), ("epsilon", 0.0), ("norm_coefficient", 0.0), ("norm_coefficient_post", 0.0)))
    steps = f("Cast", site.input(1), to=onnx.TensorProto.FLOAT)
    started = f("Greater", site.input(1), site.const("no_steps", np.array(0, np.int64)))
    # With steps taken, the rate is corrected for the moments' bias.
    correction = f("Div", f("Sqrt", f("Sub", f.number(1.0), f("Pow", f.number(beta), steps))),
                   f("Sub", f.number(1.0), f("Pow", f.number(alpha), steps)))
    rate = f("Where", started, f("Mul", site.input(0), correction), site.input(0))
    for i, (x, g, v, h) in enumerate(groups):
        g_reg = _regularised(f, norm, x, g)
        v_new = f("Add", f("Mul", f.number(alpha), v), f("Mul", f.number(1 - alpha), g_reg),
                  out=outs[n + i] if len(outs) > n + i else "")
        h_new = f("Add", f("Mul", f.number(beta), h), f("Mul", f.number(1 - beta), f("Mul", g_reg, g_reg)),
                  out=outs[2 * n + i] if len(outs) > 2 * n + i else "")
        step = f("Mul", rate, f("Div", v_new, f("Add", f("Sqrt", h_new), f.number(eps))))
        f("Mul", f.number(1 - post), f("Sub", x, step), out=outs[i])
    return f.nodes


def _momentum(site: Site) -> list:
    f, groups, outs = _optimizer(site, 3)
    raw, n = site.raw, len(groups)
    alpha, beta, norm = (float(raw.get(k, d)) for k, d in (("alpha", 0.0), ("beta", 0.0), ("norm_coefficient", 0.0)))
    mode = raw.get("mode", "standard")
    if mode not in ("standard", "nesterov"):
        raise BuildError(f"attribute mode={mode!r} is not supported; supported: 'standard', 'nesterov'")
    started = f("Greater", site.input(1), site.const("no_steps", np.array(0, np.int64)))
    # The gradient's coefficient is 1 at the first step.
    beta_now = f("Where", started, f.number(beta), f.number(1.0))
    for i, (x, g, v) in enumerate(groups):
        g_reg = _regularised(f, norm, x, g)
        v_new = f("Add", f("Mul", f.number(alpha), v), f("Mul", beta_now, g_reg),
                  out=outs[n + i] if len(outs) > n + i else "")
        direction = v_new if mode == "standard" else f("Add", g_reg, f("Mul", f.number(alpha), v_new))
        f("Sub", x, f("Mul", site.input(0), direction), out=outs[i])
    return f.nodes


def _eye_like(site: Site) -> list:
    shape = site.shape(0)
    if len(shape) != 2:
        raise BuildError(f"{site.where}: the input has shape {shape}; EyeLike takes a 2-D one")
    dtype = site.raw.get("dtype")
    np_dtype = np.dtype(site.tensors[site.input(0)].dtype) if dtype is None else \
        helper.tensor_dtype_to_np_dtype(int(dtype))
    site.add_constant(site.node.output[0], np.eye(*shape, k=int(site.raw.get("k", 0)), dtype=np_dtype))
    return []


def _optional_has_element(site: Site) -> list:
    # A module's tensors are never absent: only a left-out input is.
    site.add_constant(site.node.output[0], np.array(bool(site.input(0))))
    return []


def _optional_get_element(site: Site) -> list:
    if not site.input(0):
        raise BuildError(f"{site.where}: its input is left out, and an absent optional has no element")
    return [site.make("Identity", [site.input(0)], [site.node.output[0]])]


@dataclass(frozen=True)
class Decomposition:
    write: Callable            # Site -> list of NodeProto
    compile_time_inputs: tuple  # input positions that must be constants
    note: str                  # what it takes, for the operator table
    # Whether a node (its raw attributes) is written out here; the others
    # go to the op's lowering (BatchNormalization's inference form).
    applies: Callable = lambda raw: True


DECOMPOSED = {
    "DFT": Decomposition(_dft, (1, 2), "a MatMul with the transform's matrix; constant dft_length and axis"),
    "STFT": Decomposition(_stft, (1, 3), "frames gathered, windowed and transformed by a MatMul; constant "
                                         "frame_step and frame_length"),
    "Det": Decomposition(_det, (), f"sum of signed products over permutations; matrices up to "
                                   f"{MAX_DET_SIZE}x{MAX_DET_SIZE}"),
    "MaxUnpool": Decomposition(_max_unpool, (2,), "a ScatterElements into zeros; constant output_shape"),
    "ReverseSequence": Decomposition(_reverse_sequence, (), "a GatherElements with indices from the lengths"),
    "EyeLike": Decomposition(_eye_like, (), "the constant it is, from the input's shape"),
    "BatchNormalization": Decomposition(_batch_norm_training, (), "training_mode=1: the batch's statistics",
                                        applies=lambda raw: bool(int(raw.get("training_mode", 0)))),
    "ai.onnx.preview.training.Adagrad": Decomposition(_adagrad, (), "element-wise ops"),
    "ai.onnx.preview.training.Adam": Decomposition(_adam, (), "element-wise ops"),
    "ai.onnx.preview.training.Momentum": Decomposition(_momentum, (), "element-wise ops (standard and nesterov)"),
    "TensorScatter": Decomposition(_tensor_scatter, (), "a GatherElements of the update and a Where into the cache"),
    "OptionalHasElement": Decomposition(_optional_has_element, (), "true for a tensor, false for a left-out input"),
    "OptionalGetElement": Decomposition(_optional_get_element, (), "a tensor is its own element"),
}


def decomposed_name(node: onnx.NodeProto) -> str:
    """node's key in DECOMPOSED: its op type, qualified by its domain
    outside the default one."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def decompose(node: onnx.NodeProto, raw: dict, name: str, opset: int, tensors: dict, constants: dict,
              add_constant) -> list:
    """The nodes computing node (an op of DECOMPOSED) from ops crosscompile
    lowers; raises BuildError naming the node when it cannot."""
    site = Site(node, raw, name, opset, tensors, constants, add_constant)
    for pos, tensor_name in enumerate(node.input):
        if tensor_name and tensor_name not in tensors:
            raise BuildError(f"{site.where}: input {tensor_name!r} is not produced by any node")
    try:
        return DECOMPOSED[decomposed_name(node)].write(site)
    except BuildError as exc:
        message = str(exc)
        raise BuildError(message if message.startswith("node ") else f"{site.where}: {message}") from None
