"""A quantized model (QDQ, int8 per-channel weights) compiled for ARM boards
and run on the native board server under qemu-user behind a real tracker,
against onnxruntime's int8 outputs on the host: the integer kernels on
aarch64 (rasp5, Cortex-A76; rasp4b64, Cortex-A72) and 32-bit ARM NEON
(rasp4b, opt-in with -m quantized_forms).

    pytest -k quantized tests/test_quantized_emulated.py
"""
import os

import pytest

import crosscompile
from remote import rpc
from tests import board_servers
from tests.emulated_boards import local_farm
from tests.quantized_models import calibration, input_shape, output_step, quantized_model
from tests.test_quantized import assert_within_one_step

ort = pytest.importorskip("onnxruntime")
# Far above the seconds a run takes under qemu, so that a hung module still ends the test.
TIMEOUT_S = 600.0
# (board server, target): the dot-product kernel (rasp5), its ARMv8.0 form
# (rasp4b64) and, opt-in, the widening kernel on 32-bit ARM (rasp4b), which
# the host's tests also run.
BOARDS = [("native-aarch64", "rasp5"), ("native-aarch64", "rasp4b64"),
          pytest.param("native-armv7", "rasp4b", marks=pytest.mark.quantized_forms)]


@pytest.mark.emulated
@pytest.mark.parametrize("kind, target", BOARDS)
def test_quantized_model_matches_onnxruntime_on_emulated_board(kind, target, tmp_path):
    """conv_net and wide_net (rows wide enough for the vector blocks of the
    kernels and their remainders), each in 8 bits from its first
    QuantizeLinear to its last DequantizeLinear."""
    command = board_servers.command(kind)
    key = f"quantized-{kind}"
    with local_farm(keys=[key], server_command=command) as farm:
        with rpc.connect_tracker(*farm.tracker).request(key, timeout=120) as sess:
            for form in ("qdq_per_channel_s8", "wide_qdq_per_channel_u8s8"):
                model = quantized_model(form)
                path = crosscompile.build(model, target=target).export_library(os.path.join(tmp_path, f"{form}.so"))
                feeds = calibration(1, seed=21, shape=input_shape(form))[0]
                session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                sess.upload(path, target=f"{form}.so", timeout=TIMEOUT_S)
                ours = sess.load_module(f"{form}.so", timeout=TIMEOUT_S).run(feeds, timeout=TIMEOUT_S)[0]
                assert_within_one_step(ours, session.run(None, feeds)[0], output_step(model),
                                       f"{form} on {kind} ({target})")
