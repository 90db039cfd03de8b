"""Einsum: products and sums of tensors spelled by subscripts, as
attention is often written ("bhid,bhjd->bhij" for the scores,
"bhij,bhjd->bhid" for the context, "bid,bjd->bij").

The equation is resolved at compile time into one size and one element
stride per subscript letter and operand. Two operands whose letters split
into batch, row, column and one summed letter, with the output laid out
batch, row, column, run as one matrix product per batch element (dot
products of whole rows when both run along the summed letter); every
other equation (a transpose, a trace, a sum over one operand, three
operands) runs as a loop over the output with the summed letters inside.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

from .errors import BuildError, ShapeError
from .gemm import emit_dot_rows
from .op_base import Op, _c_strides
from .matmul import strided_matmul


@dataclass(frozen=True)
class Subscripts:
    """A resolved equation: each operand's letters, the output's letters,
    and the size of every letter."""

    operands: tuple  # one str per operand, a letter per axis (ellipsis spelled out)
    output: str
    sizes: dict

    def strides(self, shapes) -> list:
        """For each operand, {letter: element stride}: a repeated letter (a
        diagonal) adds its axes' strides, a broadcast axis of size 1 has 0."""
        table = []
        for letters, shape in zip(self.operands, shapes):
            strides = {}
            for letter, dim, stride in zip(letters, shape, _c_strides(shape)):
                strides[letter] = strides.get(letter, 0) + (0 if dim == 1 and self.sizes[letter] != 1 else stride)
            table.append(strides)
        return table

    @property
    def summed(self) -> str:
        return "".join(sorted(set("".join(self.operands)) - set(self.output)))


def parse_equation(equation: str, shapes) -> Subscripts:
    """Resolve an einsum equation against the operand shapes.

    >>> parse_equation("bhid,bhjd->bhij", [(1, 2, 3, 4), (1, 2, 5, 4)]).output
    'bhij'
    >>> parse_equation("...ij,...jk", [(2, 3, 4), (4, 5)]).output
    'Aik'
    """
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(shapes):
        raise ShapeError(f"equation {equation!r} names {len(terms)} operands, the node has {len(shapes)}")
    used = set(equation)
    if not used <= set(string.ascii_letters) | set(",->."):
        raise BuildError(f"equation {equation!r} has characters other than letters, ',', '->' and '...'")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in used]
    ellipsis_rank = max((len(shape) - len(term.replace("...", "")) for term, shape in zip(terms, shapes)
                         if "..." in term), default=0)
    ellipsis = "".join(spare[:ellipsis_rank])
    operands, sizes = [], {}
    for term, shape in zip(terms, shapes):
        if "..." in term:
            term = term.replace("...", ellipsis[ellipsis_rank - (len(shape) - len(term) + 3):])
        if "." in term or len(term) != len(shape):
            raise ShapeError(f"einsum term {term!r} does not fit an operand of shape {tuple(shape)}")
        for letter, dim in zip(term, shape):
            known = sizes.get(letter, dim)
            if dim != known and 1 not in (dim, known):
                raise ShapeError(f"subscript {letter!r} has sizes {known} and {dim} in equation {equation!r}")
            sizes[letter] = max(dim, known)
        operands.append(term)
    if arrow:
        output = output.replace("...", ellipsis)
        if len(set(output)) != len(output) or not set(output) <= set(sizes):
            raise ShapeError(f"output subscripts of {equation!r} repeat a letter or name one no operand has")
    else:
        letters = "".join(operands)
        output = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ellipsis))
    return Subscripts(tuple(operands), output, sizes)


class Einsum(Op):
    op_type = "Einsum"

    def attributes(self, raw, constants, opset):
        if "equation" not in raw:
            raise BuildError("Einsum needs the equation attribute")
        return {"equation": raw["equation"]}

    def infer(self, inputs, attrs):
        if not inputs:
            raise ShapeError("Einsum needs at least one operand")
        subscripts = parse_equation(attrs["equation"], inputs)
        return [tuple(subscripts.sizes[c] for c in subscripts.output)]

    def lower(self, k, inputs, outputs, attrs):
        shapes = [t.shape for t in inputs]
        subscripts = parse_equation(attrs["equation"], shapes)
        strides = subscripts.strides(shapes)
        if _lower_as_matmul(k, subscripts, strides):
            return
        bld = k.builder
        out_letters, summed = subscripts.output, subscripts.summed
        sizes = subscripts.sizes
        out_strides = _c_strides([sizes[c] for c in out_letters])
        with k.nested_loops([sizes[c] for c in out_letters]) as idx:
            at = dict(zip(out_letters, idx))
            acc = k.variable(k.f32(0.0))
            with k.nested_loops([sizes[c] for c in summed]) as inner:
                at.update(zip(summed, inner))
                product = None
                for ptr, table in zip(k.inputs, strides):
                    value = k.load(ptr, k.index(*((at[c], s) for c, s in table.items())))
                    product = value if product is None else bld.fmul(product, value)
                bld.store(bld.fadd(bld.load(acc), product), acc)
            k.store(k.activate(bld.load(acc)), k.outputs[0], k.index(*zip(idx, out_strides)))


def _lower_as_matmul(k, subscripts: Subscripts, strides) -> bool:
    """Lower a two-operand equation of the form batch..., row, column as one
    matrix product per batch element; False when it is not of that form."""
    if len(subscripts.operands) != 2:
        return False
    a, b = subscripts.operands
    out = subscripts.output
    if len(set(a)) != len(a) or len(set(b)) != len(b):
        return False
    batch = [c for c in out if c in a and c in b]
    rows = [c for c in out if c in a and c not in b]
    cols = [c for c in out if c in b and c not in a]
    summed = [c for c in a if c in b and c not in out]
    if (len(rows), len(cols), len(summed)) != (1, 1, 1) or set(a + b) != set(out + summed[0]):
        return False
    if out != "".join(batch) + rows[0] + cols[0]:
        return False
    (m, n, kk), sizes = (rows[0], cols[0], summed[0]), subscripts.sizes
    a_strides, b_strides = strides
    block = sizes[m] * sizes[n]
    out_strides = _c_strides([sizes[c] for c in batch])
    # Both operands' rows contiguous along the summed letter (attention's
    # q . k): dot products of whole rows, in vector accumulators.
    dot_rows = (a_strides[kk], b_strides[kk], a_strides[m], b_strides[n]) == (1, 1, sizes[kk], sizes[kk])
    bld = k.builder
    with k.nested_loops([sizes[c] for c in batch]) as idx:
        bases = (k.index(*((i, a_strides[c]) for i, c in zip(idx, batch))),
                 k.index(*((i, b_strides[c]) for i, c in zip(idx, batch))),
                 k.index(*((i, s * block) for i, s in zip(idx, out_strides))))
        if dot_rows:
            a_ptr, b_ptr, out_ptr = (bld.gep(ptr, [base]) for ptr, base in zip((*k.inputs, k.outputs[0]), bases))
            emit_dot_rows(k, k.target.lanes, sizes[m], sizes[kk], sizes[n], a_ptr, b_ptr, out_ptr)
        else:
            strided_matmul(k, sizes[m], sizes[kk], sizes[n], (a_strides[m], a_strides[kk]),
                           (b_strides[kk], b_strides[n]), bases)
    return True
