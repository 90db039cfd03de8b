"""Blocks of transformer-era architectures (tests/transformer_models.py),
compiled for the host and compared with onnxruntime, in the opset forms
torch exports them in: LayerNorm and GELU spelled out (opset 13), one
LayerNormalization node (17), ReduceMean's axes as an input (18) and one
Gelu node (20). The spelled-out forms must compile to the same kernels as
the single ops; Swin's shifted windows (torch.roll as Slice and Concat,
window partitions as Reshape and Transpose). Then whole small models of the families people deploy: a
BERT-style encoder on token ids and a mask, a U-Net
(tests/segmentation_models.py), an LSTM keyword spotter and a CTC speech
model ending in LogSoftmax (tests/audio_models.py)."""
import pytest

import crosscompile
import minirt
from tests.audio_models import kws_lstm, speech_ctc
from tests.onnx_models import assert_zoo_close, reference, sample_input
from tests.segmentation_models import unet
from tests.transformer_models import bert_encoder, bert_feeds, convnext_block, swin_block, vit_block


def run_and_compare(model, tmp_path, feeds=None):
    lib = crosscompile.build(model, target="host")
    feeds = feeds or sample_input(model)
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


@pytest.mark.parametrize("opset", [13, 17])
def test_swin_blocks_with_shifted_windows_match_onnxruntime(tmp_path, opset):
    lib = run_and_compare(swin_block(opset=opset), tmp_path)
    ops = kernel_ops(lib)
    # Each block's attention (scores, bias and mask, Softmax, product by V) is one kernel.
    assert ops.count("LayerNormalization") == 4 and ops.count("FusedAttention") == 2
    assert "Softmax" not in ops


def test_spelled_out_and_single_op_forms_compile_to_the_same_kernels():
    for build_block in (vit_block, convnext_block):
        old, new = (crosscompile.build(build_block(opset=opset)) for opset in (13, 20))
        assert kernel_ops(old) == kernel_ops(new)
        assert old.summary["kernels"] == new.summary["kernels"]


@pytest.mark.parametrize("opset,einsum", [(13, False), (17, False), (13, True)])
def test_bert_encoder_on_token_ids_and_a_mask_matches_onnxruntime(tmp_path, opset, einsum):
    model = bert_encoder(opset=opset, einsum=einsum)
    lib = run_and_compare(model, tmp_path, bert_feeds(model))
    ops = kernel_ops(lib)
    assert ops.count("LayerNormalization") == 5
    # Scores by MatMul fuse into one attention kernel per layer; by Einsum they do not.
    assert ops.count("Softmax" if einsum else "FusedAttention") == 2
    assert ops.count("Einsum") == (4 if einsum else 0)


def test_unet_with_conv_transpose_and_resize_matches_onnxruntime(tmp_path):
    ops = kernel_ops(run_and_compare(unet(), tmp_path))
    assert ops.count("ConvTranspose") == 1 and ops.count("Resize") == 1


def test_lstm_keyword_spotter_matches_onnxruntime(tmp_path):
    ops = kernel_ops(run_and_compare(kws_lstm(), tmp_path))
    assert ops.count("LSTM") == 2


def test_speech_model_ending_in_log_softmax_matches_onnxruntime(tmp_path):
    ops = kernel_ops(run_and_compare(speech_ctc(), tmp_path))
    assert ops.count("GRU") == 1 and ops[-1] == "LogSoftmax"
