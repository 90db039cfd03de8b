"""The pooling ops: MaxPool, AveragePool, LpPool and the global pools,
with their kernels."""
from __future__ import annotations

import math

from llvmlite import ir

from .emit import F32, Kernel
from .errors import BuildError, ShapeError
from .op_base import Op, _c_strides, _prod
from .vectors import horizontal_reduce, load_strided, row_pieces, splat, vector_epilogue
from .window import _resolve_window, _valid_range, _window_attributes


class _Pool(Op):
    """MaxPool / AveragePool over 1-D or 2-D windows (and MaxPool's
    Indices output, see MaxPool). Channels are split between threads when
    passes.mark_split set attrs["split"]."""

    def attributes(self, raw, constants, opset):
        attrs = _window_attributes(raw)
        if attrs["kernel_shape"] is None:
            raise BuildError(f"{self.op_type} needs the kernel_shape attribute")
        attrs["ceil_mode"] = int(raw.get("ceil_mode", 0))
        attrs["count_include_pad"] = int(raw.get("count_include_pad", 0))
        attrs["storage_order"] = int(raw.get("storage_order", 0))
        return attrs

    def infer(self, inputs, attrs):
        x = inputs[0]
        if len(x) < 3:
            raise ShapeError(f"{self.op_type} needs an N x C x spatial input, got {x}")
        *_, out = _resolve_window(x, attrs["kernel_shape"], attrs, bool(attrs["ceil_mode"]),
                                  what=self.op_type)
        return [(x[0], x[1], *out[5 - len(x):])] * (2 if attrs.get("outputs", 1) > 1 else 1)

    def output_dtype(self, inputs, attrs):
        dtype = super().output_dtype(inputs, attrs)
        return [dtype, "int64"] if attrs.get("outputs", 1) > 1 else dtype

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        dims, kernel, strides, dilations, begin, end, out = \
            _resolve_window(x, attrs["kernel_shape"], attrs, bool(attrs["ceil_mode"]))
        is_max, p_norm = self.op_type == "MaxPool", attrs.get("p")
        if len(outputs) > 1:
            self._lower_with_indices(k, x, dims, kernel, strides, dilations, begin, out, attrs["storage_order"])
            return
        whole = tuple(kernel) == tuple(dims) and not any(begin) and not any(end) and set(dilations) == {1}
        if p_norm is None and whole:
            # One window over the whole input (ResNet's 7x7 average): a global pool.
            global_pool(k, x[0] * x[1], _prod(dims), is_max)
            return
        if p_norm is None and dims[0] == 1 and kernel[0] == 1:
            self._lower_rows(k, x, dims[1:], kernel[1:], strides[1:], dilations[1:], begin[1:], end[1:],
                             out[1:], is_max, bool(attrs["count_include_pad"]))
            return
        self._lower_windows(k, x, dims, kernel, strides, dilations, begin, end, out, is_max, p_norm, attrs)

    @staticmethod
    def _lower_windows(k, x, dims, kernel, strides, dilations, begin, end, out, is_max, p_norm, attrs):
        """Any window, one output element at a time, each tap checked; with
        p_norm, the p-norm of the window's elements (LpPool)."""
        bld = k.builder
        X, Y = k.inputs[0], k.outputs[0]
        in_strides, out_strides = _c_strides(dims), _c_strides(out)
        with k.share(x[0] * x[1]) as (lo, hi), k.loop(hi, start=lo) as nc, k.nested_loops(out) as opos:
            acc = k.variable(k.f32(-math.inf if is_max else 0.0))
            valid = k.variable(k.f32(0.0))
            padded = k.variable(k.f32(0.0))
            with k.nested_loops(kernel) as kpos:
                ipos = [k.index((o, s), (kk, d), (-b, 1))
                        for o, kk, s, d, b in zip(opos, kpos, strides, dilations, begin)]
                if not is_max:
                    # count_include_pad counts positions inside the padded input.
                    inside_pad = None
                    for i, size, e in zip(ipos, dims, end):
                        ok = bld.icmp_signed("<", i, k.i64(size + e))
                        inside_pad = ok if inside_pad is None else bld.and_(inside_pad, ok)
                    with bld.if_then(inside_pad):
                        bld.store(bld.fadd(bld.load(padded), k.f32(1.0)), padded)
                inside = None
                for i, size in zip(ipos, dims):
                    ok = k.in_range(i, size)
                    inside = ok if inside is None else bld.and_(inside, ok)
                with bld.if_then(inside):
                    v = k.load(X, k.index((nc, _prod(dims)), *zip(ipos, in_strides)))
                    if is_max:
                        bld.store(k.maximum(bld.load(acc), v), acc)
                    elif p_norm is not None:
                        magnitude, term = k.maximum(v, bld.fsub(k.f32(0.0), v)), k.f32(1.0)
                        for _ in range(p_norm):
                            term = bld.fmul(term, magnitude)
                        bld.store(bld.fadd(bld.load(acc), term), acc)
                    else:
                        bld.store(bld.fadd(bld.load(acc), v), acc)
                        bld.store(bld.fadd(bld.load(valid), k.f32(1.0)), valid)
            result = bld.load(acc)
            if p_norm is not None:
                positive = bld.fcmp_ordered(">", result, k.f32(0.0))
                result = bld.select(positive, k.power(bld.select(positive, result, k.f32(1.0)), 1.0 / p_norm),
                                    result)
            elif not is_max:
                count = bld.load(padded if attrs["count_include_pad"] else valid)
                result = bld.fdiv(result, count)
            k.store(k.activate(result), Y, k.index((nc, _prod(out)), *zip(opos, out_strides)))


    @staticmethod
    def _lower_with_indices(k, x, dims, kernel, strides, dilations, begin, out, storage_order):
        """MaxPool and the flat index of each maximum in the input (over
        batch and channels too; the spatial part in column-major order with
        storage_order=1). The first of equal maxima wins, as in ONNX's
        reference."""
        bld = k.builder
        X, Y, I = k.inputs[0], k.outputs[0], k.typed(k.outputs[1], "int64")
        in_strides, out_strides, plane = _c_strides(dims), _c_strides(out), _prod(dims)
        index_strides = in_strides if not storage_order else _c_strides(dims[::-1])[::-1]
        with k.share(x[0] * x[1]) as (lo, hi), k.loop(hi, start=lo) as nc, k.nested_loops(out) as opos:
            best = k.variable(k.f32(-math.inf))
            where = k.variable(k.i64(-1))
            with k.nested_loops(kernel) as kpos:
                ipos = [k.index((o, s), (kk, d), (-b, 1))
                        for o, kk, s, d, b in zip(opos, kpos, strides, dilations, begin)]
                inside = None
                for i, size in zip(ipos, dims):
                    ok = k.in_range(i, size)
                    inside = ok if inside is None else bld.and_(inside, ok)
                with bld.if_then(inside):
                    v = k.load(X, k.index((nc, plane), *zip(ipos, in_strides)))
                    first = bld.icmp_signed("<", bld.load(where), k.i64(0))
                    with bld.if_then(bld.or_(first, bld.fcmp_ordered(">", v, bld.load(best)))):
                        bld.store(v, best)
                        bld.store(k.index((nc, plane), *zip(ipos, index_strides)), where)
            at = k.index((nc, _prod(out)), *zip(opos, out_strides))
            k.store(k.activate(bld.load(best)), Y, at)
            k.store(bld.load(where), I, at)

    @staticmethod
    def _lower_rows(k, x, dims, kernel, strides, dilations, begin, end, out, is_max, include_pad):
        """1-D and 2-D windows, one output row at a time: rows of the window
        outside the input are masked by a select decided once per output
        row, and the columns whose window lies inside the row run without
        any check, so the loop vectorises; only the few columns at the
        edges test each tap."""
        (h, wd), (kh_n, kw_n), (sh, sw), (dh, dw), (ph, pw), (eh, ew), (oh_n, ow_n) = \
            dims, kernel, strides, dilations, begin, end, out
        bld = k.builder
        X, Y = k.inputs[0], k.outputs[0]
        lo = min(ow_n, max(_valid_range(kw * dw - pw, sw, wd, ow_n)[0] for kw in range(kw_n)))
        hi = max(lo, min(_valid_range(kw * dw - pw, sw, wd, ow_n)[1] for kw in range(kw_n)))
        empty = k.f32(-math.inf if is_max else 0.0)
        one, zero = k.f32(1.0), k.f32(0.0)
        # Explicit vectors for the interior columns, where every fused op has a vector form.
        lanes = k.target.lanes
        vectors = vector_epilogue(k) or not k.epilogue
        with k.share(x[0] * x[1]) as (nc_lo, nc_hi), k.loop(nc_hi, start=nc_lo) as nc, k.loop(oh_n) as oh:
            plane = k.index((nc, h * wd))
            rows = []
            for kh in range(kh_n):
                ih = k.index((oh, sh), (kh * dh - ph, 1))
                inside = k.in_range(ih, h)
                counted = bld.icmp_signed("<", ih, k.i64(h + eh)) if include_pad else inside
                rows.append((inside, counted, bld.select(inside, k.index((plane, 1), (ih, wd)), plane)))
            out_row = k.index((nc, oh_n * ow_n), (oh, ow_n))
            row_count = zero
            if not is_max:
                for _, counted, _ in rows:
                    row_count = bld.fadd(row_count, bld.select(counted, one, zero))

            def combine(acc, value):
                return k.maximum(acc, value) if is_max else bld.fadd(acc, value)

            divisor = bld.fmul(row_count, k.f32(kw_n))  # of every interior column's sum

            def interior(first, last):  # a loop LLVM vectorises at full width
                with k.loop(last, start=first) as ow:
                    acc = empty
                    for inside, _, line in rows:
                        for kw in range(kw_n):
                            value = k.load(X, k.index((line, 1), (ow, sw), (kw * dw - pw, 1)))
                            acc = combine(acc, bld.select(inside, value, empty))
                    if not is_max:
                        acc = bld.fdiv(acc, divisor)
                    k.store(k.activate(acc), Y, bld.add(out_row, ow))

            # Rows of a vector's width or more go to LLVM's loop (measured
            # faster there); shorter ones (13 columns next to 16 lanes), which
            # that loop would run as scalars, to narrower explicit vectors.
            short = vectors and hi - lo < lanes
            if not short and lo < hi:
                interior(lo, hi)
            pieces, vec_end = row_pieces(lo, hi, lanes, sw) if short else ([], hi)
            for first, width in pieces:
                with k.vector_constants(width):
                    acc = k.f32(-math.inf if is_max else 0.0)
                    for inside, _, line in rows:
                        for kw in range(kw_n):
                            start = first * sw + kw * dw - pw
                            value = load_strided(k, X, k.index((line, 1), (start, 1)), width, sw,
                                                 spare=wd - (start + (width - 1) * sw + 1))
                            acc = combine(acc, bld.select(inside, value, k.f32(-math.inf if is_max else 0.0)))
                    if not is_max:
                        acc = bld.fdiv(acc, splat(k, divisor, width))
                    acc = k.activate(acc)
                    bld.store(acc, bld.bitcast(bld.gep(Y, [bld.add(out_row, k.i64(first))]),
                                               ir.VectorType(F32, width).as_pointer()), align=4)
            if vec_end < hi:
                interior(vec_end, hi)
            for first, last in ((0, lo), (hi, ow_n)):
                if first >= last:
                    continue
                with k.loop(last, start=first) as ow:
                    acc, count = empty, zero
                    for inside, counted, line in rows:
                        for kw in range(kw_n):
                            iw = k.index((ow, sw), (kw * dw - pw, 1))
                            ok = bld.and_(inside, k.in_range(iw, wd))
                            value = k.load(X, bld.select(ok, bld.add(line, iw), line))
                            acc = combine(acc, bld.select(ok, value, empty))
                            if not is_max:
                                if include_pad:
                                    ok = bld.and_(counted, bld.icmp_signed("<", iw, k.i64(wd + ew)))
                                count = bld.fadd(count, bld.select(ok, one, zero))
                    if not is_max:
                        acc = bld.fdiv(acc, count)
                    k.store(k.activate(acc), Y, bld.add(out_row, ow))

    def parallel(self, attrs):
        return bool(attrs.get("split"))


class MaxPool(_Pool):
    """Max over each window; with a second output, the flat index of each
    maximum (storage_order 0 or 1)."""

    op_type = "MaxPool"
    counts_outputs = True


class AveragePool(_Pool):
    op_type = "AveragePool"


class LpPool(_Pool):
    """(sum of |x|^p over the window)^(1/p), p a whole number (2 by
    default); padding adds nothing."""

    op_type = "LpPool"

    def attributes(self, raw, constants, opset):
        attrs = super().attributes(raw, constants, opset)
        attrs["p"] = int(raw.get("p", 2))
        if attrs["p"] < 1:
            raise BuildError(f"LpPool p={attrs['p']} must be a whole number of 1 or more")
        return attrs


def global_pool(k: Kernel, planes: int, size: int, is_max: bool) -> None:
    """Y[p] = max or mean of X[p, :size] for each of `planes` planes.
    Each plane is reduced in vector accumulators (two, to overlap the adds'
    latency), then across their lanes: a scalar sum is one long chain of
    dependent adds, which LLVM may not reorder into vectors itself."""
    bld = k.builder
    lanes = k.target.lanes
    step = 2 * lanes if lanes > 1 and size >= 2 * lanes else 0

    def combine(a, b):
        return k.maximum(a, b) if is_max else bld.fadd(a, b)

    with k.share(planes) as (lo, hi), k.loop(hi, start=lo) as p:
        base = k.index((p, size))
        acc = k.variable(k.f32(-math.inf if is_max else 0.0))
        if step:
            with k.vector_constants(lanes):
                start = k.f32(-math.inf if is_max else 0.0)
            accs = [k.variable(start) for _ in range(2)]
            with k.loop(size // step) as i:
                at = bld.add(base, bld.mul(i, k.i64(step)))
                for u, slot in enumerate(accs):
                    value = load_strided(k, k.inputs[0], bld.add(at, k.i64(u * lanes)), lanes, 1)
                    with k.vector_constants(lanes):
                        bld.store(combine(bld.load(slot), value), slot)
            with k.vector_constants(lanes):
                vec = combine(bld.load(accs[0]), bld.load(accs[1]))
            bld.store(horizontal_reduce(k, vec, combine), acc)
        with k.loop(size, start=size // step * step if step else 0) as i:
            bld.store(combine(bld.load(acc), k.load(k.inputs[0], bld.add(base, i))), acc)
        result = bld.load(acc) if is_max else bld.fmul(bld.load(acc), k.f32(1.0 / size))
        k.store(k.activate(result), k.outputs[0], p)


class _GlobalPool(Op):
    def infer(self, inputs, attrs):
        x = inputs[0]
        if len(x) < 3:
            raise ShapeError(f"{self.op_type} needs an N x C x spatial input, got {x}")
        return [(x[0], x[1]) + (1,) * (len(x) - 2)]

    def lower(self, k, inputs, outputs, attrs):
        x = inputs[0].shape
        global_pool(k, x[0] * x[1], _prod(x[2:]), self.op_type == "GlobalMaxPool")

    def parallel(self, attrs):
        return bool(attrs.get("split"))


class GlobalAveragePool(_GlobalPool):
    op_type = "GlobalAveragePool"


class GlobalMaxPool(_GlobalPool):
    op_type = "GlobalMaxPool"
