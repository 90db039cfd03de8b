"""Graph passes that recognise an op spelled out in smaller ops, the way
exporters write it for opsets that lack it, and put the op in its place:

- LayerNorm before opset 17: ReduceMean, Sub, Pow (or Mul by itself),
  ReduceMean, Add epsilon, Sqrt, Div, then optionally Mul by the scale and
  Add the bias, becomes one LayerNormalization (three passes over a row
  instead of nine kernels and their intermediate tensors);
- GELU before opset 20: Div by sqrt(2) (or Mul by its inverse), Erf, Add 1,
  Mul by x and Mul by 0.5 (in either order), becomes one Gelu, which then
  fuses into the kernel producing x like any activation; so does the tanh
  approximation, x^3, Mul by 0.044715, Add x, Mul by sqrt(2 / pi), Tanh
  and the same tail, as a Gelu with approximate="tanh";
- SiLU (swish), x * sigmoid(x), as exporters write it for EfficientNet
  and friends: a Sigmoid read only by a Mul with x becomes one Swish
  (one pass over the tensor instead of two kernels and an intermediate
  tensor);
- attention: MatMul(Q, K^T), a scale, masks, Softmax and MatMul(., V)
  become one FusedAttention kernel that holds one head's scores at a time
  per thread (attention.py), not every head's.

Pure functions from a Graph to a Graph, as in passes.py.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .ir import Graph, Node, Tensor
from .op_base import _axis
from .passes import eliminate_dead_code


class _Uses:
    """Who reads each tensor, for walking a chain of single-use nodes."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.readers: dict[str, list] = {}
        for node in graph.nodes:
            for name in dict.fromkeys(node.inputs):
                self.readers.setdefault(name, []).append(node)
        for name in graph.outputs:
            self.readers.setdefault(name, []).append(None)

    def only(self, tensor: str, op_type: str):
        """The one node reading tensor, when it is the only reader and an op_type."""
        readers = self.readers.get(tensor, [])
        if len(readers) == 1 and readers[0] is not None and readers[0].op_type == op_type:
            return readers[0]
        return None

    def other_input(self, node: Node, tensor: str):
        """The input of a two-input node that is not tensor (None otherwise)."""
        if len(node.inputs) != 2 or tensor not in node.inputs or node.inputs[0] == node.inputs[1]:
            return None
        return node.inputs[1 - node.inputs.index(tensor)]

    def scalar(self, name, value: float, rel: float = 1e-6) -> bool:
        """name is a constant with one element close to value."""
        array = self.graph.constants.get(name)
        return (array is not None and array.size == 1
                and math.isclose(float(np.asarray(array).reshape(-1)[0]), value, rel_tol=rel))


def _replace_chains(graph: Graph, matches: list) -> Graph:
    """Put each match's new node where its first node stood and drop the rest."""
    if not matches:
        return graph
    first = {chain[0].name: new for chain, new in matches}
    gone = {node.name for chain, _ in matches for node in chain[1:]}
    nodes = [first.get(node.name, node) for node in graph.nodes if node.name not in gone]
    return eliminate_dead_code(replace(graph, nodes=nodes))


def _trailing_axis(graph: Graph, node: Node):
    """The first axis of a keepdims ReduceMean over the trailing axes of its
    input (LayerNorm's normalized axes), or None."""
    axes, rank = node.attrs.get("axes"), len(graph.tensors[node.inputs[0]].shape)
    if not axes or not node.attrs.get("keepdims", 1):
        return None
    normalized = sorted(_axis(a, rank) for a in axes)
    return normalized[0] if normalized == list(range(normalized[0], rank)) else None


def fuse_layer_norm(graph: Graph) -> Graph:
    """Replace each decomposed LayerNorm by a LayerNormalization node.

    >>> fused = fuse_layer_norm(graph)  # doctest: +SKIP
    """
    uses = _Uses(graph)
    matches, taken = [], set()
    for mean in graph.nodes:
        if mean.op_type != "ReduceMean" or mean.name in taken:
            continue
        axis = _trailing_axis(graph, mean)
        x = mean.inputs[0]
        sub = uses.only(mean.outputs[0], "Sub")
        if axis is None or sub is None or sub.inputs != [x, mean.outputs[0]]:
            continue
        centred = sub.outputs[0]
        readers = uses.readers.get(centred, [])
        square = next((n for n in readers if n is not None and (
            (n.op_type == "Pow" and n.inputs == [centred] and n.attrs.get("exponent") == 2.0)
            or (n.op_type == "Mul" and n.inputs == [centred, centred]))), None)
        div = next((n for n in readers if n is not None and n.op_type == "Div" and n.inputs[0] == centred), None)
        if len(readers) != 2 or square is None or div is None:
            continue
        variance = uses.only(square.outputs[0], "ReduceMean")
        if variance is None or _trailing_axis(graph, variance) != axis:
            continue
        add_eps = uses.only(variance.outputs[0], "Add")
        epsilon = add_eps and uses.other_input(add_eps, variance.outputs[0])
        if epsilon is None or epsilon not in graph.constants or graph.constants[epsilon].size != 1:
            continue
        sqrt = uses.only(add_eps.outputs[0], "Sqrt")
        if sqrt is None or div.inputs != [centred, sqrt.outputs[0]] or uses.only(sqrt.outputs[0], "Div") is not div:
            continue
        chain = [mean, sub, square, variance, add_eps, sqrt, div]
        inputs = [x]
        scale_mul = uses.only(div.outputs[0], "Mul")
        scale = scale_mul and uses.other_input(scale_mul, div.outputs[0])
        normalized = graph.tensors[x].shape[axis:]
        if scale is not None and _broadcasts_to(graph.tensors[scale].shape, normalized):
            chain.append(scale_mul)
            inputs.append(scale)
            bias_add = uses.only(scale_mul.outputs[0], "Add")
            bias = bias_add and uses.other_input(bias_add, scale_mul.outputs[0])
            if bias is not None and _broadcasts_to(graph.tensors[bias].shape, normalized):
                chain.append(bias_add)
                inputs.append(bias)
        else:
            one = f"{mean.name}/unit_scale"
            graph = _with_constant(graph, one, np.ones(1, np.float32))
            inputs.append(one)
        attrs = {"axis": axis, "epsilon": float(graph.constants[epsilon].reshape(-1)[0])}
        matches.append((chain, Node("LayerNormalization", mean.name, inputs, list(chain[-1].outputs), attrs)))
        taken.update(node.name for node in chain)
    return _replace_chains(graph, matches)


def _broadcasts_to(shape, normalized) -> bool:
    """A LayerNorm scale or bias of this shape applies along the normalized
    axes alone (leading 1s aside), as the fused op reads it."""
    shape = tuple(shape)
    while shape and shape[0] == 1 and len(shape) > len(normalized):
        shape = shape[1:]
    return len(shape) <= len(normalized) and all(
        d in (1, n) for d, n in zip(shape[::-1], tuple(normalized)[::-1]))


def _with_constant(graph: Graph, name: str, value: np.ndarray) -> Graph:
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    constants[name] = value
    tensors[name] = Tensor(name, value.shape, "float32")
    return replace(graph, constants=constants, tensors=tensors)


def fuse_gelu(graph: Graph) -> Graph:
    """Replace each x * 0.5 * (1 + erf(x / sqrt(2))) by a Gelu node, and
    each x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) by a
    Gelu node with approximate="tanh" (torch's gelu(approximate="tanh"),
    GPT-2's "new GELU"; the cube as Pow(x, 3) or x * (x * x)).

    >>> fused = fuse_gelu(graph)  # doctest: +SKIP
    """
    uses = _Uses(graph)
    producer = {out: node for node in graph.nodes for out in node.outputs}
    matches = []
    for node in graph.nodes:
        if node.op_type == "Tanh":
            head, approximate = _tanh_gelu_head(uses, producer, node), "tanh"
        elif node.op_type in ("Div", "Mul"):
            head, approximate = _erf_gelu_head(uses, node), "none"
        else:
            continue
        if head is None:
            continue
        x, phi = head
        tail = _gelu_tail(uses, producer, x, phi[-1].outputs[0])
        if tail is not None:
            chain = phi + tail
            matches.append((chain, Node("Gelu", chain[0].name, [x], list(chain[-1].outputs),
                                        {"approximate": approximate})))
    return _replace_chains(graph, matches)


def fuse_swish(graph: Graph) -> Graph:
    """Replace each x * sigmoid(x) (the Mul's operands in either order) by a
    Swish node with alpha 1, when the Sigmoid's only reader is that Mul.

    >>> fused = fuse_swish(graph)  # doctest: +SKIP
    """
    uses = _Uses(graph)
    matches = []
    for node in graph.nodes:
        if node.op_type != "Sigmoid" or graph.tensors[node.inputs[0]].dtype != "float32":
            continue
        product = uses.only(node.outputs[0], "Mul")
        if product is not None and uses.other_input(product, node.outputs[0]) == node.inputs[0]:
            matches.append(([node, product], Node("Swish", node.name, [node.inputs[0]], list(product.outputs),
                                                  {"alpha": 1.0})))
    return _replace_chains(graph, matches)


def _erf_gelu_head(uses: _Uses, scale: Node):
    """(x, [scale, erf]) when scale is x / sqrt(2) (or x * sqrt(1/2)) read by one Erf."""
    if len(scale.inputs) != 2:
        return None
    x, factor = scale.inputs
    wanted = math.sqrt(2.0) if scale.op_type == "Div" else math.sqrt(0.5)
    if not uses.scalar(factor, wanted, rel=1e-5):
        return None
    erf = uses.only(scale.outputs[0], "Erf")
    return None if erf is None else (x, [scale, erf])


def _tanh_gelu_head(uses: _Uses, producer: dict, tanh: Node):
    """(x, [cube nodes..., Mul by 0.044715, Add x, Mul by sqrt(2 / pi), tanh])
    when tanh's input is sqrt(2 / pi) * (x + 0.044715 * x^3)."""
    def scaled(name, value):
        """(the node, its other input) when name is a single-use Mul by value."""
        node = producer.get(name)
        if node is None or node.op_type != "Mul" or len(uses.readers.get(name, [])) != 1:
            return None, None
        for pos in (0, 1):
            if uses.scalar(node.inputs[pos], value, rel=1e-4):
                return node, node.inputs[1 - pos]
        return None, None

    outer, inner = scaled(tanh.inputs[0], math.sqrt(2.0 / math.pi))
    add = producer.get(inner) if outer is not None else None
    if add is None or add.op_type != "Add" or len(uses.readers[inner]) != 1 or len(add.inputs) != 2:
        return None
    for pos in (0, 1):
        x, term = add.inputs[pos], add.inputs[1 - pos]
        kappa, cubed = scaled(term, 0.044715)
        cube = _cube_of(uses, producer, x, cubed) if kappa is not None else None
        if cube is not None:
            return x, [*cube, kappa, add, outer, tanh]
    return None


def _cube_of(uses: _Uses, producer: dict, x: str, name: str):
    """The nodes computing name = x^3 (Pow(x, 3), or x * (x * x) in either
    order) with single-use intermediates, or None."""
    node = producer.get(name)
    if node is None or len(uses.readers.get(name, [])) != 1:
        return None
    if node.op_type == "Pow" and node.inputs == [x] and node.attrs.get("exponent") == 3.0:
        return [node]
    if node.op_type != "Mul" or len(node.inputs) != 2 or x not in node.inputs:
        return None
    square = producer.get(uses.other_input(node, x) or "")
    if (square is not None and square.op_type == "Mul" and square.inputs == [x, x]
            and len(uses.readers[square.outputs[0]]) == 1):
        return [square, node]
    return None


def _gelu_tail(uses: _Uses, producer: dict, x: str, phi: str):
    """The nodes computing x * 0.5 * (1 + phi), as (x * (1 + phi)) * 0.5 or
    (x * 0.5) * (1 + phi), with single-use intermediates; None otherwise."""
    plus_one = uses.only(phi, "Add")
    if plus_one is None or not uses.scalar(uses.other_input(plus_one, phi), 1.0):
        return None
    product = uses.only(plus_one.outputs[0], "Mul")
    other = product and uses.other_input(product, plus_one.outputs[0])
    if other is None:
        return None
    if other == x:  # (x * (1 + phi)) * 0.5
        half = uses.only(product.outputs[0], "Mul")
        if half is None or not uses.scalar(uses.other_input(half, product.outputs[0]), 0.5):
            return None
        return [plus_one, product, half]
    half = producer.get(other)  # (x * 0.5) * (1 + phi)
    if (half is None or half.op_type != "Mul" or uses.other_input(half, x) is None
            or not uses.scalar(uses.other_input(half, x), 0.5) or len(uses.readers[other]) != 1):
        return None
    return [plus_one, half, product]


# Score matrices the fused attention kernel keeps in scratch at most: the
# most threads that share its heads (boards have up to 4 cores; further
# threads wait at the kernel's barrier).
ATTENTION_SLOTS = 4


def fuse_attention(graph: Graph) -> Graph:
    """Replace each MatMul(Q, K^T) -> Mul or Div by a scalar constant
    (optional) -> Add of masks (up to two, each broadcasting to the scores
    with rows as long as theirs) -> Softmax over the last axis -> MatMul(., V)
    by one FusedAttention node (attention.py), which computes one head's
    scores at a time per thread instead of all of them
    (schedule.assign_tiles then gives it the tile of its two products). Q, K^T and V must share
    their batch dimensions and every intermediate have one reader;
    anything else (a mask of another shape, a Softmax on another axis, a
    product by constant weights) keeps the separate ops.

    >>> fused = fuse_attention(graph)  # doctest: +SKIP
    """
    uses = _Uses(graph)
    matches = []
    for first in graph.nodes:
        found = _attention_chain(graph, uses, first)
        if found is None:
            continue
        chain, scale, masks = found
        q, kt = first.inputs
        v = chain[-1].inputs[1]
        batch = graph.tensors[q].shape[:-2]
        attrs = {"scale": scale, "slots": min(ATTENTION_SLOTS, math.prod(batch))}
        # In the place of the last MatMul, where V and the masks are computed.
        matches.append(([chain[-1], *chain[:-1]], Node("FusedAttention", f"{first.name}/attention",
                                                       [q, kt, v, *masks], list(chain[-1].outputs), attrs)))
    return _replace_chains(graph, matches)


def _plain_product(graph: Graph, node) -> bool:
    """A MatMul of two runtime operands with nothing fused into it."""
    return (node is not None and node.op_type == "MatMul" and len(node.inputs) == 2
            and not any(node.attrs.get(key) for key in ("epilogue", "bias"))
            and not any(t in graph.constants for t in node.inputs))


def _attention_chain(graph: Graph, uses: _Uses, first: Node):
    """(nodes, scale, masks) of the attention chain starting at MatMul
    first, or None."""
    if not _plain_product(graph, first):
        return None
    q, kt = (graph.tensors[t].shape for t in first.inputs)
    if len(q) < 3 or len(kt) != len(q) or q[:-2] != kt[:-2]:
        return None
    scores = graph.tensors[first.outputs[0]].shape
    chain, tensor, scale, masks = [first], first.outputs[0], 1.0, []
    readers = uses.readers.get(tensor, [])
    node = readers[0] if len(readers) == 1 else None
    if node is not None and node.op_type in ("Mul", "Div"):
        factor = uses.other_input(node, tensor)
        value = graph.constants.get(factor) if factor is not None else None
        if (value is None or value.size != 1 or value.dtype.kind != "f"
                or (node.op_type == "Div" and node.inputs[0] != tensor)):
            return None
        value = float(value.reshape(-1)[0])
        scale = value if node.op_type == "Mul" else 1.0 / value
        chain.append(node)
        tensor = node.outputs[0]
    while len(masks) < 2:
        add = uses.only(tensor, "Add")
        mask = add and uses.other_input(add, tensor)
        if mask is None:
            break
        shape = graph.tensors[mask].shape
        if (graph.tensors[mask].dtype != "float32" or len(shape) > len(scores) or not shape
                or shape[-1] != scores[-1] or graph.tensors[add.outputs[0]].shape != scores
                or not all(s in (1, full) for s, full in zip(shape[::-1], scores[::-1]))):
            return None
        chain.append(add)
        masks.append(mask)
        tensor = add.outputs[0]
    softmax = uses.only(tensor, "Softmax")
    if (softmax is None or softmax.attrs.get("epilogue") or graph.tensors[tensor].shape != scores
            or (softmax.attrs["axis"] % len(scores)) != len(scores) - 1):
        return None
    last = uses.only(softmax.outputs[0], "MatMul")
    if not _plain_product(graph, last) or last.inputs[0] != softmax.outputs[0]:
        return None
    v = graph.tensors[last.inputs[1]].shape
    if len(v) != len(q) or v[:-1] != scores[:-2] + (scores[-1],):
        return None
    return chain + [softmax, last], scale, masks
