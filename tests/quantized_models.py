"""Small quantized ONNX models for tests: fp32 models built with onnx.helper,
quantized by onnxruntime's own quantizer (quantize_static in QDQ and
QOperator form, quantize_dynamic), so the tests meet what users' tools write.

    from tests.quantized_models import quantized_model
    model = quantized_model("qdq_per_channel_s8")   # an onnx.ModelProto
"""
from __future__ import annotations

import functools
import pathlib
import tempfile

import numpy as np
import onnx
from onnx import helper

from tests.onnx_models import make_model

INPUT_SHAPE = (1, 3, 12, 12)


def _conv(rng, name, cin, cout, size, group=1):
    weight = (rng.standard_normal((cout, cin // group, size, size)) / np.sqrt(cin // group * size * size))
    bias = 0.1 * rng.standard_normal(cout)
    return {f"{name}_w": weight.astype(np.float32), f"{name}_b": bias.astype(np.float32)}


def conv_net(seed: int = 0) -> onnx.ModelProto:
    """Conv/Relu, a strided conv, a depthwise conv with a residual Add,
    LeakyRelu, Mul, Sigmoid, AveragePool, Concat, GlobalAveragePool and two
    dense layers (MatMul, Gemm): every op the quantizer quantizes in both
    static forms. Input "x" (1, 3, 12, 12), output "y" (1, 10)."""
    rng = np.random.default_rng(seed)
    inits = {}
    inits.update(_conv(rng, "c1", 3, 16, 3))
    inits.update(_conv(rng, "c2", 16, 16, 3))
    inits.update(_conv(rng, "dw", 16, 16, 3, group=16))
    inits.update(_conv(rng, "pw", 16, 8, 1))
    inits["fc1_w"] = (rng.standard_normal((24, 32)) / np.sqrt(24)).astype(np.float32)
    inits["fc2_w"] = (rng.standard_normal((10, 32)) / np.sqrt(32)).astype(np.float32)
    inits["fc2_b"] = (0.1 * rng.standard_normal(10)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "c1_w", "c1_b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "c2_w", "c2_b"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Conv", ["r2", "dw_w", "dw_b"], ["dw"], pads=[1, 1, 1, 1], group=16),
        helper.make_node("Add", ["dw", "r2"], ["res"]),
        helper.make_node("LeakyRelu", ["res"], ["lr"], alpha=0.1),
        helper.make_node("Conv", ["lr", "pw_w", "pw_b"], ["pw"]),
        helper.make_node("Sigmoid", ["pw"], ["sg"]),
        helper.make_node("Mul", ["pw", "sg"], ["swish"]),
        helper.make_node("AveragePool", ["swish"], ["ap"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["ap", "lr"], ["cat"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc1_w"], ["fc1"]),
        helper.make_node("Relu", ["fc1"], ["r3"]),
        helper.make_node("Gemm", ["r3", "fc2_w", "fc2_b"], ["y"], transB=1),
    ]
    return make_model(nodes, {"x": INPUT_SHAPE}, {"y": (1, 10)}, inits)


def dense_net(seed: int = 0) -> onnx.ModelProto:
    """A small convolution and two dense layers, the shape of what
    quantize_dynamic is used for (it quantizes Conv and MatMul only).
    Input "x" (1, 3, 12, 12), output "y" (1, 10)."""
    rng = np.random.default_rng(seed)
    inits = _conv(rng, "c1", 3, 4, 3)
    inits["fc1_w"] = (rng.standard_normal((4 * 6 * 6, 32)) / 12).astype(np.float32)
    inits["fc2_w"] = (rng.standard_normal((32, 10)) / np.sqrt(32)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "c1_w", "c1_b"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Flatten", ["r1"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc1_w"], ["fc1"]),
        helper.make_node("Relu", ["fc1"], ["r2"]),
        helper.make_node("MatMul", ["r2", "fc2_w"], ["y"]),
    ]
    return make_model(nodes, {"x": INPUT_SHAPE}, {"y": (1, 10)}, inits)


WIDE_SHAPE = (1, 3, 8, 40)


def wide_net(seed: int = 0) -> onnx.ModelProto:
    """Rows wide enough for the kernels' vector blocks and their remainders
    (40, 20 and 10 columns), a convolution of 10 filters (the integer
    tiles' 8 or 4 rows and a remainder): convolutions of stride 1 and 2, depthwise
    convolutions of stride 1 and 2, a MaxPool with ceil_mode, a Concat of
    inputs quantized apart, a residual Add, GlobalAveragePool and a dense
    layer. Input "x" WIDE_SHAPE, output "y" (1, 10)."""
    rng = np.random.default_rng(seed)
    inits = {}
    inits.update(_conv(rng, "c1", 3, 10, 3))
    inits.update(_conv(rng, "c2", 10, 8, 3))
    inits.update(_conv(rng, "dw1", 8, 8, 3, group=8))
    inits.update(_conv(rng, "dw2", 8, 8, 3, group=8))
    inits.update(_conv(rng, "pw", 16, 16, 1))
    inits["fc_w"] = (rng.standard_normal((16, 10)) / 4).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "c1_w", "c1_b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "c2_w", "c2_b"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Conv", ["r2", "dw1_w", "dw1_b"], ["dw1"], pads=[1, 1, 1, 1], group=8),
        helper.make_node("Conv", ["r2", "dw2_w", "dw2_b"], ["dw2"], pads=[1, 1, 1, 1], group=8, strides=[2, 2]),
        helper.make_node("MaxPool", ["dw1"], ["mp"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        helper.make_node("Concat", ["mp", "dw2"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "pw_w", "pw_b"], ["pw"]),
        helper.make_node("Add", ["pw", "cat"], ["res"]),
        helper.make_node("GlobalAveragePool", ["res"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc_w"], ["y"]),
    ]
    return make_model(nodes, {"x": WIDE_SHAPE}, {"y": (1, 10)}, inits)


BN_SHAPE = (1, 3, 9, 9)


def batchnorm_net(seed: int = 0) -> onnx.ModelProto:
    """A residual block written as some exporters write it (Caffe2's
    ResNets): convolutions without bias, each followed by its own
    BatchNormalization (that the quantizer keeps apart, with a
    QuantizeLinear between), the residual as a Sum, then Relu and a 1 x 1
    convolution. 16
    channels of 9 x 9 pixels (a plane of 16-pixel vectors and a remainder).
    Input "x" BN_SHAPE, output "y" (1, 16, 9, 9)."""
    rng = np.random.default_rng(seed)
    inits = {}
    for name, cin in (("c1", 3), ("c2", 16), ("c3", 16)):
        inits[f"{name}_w"] = (rng.standard_normal((16, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)
        inits[f"{name}_s"] = rng.uniform(0.5, 2.0, 16).astype(np.float32)
        inits[f"{name}_b"] = (0.2 * rng.standard_normal(16)).astype(np.float32)
        inits[f"{name}_m"] = (0.1 * rng.standard_normal(16)).astype(np.float32)
        inits[f"{name}_v"] = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    nodes = []
    for name, x in (("c1", "x"), ("c2", "r1"), ("c3", "r2")):
        nodes.append(helper.make_node("Conv", [x, f"{name}_w"], [f"{name}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("BatchNormalization", [name] + [f"{name}_{p}" for p in "sbmv"],
                                      [f"{name}_bn"]))
        if name != "c3":
            nodes.append(helper.make_node("Relu", [f"{name}_bn"], [f"r{name[1]}"]))
    inits["c4_w"] = (rng.standard_normal((16, 16, 1, 1)) / 4).astype(np.float32)
    nodes += [helper.make_node("Sum", ["c3_bn", "r1"], ["sum"]), helper.make_node("Relu", ["sum"], ["r3"]),
              helper.make_node("Conv", ["r3", "c4_w"], ["y"])]
    return make_model(nodes, {"x": BN_SHAPE}, {"y": (1, 16, 9, 9)}, inits)


CONVS_SHAPE = (2, 3, 8, 40)


def conv_stack(seed: int = 0) -> onnx.ModelProto:
    """Only what the integer tile kernels run, in two images: 3x3
    convolutions of 10 and 12 filters (blocks of the tiles' rows and a
    remainder), stride 1 and 2, over rows of 40 and 20 pixels, and a 1x1
    one. Input "x" CONVS_SHAPE, output "y" (2, 16, 4, 20)."""
    rng = np.random.default_rng(seed)
    inits = {}
    inits.update(_conv(rng, "c1", 3, 10, 3))
    inits.update(_conv(rng, "c2", 10, 12, 3))
    inits.update(_conv(rng, "pw", 12, 16, 1))
    nodes = [
        helper.make_node("Conv", ["x", "c1_w", "c1_b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "c2_w", "c2_b"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Conv", ["r2", "pw_w", "pw_b"], ["y"]),
    ]
    return make_model(nodes, {"x": CONVS_SHAPE}, {"y": (2, 16, 4, 20)}, inits)


def calibration(count: int = 8, seed: int = 1, shape: tuple = INPUT_SHAPE) -> list:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(count)]


# name -> (format, per_channel, activation type, weight type, reduce_range).
# onnxruntime on an x86 core without VNNI multiplies uint8 by int8 in pairs
# summed into int16 (vpmaddubsw), which saturates for 8-bit weights: the
# forms with int8 weights are made with reduce_range (7-bit weights), as
# onnxruntime's documentation advises for such cores, so that its outputs
# are the exact integer arithmetic ours are compared with.
STATIC_FORMS = {
    "qdq_per_tensor_u8": ("QDQ", False, "QUInt8", "QUInt8", False),
    "qdq_per_channel_s8": ("QDQ", True, "QInt8", "QInt8", True),
    "qoperator_u8": ("QOperator", False, "QUInt8", "QUInt8", False),
    "qdq_per_channel_u8s8": ("QDQ", True, "QUInt8", "QInt8", True),
    "qoperator_per_channel_s8": ("QOperator", True, "QUInt8", "QInt8", True),
    # wide_net rather than conv_net (see input_shape).
    "wide_qdq_per_channel_u8s8": ("QDQ", True, "QUInt8", "QInt8", True),
    # conv_stack (see input_shape).
    "convs_qdq_per_channel_u8s8": ("QDQ", True, "QUInt8", "QInt8", True),
    # batchnorm_net (see input_shape).
    "bn_qdq_per_channel_u8s8": ("QDQ", True, "QUInt8", "QInt8", True),
}
FORMS = tuple(STATIC_FORMS) + ("dynamic",)
# The forms the default test run covers (one of each kind); the others run
# with `pytest -m quantized_forms`.
DEFAULT_FORMS = ("qdq_per_tensor_u8", "qdq_per_channel_s8", "qoperator_u8", "dynamic")


def input_shape(form: str) -> tuple:
    """The input shape of a form's model: wide_net's for the wide forms,
    conv_stack's for the convs forms, batchnorm_net's for the bn forms."""
    shapes = {"wide": WIDE_SHAPE, "convs": CONVS_SHAPE, "bn": BN_SHAPE}
    return shapes.get(form.split("_")[0], INPUT_SHAPE)


def quantized_model(form: str) -> onnx.ModelProto:
    """conv_net (dense_net for "dynamic") quantized in one of FORMS; made
    once per process."""
    model = onnx.ModelProto()
    model.ParseFromString(_quantized_bytes(form))
    return model


@functools.lru_cache(maxsize=None)
def _quantized_bytes(form: str) -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        return _quantize(form, pathlib.Path(folder)).SerializeToString()


def _quantize(form: str, folder: pathlib.Path) -> onnx.ModelProto:
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic,
                                          quantize_static)

    source, target = folder / "fp32.onnx", folder / f"{form}.onnx"
    nets = {"dynamic": dense_net, "wide": wide_net, "convs": conv_stack, "bn": batchnorm_net}
    onnx.save(nets.get(form.split("_")[0], conv_net)(), source)
    if form == "dynamic":
        quantize_dynamic(str(source), str(target))
        return onnx.load(target)
    fmt, per_channel, activations, weights, reduce_range = STATIC_FORMS[form]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(calibration(shape=input_shape(form)))

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(source), str(target), Reader(), quant_format=getattr(QuantFormat, fmt),
                    per_channel=per_channel, activation_type=getattr(QuantType, activations),
                    weight_type=getattr(QuantType, weights), reduce_range=reduce_range)
    return onnx.load(target)


def output_step(model: onnx.ModelProto) -> "float | None":
    """The scale of the DequantizeLinear writing the graph's output (one
    quantization step of it), or None for a float output (dynamic form)."""
    inits = {t.name: t for t in model.graph.initializer}
    out = model.graph.output[0].name
    for node in model.graph.node:
        if node.output[0] == out and node.op_type == "DequantizeLinear":
            return float(onnx.numpy_helper.to_array(inits[node.input[1]]))
    return None
