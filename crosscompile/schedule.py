"""Schedules: which register tile each convolution's GEMM uses.

By default a convolution gets default_tile(target, shape): gemm.tile_for's
tile, transposed for convolutions that read windows. A schedule table maps
a convolution's shape (ConvShape.key) to a tile measured faster for it
(`tether tune` measures them, crosscompile.tuning caches them); build()
looks every GEMM convolution up there and falls back to the default.

assign_tiles is the graph pass that makes this choice once and writes it
into each convolution's attributes. Plain data and functions only: no
files, clocks or boards here.

Example:
    >>> from crosscompile.target import resolve_target
    >>> [t.label for t in candidate_tiles(resolve_target("rasp4b64"))]
    ['8x3', '16x1', '10x1', '14x2', '8x2', '9x3', '6x3', '6x4']
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional

from . import winograd
from .errors import BuildError
from .gemm import GemmTile, channel_tile, tile_for
from .ir import Node
from .conv import depthwise_planes, split_phases
from .passes import _is_depthwise, runs_as_gemm, runs_as_tiled_product
from .window import _resolve_window

# Rows of one register tile at most: past this the broadcasts of A, not
# the loads of B, bound the inner loop, and the tile's tail grows.
MAX_ROWS = 16
# Vectors of C columns per tile at most: rows of output pixels are short in
# late layers (7 x 7), so wider tiles mostly run their tail.
MAX_VECTORS = 4
# Candidates measured per shape at most.
MAX_CANDIDATES = 8


@dataclass(frozen=True)
class ConvShape:
    """What identifies a convolution for tuning: its input and weight
    shapes and window attributes (as the ONNX node gives them)."""

    x: tuple
    w: tuple
    y: tuple
    strides: tuple
    pads: tuple
    dilations: tuple
    group: int
    auto_pad: str = "NOTSET"

    @property
    def key(self) -> str:
        """A stable text key, e.g. 'x1x64x56x56-w64x64x3x3-s1x1-p1x1x1x1-d1x1-g1'.

        >>> ConvShape((1, 8, 5, 5), (4, 8, 3, 3), (1, 4, 5, 5), (1, 1), (1, 1, 1, 1), (1, 1), 1).key
        'x1x8x5x5-w4x8x3x3-s1x1-p1x1x1x1-d1x1-g1'
        """
        def dims(values):
            return "x".join(str(int(v)) for v in values)
        text = (f"x{dims(self.x)}-w{dims(self.w)}-s{dims(self.strides)}-p{dims(self.pads)}"
                f"-d{dims(self.dilations)}-g{self.group}")
        return text if self.auto_pad == "NOTSET" else f"{text}-{self.auto_pad.lower()}"

    @property
    def gemm(self) -> tuple:
        """(M, K, N) of one group's GEMM: output channels, reduction, output pixels."""
        m = self.w[0] // self.group
        k = 1
        for d in self.w[1:]:
            k *= d
        n = 1
        for d in self.y[2:]:
            n *= d
        return m, k, n

    def to_dict(self) -> dict:
        return {"x": list(self.x), "w": list(self.w), "y": list(self.y),
                "strides": list(self.strides), "pads": list(self.pads),
                "dilations": list(self.dilations), "group": self.group,
                "auto_pad": self.auto_pad}

    @staticmethod
    def from_dict(data: dict) -> "ConvShape":
        return ConvShape(tuple(data["x"]), tuple(data["w"]), tuple(data["y"]),
                         tuple(data["strides"]), tuple(data["pads"]), tuple(data["dilations"]),
                         int(data["group"]), data.get("auto_pad", "NOTSET"))


def conv_shape(graph, node) -> ConvShape:
    """The ConvShape of a Conv node of an imported graph."""
    x = tuple(graph.tensors[node.inputs[0]].shape)
    w = tuple(graph.tensors[node.inputs[1]].shape)
    y = tuple(graph.tensors[node.outputs[0]].shape)
    spatial = len(x) - 2
    attrs = node.attrs
    return ConvShape(x, w, y, tuple(attrs.get("strides") or (1,) * spatial),
                     tuple(attrs.get("pads") or (0,) * (2 * spatial)),
                     tuple(attrs.get("dilations") or (1,) * spatial),
                     int(attrs.get("group", 1)), attrs.get("auto_pad", "NOTSET"))


def fits(target, mr: int, nv: int) -> bool:
    """mr x nv accumulators, nv loaded vectors of B and one broadcast of A
    fit the target's vector register file (for a transposed tile, mr is its
    pixels: the same count of accumulators, loads and broadcast)."""
    return mr >= 1 and nv >= 1 and mr * nv + nv + 1 <= target.vector_registers


def most_rows(target, nv: int) -> int:
    """The most rows of nv vectors (or pixels of a transposed tile of nv
    vectors of channels) that fit the target's registers, the bound fits
    checks.

    >>> from crosscompile.target import resolve_target
    >>> most_rows(resolve_target("rasp4b64"), 2)
    14
    """
    return (target.vector_registers - 1 - nv) // nv


# Reduction depths (K) from which the transposed tile is the default, for
# convolutions reading windows and for 1x1 ones. Its tiles are moved to and
# from the channel-major output by in-register transposes, a cost per
# output that a deep reduction amortises: measured on AVX-512 against the
# tile of rows, windows gained from K = 27 (a 3-channel stem) up, 1x1
# convolutions from K = 512 (ResNet-50's 1024 -> 256) and lost below.
WINDOW_CHANNEL_DEPTH = 16
POINTWISE_CHANNEL_DEPTH = 512
# Below this depth the transposed tile is one vector of channels by as many
# pixels as lanes: each channel's run of pixels is then one whole vector
# (a 64-byte line with AVX-512) and the transpose square, where the wider
# default tile stores runs of 6. Measured in SqueezeNet and ResNet-50: the
# stems (27 and 147 deep) 0.64 -> 0.50 ms and 2.42 -> 2.23 ms, SqueezeNet's
# 144-deep 3x3 0.53 -> 0.50 ms; deeper convolutions lost up to 10 % with
# it (one weight vector per 16 FMAs). Only where a vector is a whole cache
# line (16 lanes): with AVX2's 8 lanes the square tile holds 8 accumulators
# and spends 9 loads on 8 FMAs, and SqueezeNet's stem and 144-deep 3x3s
# took 1.26 / 1.41 ms with it against 0.83 / 0.66 ms with the channel tile
# (one thread, AMD EPYC Zen 3, interleaved per-layer profiles).
SQUARE_TILE_DEPTH = 256
# 1x1 convolutions with at most this many output pixels (14 x 14) take the
# transposed tile whatever their depth, residual Add included: the tile of
# rows would leave vectors of pixels partly empty (49 pixels in 64 lanes
# with AVX-512; 196 in 3 panels of 64 and a last one of 4). Measured on
# AMD Zen 5, one thread, against the tile of rows: ResNet-50's 512 -> 2048
# at 7 x 7 with its residual Add 491 -> 429 us (AVX-512) and 917 -> 844 us
# (AVX2 code); 1024 -> 2048 at stride 2 974 -> 819 and 1787 -> 1648 us.
# Up to 14 x 14 rather than 7 x 7, whole models against onnxruntime
# (AVX-512): ResNet-50 0.89 -> 0.87, DenseNet-121 0.80 -> 0.75; with AVX2
# code ResNet-50 took the same time either way.
FEW_PIXELS = 196
# ... at least this deep (a shallower one's transposes cost more than the
# tile of rows' empty lanes), and with whole vectors of the transposed
# tile's channels (ShuffleNet's grouped ones, 60 - 240 channels per group,
# went from 0.71 to 0.80 of onnxruntime's time with it).
FEW_PIXELS_DEPTH = 64
CACHE_LINE_BYTES = 64


def reads_windows(shape: ConvShape) -> bool:
    """Whether a convolution reads a window of more than one pixel per
    output (3x3, 7x7, ...): 1-D or 2-D, kernel larger than 1x1."""
    area = 1
    for d in shape.w[2:]:
        area *= d
    return area > 1 and len(shape.x) <= 4


def default_tile(target, shape: ConvShape, residual: bool = False) -> GemmTile:
    """The tile a convolution gets unless a schedule names another.

    Deep enough convolutions (see WINDOW_CHANNEL_DEPTH) take a transposed
    tile (vectors of output channels by pixels, gemm.emit_channel_gemm):
    channel_tile(tile_for(target)), or below SQUARE_TILE_DEPTH on targets
    whose vector is a cache line (16 lanes) one vector of channels by a
    vector's worth of pixels.
    For those reading windows the tile of rows would read a padded copy of
    the input whose rows are wider than the output's, spending a share of
    its FMAs on the padding columns (1/8 at 14 x 14, 2/9 at 7 x 7), and
    copy the output out of that grid; 1x1 convolutions read the input in
    place either way, and gain from the transposed tile's whole vectors
    of channels only when deep. A convolution whose output is added to
    another tensor (residual, fused into its epilogue) keeps the tile of
    rows, which reads that tensor a vector at a time, unless it is a 1x1
    convolution of at most FEW_PIXELS output pixels.

    Where the target multiplies by a lane (ARM), every convolution keeps
    the tile of rows: it loads its weights a vector at a time, where the
    transposed tile loads one input value per pixel, and so costs fewer
    instructions per FMA than the padding columns add. Counted on an
    emulated Cortex-A72: SqueezeNet 142.8 -> 130.9 M instructions per
    inference, ResNet-18 715.2 -> 669.4 M.
    """
    tile = tile_for(target)
    depth = shape.gemm[1]
    threshold = WINDOW_CHANNEL_DEPTH if reads_windows(shape) else POINTWISE_CHANNEL_DEPTH
    few_pixels = (not reads_windows(shape) and shape.gemm[2] <= FEW_PIXELS and depth >= FEW_PIXELS_DEPTH
                  and shape.gemm[0] % channel_tile(tile).mr == 0)
    if target.multiplies_by_lane or (not few_pixels and (depth < threshold or residual)):
        return tile
    square = GemmTile(tile.lanes, tile.lanes, 1, tile.lanes)
    if depth < SQUARE_TILE_DEPTH and 4 * tile.lanes >= CACHE_LINE_BYTES and fits(target, square.pixels, square.nv):
        return square
    return channel_tile(tile)


def candidate_tiles(target, m: Optional[int] = None, shape: Optional[ConvShape] = None) -> list:
    """The register tiles worth measuring for a target, the default first.

    Every tile that fits the register file is a candidate in principle;
    this keeps, per number of vectors, the largest row count that fits and
    one of about two thirds of it (rounded to even), the ones that use the
    register file well. With m (output channels per group) given, tiles with
    more rows than m are dropped: their rows would be padding. With shape
    given, its default_tile comes first, and a convolution reading windows
    also gets the transposed form of the largest tiles.
    """
    lanes = target.lanes
    plain = tile_for(target)
    default = default_tile(target, shape) if shape is not None else plain
    out = [default]
    fitting = [plain]
    for nv in range(1, MAX_VECTORS + 1):
        largest = min(MAX_ROWS, most_rows(target, nv))
        for mr in (largest, max(2, largest * 2 // 3 // 2 * 2)):
            tile = GemmTile(lanes, mr, nv)
            if mr >= 2 and fits(target, mr, nv) and tile not in fitting:
                fitting.append(tile)
    rows_tiles = [t for t in fitting if m is None or t.mr <= max(m, plain.mr)]
    if shape is not None and reads_windows(shape):
        # Transposed (their rows become pixels): nv vectors of channels,
        # no more than m needs; the largest register tiles first.
        pool = [plain] + sorted(fitting[1:], key=lambda t: -t.mr * t.nv)
        channel = [channel_tile(t) for t in pool if m is None or t.nv <= -(-m // lanes)]
        out += [t for t in channel if t not in out][:2]
    out += [t for t in rows_tiles if t not in out]
    return out[:MAX_CANDIDATES]


def tile_table(target, schedules) -> Mapping:
    """The {shape key: tile} mapping of `schedules` for `target`.

    schedules is None, a mapping of shape keys to GemmTile, (mr, nv) or a
    cache entry holding "best", or an object with tiles_for(target)
    (crosscompile.tuning.TuningCache).
    """
    if schedules is None:
        return {}
    if hasattr(schedules, "tiles_for"):
        return schedules.tiles_for(target)
    if not isinstance(schedules, Mapping):
        raise TypeError("schedules must be a mapping of convolution shape keys to tiles or a "
                        f"TuningCache, not {type(schedules).__name__}")
    return schedules


def as_tile(target, value) -> GemmTile:
    """A GemmTile for the target from a GemmTile, its spec ((mr, nv) or
    (mr, nv, pixels)) or a cache entry."""
    lanes = target.lanes
    if isinstance(value, Mapping):
        value = value["best"]
    spec = value.spec if isinstance(value, GemmTile) else [int(v) for v in value]
    if len(spec) not in (2, 3):
        raise BuildError(f"tile {spec} should be [mr, nv] or [mr, nv, pixels]")
    mr, nv, pixels = (spec + [0])[:3]
    if pixels and mr != nv * lanes:
        raise BuildError(f"transposed tile {spec} should have mr = nv x {lanes} lanes = {nv * lanes}")
    if not fits(target, pixels or mr, nv):
        raise BuildError(f"tile {spec} does not fit the {target.vector_registers} vector "
                         f"registers of target {target.name!r} (needs mr*nv + nv + 1)")
    return GemmTile(lanes, mr, nv, pixels)


def assign_tiles(graph, target, table: Mapping):
    """Write each GEMM convolution's register tile into the graph: the tile
    `table` ({ConvShape.key: tile}, see tile_table) schedules for its shape,
    else the target's default. Runs after the fusion passes, so a Conv's
    fused residual (attrs["residual_at"]) is known, not predicted.

    Each such Conv gets attrs["gemm_tile"] (the GemmTile), attrs["conv_shape"]
    (its ConvShape), attrs["tile_tuned"] (whether the table chose it) and
    attrs["winograd"] (the output tile, 2 or 4, of the Winograd variant it
    runs as, where one pays and no tuned tile was chosen for it; else 0), which weight packing, the
    lowering and the module metadata read. Each MatMul and Gemm that runs
    on the micro-kernel (passes.runs_as_tiled_product) gets the target's
    tile of rows as attrs["matmul_tile"], and attrs["pack_rows"] where the
    target loads the values it broadcasts a vector at a time
    (Target.multiplies_by_lane) or the node computes in fp16 (attrs["precision"],
    crosscompile.precision: its tile reads A packed as halves), so that A
    is first packed like weights. A node marked fp16 gets the fp16 tile
    (gemm.tile_for(target, "fp16"), for Winograd's products too), never a
    tuned one.
    A depthwise convolution that reads a zero-padded copy of its input
    (conv.depthwise_planes, for the target's vector width) gets the copy's
    (rows, columns) as attrs["padded_planes"]; one marked fp16 always does
    (it holds the copy in halves); where conv.split_phases says so, its
    copy holds the even columns, then the odd ones (attrs["padded_phases"]).
    A ConvTranspose with constant
    weights gets the tile of rows its columns are computed with
    (attrs["columns_tile"]).

    >>> from crosscompile.target import resolve_target
    >>> graph = assign_tiles(graph, resolve_target("rasp4b64"), {})  # doctest: +SKIP
    """
    readers: dict = {}
    for node in graph.nodes:
        for name in set(node.inputs):
            readers.setdefault(name, []).append(node)
    nodes = []
    for node in graph.nodes:
        half = node.attrs.get("precision") == "fp16"
        if runs_as_gemm(graph, node):
            shape = conv_shape(graph, node)
            if half:  # tuned tiles were measured in float32
                tile, tuned = tile_for(target, "fp16"), False
            else:
                tile, tuned = _scheduled_tile(target, table, node, shape, _adds_residual(graph, node, readers))
            geometry = _resolve_window(shape.x, shape.w[2:], node.attrs, what="convolution")
            transformed = 0 if tuned else winograd.choose(target, geometry, shape.x[1], shape.w[0], shape.group)
            if transformed:
                tile = winograd.product_tile(target, winograd.plan(geometry, shape.x[1], shape.w[0], transformed),
                                             "fp16" if half else "fp32")
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, gemm_tile=tile, conv_shape=shape, tile_tuned=tuned,
                             winograd=transformed))
        elif node.op_type == "Conv" and _is_depthwise(graph, node):
            shape = conv_shape(graph, node)
            planes = depthwise_planes(_resolve_window(shape.x, shape.w[2:], node.attrs, what="convolution"),
                                      target.lanes, half)
            if planes is not None:
                attrs = dict(node.attrs, padded_planes=planes)
                if split_phases(target, node.attrs, half):
                    attrs.update(padded_planes=(planes[0], planes[1] + planes[1] % 2), padded_phases=True)
                node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs), attrs)
        elif node.op_type == "ConvTranspose" and node.inputs[1] in graph.constants:
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, columns_tile=tile_for(target)))
        elif runs_as_tiled_product(graph, node):
            # An fp16 tile reads A packed as halves.
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, matmul_tile=tile_for(target, "fp16" if half else "fp32"),
                             pack_rows=target.multiplies_by_lane or half))
        elif node.op_type == "FusedAttention":  # its two products, Q and the scores read in place
            node = Node(node.op_type, node.name, list(node.inputs), list(node.outputs),
                        dict(node.attrs, matmul_tile=tile_for(target)))
        nodes.append(node)
    return replace(graph, nodes=nodes)


def _adds_residual(graph, node, readers: dict) -> bool:
    """Whether a Conv's output goes only into a residual Add: fused into
    this Conv (attrs["residual_at"]), fused into the Conv on the Add's other
    side (its last input), or an Add (or Sum) of two tensors of one shape
    left as it is. Both operands of the Add count, fused or not: the
    default tiles (and so the tuning cache's "default" entries) were
    settled that way.
    """
    if node.attrs.get("residual_at") is not None:
        return True
    out = node.outputs[0]
    if len(readers.get(out, ())) != 1:
        return False
    reader = readers[out][0]
    if reader.op_type == "Conv":
        return (reader.attrs.get("residual_at") is not None and reader.inputs[-1] == out
                and out not in reader.inputs[:-1])
    if reader.op_type not in ("Add", "Sum") or len(reader.inputs) != 2:
        return False
    shape = graph.tensors[out].shape
    return all(graph.tensors[t].shape == shape for t in reader.inputs)


def _scheduled_tile(target, table: Mapping, node, shape: ConvShape, residual: bool) -> tuple:
    """(tile, tuned) of one GEMM convolution."""
    default = default_tile(target, shape, residual)
    value = table.get(shape.key)
    if isinstance(value, Mapping) and value.get("default") not in (None, default.spec):
        # Tuned against another default (an older compiler, or this
        # convolution without the residual Add it has here): not comparable.
        value = None
    try:
        tile = as_tile(target, value) if value is not None else default
    except BuildError as exc:
        # A table written for a wider machine (more lanes or registers)
        # fails here: name the convolution and a tile that builds.
        raise BuildError(f"Conv {node.name!r} ({shape.key}): {exc}; schedule a tile for "
                         f"target {target.name!r}, e.g. its default {default.spec}") from None
    return tile, value is not None
