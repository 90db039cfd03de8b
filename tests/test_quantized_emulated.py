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
    """conv_net, wide_net (rows wide enough for the vector blocks of the
    kernels and their remainders) and batchnorm_net (per-channel tables),
    each in 8 bits from its first QuantizeLinear to its last DequantizeLinear."""
    command = board_servers.command(kind)
    key = f"quantized-{kind}"
    with local_farm(keys=[key], server_command=command) as farm:
        with rpc.connect_tracker(*farm.tracker).request(key, timeout=120) as sess:
            for form in ("qdq_per_channel_s8", "wide_qdq_per_channel_u8s8", "bn_qdq_per_channel_u8s8"):
                model = quantized_model(form)
                path = crosscompile.build(model, target=target).export_library(os.path.join(tmp_path, f"{form}.so"))
                feeds = calibration(1, seed=21, shape=input_shape(form))[0]
                session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                sess.upload(path, target=f"{form}.so", timeout=TIMEOUT_S)
                ours = sess.load_module(f"{form}.so", timeout=TIMEOUT_S).run(feeds, timeout=TIMEOUT_S)[0]
                assert_within_one_step(ours, session.run(None, feeds)[0], output_step(model),
                                       f"{form} on {kind} ({target})")


# Stride-1 convolutions whose output rows are as wide as the input's: the
# packing reads each tap's pixels as one shifted line and then pads the
# columns outside the image (int8_dot._pack_plane). Rows of 19 pixels (a
# 16-pixel vector and a remainder), 6 channels (a group of 4 and one of 2),
# padding on one side only, a dilated kernel and taps that reach no row.
TAP_SHAPE = (1, 6, 9, 19)
TAP_LAYERS = [  # (name, filters, kernel, pads, dilations)
    ("square", 10, (3, 3), [1, 1, 1, 1], [1, 1]),
    ("lopsided", 7, (5, 3), [3, 2, 1, 0], [1, 1]),
    ("dilated", 9, (3, 3), [2, 2, 2, 2], [2, 2]),
    ("tall", 5, (21, 1), [10, 0, 10, 0], [1, 1]),  # its first and last taps reach no row
    # 1 x 1 layers of 2, 8, 2 and 3 groups of 4 along the reduction: the
    # tiles' unrolled and looped reductions and a loop's remainder.
    ("widen", 32, (1, 1), [0, 0, 0, 0], [1, 1]),
    ("narrow", 8, (1, 1), [0, 0, 0, 0], [1, 1]),
    ("middle", 12, (1, 1), [0, 0, 0, 0], [1, 1]),
    ("last", 6, (1, 1), [0, 0, 0, 0], [1, 1]),
]


def padded_taps_model() -> "onnx.ModelProto":
    """x -> each layer of TAP_LAYERS on the last one's output, int8
    weights over -127..127 (the "quads" tiles on the A72), each output dequantized into the graph's outputs."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from tests.test_quantized_x86 import _dequantized, _quantized_layer

    rng = np.random.default_rng(5)
    nodes, inits = [], {"x_s": np.float32(0.05), "x_z": np.uint8(128)}
    nodes.append(helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]))
    _dequantized(nodes, inits, "xq", 0.05, np.uint8(128))
    previous, channels, scale, outputs = "xq", TAP_SHAPE[1], 0.05, {}
    for name, filters, kernel, pads, dilations in TAP_LAYERS:
        weight = rng.integers(-127, 128, (filters, channels, *kernel)).astype(np.int8)
        depth = channels * kernel[0] * kernel[1]
        # inputs spread over some 50 steps (x) or 30 (a layer's output), weights
        # over 74: outputs over some 30 steps either side
        y_scale = float(scale * 0.01 * np.sqrt(depth) * (50 if previous == "xq" else 30) * 74 / 30)
        layer = _quantized_layer(nodes, inits, previous, name, weight, np.zeros(filters, np.int8),
                                 (0.01 * rng.uniform(0.5, 1.5, filters)).astype(np.float32), y_scale,
                                 np.uint8(128), pads=pads, dilations=dilations)
        _dequantized(nodes, inits, layer, y_scale, np.uint8(128))
        nodes.append(helper.make_node("Identity", [f"{layer}_f"], [f"y_{name}"]))
        outputs[f"y_{name}"] = (1, filters, TAP_SHAPE[2], TAP_SHAPE[3])
        previous, channels, scale = layer, filters, y_scale
    graph = helper.make_graph(nodes, "taps", [helper.make_tensor_value_info("x", TensorProto.FLOAT, TAP_SHAPE)],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
                              [numpy_helper.from_array(np.asarray(v), n) for n, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.mark.emulated
def test_padded_taps_on_emulated_boards_equal_the_widening_kernel(tmp_path):
    """padded_taps_model with the dot-product tiles (rasp5) and their
    ARMv8.0 form (rasp4b64) under qemu: every output element for element
    that of the widening kernel (plain integer arithmetic) on the host."""
    import numpy as np

    import minirt
    from tests.test_quantized_x86 import REFERENCE, _kernels

    model = padded_taps_model()
    assert set(_kernels(model, REFERENCE).values()) == {"widening"}
    exact = minirt.load(crosscompile.build(model, target=REFERENCE).export_library(tmp_path / "exact.so"))
    feeds = {"x": (2.5 * np.random.default_rng(8).standard_normal(TAP_SHAPE)).astype(np.float32)}
    want = exact.run(feeds)
    command = board_servers.command("native-aarch64")
    with local_farm(keys=["taps"], server_command=command) as farm:
        with rpc.connect_tracker(*farm.tracker).request("taps", timeout=120) as sess:
            for target, kernel in (("rasp5", "dot"), ("rasp4b64", "quads")):
                assert set(_kernels(model, target).values()) == {kernel}, target
                path = crosscompile.build(model, target=target).export_library(tmp_path / f"{target}.so")
                sess.upload(path, target=f"{target}.so", timeout=TIMEOUT_S)
                got = sess.load_module(f"{target}.so", timeout=TIMEOUT_S).run(feeds, timeout=TIMEOUT_S)
                for (name, *_), ours, exact_out in zip(TAP_LAYERS, got, want):
                    assert np.array_equal(ours, exact_out), (
                        f"{name} on {target}: {np.count_nonzero(ours != exact_out)} of {ours.size} outputs "
                        f"differ from the widening kernel's")
                    assert len(np.unique(exact_out)) > 20, (name, np.unique(exact_out))
