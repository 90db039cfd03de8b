"""CumSum and CumProd: running sums or products along one axis (positions
from a mask, a cumulative distribution before sampling), inclusive or
exclusive, from either end."""
from __future__ import annotations

from llvmlite import ir

from .emit import ELEMENT_TYPES
from .errors import BuildError, ShapeError
from .op_base import Op, _axis, _const_ints, _prod

SUMMED_DTYPES = ("float32", "int64", "int32")


class CumSum(Op):
    """y[j] = sum of x[i] for i <= j along axis (i < j with exclusive; the
    sums run from the end with reverse). The axis is a constant input."""

    op_type = "CumSum"
    compile_time_inputs = (1,)
    product = False

    def attributes(self, raw, constants, opset):
        axis = _const_ints(constants, 1)
        if axis is None or len(axis) != 1:
            raise BuildError(f"{self.op_type} needs its axis as a constant scalar input")
        return {"axis": axis[0], "exclusive": int(raw.get("exclusive", 0)), "reverse": int(raw.get("reverse", 0))}

    def infer(self, inputs, attrs):
        if len(inputs) != 1:
            raise ShapeError(f"{self.op_type} takes one runtime input (a constant axis), got {len(inputs)}")
        _axis(attrs["axis"], len(inputs[0]))
        return [inputs[0]]

    def output_dtype(self, inputs, attrs):
        if inputs[0].dtype not in SUMMED_DTYPES:
            raise BuildError(f"{self.op_type} of {inputs[0].name!r} of dtype {inputs[0].dtype} is not supported; "
                             f"supported: {', '.join(SUMMED_DTYPES)}")
        return inputs[0].dtype

    def lower(self, k, inputs, outputs, attrs):
        x, dtype = inputs[0].shape, inputs[0].dtype
        axis = _axis(attrs["axis"], len(x))
        outer, length, inner = _prod(x[:axis]), x[axis], _prod(x[axis + 1:])
        bld = k.builder
        src, dst = k.typed(k.inputs[0], dtype), k.typed(k.outputs[0], dtype)
        floating = dtype == "float32"
        if self.product:
            add = bld.fmul if floating else bld.mul
        else:
            add = bld.fadd if floating else bld.add
        start = ir.Constant(ELEMENT_TYPES[dtype], int(self.product))
        with k.loop(outer) as o, k.loop(inner) as r:
            total = k.variable(start)
            with k.loop(length) as step:
                j = bld.sub(k.i64(length - 1), step) if attrs["reverse"] else step
                at = k.index((o, length * inner), (j, inner), (r, 1))
                value = k.load(src, at)
                running = add(bld.load(total), value)
                result = bld.load(total) if attrs["exclusive"] else running
                k.store(k.activate(result), dst, at)
                bld.store(running, total)
        k.activated = True


class CumProd(CumSum):
    """Running products, with CumSum's attributes (opset 26)."""

    op_type = "CumProd"
    product = True
