"""Blocks of transformer-era architectures (tests/transformer_models.py),
compiled for the host and compared with onnxruntime, in the opset forms
torch exports them in: LayerNorm and GELU spelled out (opset 13), one
LayerNormalization node (17), ReduceMean's axes as an input (18) and one
Gelu node (20). The spelled-out forms must compile to the same kernels as
the single ops."""
import pytest

import crosscompile
import minirt
from tests.onnx_models import assert_zoo_close, reference, sample_input
from tests.transformer_models import convnext_block, vit_block


def run_and_compare(model, tmp_path):
    lib = crosscompile.build(model, target="host")
    feeds = sample_input(model)
    module = minirt.load(lib.export_library(tmp_path / f"{model.graph.name}.so"))
    assert_zoo_close(module.run(feeds), reference(model, feeds))
    module.close()
    return lib


def kernel_ops(lib) -> list:
    return [step["op"] for step in lib.metadata["steps"]]


@pytest.mark.parametrize("opset", [13, 17, 18, 20])
def test_vit_block_matches_onnxruntime(tmp_path, opset):
    lib = run_and_compare(vit_block(opset=opset), tmp_path)
    ops = kernel_ops(lib)
    assert ops.count("LayerNormalization") == 2
    assert not {"ReduceMean", "Pow", "Sqrt", "Erf", "Gelu"} & set(ops), ops  # Gelu runs in the bias Add


@pytest.mark.parametrize("opset", [13, 17, 18, 20])
def test_convnext_block_matches_onnxruntime(tmp_path, opset):
    lib = run_and_compare(convnext_block(opset=opset), tmp_path)
    ops = kernel_ops(lib)
    assert ops.count("LayerNormalization") == 2 and ops.count("ReduceMean") == 1
    assert not {"Pow", "Sqrt", "Erf", "Gelu"} & set(ops), ops


def test_spelled_out_and_single_op_forms_compile_to_the_same_kernels():
    for build_block in (vit_block, convnext_block):
        old, new = (crosscompile.build(build_block(opset=opset)) for opset in (13, 20))
        assert kernel_ops(old) == kernel_ops(new)
        assert old.summary["kernels"] == new.summary["kernels"]
