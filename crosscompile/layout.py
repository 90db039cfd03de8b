"""Ops that only move elements, of any dtype: DepthToSpace and
SpaceToDepth (a reshape, a transpose and a reshape, done as one strided
copy), Tile (a strided copy over an interleaved shape) and Trilu (a copy
that zeroes one side of each matrix's diagonal)."""
from __future__ import annotations

from llvmlite import ir

from .errors import BuildError, ShapeError
from .op_base import ALL_DTYPES, Op, _c_strides, _check_choice, _const_ints, copy_strided


class _BlockMove(Op):
    """DepthToSpace and SpaceToDepth on (N, C, H, W): each is
    reshape(six_d) -> transpose(perm) -> reshape(out), so the output is a
    copy of the input read with the permuted strides of six_d."""

    data_dtypes = ALL_DTYPES

    def attributes(self, raw, constants, opset):
        if "blocksize" not in raw:
            raise BuildError(f"{self.op_type} needs the blocksize attribute")
        mode = raw.get("mode", "DCR")
        _check_choice("mode", mode, ("DCR", "CRD"))
        return {"blocksize": int(raw["blocksize"]), "mode": mode}

    def geometry(self, x, attrs):
        """(six_d, perm, output shape)."""
        raise NotImplementedError

    def infer(self, inputs, attrs):
        if len(inputs[0]) != 4:
            raise ShapeError(f"{self.op_type} takes a 4-D (N, C, H, W) tensor, got shape {inputs[0]}")
        if attrs["blocksize"] < 1:
            raise ShapeError(f"{self.op_type} blocksize {attrs['blocksize']} must be positive")
        return [self.geometry(inputs[0], attrs)[2]]

    def lower(self, k, inputs, outputs, attrs):
        six_d, perm, _ = self.geometry(inputs[0].shape, attrs)
        strides = _c_strides(six_d)
        copy_strided(k, [six_d[p] for p in perm], [strides[p] for p in perm], inputs[0].dtype)


class DepthToSpace(_BlockMove):
    """Channels into b x b blocks of pixels: DCR takes the block offset from
    the channel's high part (depth, column, row), CRD from its low part."""

    op_type = "DepthToSpace"

    def geometry(self, x, attrs):
        n, c, h, w = x
        b = attrs["blocksize"]
        if c % (b * b):
            raise ShapeError(f"DepthToSpace: {c} channels are not a multiple of blocksize^2 = {b * b}")
        if attrs["mode"] == "DCR":
            six_d, perm = (n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2)
        else:
            six_d, perm = (n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3)
        return six_d, perm, (n, c // (b * b), h * b, w * b)


class SpaceToDepth(_BlockMove):
    """b x b blocks of pixels into channels, the inverse of DepthToSpace
    in the same mode (opset 28 added mode; DCR before)."""

    op_type = "SpaceToDepth"

    def geometry(self, x, attrs):
        n, c, h, w = x
        b = attrs["blocksize"]
        if h % b or w % b:
            raise ShapeError(f"SpaceToDepth: height {h} and width {w} must be multiples of blocksize {b}")
        perm = (0, 3, 5, 1, 2, 4) if attrs["mode"] == "DCR" else (0, 1, 3, 5, 2, 4)
        return (n, c, h // b, b, w // b, b), perm, (n, c * b * b, h // b, w // b)


class Tile(Op):
    """The input repeated repeats[i] times along each axis i (a constant
    input): the output read as (r0, d0, r1, d1, ...) steps through the
    input with stride 0 along each r."""

    op_type = "Tile"
    compile_time_inputs = (1,)
    data_dtypes = ALL_DTYPES

    def attributes(self, raw, constants, opset):
        repeats = _const_ints(constants, 1)
        if repeats is None:
            raise BuildError("Tile needs its repeats as a constant input")
        return {"repeats": repeats}

    def infer(self, inputs, attrs):
        x, repeats = inputs[0], attrs["repeats"]
        if len(repeats) != len(x) or min(repeats, default=0) < 0:
            raise ShapeError(f"Tile repeats {repeats} must be {len(x)} non-negative counts for shape {x}")
        return [tuple(d * r for d, r in zip(x, repeats))]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        if outputs[0].size == 0:
            k.activated = True
            return
        shape, strides = [], []
        for d, r, s in zip(x, attrs["repeats"], _c_strides(x)):
            shape += [r, d]
            strides += [0, s]
        copy_strided(k, shape, strides, inputs[0].dtype)


class Trilu(Op):
    """The upper (upper=1) or lower triangle of each matrix in the last two
    axes, from the diagonal shifted by k (a constant input, default 0);
    the rest is zero."""

    op_type = "Trilu"
    compile_time_inputs = (1,)
    data_dtypes = ALL_DTYPES

    def attributes(self, raw, constants, opset):
        diagonal = _const_ints(constants, 1)
        return {"upper": int(raw.get("upper", 1)), "k": diagonal[0] if diagonal else 0}

    def infer(self, inputs, attrs):
        if len(inputs[0]) < 2:
            raise ShapeError(f"Trilu takes a tensor of rank >= 2, got shape {inputs[0]}")
        return [inputs[0]]

    def lower(self, k, inputs, outputs, attrs):
        shape, dtype = inputs[0].shape, inputs[0].dtype
        if outputs[0].size == 0:
            k.activated = True
            return
        b = k.builder
        src, dst = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
        strides = _c_strides(shape)
        with k.nested_loops(shape) as idx:
            at = k.index(*zip(idx, strides))
            offset = b.sub(idx[-1], idx[-2])  # j - i
            if attrs["upper"]:
                keep = b.icmp_signed(">=", offset, k.i64(attrs["k"]))
            else:
                keep = b.icmp_signed("<=", offset, k.i64(attrs["k"]))
            value = k.load(src, at)
            k.store(k.activate(b.select(keep, value, ir.Constant(value.type, 0))), dst, at)
