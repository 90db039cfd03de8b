"""crosscompile: real compiles, checked against onnxruntime."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from elftools.elf.elffile import ELFFile
from onnx import TensorProto, helper

import crosscompile
from crosscompile import BuildError, Target, UnsupportedOpError
from crosscompile.frontend import import_onnx
from crosscompile.memory import plan_memory
from crosscompile.passes import eliminate_dead_code
from crosscompile.target import normalize_triple
from tests.cross_targets import ALLOWED_UNDEFINED, CROSS_TARGETS, DRIVER_C, EMULATED, emulated_tools
from tests.onnx_models import (ATOL, RTOL, make_model, matmul_mlp, mlp, rand, reference, run_host,
                               sample_input, single_op)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- ops ----------------------------------------------------------------------

@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 17, 5), (17, 3, 1)])
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm_transposes(tmp_path, m, k, n, trans_a, trans_b):
    a_shape = (k, m) if trans_a else (m, k)
    b = rand(*((n, k) if trans_b else (k, n)))
    model = single_op("Gemm", {"a": a_shape}, {"b": b, "c": rand(n, seed=2)},
                      transA=trans_a, transB=trans_b)
    run_host(model, tmp_path)


@pytest.mark.parametrize("c_shape", [None, (), (1,), (5,), (1, 5), (3, 1), (3, 5)])
def test_gemm_alpha_beta_and_c_broadcasting(tmp_path, c_shape):
    inits = {"b": rand(17, 5)}
    if c_shape is not None:
        inits["c"] = rand(*c_shape, seed=3)
    model = single_op("Gemm", {"a": (3, 17)}, inits, alpha=0.5, beta=-2.0)
    run_host(model, tmp_path)


@pytest.mark.parametrize("a_shape,b_shape", [((1, 1), (1, 1)), ((3, 17), (17, 5)),
                                             ((2, 3, 17), (17, 4)), ((2, 1, 3, 7), (7, 1))])
def test_matmul(tmp_path, a_shape, b_shape):
    run_host(single_op("MatMul", {"a": a_shape}, {"b": rand(*b_shape)}), tmp_path)


@pytest.mark.parametrize("a_shape,b_shape", [((17,), (17,)), ((3, 17), (17,)), ((2, 1, 5), (3, 1)),
                                             ((1,), (4, 3)), ((3, 1, 1), (1, 2, 1))])
def test_add_broadcasting(tmp_path, a_shape, b_shape):
    run_host(single_op("Add", {"a": a_shape, "b": b_shape}), tmp_path)


def test_add_with_constant_operand(tmp_path):
    run_host(single_op("Add", {"a": (3, 17)}, {"b": rand(17)}), tmp_path)


def test_relu(tmp_path):
    run_host(single_op("Relu", {"x": (3, 17)}), tmp_path)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [0, 1, -1, None])
def test_softmax_axis_semantics_per_opset(tmp_path, opset, axis):
    attrs = {} if axis is None else {"axis": axis}
    model = single_op("Softmax", {"x": (2, 3, 17)}, opset=opset, **attrs)
    run_host(model, tmp_path, feeds={"x": 20 * rand(2, 3, 17)})


def test_softmax_exp_accuracy_over_a_wide_range(tmp_path):
    # A pair (x, 0) gives softmax = exp(x) / (exp(x) + 1): checks the inline exp.
    x = np.stack([np.linspace(-80, 0, 1001, dtype=np.float32), np.zeros(1001, np.float32)], axis=1)
    model = single_op("Softmax", {"x": x.shape})
    run_host(model, tmp_path, feeds={"x": x})


@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1])
def test_flatten(tmp_path, axis):
    run_host(single_op("Flatten", {"x": (2, 3, 4)}, axis=axis), tmp_path)


@pytest.mark.parametrize("shape", [[0, -1], [-1], [2, 0, 2, -1], [4, 3, 2]])
def test_reshape(tmp_path, shape):
    model = single_op("Reshape", {"x": (2, 3, 4)}, {"shape": np.array(shape, np.int64)})
    run_host(model, tmp_path)


def test_reshape_shape_from_constant_node_then_relu(tmp_path):
    nodes = [
        helper.make_node("Constant", [], ["s"], value=helper.make_tensor("s", TensorProto.INT64, [2], [3, -1])),
        helper.make_node("Reshape", ["x", "s"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    lib = run_host(make_model(nodes, {"x": (1, 3, 5)}, {"y": (3, 5)}), tmp_path)
    assert lib.metadata["ops"] == ["Relu", "Reshape"]


@pytest.mark.parametrize("op_type", ["Identity", "Dropout"])
def test_identity_and_dropout(tmp_path, op_type):
    run_host(single_op(op_type, {"x": (3, 17)}), tmp_path)


def test_dropout_ratio_input_and_unused_mask(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Dropout", ["r", "ratio"], ["y", "mask"])]
    model = make_model(nodes, {"x": (3, 17)}, {"y": (3, 17)}, {"ratio": np.array(0.3, np.float32)})
    run_host(model, tmp_path)


# -- whole models --------------------------------------------------------------

@pytest.mark.parametrize("build_model", [
    lambda: mlp(), lambda: mlp(batch=4), lambda: mlp(sizes=(784, 1, 3), softmax=False),
    lambda: mlp(sizes=(17, 3, 1), batch=2), lambda: matmul_mlp(), lambda: matmul_mlp((5, 17, 17, 1), batch=1),
], ids=["mlp", "mlp-batch4", "mlp-odd", "mlp-no-image", "matmul-mlp", "matmul-mlp-odd"])
def test_whole_models_match_onnxruntime(tmp_path, build_model):
    run_host(build_model(), tmp_path)


def test_build_from_path_and_metadata(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), str(path))
    lib = crosscompile.build(str(path), target="rasp4b64")
    meta = lib.metadata
    assert meta["abi_version"] == 1
    assert meta["target"] == {"name": "rasp4b64", "triple": "aarch64-unknown-linux-gnu",
                              "cpu": "cortex-a72", "features": "+neon"}
    assert meta["inputs"] == [{"name": "input", "shape": [1, 1, 28, 28], "dtype": "float32"}]
    assert meta["outputs"] == [{"name": "output", "shape": [1, 10], "dtype": "float32"}]
    assert meta["ops"] == ["Flatten", "Gemm", "Relu", "Softmax"]
    assert meta["param_bytes"] == 4 * (784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10)
    assert meta["producer"].startswith("tether-crosscompile ")
    assert lib.target is crosscompile.TARGETS["rasp4b64"]
    assert lib.export_library(tmp_path / "x.so") == str(tmp_path / "x.so")
    assert (tmp_path / "x.so").read_bytes() == lib.so_bytes


# -- memory planning (pure) --------------------------------------------------------

def test_memory_plan_reuses_workspace_and_never_overlaps_live_tensors():
    graph = eliminate_dead_code(import_onnx(mlp(sizes=(784, 300, 200, 100, 10), batch=2)))
    plan = plan_memory(graph)
    assert "flatten" in plan.aliased_nodes  # Flatten of the input costs nothing
    ws = {n: plan.locations[n].index for n in graph.tensors if plan.locations[n].kind == "workspace"}
    assert plan.workspace_bytes < sum(graph.tensors[n].nbytes for n in ws)
    live = {}
    for pos, node in enumerate(graph.nodes):
        for name in node.inputs + node.outputs:
            live.setdefault(name, [pos, pos])[1] = pos
    for a in ws:
        assert ws[a] % 64 == 0
        for b in ws:
            overlap_time = live[a][0] <= live[b][1] and live[b][0] <= live[a][1]
            overlap_space = ws[a] < ws[b] + graph.tensors[b].nbytes and ws[b] < ws[a] + graph.tensors[a].nbytes
            assert a == b or not (overlap_time and overlap_space), (a, b)


def test_memory_plan_copies_an_output_that_aliases_an_input():
    graph = import_onnx(single_op("Flatten", {"x": (2, 3, 4)}))
    plan = plan_memory(graph)
    assert plan.aliased_nodes == frozenset()
    assert plan.locations["y"].kind == "output"


def test_dead_code_is_removed():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["unused"])]
    graph = eliminate_dead_code(import_onnx(make_model(nodes, {"x": (3,)}, {"y": (3,)})))
    assert [n.op_type for n in graph.nodes] == ["Relu"]
    assert "unused" not in graph.tensors


# -- bad input -------------------------------------------------------------------------

def test_garbage_file_is_a_build_error(tmp_path):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"\x00\xffthis is not protobuf" * 10)
    with pytest.raises(BuildError, match="not a valid ONNX model") as info:
        crosscompile.build(str(path))
    assert "garbage.onnx" in str(info.value)


def test_missing_file_is_a_build_error(tmp_path):
    with pytest.raises(BuildError, match="does not exist"):
        crosscompile.build(str(tmp_path / "nope.onnx"))


@pytest.mark.parametrize("op_type,inits", [("GlobalLpPool", {}), ("DeformConv", {"w": rand(1, 2, 3, 3)})])
def test_unsupported_op_names_op_and_node(op_type, inits):
    model = single_op(op_type, {"x": (1, 1, 5, 5)}, inits)
    with pytest.raises(UnsupportedOpError) as info:
        crosscompile.build(model)
    message = str(info.value)
    assert f"unsupported op {op_type!r} (1 node: 'the_{op_type.lower()}')" in message
    assert "`tether ops`" in message and "Softmax" not in message
    assert info.value.op_type == op_type and isinstance(info.value, BuildError)
    assert info.value.unsupported == {op_type: [f"the_{op_type.lower()}"]}


def test_every_unsupported_op_and_refused_node_in_one_error():
    # Two DeformConvs (the second fed by a node after the first), four
    # ImageDecoders, an op of another domain and a Reshape refusing its shape.
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("DeformConv", ["r"], ["s1"], name="deform_1"),
             helper.make_node("Relu", ["s1"], ["s2"], name="after_deform"),
             helper.make_node("DeformConv", ["s2"], ["s3"], name="deform_2"),
             helper.make_node("Custom", ["x"], ["c"], name="custom", domain="com.example"),
             helper.make_node("Reshape", ["r", "bad_shape"], ["bad"], name="bad_reshape")]
    nodes += [helper.make_node("ImageDecoder", ["r"], [f"nz{i}"], name=f"decoder_{i}") for i in range(4)]
    nodes.append(helper.make_node("Sum", ["s3", "c", "bad", "nz0", "nz1", "nz2", "nz3"], ["y"], name="sum"))
    model = make_model(nodes, {"x": (2, 3)}, {"y": None}, {"bad_shape": np.array([4, 4], np.int64)},
                       opset=17)
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedOpError) as info:
        crosscompile.build(model)
    assert info.value.unsupported == {"DeformConv": ["deform_1", "deform_2"], "com.example.Custom": ["custom"],
                                      "ImageDecoder": [f"decoder_{i}" for i in range(4)]}
    message = str(info.value)
    assert ("unsupported ops 'DeformConv' (2 nodes: 'deform_1', 'deform_2'); 'com.example.Custom' (1 node: "
            "'custom'); 'ImageDecoder' (4 nodes: 'decoder_0', 'decoder_1', 'decoder_2' and 1 more)") in message
    assert "also node 'bad_reshape' (Reshape): cannot reshape (2, 3)" in message
    assert "\n" not in message


def test_refusals_of_supported_nodes_are_all_named():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["a"], name="first"),
             helper.make_node("Transpose", ["x"], ["b"], perm=[0, 0], name="second"),
             helper.make_node("Relu", ["x"], ["y"], name="fine")]
    model = make_model(nodes, {"x": (2, 3)}, {"y": None}, {"shape": np.array([5], np.int64)})
    with pytest.raises(crosscompile.ShapeError) as info:
        crosscompile.build(model)
    assert "node 'first' (Reshape)" in str(info.value) and "node 'second' (Transpose)" in str(info.value)


def test_supported_ops_are_listed_by_tether_ops_and_in_the_docs():
    from crosscompile.operator_table import markdown_table, operator_rows, updated_document
    done = subprocess.run([sys.executable, "-m", "remote.cli", "ops"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines()[:-1]]
    assert listed == crosscompile.supported_ops()
    assert {"Conv", "Gemm", "Softmax", "QLinearConv", "Shape"} <= set(listed)
    assert "FusedAttention" not in listed  # the compiler's own op, not ONNX's
    assert "Conv " in done.stdout and "crosscompile/conv.py" in done.stdout
    doc_path = os.path.join(ROOT, "docs", "operators.md")
    with open(doc_path, encoding="utf-8") as f:
        doc = f.read()
    assert updated_document(doc, operator_rows()) == doc, \
        "docs/operators.md is out of date: run `tether ops --update-doc docs/operators.md`"
    assert markdown_table(operator_rows()) in doc


def test_symbolic_dim_needs_input_shapes(tmp_path):
    model = mlp(sizes=(20, 7, 3), batch=1)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(BuildError, match=r"'input'.*input_shapes=\{'input'"):
        crosscompile.build(model)
    lib = run_host(model, tmp_path, feeds={"input": rand(5, 20)}, input_shapes={"input": (5, 20)})
    assert lib.metadata["inputs"][0]["shape"] == [5, 20]


def test_input_shapes_for_unknown_input_is_an_error():
    with pytest.raises(BuildError, match="not model inputs"):
        crosscompile.build(mlp(), input_shapes={"inptu": (1, 784)})


def test_shape_mismatch_names_the_node():
    model = single_op("MatMul", {"a": (3, 4)}, {"b": rand(5, 2)})
    with pytest.raises(BuildError, match="the_matmul.*inner dimensions"):
        crosscompile.build(model)


def test_input_of_an_unsupported_dtype_is_rejected():
    model = single_op("Relu", {"x": (3,)})
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.COMPLEX64
    with pytest.raises(BuildError, match="'x' has dtype complex64; supported: float32, float64, float16, "
                                         "bfloat16, int64"):
        crosscompile.build(model)


# -- targets ---------------------------------------------------------------------------

@pytest.mark.parametrize("given,normal", [
    ("armv7l-linux-gnueabihf", "armv7l-unknown-linux-gnueabihf"),
    ("aarch64-linux-gnu", "aarch64-unknown-linux-gnu"),
    ("aarch64-linux-android", "aarch64-unknown-linux-android"),
    ("armv7-linux-androideabi", "armv7-unknown-linux-androideabi"),
    ("x86_64-pc-linux-gnu", "x86_64-pc-linux-gnu"),
    ("aarch64-unknown-linux-gnu", "aarch64-unknown-linux-gnu"),
])
def test_triple_normalisation(given, normal):
    assert normalize_triple(given) == normal


def test_target_parsing():
    t = Target.parse("armv7l-linux-gnueabihf/cortex-a7/+neon,+vfp4")
    assert (t.triple, t.cpu, t.features) == ("armv7l-unknown-linux-gnueabihf", "cortex-a7", "+neon,+vfp4")
    t = Target.parse("aarch64-linux-gnu")
    assert (t.triple, t.cpu, t.features) == ("aarch64-unknown-linux-gnu", "generic", "")
    with pytest.raises(BuildError, match="unknown architecture"):
        Target.parse("potato-linux-gnu")
    with pytest.raises(BuildError, match="preset"):
        Target.parse("a/b/c/d")
    with pytest.raises(BuildError, match="'sparc' is not supported; supported: aarch64, arm"):
        crosscompile.build(mlp(sizes=(17, 3)), target="sparc-linux-gnu")


def test_presets():
    import llvmlite.binding as llvm
    assert crosscompile.TARGETS["host"].triple == normalize_triple(llvm.get_process_triple())
    assert crosscompile.TARGETS["rasp4b"].triple == "armv7l-unknown-linux-gnueabihf"
    assert crosscompile.TARGETS["rasp3b"].cpu == "cortex-a53"
    assert crosscompile.TARGETS["rasp5"].cpu == "cortex-a76"
    assert crosscompile.TARGETS["android-armv7"].triple == "armv7-unknown-linux-androideabi"


def test_explicit_triple_string_builds_hard_float(tmp_path):
    lib = crosscompile.build(mlp(sizes=(17, 3)), target="armv7l-linux-gnueabihf/cortex-a72/+neon")
    path = lib.export_library(tmp_path / "m.so")
    with open(path, "rb") as f:
        assert ELFFile(f).header["e_flags"] & 0x400  # EF_ARM_ABI_FLOAT_HARD


@pytest.mark.parametrize("preset", sorted(CROSS_TARGETS))
def test_cross_targets_produce_self_contained_elf(tmp_path, preset):
    elf_class, machine, hard_float = CROSS_TARGETS[preset]
    path = crosscompile.build(mlp(), target=preset).export_library(tmp_path / "m.so")
    with open(path, "rb") as f:
        elf = ELFFile(f)
        assert elf.header["e_ident"]["EI_CLASS"] == elf_class
        assert elf.header["e_machine"] == machine
        assert elf.header["e_type"] == "ET_DYN"
        if hard_float is not None:
            assert bool(elf.header["e_flags"] & 0x400) == hard_float
        dynsym = elf.get_section_by_name(".dynsym")
        undefined = {s.name for s in dynsym.iter_symbols()
                     if s.name and s["st_shndx"] == "SHN_UNDEF"}
        exported = {s.name for s in dynsym.iter_symbols() if s["st_shndx"] != "SHN_UNDEF"}
        assert undefined <= ALLOWED_UNDEFINED
        assert {"tether_abi_version", "tether_metadata", "tether_run"} <= exported
        assert elf.get_section_by_name(".gnu.version_r") is None
        assert elf.get_section_by_name(".gnu.hash") is not None and elf.get_section_by_name(".hash") is not None
        needed = [t.needed for t in elf.get_section_by_name(".dynamic").iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        assert needed == []


# -- really running on emulated boards -------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(EMULATED))
def test_runs_under_qemu_user(tmp_path, preset):
    qemu, gcc, sysroot = emulated_tools(preset)
    model = mlp(batch=2)
    feeds = sample_input(model)
    lib = crosscompile.build(model, target=preset)
    so = lib.export_library(tmp_path / "m.so")
    (tmp_path / "driver.c").write_text(DRIVER_C)
    subprocess.run([gcc, "-O1", "-o", str(tmp_path / "driver"), str(tmp_path / "driver.c"), "-ldl"],
                   check=True, capture_output=True)
    feeds["input"].tofile(tmp_path / "in.bin")
    want = reference(model, feeds)[0]
    proc = subprocess.run([qemu, "-L", sysroot, str(tmp_path / "driver"), so,
                           str(lib.metadata["workspace_bytes"]), str(tmp_path / "in.bin"),
                           str(feeds["input"].size), str(tmp_path / "out.bin"), str(want.size)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    version, metadata = proc.stdout.split("\n", 1)
    assert version == "1" and json.loads(metadata) == lib.metadata
    got = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# -- linking ------------------------------------------------------------------------------------

def test_linker_failure_is_a_clear_build_error(monkeypatch):
    monkeypatch.setenv("TETHER_LD", "/nonexistent/ld.lld")
    with pytest.raises(BuildError, match="linker '/nonexistent/ld.lld' not found; set TETHER_LD"):
        crosscompile.build(mlp(sizes=(17, 3)))
    monkeypatch.setenv("TETHER_LD", shutil.which("false") or "/bin/false")
    with pytest.raises(BuildError, match=r"linking mlp.so with .*false failed \(exit 1\)"):
        crosscompile.build(mlp(sizes=(17, 3)))


def test_falls_back_to_ziglang_lld(monkeypatch, tmp_path):
    pytest.importorskip("ziglang", reason="pip install ziglang")
    monkeypatch.delenv("TETHER_LD", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no ld.lld on PATH
    run_host(mlp(sizes=(17, 3)), tmp_path)


@pytest.mark.parametrize("training", [None, np.array(True)])
def test_dropout_mask_is_all_true_in_inference_and_at_ratio_zero(tmp_path, training):
    import minirt
    from onnx import numpy_helper
    inits = {"ratio": np.array(0.0 if training is not None else 0.4, np.float32)}
    names = ["x", "ratio"]
    if training is not None:
        inits["training"], names = training, names + ["training"]
    graph = helper.make_graph([helper.make_node("Dropout", names, ["y", "mask"])], "dropout",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("mask", TensorProto.BOOL, None)],
                              [numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y, mask = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run({"x": x})
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.bool_ and mask.shape == (3, 4) and mask.all()
    training_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    training_model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(0.5, np.float32), "ratio"))
    if training is not None:
        with pytest.raises(crosscompile.BuildError, match=r"Dropout with training_mode=True and ratio 0.5 is not "
                                                          "supported: it drops random elements"):
            crosscompile.build(training_model)


def test_mel_weight_matrix_of_constants_is_a_constant_and_of_runtime_inputs_refused(tmp_path):
    import minirt
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator
    values = {"bins": np.array(8, np.int64), "dft": np.array(64, np.int64), "rate": np.array(8000, np.int64),
              "low": np.array(100.0, np.float32), "high": np.array(3000.0, np.float32)}
    node = helper.make_node("MelWeightMatrix", list(values), ["w"])
    scale = helper.make_node("Mul", ["w", "x"], ["y"])
    graph = helper.make_graph([node, scale], "mel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, n) for n, v in values.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([2.0], np.float32)
    got = minirt.load(crosscompile.build(model).export_library(tmp_path / "m.so")).run({"x": x})[0]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-6)
    del model.graph.initializer[0]
    model.graph.input.append(helper.make_tensor_value_info("bins", TensorProto.INT64, []))
    with pytest.raises(BuildError, match=r"\(MelWeightMatrix\): its inputs must be constants"):
        crosscompile.build(model)
