"""The ViT, ConvNeXt and Swin blocks of tests/transformer_models.py, and the
BERT-style encoder, U-Net, LSTM keyword spotter and CTC speech model,
compiled for rasp4b64 and rasp3b and run on emulated Debian bookworm
boards (arm64 and armhf) through a real tracker, against onnxruntime on
the host: the reductions, normalisations, erf and their vector forms on
NEON, int64 token ids, ConvTranspose, Resize and the recurrent layers;
and TopK, ArgMax, CumSum, GatherElements and Einsum in one small model.

    pytest -m bookworm_arm64 tests/test_modern_models_emulated.py
"""
import os

import numpy as np
import pytest
from onnx import helper

import crosscompile
from deploy_recipes import emulate
from remote import rpc
from tests.emulated_boards import TARGET_FOR_ARCH, local_farm, running_board, skip_without_tools
from tests.audio_models import kws_lstm, speech_ctc
from tests.onnx_models import assert_zoo_close, rand, reference, sample_input
from tests.segmentation_models import unet
from tests.test_ops_logic import typed_model
from tests.transformer_models import bert_encoder, bert_feeds, convnext_block, swin_block, vit_block

RELEASE = "bookworm"
# Far above what a block takes under qemu (seconds), so a hung module still ends the test.
TIMEOUT_S = 600.0
BLOCKS = {"vit": vit_block, "convnext": convnext_block, "swin": swin_block}
# Whole models: (builder, inputs for it).
MODELS = {"bert": (bert_encoder, bert_feeds), "unet": (unet, sample_input), "kws_lstm": (kws_lstm, sample_input),
          "speech_ctc": (speech_ctc, sample_input)}


@pytest.fixture(scope="module", params=[
    pytest.param(arch, id=f"{RELEASE}-{arch}", marks=[pytest.mark.emulated, getattr(pytest.mark, f"{RELEASE}_{arch}")])
    for arch in ("arm64", "armhf")])
def board(request):
    """(tracker address, key, arch) of one emulated board behind a tracker."""
    skip_without_tools()
    arch = request.param
    emulate.build_rootfs(RELEASE, arch)
    with local_farm() as farm:
        with running_board(farm, RELEASE, arch, f"modern-{RELEASE}-{arch}") as b:
            yield farm.tracker, b.key, arch


def run_on_board(board, tmp_path, name, model, feeds):
    tracker, key, arch = board
    path = crosscompile.build(model, target=TARGET_FOR_ARCH[arch]).export_library(os.path.join(tmp_path, f"{name}.so"))
    with rpc.connect_tracker(*tracker).request(key, timeout=120) as sess:
        sess.upload(path, target=f"{name}.so", timeout=TIMEOUT_S)
        outputs = sess.load_module(f"{name}.so", timeout=TIMEOUT_S).run(feeds, timeout=TIMEOUT_S)
    assert_zoo_close(outputs, reference(model, feeds))


@pytest.mark.parametrize("opset", [13, 20])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_block_matches_onnxruntime_on_emulated_board(board, tmp_path, block, opset):
    model = BLOCKS[block](opset=opset)
    run_on_board(board, tmp_path, block, model, sample_input(model))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_matches_onnxruntime_on_emulated_board(board, tmp_path, name):
    build_model, make_feeds = MODELS[name]
    model = build_model()
    run_on_board(board, tmp_path, name, model, make_feeds(model))


def test_ranking_ops_and_einsum_match_onnxruntime_on_emulated_board(board, tmp_path):
    # int64 compares and selects are pairs of registers on armhf: TopK and
    # ArgMax indices, a CumSum of int64 positions, GatherElements, Einsum.
    feeds = {"logits": rand(2, 37), "mask": np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int64),
             "q": rand(1, 2, 5, 8, seed=2), "k": rand(1, 2, 6, 8, seed=3)}
    nodes = [helper.make_node("TopK", ["logits", "five"], ["top", "top_ids"]),
             helper.make_node("ArgMax", ["logits"], ["best"], axis=1, select_last_index=1),
             helper.make_node("CumSum", ["mask", "one"], ["positions"]),
             helper.make_node("GatherElements", ["logits", "top_ids"], ["picked"], axis=1),
             helper.make_node("Einsum", ["q", "k"], ["scores"], equation="bhid,bhjd->bhij")]
    model = typed_model(nodes, feeds, {"top": np.float32, "top_ids": np.int64, "best": np.int64,
                                       "positions": np.int64, "picked": np.float32, "scores": np.float32},
                        {"five": np.array([5], np.int64), "one": np.array(1, np.int64)})
    run_on_board(board, tmp_path, "ranking", model, feeds)
