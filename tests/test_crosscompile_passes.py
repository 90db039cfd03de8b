"""Graph passes as pure functions, the object tar, bad input, and CNN
modules for every target preset."""
import json
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile
from onnx import TensorProto, helper

import crosscompile
import minirt
from crosscompile import BuildError, ShapeError
from crosscompile.frontend import import_onnx
from crosscompile.ir import Graph, Node, Tensor
from crosscompile.memory import plan_memory
from crosscompile.passes import eliminate_dead_code, fold_batchnorm, fuse_elementwise, pack_conv_weights
from crosscompile.schedule import assign_tiles, conv_shape
from crosscompile.target import resolve_target
from tests.cross_targets import ALLOWED_UNDEFINED, CROSS_TARGETS
from tests.onnx_models import make_model, rand, reference, single_op


def t(name, *shape):
    return Tensor(name, shape)


def conv_bn_relu_graph():
    tensors = {n: t(n, 1, 4, 5, 5) for n in ("c", "b", "y")}
    tensors["x"] = t("x", 1, 3, 5, 5)
    constants = {"w": rand(4, 3, 1, 1), "s": rand(4, seed=1), "bb": rand(4, seed=2),
                 "m": rand(4, seed=3), "v": np.abs(rand(4, seed=4)) + 0.5}
    for name, value in constants.items():
        tensors[name] = Tensor(name, value.shape)
    nodes = [Node("Conv", "conv", ["x", "w"], ["c"], {"group": 1, "kernel_shape": None, "strides": None,
                                                       "pads": None, "auto_pad": "NOTSET", "dilations": None}),
             Node("BatchNormalization", "bn", ["c", "s", "bb", "m", "v"], ["b"], {"epsilon": 1e-5}),
             Node("Relu", "relu", ["b"], ["y"], {})]
    return Graph("g", ["x"], ["y"], nodes, tensors, constants)


def test_fold_batchnorm_rewrites_weights_and_keeps_the_input_graph():
    graph = conv_bn_relu_graph()
    folded = fold_batchnorm(graph)
    assert [n.op_type for n in folded.nodes] == ["Conv", "Relu"]
    assert [n.op_type for n in graph.nodes] == ["Conv", "BatchNormalization", "Relu"]  # pure
    conv = folded.nodes[0]
    a = graph.constants["s"] / np.sqrt(graph.constants["v"] + 1e-5)
    np.testing.assert_allclose(folded.constants[conv.inputs[1]],
                               graph.constants["w"] * a[:, None, None, None], rtol=1e-6)
    np.testing.assert_allclose(folded.constants[conv.inputs[2]],
                               graph.constants["bb"] - graph.constants["m"] * a, rtol=1e-5, atol=1e-6)
    assert "w" not in folded.constants  # the unfolded weight is dead


def test_fold_batchnorm_leaves_a_conv_with_two_readers():
    graph = conv_bn_relu_graph()
    graph.outputs.append("c")
    assert [n.op_type for n in fold_batchnorm(graph).nodes] == ["Conv", "BatchNormalization", "Relu"]


def test_fuse_elementwise_chains_activations_into_the_producer():
    graph = conv_bn_relu_graph()
    graph.nodes.append(Node("Clip", "clip", ["y"], ["z"], {"min": 0.0, "max": 6.0}))
    graph.tensors["z"] = t("z", 1, 4, 5, 5)
    graph.outputs[:] = ["z"]
    fused = fuse_elementwise(fold_batchnorm(graph))
    assert len(fused.nodes) == 1
    node = fused.nodes[0]
    assert node.outputs == ["z"]
    assert [op for op, _ in node.attrs["epilogue"]] == ["Relu", "Clip"]


def test_fuse_elementwise_keeps_an_intermediate_someone_else_reads():
    graph = conv_bn_relu_graph()
    graph.outputs.append("b")
    assert [n.op_type for n in fuse_elementwise(graph).nodes] == ["Conv", "BatchNormalization", "Relu"]


def test_memory_plan_reuses_workspace_along_a_chain():
    shape = (1, 8, 16, 16)
    names = ["x"] + [f"a{i}" for i in range(6)]
    tensors = {n: Tensor(n, shape) for n in names}
    nodes = [Node("Relu", f"r{i}", [names[i]], [names[i + 1]], {}) for i in range(6)]
    graph = Graph("g", ["x"], ["a5"], nodes, tensors, {})
    plan = plan_memory(graph)
    one = tensors["x"].nbytes
    assert plan.workspace_bytes == 2 * one  # ping-pong between two buffers
    offsets = {plan.locations[f"a{i}"].index for i in range(5)}
    assert offsets == {0, one}


def dense_block(batch=1, layers=3, seed=0):
    """DenseNet-like: each layer's Conv reads the running Concat and adds
    its output to the next one; a Concat along axis 2 and one whose input
    another Concat already takes stay copies. Output: Relu of the last."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Relu", ["x"], ["c0"])]
    inits = {}
    channels = 4
    for i in range(layers):
        inits[f"w{i}"] = (rng.standard_normal((3, channels, 3, 3)) / 6).astype(np.float32)
        nodes += [helper.make_node("Conv", [f"c{i}", f"w{i}"], [f"n{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"n{i}"], [f"r{i}"]),
                  helper.make_node("Concat", [f"c{i}", f"r{i}"], [f"c{i + 1}"], axis=1)]
        channels += 3
    nodes += [helper.make_node("Concat", [f"r{layers - 1}", "x2"], ["h"], axis=2),   # rows: not contiguous
              helper.make_node("Concat", [f"r{layers - 2}", f"r{layers - 1}"], ["again"], axis=1),
              helper.make_node("Mul", [f"c{layers}", f"c{layers}"], ["sq"]),
              helper.make_node("Relu", ["sq"], ["y"])]
    inputs = {"x": (batch, 4, 6, 7), "x2": (batch, 3, 2, 7)}
    return make_model(nodes, inputs, {"y": None, "h": None, "again": None}, inits)


def test_concats_are_computed_in_place_when_their_inputs_are_slices(tmp_path):
    model = dense_block()
    lib = crosscompile.build(model, target="host")
    ops = [step["op"] for step in lib.metadata["steps"]]
    # The three growing Concats need no step; the axis-2 one and the one
    # reading a tensor the block's Concat already holds are copies.
    assert ops.count("Concat") == 2
    feeds = {"x": rand(1, 4, 6, 7, seed=1), "x2": rand(1, 3, 2, 7, seed=2)}
    module = minirt.load(lib.export_library(tmp_path / "m.so"))
    want = reference(model, feeds)
    for threads in (1, 2, 3):
        module.set_threads(threads)
        for got, expected in zip(module.run(feeds), want):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_concat_slices_share_one_buffer_and_batches_keep_the_copy():
    imported = import_onnx(dense_block())
    plan = plan_memory(imported)
    base = plan.locations["c3"].index
    # c3 = [c2, r2] = [[c1, r1], r2] = [[[c0, r0], r1], r2]: one buffer, each
    # tensor at the bytes of the channels before it (6 x 7 floats each).
    at = {t: plan.locations[t].index - base for t in ("c0", "r0", "c1", "r1", "c2", "r2")}
    plane = 4 * 6 * 7
    assert at == {"c0": 0, "r0": 4 * plane, "c1": 0, "r1": 7 * plane, "c2": 0, "r2": 10 * plane}
    in_place = {n.outputs[0] for n in imported.nodes if n.name in plan.aliased_nodes}
    assert in_place == {"c1", "c2", "c3"}
    # With two images a Concat's input is two blocks of its output: copied.
    batched_graph = import_onnx(dense_block(batch=2))
    batched = plan_memory(batched_graph)
    assert not any(n.op_type == "Concat" and n.name in batched.aliased_nodes for n in batched_graph.nodes)


def test_dead_code_removal_drops_unused_branches():
    graph = conv_bn_relu_graph()
    graph.outputs[:] = ["c"]
    assert [n.name for n in eliminate_dead_code(graph).nodes] == ["conv"]


def test_constant_folding_evaluates_shape_arithmetic_at_import():
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "i"], ["d"], axis=0),
             helper.make_node("Mul", ["d", "two"], ["d2"]),
             helper.make_node("Unsqueeze", ["d2", "ax"], ["d3"]),
             helper.make_node("Concat", ["d3", "m1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    inits = {"i": np.array(0, np.int64), "two": np.array(2, np.int64), "ax": np.array([0], np.int64),
             "m1": np.array([-1], np.int64)}
    graph = import_onnx(make_model(nodes, {"x": (3, 4, 6)}, {"y": None}, inits))
    assert [n.op_type for n in graph.nodes] == ["Reshape"]
    assert graph.tensors["y"].shape == (6, 12)
    assert list(graph.constants["shape"]) == [6, -1]


# -- object tar ------------------------------------------------------------------

def test_object_tar_links_on_the_board_with_plain_cc(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    # A network with weights (params.o) and several kernels (module.o, and
    # module1.o... when they were compiled by several processes).
    model = small_cnn()
    feeds = {"x": rand(1, 3, 11, 13, seed=11)}
    lib = crosscompile.build(model, "host")
    path = lib.export_library(tmp_path / "net.tar")
    with tarfile.open(path) as tar:
        names = sorted(tar.getnames())
        assert names[:2] == ["metadata.json", "module.o"] and names[-1] == "params.o"
        assert names[2:-1] == [f"module{i}.o" for i in range(1, len(names) - 2)]
        assert json.load(tar.extractfile("metadata.json")) == lib.metadata
        tar.extractall(tmp_path / "board")
    subprocess.run(f"{cc} -shared -o net.so *.o", shell=True, cwd=tmp_path / "board", check=True)
    got = minirt.load(tmp_path / "board" / "net.so").run(feeds)
    np.testing.assert_allclose(got[0], reference(model, feeds)[0], rtol=1e-4, atol=1e-6)


# -- CNN modules for every preset --------------------------------------------------

def small_cnn():
    """Conv+BN+Relu, depthwise Conv, LRN, pools, Sigmoid/Tanh/HardSwish, Softmax."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "s", "bb", "m", "v"], ["n1"]),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("LRN", ["r1"], ["l1"], size=3),
        helper.make_node("Conv", ["l1", "w2"], ["c2"], group=4, pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("HardSwish", ["c2"], ["h2"]),
        helper.make_node("MaxPool", ["h2"], ["p2"], kernel_shape=[2, 2], ceil_mode=1, strides=[2, 2]),
        helper.make_node("Sigmoid", ["p2"], ["s2"]),
        helper.make_node("AveragePool", ["s2"], ["a2"], kernel_shape=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Tanh", ["a2"], ["t2"]),
        helper.make_node("GlobalAveragePool", ["t2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Softmax", ["f"], ["y"]),
    ]
    inits = {"w1": rand(4, 3, 3, 3, seed=1), "b1": rand(4, seed=2), "s": rand(4, seed=3),
             "bb": rand(4, seed=4), "m": rand(4, seed=5), "v": np.abs(rand(4, seed=6)) + 0.5,
             "w2": rand(4, 1, 3, 3, seed=7)}
    return make_model(nodes, {"x": (1, 3, 11, 13)}, {"y": None}, inits, opset=14)


def test_small_cnn_matches_onnxruntime(tmp_path):
    model = small_cnn()
    feeds = {"x": rand(1, 3, 11, 13, seed=9)}
    lib = crosscompile.build(model)
    got = minirt.load(lib.export_library(tmp_path / "m.so")).run(feeds)
    np.testing.assert_allclose(got[0], reference(model, feeds)[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("preset", sorted(CROSS_TARGETS))
def test_cnn_module_needs_nothing_beyond_the_platform_loader(tmp_path, preset):
    """No libm, no versioned glibc symbols (Android's bionic has neither)."""
    path = crosscompile.build(small_cnn(), target=preset).export_library(tmp_path / "m.so")
    with open(path, "rb") as f:
        elf = ELFFile(f)
        dynsym = elf.get_section_by_name(".dynsym")
        undefined = {s.name for s in dynsym.iter_symbols() if s.name and s["st_shndx"] == "SHN_UNDEF"}
        assert undefined <= ALLOWED_UNDEFINED
        assert elf.get_section_by_name(".gnu.version_r") is None
        assert elf.get_section_by_name(".gnu.version") is None
        needed = [t.needed for t in elf.get_section_by_name(".dynamic").iter_tags()
                  if t.entry.d_tag == "DT_NEEDED"]
        assert needed == []


# -- bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("model,pattern", [
    (lambda: single_op("Conv", {"x": (1, 3, 5, 5)}, {"w": rand(2, 3, 3, 3)}, auto_pad="MIDDLE"),
     r"node 'the_conv' \(Conv\): attribute auto_pad='MIDDLE' is not supported; supported: 'NOTSET'"),
    (lambda: single_op("Pad", {"x": (2, 3)}, {"p": np.array([1, 1, 1, 1], np.int64)}, mode="wrap"),
     r"node 'the_pad' \(Pad\): attribute mode='wrap' is not supported; supported: 'constant', 'reflect', 'edge'"),
    (lambda: single_op("Conv", {"x": (1, 3, 4, 4, 4, 4)}, {"w": rand(2, 3, 3, 3, 3, 3)}),
     r"node 'the_conv' \(Conv\): only 1-D, 2-D and 3-D convolutions are supported"),
    (lambda: single_op("Conv", {"x": (1, 4, 5, 5)}, {"w": rand(2, 3, 3, 3)}, group=2),
     r"node 'the_conv' \(Conv\): Conv with group=2: input channels 4 and weight \(2, 3, 3, 3\) do not fit"),
    (lambda: single_op("MaxPool", {"x": (1, 1, 2, 2)}, kernel_shape=[5, 5]),
     r"node 'the_maxpool' \(MaxPool\): window of extent 5 .* larger than the padded input"),
    (lambda: single_op("Cast", {"x": (3,)}, to=TensorProto.COMPLEX64),
     r"node 'the_cast' \(Cast\): Cast of a runtime tensor to COMPLEX64 is not supported; supported: FLOAT, "
     r"DOUBLE, FLOAT16, BFLOAT16"),
])
def test_bad_models_give_one_clear_error(model, pattern):
    with pytest.raises(BuildError, match=pattern):
        crosscompile.build(model())


def test_unknown_input_dim_names_the_input_and_the_fix():
    model = single_op("Conv", {"x": ("N", 3, 8, 8)}, {"w": rand(2, 3, 3, 3)})
    with pytest.raises(ShapeError, match=r"input 'x' has unknown dimensions \('N', 3, 8, 8\); pass its "
                                         r"concrete shape, e.g. build\(model, input_shapes="):
        crosscompile.build(model)


def test_per_channel_mul_and_add_fold_into_conv(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "scale"], ["m"]),
             helper.make_node("Add", ["shift", "m"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    inits = {"w": rand(4, 3, 3, 3, seed=1), "b": rand(4, seed=2), "scale": rand(4, 1, 1, seed=3),
             "shift": rand(1, 4, 1, 1, seed=4)}
    model = make_model(nodes, {"x": (1, 3, 6, 7)}, {"y": None}, inits)
    lib = crosscompile.build(model)
    assert lib.summary["folded_into_conv"] == 2 and lib.summary["kernels"] == 1
    feeds = {"x": rand(1, 3, 6, 7, seed=5)}
    got = minirt.load(lib.export_library(tmp_path / "m.so")).run(feeds)
    np.testing.assert_allclose(got[0], reference(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_a_full_size_mul_is_not_folded():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Mul", ["c", "k"], ["y"])]
    model = make_model(nodes, {"x": (1, 3, 4, 4)}, {"y": None},
                       {"w": rand(2, 3, 1, 1), "k": rand(1, 2, 4, 4)})
    assert crosscompile.build(model).summary["folded_into_conv"] == 0


def test_pack_conv_weights_lays_out_row_blocks_for_the_micro_kernel():
    graph = conv_bn_relu_graph()
    weight = graph.constants[graph.nodes[0].inputs[1]]
    target = resolve_target("host")
    rows3 = {conv_shape(graph, graph.nodes[0]).key: (3, 1)}
    packed = pack_conv_weights(assign_tiles(graph, target, rows3))
    conv = packed.nodes[0]
    assert conv.attrs["packed_mr"] == 3 and conv.attrs["weight_shape"] == weight.shape
    assert conv.attrs["gemm_tile"].spec == [3, 1] and conv.attrs["tile_tuned"]
    blocks = packed.constants[conv.inputs[1]]
    m, k = weight.shape[0], weight[0].size
    assert blocks.shape == (-(-m // 3), k, 3)
    # row i, reduction index p lives at [i // 3, p, i % 3]; padding rows are 0
    flat = weight.reshape(m, k)
    for i in range(m):
        np.testing.assert_array_equal(blocks[i // 3, :, i % 3], flat[i])
    assert not blocks[m // 3, :, m % 3:].any()
