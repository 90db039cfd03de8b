"""Graph passes: pure functions from a Graph to a Graph (memory.py plans the buffers).

Nothing here touches LLVM, files or the clock, so each pass is unit-testable
on hand-made graphs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from .ir import Graph, Node, Tensor
from .ops import OPS
from .recurrent import R_TRANSPOSED, W_TRANSPOSED
from .window import _resolve_window, _valid_range


def eliminate_dead_code(graph: Graph) -> Graph:
    """Drop nodes, constants and tensors the graph outputs do not depend on."""
    live = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if any(out in live for out in node.outputs):
            kept.append(node)
            live.update(node.inputs)
            live.update(node.outputs)  # outputs nobody reads are still written
    live.update(graph.inputs)
    return replace(
        graph,
        nodes=kept[::-1],
        constants={k: v for k, v in graph.constants.items() if k in live},
        tensors={k: v for k, v in graph.tensors.items() if k in live},
    )


def _consumers(graph: Graph) -> Counter:
    uses = Counter(name for node in graph.nodes for name in node.inputs)
    uses.update(graph.outputs)
    return uses


def _scale_output_channels(conv: Node, weight: np.ndarray, a: np.ndarray) -> np.ndarray:
    """weight with each output channel's filter scaled by a: a Conv's
    output channels are axis 0 of its weight; a ConvTranspose's weight is
    (input channels, output channels / group, ...), so output channel
    g * (M / group) + j is column j of group g's rows."""
    if conv.op_type == "Conv":
        return weight * a.reshape((-1,) + (1,) * (weight.ndim - 1))
    group = conv.attrs["group"]
    per_input = np.repeat(a.reshape(group, -1), weight.shape[0] // group, axis=0)
    return weight * per_input.reshape(per_input.shape + (1,) * (weight.ndim - 2))


def fold_batchnorm(graph: Graph) -> Graph:
    """Fold each BatchNormalization with constant parameters into the Conv
    or ConvTranspose that feeds it (when it has constant weights and no
    other reader): W' = W * a per output channel, B' = (B - mean) * a + beta
    with a = scale / sqrt(var + eps).
    """
    producer = {out: node for node in graph.nodes for out in node.outputs}
    uses = _consumers(graph)
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    replaced: dict[str, Node] = {}  # conv name -> folded conv
    dropped = set()
    for node in graph.nodes:
        if node.op_type != "BatchNormalization":
            continue
        conv = producer.get(node.inputs[0])
        if (conv is None or conv.op_type not in ("Conv", "ConvTranspose") or uses[node.inputs[0]] != 1
                or conv.name in replaced
                or not all(t in constants for t in conv.inputs[1:] + node.inputs[1:])):
            continue
        scale, beta, mean, var = (constants[t].astype(np.float64) for t in node.inputs[1:])
        a = scale / np.sqrt(var + node.attrs["epsilon"])
        weight = constants[conv.inputs[1]]
        bias = constants[conv.inputs[2]].astype(np.float64) if len(conv.inputs) == 3 else 0.0
        new_w = _scale_output_channels(conv, weight, a).astype(np.float32)
        new_b = ((bias - mean) * a + beta).astype(np.float32)
        w_name, b_name = f"{conv.name}/bn_weight", f"{conv.name}/bn_bias"
        for name, value in ((w_name, new_w), (b_name, new_b)):
            constants[name] = value
            tensors[name] = Tensor(name, value.shape, "float32")
        replaced[conv.name] = Node(conv.op_type, conv.name, [conv.inputs[0], w_name, b_name],
                                   list(node.outputs), dict(conv.attrs))
        dropped.add(node.name)
    if not replaced:
        return graph
    nodes = [replaced.get(n.name, n) for n in graph.nodes if n.name not in dropped]
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def _fold_affine(graph: Graph, op_type: str, fold) -> Graph:
    """The walk fold_channel_affine and fuse_matmul_affine share: for each
    Mul or Add of one runtime and one constant input whose runtime input is
    the output of an op_type node that nothing else reads, fold(node,
    producer, constant name, constants, tensors) returns the producer's new
    form computing the Mul's or Add's output (adding what constants it
    needs to the two dicts), or None to leave it."""
    producer = {out: node for node in graph.nodes for out in node.outputs}
    uses = _consumers(graph)
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    current: dict[str, Node] = {}  # producer name -> its latest folded form
    dropped = set()
    for node in graph.nodes:
        if node.op_type not in ("Mul", "Add") or len(node.inputs) != 2:
            continue
        data = [t for t in node.inputs if t not in constants]
        if len(data) != 1:
            continue
        (const_name,) = [t for t in node.inputs if t in constants]
        source = producer.get(data[0])
        source = current.get(source.name, source) if source is not None else None
        if source is None or source.op_type != op_type or uses[data[0]] != 1 or data[0] != source.outputs[0]:
            continue
        folded = fold(node, source, const_name, constants, tensors)
        if folded is None:
            continue
        current[source.name] = producer[node.outputs[0]] = folded
        dropped.add(node.name)
    if not current:
        return graph
    nodes = [current.get(n.name, n) for n in graph.nodes if n.name not in dropped]
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def _add_constant(constants: dict, tensors: dict, name: str, array: np.ndarray) -> None:
    constants[name] = array
    tensors[name] = Tensor(name, array.shape, str(array.dtype))


def fold_channel_affine(graph: Graph) -> Graph:
    """Fold a Mul or Add by a per-channel constant (shape (M, 1, 1), (1, M, 1, 1),
    scalar, ...) into the Conv that feeds it: Mul scales W and B, Add shifts B.
    Exporters write BatchNorm this way (e.g. Inception v2)."""
    def fold(node, conv, const_name, constants, tensors):
        if conv.attrs.get("epilogue") or not all(t in constants for t in conv.inputs[1:]):
            return None
        out_shape = tensors[conv.outputs[0]].shape
        value = constants[const_name]
        if value.ndim > len(out_shape) or value.dtype != np.float32:
            return None
        padded = value.reshape((1,) * (len(out_shape) - value.ndim) + value.shape)
        m = out_shape[1]
        if any(d != 1 for i, d in enumerate(padded.shape) if i != 1) or padded.shape[1] not in (1, m):
            return None
        per_channel = np.broadcast_to(padded.reshape(-1), (m,)).astype(np.float64)
        weight = constants[conv.inputs[1]]
        bias = constants[conv.inputs[2]].astype(np.float64) if len(conv.inputs) == 3 else np.zeros(m)
        if node.op_type == "Mul":
            weight = weight * per_channel.reshape((-1,) + (1,) * (weight.ndim - 1))
            bias = bias * per_channel
        else:
            bias = bias + per_channel
        w_name, b_name = f"{node.name}/folded_weight", f"{node.name}/folded_bias"
        _add_constant(constants, tensors, w_name, weight.astype(np.float32))
        _add_constant(constants, tensors, b_name, bias.astype(np.float32))
        return Node("Conv", conv.name, [conv.inputs[0], w_name, b_name], list(node.outputs), dict(conv.attrs))
    return _fold_affine(graph, "Conv", fold)


def fuse_elementwise(graph: Graph) -> Graph:
    """Run each fusable element-wise op (Relu, Clip, Sigmoid, ...) as the
    epilogue of the node producing its input, when that node has one output,
    is not a shape-only alias, and nothing else reads the intermediate.

    The producer's attrs gain "epilogue": a tuple of (op_type, attrs).
    """
    producer = {out: node for node in graph.nodes for out in node.outputs}
    uses = _consumers(graph)
    merged: dict[str, Node] = {}  # producer name -> node with epilogue
    absorbed: dict[str, str] = {}  # activation name -> producer name
    for node in graph.nodes:
        if not OPS[node.op_type].fusable or len(node.inputs) != 1:
            continue
        src = producer.get(node.inputs[0])
        if src is None:
            continue
        src = merged.get(src.name, src)
        if (OPS[src.op_type].alias or len(src.outputs) != 1
                or uses[node.inputs[0]] != 1 or node.inputs[0] not in src.outputs):
            continue
        attrs = dict(src.attrs)
        attrs["epilogue"] = tuple(attrs.get("epilogue", ())) + ((node.op_type, node.attrs),)
        fused = Node(src.op_type, src.name, list(src.inputs), list(node.outputs), attrs)
        merged[src.name] = fused
        producer[node.outputs[0]] = fused
        absorbed[node.name] = src.name
    if not absorbed:
        return graph
    nodes = [merged.get(n.name, n) for n in graph.nodes if n.name not in absorbed]
    live = {t for n in nodes for t in n.inputs + n.outputs} | set(graph.inputs) | set(graph.outputs)
    return replace(graph, nodes=nodes, tensors={k: v for k, v in graph.tensors.items() if k in live})


# Output channels per group below which a Conv keeps its direct loop nest
# (depthwise convolutions): a register tile of rows would be mostly padding.
MIN_GEMM_ROWS = 4


def _is_depthwise(graph: Graph, node: Node) -> bool:
    """One 2-D (or 1-D) filter per channel: the direct depthwise kernel's case."""
    x, w = graph.tensors[node.inputs[0]].shape, graph.tensors[node.inputs[1]].shape
    return len(x) in (3, 4) and node.attrs.get("group", 1) == x[1] == w[0] and w[1] == 1


# Ops that can split their channels between threads, and the input size
# from which they do: below it the barrier after the op would cost more
# than the share of work it saves (a serial op only makes the other threads
# wait once, at the next split op).
SPLITTABLE = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")
MIN_SPLIT_ELEMENTS = 64 * 1024


def mark_split(graph: Graph) -> Graph:
    """Mark attrs["split"] on splittable ops with inputs of at least
    MIN_SPLIT_ELEMENTS values, so they run on every thread of a parallel run."""
    nodes = []
    for node in graph.nodes:
        if node.op_type in SPLITTABLE and graph.tensors[node.inputs[0]].size >= MIN_SPLIT_ELEMENTS:
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, split=True))
        nodes.append(node)
    return replace(graph, nodes=nodes)


def runs_as_gemm(graph: Graph, node: Node) -> bool:
    """Whether a Conv runs as a GEMM on packed weights: constant weights
    and at least MIN_GEMM_ROWS output channels per group (fewer would make
    a register tile of rows mostly padding)."""
    return (node.op_type == "Conv" and len(node.inputs) >= 2 and node.inputs[1] in graph.constants
            and graph.tensors[node.inputs[1]].shape[0] // node.attrs.get("group", 1) >= MIN_GEMM_ROWS)


def runs_as_tiled_product(graph: Graph, node: Node) -> bool:
    """Whether a MatMul or Gemm runs on the GEMM micro-kernel
    (matmul.lower_tiled): a MatMul whose right-hand side is a matrix or a
    batch of them (constant or not), a Gemm with constant B and a C that is
    one row or a scalar (it becomes a bias per column) - except one row
    times transposed weights, the fully connected layer of a classifier,
    which the matrix-vector kernel gemm.emit_dot_rows streams."""
    shapes = [graph.tensors[t].shape for t in node.inputs]
    if node.op_type == "MatMul":
        return len(shapes[1]) >= 2
    if node.op_type != "Gemm" or node.inputs[1] not in graph.constants:
        return False
    attrs = node.attrs
    m = shapes[0][1] if attrs["transA"] else shapes[0][0]
    n = shapes[1][0] if attrs["transB"] else shapes[1][1]
    if attrs["transB"] and not attrs["transA"] and m == 1:
        return False
    if len(node.inputs) < 3 or attrs["beta"] == 0.0:
        return True
    c = tuple(shapes[2])
    return node.inputs[2] in graph.constants and (len(c) < 2 or c[0] == 1) and c[-1:] in ((), (1,), (n,))


def fuse_matmul_affine(graph: Graph) -> Graph:
    """Fold an Add of a constant row (a Linear layer's bias) and a Mul by
    one (a layer scale, scaling each output column) into the MatMul with
    constant weights that feeds it, when nothing else reads the product:
    Add becomes the MatMul's bias per column (attrs["bias"], input 2), Mul
    scales the weights' columns and the bias. The Gelu or other activation
    that follows then fuses into the MatMul too (fuse_elementwise)."""
    def fold(node, matmul, const_name, constants, tensors):
        weight = constants.get(matmul.inputs[1])
        if weight is None or weight.ndim != 2 or weight.dtype != np.float32:
            return None
        n = weight.shape[1]
        value = constants[const_name]
        if (value.dtype != np.float32 or value.ndim > len(tensors[matmul.outputs[0]].shape)
                or any(d != 1 for d in value.shape[:-1]) or value.shape[-1:] not in ((), (1,), (n,))):
            return None
        row = np.broadcast_to(value.reshape(-1), (n,)).astype(np.float64)
        has_bias = matmul.attrs.get("bias", False)
        bias = constants[matmul.inputs[2]].astype(np.float64) if has_bias else np.zeros(n)
        inputs = list(matmul.inputs[:2])
        if node.op_type == "Mul":
            inputs[1] = f"{node.name}/scaled_weight"
            _add_constant(constants, tensors, inputs[1], (weight * row).astype(np.float32))
            bias = bias * row
        else:
            bias, has_bias = bias + row, True
        if has_bias:
            inputs.append(f"{node.name}/bias")
            _add_constant(constants, tensors, inputs[2], bias.astype(np.float32))
        return Node("MatMul", matmul.name, inputs, list(node.outputs), dict(matmul.attrs, bias=has_bias))
    return _fold_affine(graph, "MatMul", fold)


def pack_matmul_weights(graph: Graph) -> Graph:
    """Store the constant weights of each MatMul and Gemm that has a
    register tile (attrs["matmul_tile"], written by schedule.assign_tiles)
    as gemm.pack_columns(W, tile.nr), the panels the micro-kernel reads,
    and mark it attrs["packed_weights"] with attrs["weight_shape"] = (K, N).
    A Gemm's transB and alpha go into the packed weights and beta * C
    becomes its bias per column (attrs["bias"])."""
    from .gemm import pack_columns
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    nodes = []
    for node in graph.nodes:
        tile = node.attrs.get("matmul_tile")
        weight = constants.get(node.inputs[1]) if tile is not None else None
        if weight is None or weight.ndim != 2:
            nodes.append(node)
            continue
        attrs = dict(node.attrs, packed_weights=True)
        extra = list(node.inputs[2:])
        if node.op_type == "Gemm":
            weight = (weight.T if node.attrs["transB"] else weight) * np.float32(node.attrs["alpha"])
            extra = []
            if len(node.inputs) == 3 and node.attrs["beta"] != 0.0:
                bias = np.broadcast_to(constants[node.inputs[2]].reshape(-1), (weight.shape[1],))
                extra = [f"{node.name}/bias"]
                _add_constant(constants, tensors, extra[0], (bias * np.float32(node.attrs["beta"])).astype(np.float32))
            attrs["bias"] = bool(extra)
        # A Gemm's packed weights carry its transB and alpha: its own.
        name = f"{node.name if node.op_type == 'Gemm' else node.inputs[1]}/panels{tile.nr}"
        name += "/fp16" if tile.precision == "fp16" else ""
        if name not in constants:
            _add_constant(constants, tensors, name, pack_columns(np.asarray(weight, np.float32), tile.nr, tile.dtype))
        attrs["weight_shape"] = tuple(weight.shape)
        nodes.append(Node(node.op_type, node.name, [node.inputs[0], name, *extra], list(node.outputs), attrs))
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def transpose_recurrent_weights(graph: Graph) -> Graph:
    """Give each LSTM, GRU and RNN whose W or R is constant that weight
    transposed per direction ([directions, K, gates * hidden]) in its place,
    at input position W_TRANSPOSED or R_TRANSPOSED: a row of it is whole
    vectors of gate columns for the GEMM micro-kernel (W^T) and for the
    step's row-times-matrix product (R^T), where W and R themselves end
    every gate value in a horizontal sum (see recurrent.py)."""
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    nodes = []
    for node in graph.nodes:
        positions = node.attrs.get("input_positions")
        if node.op_type not in ("LSTM", "GRU", "RNN") or positions is None:
            nodes.append(node)
            continue
        by_position = dict(zip(positions, node.inputs))
        inputs, positions = list(node.inputs), list(positions)
        for source, position in ((1, W_TRANSPOSED), (2, R_TRANSPOSED)):
            weight = constants.get(by_position.get(source, ""))
            if weight is None or weight.ndim != 3:
                continue
            name = f"{by_position[source]}/transposed"
            if name not in constants:
                _add_constant(constants, tensors, name, np.ascontiguousarray(weight.transpose(0, 2, 1), np.float32))
            inputs[positions.index(source)] = name
            positions[positions.index(source)] = position
        nodes.append(Node(node.op_type, node.name, inputs, list(node.outputs),
                          dict(node.attrs, input_positions=tuple(positions))))
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def pack_conv_weights(graph: Graph) -> Graph:
    """Store the constant weight of each Conv that has a register tile
    (attrs["gemm_tile"], written by schedule.assign_tiles) as
    pack_weights(W_g, tile.mr) (the GEMM micro-kernel's layout) per group g,
    concatenated, and mark the node with attrs["packed_mr"]; likewise each
    ConvTranspose with attrs["columns_tile"], its weights packed by
    conv_transpose.pack_column_weights.

    A Conv marked attrs["winograd"] stores its weights transformed and
    packed instead (winograd.transform_weights). The packed constant is a
    new tensor, so a weight another node also reads stays as it was. Depthwise convolutions are marked
    attrs["depthwise"] instead (they run a direct kernel).
    """
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    nodes = []
    for node in graph.nodes:
        tile = node.attrs.get({"Conv": "gemm_tile", "ConvTranspose": "columns_tile"}.get(node.op_type, ""))
        if tile is not None:
            kind = ("columns" if node.op_type == "ConvTranspose" else
                    "winograd" if node.attrs.get("winograd") else "packed")
            name = f"{node.inputs[1]}/{kind}{node.attrs.get('winograd') or ''}/{tile.mr}"
            name += "/fp16" if tile.precision == "fp16" else ""
            if name not in constants:
                constants[name] = _packed_weights(kind, constants[node.inputs[1]], node.attrs.get("group", 1),
                                                  tile.mr, node.attrs.get("winograd") or 0, tile.dtype)
                tensors[name] = Tensor(name, constants[name].shape, tile.dtype)
            attrs = dict(node.attrs, packed_mr=tile.mr,
                         weight_shape=tuple(graph.tensors[node.inputs[1]].shape))
            node = Node(node.op_type, node.name, [node.inputs[0], name, *node.inputs[2:]],
                        list(node.outputs), attrs)
        elif node.op_type == "Conv" and _is_depthwise(graph, node):
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, depthwise=True))
        nodes.append(node)
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def _packed_weights(kind: str, weight: np.ndarray, group: int, mr: int, winograd_tile: int = 0,
                    dtype: str = "float32") -> np.ndarray:
    """A Conv's or ConvTranspose's constant weights in the layout its lowering
    reads (packed ones as dtype: float16 for an fp16 tile)."""
    from . import winograd
    from .conv_transpose import pack_column_weights
    from .gemm import pack_weights
    if kind == "winograd":
        return winograd.transform_weights(weight, mr, winograd_tile, dtype)
    if kind == "columns":
        return pack_column_weights(weight, group, mr)
    return np.concatenate([pack_weights(w, mr, dtype) for w in np.split(weight, group)])


def fuse_residual_add(graph: Graph) -> Graph:
    """Fold `Add(conv, r)` (or a two-input Sum) into a GEMM Conv (or a
    MatMul that runs on the micro-kernel) that only the Add reads: the Conv gains r as its last input and adds it in its
    epilogue (attrs["residual_at"]: after that many of its own fused ops,
    followed by the Add's), saving a pass over both tensors. The fused node
    takes the Add's place, where r is already computed. Only when every
    fused op has a vector form, as the micro-kernel's epilogue needs.
    """
    producer = {out: node for node in graph.nodes for out in node.outputs}
    uses = _consumers(graph)
    fused: dict[str, Node] = {}  # add name -> fused conv
    dropped = set()

    def vectorizable(node):
        return all(OPS[op].vectorizable for op, _ in node.attrs.get("epilogue", ()))

    for node in graph.nodes:
        if node.op_type not in ("Add", "Sum") or len(node.inputs) != 2:
            continue
        shape = graph.tensors[node.outputs[0]].shape
        if any(graph.tensors[t].shape != shape for t in node.inputs) or not vectorizable(node):
            continue
        for pos, name in enumerate(node.inputs):
            conv = producer.get(name)
            other = node.inputs[1 - pos]
            if (conv is None or not (runs_as_gemm(graph, conv) or (
                    conv.op_type == "MatMul" and runs_as_tiled_product(graph, conv)))
                    or conv.name in dropped or uses[name] != 1 or other == name
                    or not vectorizable(conv) or other in graph.constants):
                continue
            own = tuple(conv.attrs.get("epilogue", ()))
            attrs = dict(conv.attrs, residual_at=len(own),
                         epilogue=own + tuple(node.attrs.get("epilogue", ())))
            fused[node.name] = Node(conv.op_type, conv.name, conv.inputs + [other], list(node.outputs), attrs)
            dropped.add(conv.name)
            break
    if not fused:
        return graph
    nodes = [fused.get(n.name, n) for n in graph.nodes if n.name not in dropped]
    return eliminate_dead_code(replace(graph, nodes=nodes))


def _meets_input(outputs: tuple) -> bool:
    lo, hi = outputs
    return lo < hi


def _live_taps(size: int, kernel: int, stride: int, dilation: int, begin: int, count: int) -> tuple:
    """(first, last) kernel index along one axis whose tap meets the input
    for some output position, or None if none does."""
    live = [t for t in range(kernel) if _meets_input(_valid_range(t * dilation - begin, stride, size, count))]
    return (live[0], live[-1]) if live else None


def crop_dead_taps(graph: Graph) -> Graph:
    """Drop the kernel rows and columns of a Conv with constant weights that
    read only padding, whatever the output position, and shrink its
    padding to match: the output is the same, the work is not. A dilated
    3x3 convolution whose dilation reaches past the map (DeepLabV3's ASPP:
    dilations 24 and 36 on a 14 x 14 map) becomes a 1x1 convolution, 9x
    fewer multiplications; a large kernel on a small map loses its border.
    Taps that meet the input for only some outputs stay (they count there).
    """
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    nodes, changed = [], False
    for node in graph.nodes:
        if node.op_type != "Conv" or len(node.inputs) < 2 or node.inputs[1] not in constants:
            nodes.append(node)
            continue
        x, weight = graph.tensors[node.inputs[0]].shape, constants[node.inputs[1]]
        axes = len(x) - 2
        # The window's 3-D geometry, only the input's own spatial axes kept.
        spatial, kernel, strides, dilations, begin, end, out = (
            part[-axes:] for part in _resolve_window(x, tuple(weight.shape[2:]), node.attrs, what="convolution"))
        spans = [_live_taps(*args) for args in zip(spatial, kernel, strides, dilations, begin, out)]
        if None in spans or all(span == (0, k - 1) for span, k in zip(spans, kernel)):
            nodes.append(node)  # nothing to drop (or no tap meets the input: left as it is)
            continue
        new_begin = [b - first * d for b, (first, _), d in zip(begin, spans, dilations)]
        new_end = [e - (k - 1 - last) * d for e, (_, last), k, d in zip(end, spans, kernel, dilations)]
        if min(new_begin + new_end) < 0:
            nodes.append(node)  # the crop would need negative padding (cropping the input)
            continue
        cropped = weight[(slice(None), slice(None)) + tuple(slice(first, last + 1) for first, last in spans)]
        name = f"{node.name}/live_taps"
        _add_constant(constants, tensors, name, np.ascontiguousarray(cropped))
        # A kernel of one tap along an axis reads no dilation there.
        new_dilations = [d if last > first else 1 for (first, last), d in zip(spans, dilations)]
        attrs = dict(node.attrs, kernel_shape=tuple(cropped.shape[2:]), pads=tuple(new_begin + new_end),
                     dilations=tuple(new_dilations), auto_pad="NOTSET")
        nodes.append(Node(node.op_type, node.name, [node.inputs[0], name] + list(node.inputs[2:]),
                          list(node.outputs), attrs))
        changed = True
    if not changed:
        return graph
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def _tap_runs(size: int, kernel: int, stride: int, dilation: int, begin: int, count: int) -> list:
    """The output positions along one axis in runs that read the same kernel
    taps: [(first output, last output, first tap, last tap)], or None where
    an output reads only padding. The taps an output reads form one range."""
    runs = []
    for o in range(count):
        live = [t for t in range(kernel) if 0 <= o * stride - begin + t * dilation < size]
        if not live:
            return None
        if runs and runs[-1][2:] == (live[0], live[-1]):
            runs[-1] = (runs[-1][0], o) + runs[-1][2:]
        else:
            runs.append((o, o, live[0], live[-1]))
    return runs


# A dilated Conv is split by tap regions only when that removes at least this
# share of its multiplications, into at most this many regions. Undilated ones
# stay whole: their border taps read the zeros of a padded copy of the input
# (a 3x3 with padding 1 on 7 x 7 would lose a third of its products, in nine
# small convolutions and the copies between them).
_SPLIT_MIN_SAVING = 0.25
_SPLIT_MAX_REGIONS = 27


def split_tap_regions(graph: Graph) -> Graph:
    """Split a dilated Conv with constant weights whose outputs read different kernel
    taps by position into one Conv per region of outputs that read the same
    taps, each on the slice of the input it reads and with only those taps
    and no padding, then concatenate the regions. DeepLabV3's dilation-12 3x3
    convolutions on a 14 x 14 map read one tap row at 10 of 14 rows and two
    at the other 4: split, they do 0.18x the multiplications. Each output
    adds the same products as before, only those of taps that read padding
    (zeros) left out.
    """
    constants, tensors = dict(graph.constants), dict(graph.tensors)
    nodes, changed = [], False
    for node in graph.nodes:
        regions = _tap_regions(graph, node, constants)
        if regions is None:
            nodes.append(node)
            continue
        nodes.extend(_split_conv(node, regions, graph.tensors, constants, tensors))
        changed = True
    if not changed:
        return graph
    return eliminate_dead_code(replace(graph, nodes=nodes, constants=constants, tensors=tensors))


def _tap_regions(graph: Graph, node: Node, constants: dict):
    """Per spatial axis, the runs of _tap_runs, if splitting ``node`` pays."""
    if (node.op_type != "Conv" or len(node.inputs) < 2 or node.inputs[1] not in constants
            or any(t not in constants for t in node.inputs[2:])
            or graph.tensors[node.inputs[0]].dtype != "float32"):
        return None
    x, weight = graph.tensors[node.inputs[0]].shape, constants[node.inputs[1]]
    axes = len(x) - 2
    if axes not in (1, 2, 3):
        return None
    geometry = (part[-axes:] for part in _resolve_window(x, tuple(weight.shape[2:]), node.attrs,
                                                          what="convolution"))
    spatial, kernel, strides, dilations, begin, _end, out = geometry
    if max(dilations) == 1 or weight.shape[1] == 1 < int(node.attrs.get("group") or 1):
        # An undilated window's border is the padded copy's zeros (conv.py);
        # a depthwise kernel tests its taps or pads each plane itself.
        return None
    runs = [_tap_runs(*args) for args in zip(spatial, kernel, strides, dilations, begin, out)]
    if None in runs or all(len(r) == 1 for r in runs) or int(np.prod([len(r) for r in runs])) > _SPLIT_MAX_REGIONS:
        return None
    taps = np.prod([sum((o1 - o0 + 1) * (t1 - t0 + 1) for o0, o1, t0, t1 in r) for r in runs])
    if taps > (1 - _SPLIT_MIN_SAVING) * np.prod(out) * np.prod(kernel):
        return None
    return [(r, s, d, b) for r, s, d, b in zip(runs, strides, dilations, begin)]


def _split_conv(node: Node, regions: list, shapes: dict, constants: dict, tensors: dict) -> list:
    """The Slice, Conv and Concat nodes that compute ``node`` region by region."""
    x = shapes[node.inputs[0]]
    dtype, axes = x.dtype, len(regions)
    weight = constants[node.inputs[1]]
    nodes = []

    def region_conv(picks, out_name):
        starts = [o0 * s - b + t0 * d for (o0, _o1, t0, _t1), (_r, s, d, b) in zip(picks, regions)]
        ends = [o1 * s - b + t1 * d + 1 for (_o0, o1, _t0, t1), (_r, s, d, b) in zip(picks, regions)]
        tag = "_".join(f"{o0}-{o1}" for o0, o1, _t0, _t1 in picks)
        sliced = f"{node.name}/input_{tag}"
        tensors[sliced] = Tensor(sliced, x.shape[:2] + tuple(e - b for b, e in zip(starts, ends)), dtype)
        nodes.append(Node("Slice", f"{node.name}/slice_{tag}", [node.inputs[0]], [sliced],
                          {"starts": tuple(starts), "ends": tuple(ends),
                           "axes": tuple(range(2, 2 + axes)), "steps": None}))
        taps = weight[(slice(None), slice(None)) + tuple(slice(t0, t1 + 1) for _o0, _o1, t0, t1 in picks)]
        w_name = f"{node.name}/taps_{tag}"
        _add_constant(constants, tensors, w_name, np.ascontiguousarray(taps))
        attrs = dict(node.attrs, kernel_shape=tuple(taps.shape[2:]), pads=(0,) * (2 * axes),
                     dilations=tuple(d if t1 > t0 else 1 for (_o0, _o1, t0, t1), (_r, _s, d, _b)
                                     in zip(picks, regions)),
                     auto_pad="NOTSET")
        tensors[out_name] = Tensor(out_name, shapes[node.outputs[0]].shape[:2]
                                   + tuple(o1 - o0 + 1 for o0, o1, _t0, _t1 in picks), dtype)
        nodes.append(Node("Conv", f"{node.name}/region_{tag}", [sliced, w_name] + list(node.inputs[2:]),
                          [out_name], attrs))

    def assemble(axis, picks, out_name):
        if axis == axes:
            region_conv(picks, out_name)
            return
        runs = regions[axis][0]
        if len(runs) == 1:
            assemble(axis + 1, picks + [runs[0]], out_name)
            return
        parts = []
        for run in runs:
            part = f"{out_name}/part_{axis}_{run[0]}"
            assemble(axis + 1, picks + [run], part)
            parts.append(part)
        if out_name not in tensors:
            first = tensors[parts[0]].shape
            tensors[out_name] = Tensor(out_name, first[:2 + axis] + (sum(tensors[p].shape[2 + axis] for p in parts),)
                                       + first[3 + axis:], dtype)
        nodes.append(Node("Concat", f"{node.name}/concat_{axis}_{len(nodes)}", parts, [out_name],
                          {"axis": 2 + axis}))

    assemble(0, [], node.outputs[0])
    return nodes
