"""The ViT and ConvNeXt blocks of tests/transformer_models.py compiled for
rasp4b64 and rasp3b and run on emulated Debian bookworm boards (arm64 and
armhf) through a real tracker, against onnxruntime on the host: the
reductions, normalisations, erf and their vector forms on NEON.

    pytest -m bookworm_arm64 tests/test_modern_models_emulated.py
"""
import os

import pytest

import crosscompile
from deploy_recipes import emulate
from remote import rpc
from tests.emulated_boards import TARGET_FOR_ARCH, local_farm, running_board, skip_without_tools
from tests.onnx_models import assert_zoo_close, reference, sample_input
from tests.transformer_models import convnext_block, vit_block

RELEASE = "bookworm"
# Far above what a block takes under qemu (seconds), so a hung module still ends the test.
TIMEOUT_S = 600.0
BLOCKS = {"vit": vit_block, "convnext": convnext_block}


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


@pytest.mark.parametrize("opset", [13, 20])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_block_matches_onnxruntime_on_emulated_board(board, tmp_path, block, opset):
    tracker, key, arch = board
    model = BLOCKS[block](opset=opset)
    feeds = sample_input(model)
    path = crosscompile.build(model, target=TARGET_FOR_ARCH[arch]).export_library(
        os.path.join(tmp_path, f"{block}.so"))
    with rpc.connect_tracker(*tracker).request(key, timeout=120) as sess:
        sess.upload(path, target=f"{block}.so", timeout=TIMEOUT_S)
        outputs = sess.load_module(f"{block}.so", timeout=TIMEOUT_S).run(feeds, timeout=TIMEOUT_S)
    assert_zoo_close(outputs, reference(model, feeds))
