"""fp32 ONNX model -> int8 QDQ model ready to compile, with onnxruntime's
quantizer (the optional extra `quantize`), and the accuracy it costs.

Host only. Calibration data is a folder of samples: one .npy file per
sample for a model of one input (the input's shape, or without its batch
dimension), or one .npz file per sample holding an array per input name.
Without data, N random normal samples calibrate (fine to try a model's
speed; real data gives the accuracy).

    >>> report = quantize_model("model.onnx", "model_int8.onnx", random=8)  # doctest: +SKIP
    >>> report.cosine                                                       # doctest: +SKIP
    0.9991
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.version_converter

from .errors import BuildError
from .input_sets import read_input_sets
from .frontend import load_model


@dataclass(frozen=True)
class QuantizeReport:
    """What quantization cost, measured on the calibration samples with
    onnxruntime (fp32 model against the int8 one, first output)."""

    output: str
    samples: int
    cosine: float           # mean cosine similarity of the outputs
    max_abs_error: float    # largest absolute difference of any output element
    top1_agreement: float   # fraction of samples whose arg-max agrees

    def text(self) -> str:
        return (f"{self.output}: int8 against fp32 on {self.samples} samples: cosine {self.cosine:.5f}, "
                f"largest difference {self.max_abs_error:.4g}, arg-max agrees on {self.top1_agreement:.1%}")


def _onnxruntime():
    try:
        import onnxruntime
        from onnxruntime import quantization
    except ImportError:
        raise BuildError("quantizing needs onnxruntime on the host: `bash deploy_recipes/venv.sh "
                         "quantize` in a checkout, or `pip install onnxruntime`") from None
    return onnxruntime, quantization


def model_inputs(model: onnx.ModelProto) -> dict:
    """{name: shape} of a model's runtime inputs (unknown dimensions as 1)."""
    inits = {i.name for i in model.graph.initializer}
    return {vi.name: tuple(d.dim_value or 1 for d in vi.type.tensor_type.shape.dim)
            for vi in model.graph.input if vi.name not in inits}


def calibration_samples(model: onnx.ModelProto, folder: "str | None" = None, random: "int | None" = None,
                        seed: int = 0) -> list:
    """The samples ({input name: float32 array}) in folder, or `random`
    random normal ones."""
    inputs = model_inputs(model)
    if folder is None:
        if not random or random < 1:
            raise BuildError("give calibration data (a folder of .npy/.npz samples) or a number of random samples")
        rng = np.random.default_rng(seed)
        return [{name: rng.standard_normal(shape).astype(np.float32) for name, shape in inputs.items()}
                for _ in range(random)]
    try:
        found = read_input_sets(folder, list(inputs))
    except ValueError as exc:
        raise BuildError(f"calibration folder {exc}") from None
    return [_fit(sample, inputs, path) for path, sample in found]


def _fit(sample: dict, inputs: dict, path: str) -> dict:
    fitted = {}
    for name, value in sample.items():
        value = np.asarray(value, np.float32)
        if value.shape != inputs[name] and (1,) + value.shape == inputs[name]:
            value = value[None]
        if value.shape != inputs[name]:
            raise BuildError(f"{path}: {name!r} has shape {value.shape}, the model takes {inputs[name]}")
        fitted[name] = value
    return fitted


# onnxruntime's quantizer takes opset 11 and later; older models are
# converted to this one first.
QUANTIZED_OPSET = 13


def _quantizable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """proto at opset 11 or later (QUANTIZED_OPSET for older ones), with
    no initializer listed as a graph input: older IR versions list them
    all, and onnxruntime then treats weights as inputs a caller might
    replace, which keeps them out of quantization's constant folding."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    inits = {i.name for i in proto.graph.initializer}
    if opset >= 11 and not any(vi.name in inits for vi in proto.graph.input):
        return proto
    upgraded = onnx.ModelProto()
    upgraded.CopyFrom(proto)
    upgraded.ir_version = max(upgraded.ir_version, 7)
    kept = [vi for vi in upgraded.graph.input if vi.name not in inits]
    del upgraded.graph.input[:]
    upgraded.graph.input.extend(kept)
    return upgraded if opset >= 11 else onnx.version_converter.convert_version(upgraded, QUANTIZED_OPSET)


def quantize_model(model, output: str, calibrate: "str | None" = None, random: "int | None" = None,
                   per_channel: bool = True) -> QuantizeReport:
    """Write an int8 QDQ model of `model` (path or ModelProto) to output:
    uint8 activations, int8 weights (per output channel), calibrated on the
    samples (see calibration_samples); report the accuracy it costs.

    >>> quantize_model("mobilenetv2.onnx", "mobilenetv2_int8.onnx", calibrate="images/")  # doctest: +SKIP
    """
    ort, quantization = _onnxruntime()
    proto = _quantizable(load_model(model))
    samples = calibration_samples(proto, calibrate, random)

    class Reader(quantization.CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(samples)

        def get_next(self):
            return next(self.feeds, None)

    source = output + ".fp32.onnx"
    onnx.save(proto, source)
    try:
        quantization.quantize_static(source, output, Reader(), quant_format=quantization.QuantFormat.QDQ,
                                     per_channel=per_channel, activation_type=quantization.QuantType.QUInt8,
                                     weight_type=quantization.QuantType.QInt8)
        providers = ["CPUExecutionProvider"]
        fp32 = ort.InferenceSession(source, providers=providers)
        int8 = ort.InferenceSession(output, providers=providers)
        pairs = [(fp32.run(None, s)[0].astype(np.float64), int8.run(None, s)[0].astype(np.float64))
                 for s in samples]
    finally:
        os.unlink(source)
    cosines = [float(np.dot(a.ravel(), b.ravel()) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
               for a, b in pairs]
    return QuantizeReport(output, len(samples), float(np.mean(cosines)),
                          max(float(np.abs(a - b).max()) for a, b in pairs),
                          float(np.mean([a.argmax() == b.argmax() for a, b in pairs])))
