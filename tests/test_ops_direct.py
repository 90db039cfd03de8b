"""Convolutions that read their input in place (conv._direct_plan): the
padded input copied once (split into stride phases for strides above 1),
then either GEMM rows of B as windows of that copy with the output copied
out of a grid wider than the output rows (a tile of rows), or per output
pixel one broadcast from each window into vectors of output channels
(the transposed tile, gemm.emit_channel_gemm, the default for kernels
larger than 1x1). Shapes give unequal and one-sided padding, rows sharing
their padding columns, dilation, strides 2 and 3, 1-D, groups, batches,
partial panels, row blocks and channel vectors; each is compared with
onnxruntime for 1, 2 and 3 threads under both tiles."""
import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from crosscompile.conv import _direct_plan
from crosscompile.gemm import GemmTile, channel_tile, tile_for
from crosscompile.schedule import default_tile
from crosscompile.target import resolve_target
from crosscompile.tuning import conv_shapes
from crosscompile.window import _resolve_window
from tests.onnx_models import conv_relu_model, make_model, rand, reference
from tests.test_ops_channel_tile import AVX512

CASES = [
    ((1, 17, 37, 41), (20, 17, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 5, 19, 23), (11, 5, 3, 3), {"pads": [0, 0, 2, 2]}),             # padding at the end only
    ((1, 5, 19, 60), (7, 5, 3, 5), {"pads": [1, 3, 1, 0]}),              # at the start only (columns)
    ((2, 3, 61, 59), (13, 3, 7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),  # stem-like
    ((1, 9, 40, 37), (30, 9, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((1, 6, 31, 44), (10, 6, 3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    ((1, 4, 47, 80), (8, 4, 5, 5), {"pads": [2, 1, 2, 3], "strides": [3, 3], "dilations": [1, 2]}),
    ((1, 64, 16, 16), (200, 64, 3, 3), {"pads": [1, 1, 1, 1]}),           # many rows: threads split rows
    ((2, 8, 20, 21), (12, 4, 3, 3), {"pads": [1, 1, 1, 1], "group": 2}),
    ((1, 3, 300), (5, 3, 7), {"pads": [3, 3], "strides": [2]}),          # 1-D
    ((1, 7, 33, 30), (9, 7, 4, 4), {"auto_pad": "SAME_UPPER"}),
    ((1, 24, 32, 28), (40, 24, 1, 1), {"strides": [2, 2]}),             # strided 1x1: GEMM writes Y
    ((2, 8, 16, 15), (12, 4, 1, 1), {"strides": [2, 2], "group": 2}),
]


HOST = resolve_target("host")


@pytest.mark.parametrize("tile", ["channels", "rows"])
@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
def test_direct_conv_matches_onnxruntime_on_1_2_3_threads(tmp_path, x_shape, w_shape, attrs, tile):
    model = conv_relu_model(x_shape, w_shape, attrs)
    x = rand(*x_shape, seed=3)
    want = reference(model, {"x": x})[0]
    (shape,) = conv_shapes(model)
    forced = channel_tile(tile_for(HOST)) if tile == "channels" else tile_for(HOST)
    lib = crosscompile.build(model, target="host", schedules={shape.key: forced.spec})
    assert [t["tile"] for t in lib.metadata["gemm_tiles"]] == [forced.spec]
    module = minirt.load(lib.export_library(tmp_path / "m.so"))
    for threads in (1, 2, 3):
        module.set_threads(threads)
        for _ in range(3):  # a race between copying in, multiplying and copying out would show
            got = module.run({"x": x})[0]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    module.close()


@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
def test_cases_take_the_direct_path(x_shape, w_shape, attrs):
    full = dict({"strides": None, "pads": None, "dilations": None, "auto_pad": "NOTSET"}, **attrs)
    geometry = _resolve_window(x_shape, tuple(w_shape[2:]), full)
    group = attrs.get("group", 1)
    assert _direct_plan(geometry, x_shape[1] // group, w_shape[0] // group, full) is not None


def test_small_outputs_and_fused_residuals_keep_im2col():
    """A 7 x 7 output would compute 56 grid columns for 49 outputs, more than
    the copy it saves; a residual add is fused into im2col's GEMM only."""
    attrs = {"strides": None, "pads": [1, 1, 1, 1], "dilations": None, "auto_pad": "NOTSET"}
    small = _resolve_window((1, 512, 7, 7), (3, 3), attrs)
    assert _direct_plan(small, 512, 512, attrs) is None
    large = _resolve_window((1, 64, 56, 56), (3, 3), attrs)
    assert _direct_plan(large, 64, 64, attrs) is not None
    assert _direct_plan(large, 64, 64, dict(attrs, residual_at=1)) is None


@pytest.mark.parametrize("x_shape,w_shape,pads,kind", [
    ((1, 256, 14, 14), (256, 256, 3, 3), 1, "channels"),  # 3x3: padding columns would cost 1/8
    ((1, 3, 224, 224), (64, 3, 3, 3), 0, "square"),        # a 27-deep stem
    ((1, 16, 55, 55), (64, 16, 3, 3), 1, "square"),        # 144 deep
    ((1, 1, 30, 30), (8, 1, 3, 3), 1, "rows"),             # 9 deep
    ((1, 1024, 28, 28), (256, 1024, 1, 1), 0, "channels"),  # 1x1, 1024 deep
    ((1, 256, 28, 28), (256, 256, 1, 1), 0, "rows"),       # 1x1, 256 deep
    ((1, 256, 14, 14), (1024, 256, 1, 1), 0, "few"),       # 1x1 on 196 pixels, residual or not
    ((1, 512, 7, 7), (2048, 512, 1, 1), 0, "few"),
    ((1, 240, 14, 14), (60, 240, 1, 1), 0, "rows"),        # 60 channels: not whole vectors of the transposed tile
    ((1, 32, 14, 14), (256, 32, 1, 1), 0, "rows"),         # 32 deep
])
@pytest.mark.parametrize("target", ["host", "x86_64-unknown-linux-gnu/haswell/+avx,+avx2,+fma", AVX512,
                                    "rasp4b64", "rasp4b"])
def test_default_tile_follows_kernel_and_depth(x_shape, w_shape, pads, kind, target):
    target = resolve_target(target)
    model = conv_relu_model(x_shape, w_shape, {"pads": [pads] * 4})
    (shape,) = conv_shapes(model)
    rows = tile_for(target)
    # default_tile takes the square tile where a vector is a 64-byte line only.
    square = GemmTile(rows.lanes, rows.lanes, 1, rows.lanes) if rows.lanes >= 16 else channel_tile(rows)
    want = {"rows": rows, "channels": channel_tile(rows), "square": square, "few": channel_tile(rows)}[kind]
    if target.multiplies_by_lane:
        # ARM: every convolution keeps the tile of rows (instruction counts, schedule.py).
        want = rows
    assert default_tile(target, shape) == want
    # A convolution whose output a residual Add takes keeps the tile of
    # rows, but for a 1x1 one on few pixels.
    assert default_tile(target, shape, residual=True) == (want if kind == "few" else rows)


def test_transposed_tiles_read_any_grid_in_place():
    """The transposed tile writes each output pixel itself: small outputs
    and fused residuals read the input in place too, with no output grid
    in scratch."""
    attrs = {"strides": None, "pads": [1, 1, 1, 1], "dilations": None, "auto_pad": "NOTSET",
             "residual_at": 1}
    small = _resolve_window((1, 512, 7, 7), (3, 3), attrs)
    plan = _direct_plan(small, 512, 512, attrs, any_grid=True)
    assert plan is not None and plan.scratch_floats == plan.buffer_floats
    assert plan.pixel_bases == tuple(oh * plan.wq + ow for oh in range(7) for ow in range(7))


def test_strided_1x1_takes_the_direct_path_only_where_its_grid_is_the_output():
    attrs = {"strides": [2, 2], "pads": None, "dilations": None, "auto_pad": "NOTSET"}
    exact = _resolve_window((1, 256, 56, 56), (1, 1), attrs)      # 28 x 28 = 784 columns
    assert _direct_plan(exact, 256, 512, attrs).n_virtual == 784
    ragged = _resolve_window((1, 1024, 14, 14), (1, 1), attrs)    # 49 columns, grid of 52
    assert _direct_plan(ragged, 1024, 2048, attrs) is None


def test_residual_add_writes_over_its_last_reader_buffer(tmp_path):
    """Bottleneck-like chain: each fused residual conv whose shortcut nothing
    reads later takes over the shortcut's buffer; 1, 2 and 3 threads match
    onnxruntime, as does a shortcut still read afterwards."""
    from crosscompile.compiler import lowered_graph
    from crosscompile.memory import plan_memory
    from crosscompile.target import resolve_target

    def w(cout, cin, k, seed):
        return (rand(cout, cin, k, k, seed=seed) / np.sqrt(cin * k * k)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a0"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a0"], ["t"])]
    inits = {"w0": w(24, 5, 3, 1)}
    # Blocks h = relu(conv(in)), out = conv(h) + in (then Relu): 1x1, 3x3, 1x1.
    for i, (src, k, first) in enumerate([("t", 1, True), ("u1", 3, False), ("u2", 1, True)]):
        pads = [k // 2] * 4
        add = [f"c{i}", src] if first else [src, f"c{i}"]
        nodes += [helper.make_node("Conv", [src, f"wa{i}"], [f"p{i}"], pads=pads),
                  helper.make_node("Relu", [f"p{i}"], [f"h{i}"]),
                  helper.make_node("Conv", [f"h{i}", f"wb{i}"], [f"c{i}"], pads=pads),
                  helper.make_node("Add", add, [f"s{i}"]),
                  helper.make_node("Relu", [f"s{i}"], [f"u{i + 1}"])]
        inits.update({f"wa{i}": w(24, 24, k, 2 + i), f"wb{i}": w(24, 24, k, 5 + i)})
    nodes.append(helper.make_node("Mul", ["s2", "u2"], ["y"]))   # u2 read after its Add
    model = make_model(nodes, {"x": (2, 5, 11, 13)}, {"y": None}, inits)
    _, _, graph = lowered_graph(model, resolve_target("host"), None, {})
    plan = plan_memory(graph)
    fused = [n for n in graph.nodes if n.attrs.get("residual_at") is not None]
    shared = [plan.locations[n.inputs[-1]] == plan.locations[n.outputs[0]] for n in fused]
    assert shared == [True, True, False]
    x = rand(2, 5, 11, 13, seed=5)
    want = reference(model, {"x": x})[0]
    module = minirt.load(crosscompile.build(model, target="host").export_library(tmp_path / "m.so"))
    for threads in (1, 2, 3):
        module.set_threads(threads)
        for _ in range(3):
            np.testing.assert_allclose(module.run({"x": x})[0], want, rtol=1e-4, atol=1e-5)
    module.close()
