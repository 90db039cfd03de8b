"""Low-bit element types (float8, float4, E8M0, int4, int2; see
crosscompile.lowbit): compiled modules give onnx's reference results bit
for bit, for Casts both ways (saturate on and off, E8M0's round modes) and
QuantizeLinear / DequantizeLinear per tensor and per axis, over random
values and the edges (NaN, infinities, the largest value and just past
it, ties, subnormals, signed zeros)."""
import ml_dtypes  # onnx's own dependency: numpy's low-bit types
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import crosscompile
import minirt
from crosscompile.lowbit import FORMATS, TENSOR_TYPES

FLOAT8 = (T.FLOAT8E4M3FN, T.FLOAT8E4M3FNUZ, T.FLOAT8E5M2, T.FLOAT8E5M2FNUZ)
INTEGERS = (T.INT4, T.UINT4, T.INT2, T.UINT2)
OPSET = 25


def _edges() -> np.ndarray:
    """float32 values at every low-bit type's edges, and random ones."""
    special = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-7, -1e-7, 1e-30, 1e9, -1e9, 0.5, 1.5, 2.5, -2.5]
    for fmt in FORMATS.values():
        largest = fmt.largest
        smallest = 2.0 ** (1 - fmt.bias - fmt.mantissa_bits)  # the smallest subnormal
        special += [largest, -largest, np.nextafter(np.float32(largest), np.float32(np.inf))]
        special += [smallest, smallest / 2, 3 * smallest / 2, -smallest / 2, smallest * 2.5]
        if fmt.mantissa_bits:  # halfway past the largest value, and either side of it
            half_ulp = largest * 2.0 ** -(fmt.mantissa_bits + 1) / (1 + 1 - 2.0 ** -fmt.mantissa_bits)
            special += [largest + half_ulp, np.nextafter(np.float32(largest + half_ulp), np.float32(0)),
                        np.nextafter(np.float32(largest + half_ulp), np.float32(np.inf))]
    special += list(range(-20, 21))
    rng = np.random.default_rng(5)
    scaled = rng.standard_normal(400) * 10.0 ** rng.integers(-8, 6, 400)
    return np.concatenate([np.array(special, np.float64), scaled]).astype(np.float32)


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "low_bit", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _run_both(model, feeds, tmp_path, name):
    """(the module's outputs, the reference's), for one model."""
    path = crosscompile.build(model, target="host").export_library(tmp_path / f"{name}.so")
    return minirt.load(str(path)).run(feeds), ReferenceEvaluator(model).run(None, feeds)


def _assert_same_bits(got, want, names):
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        if g.dtype.itemsize == 1:  # the low-bit types: their bytes, exactly, but for NaN's payload
            nan = np.isnan(g.astype(np.float32)) & np.isnan(w.astype(np.float32)) if g.dtype.name in FORMATS else False
            same_sign = np.signbit(g.astype(np.float32)) == np.signbit(w.astype(np.float32))
            bad = np.nonzero(~((g.view(np.uint8) == w.view(np.uint8)) | (nan & same_sign)).reshape(-1))[0]
        else:  # wider floats: equal values, NaN where the reference has NaN
            g32, w32 = g.astype(np.float32), w.astype(np.float32)
            bad = np.nonzero(~((g32.view(np.uint32) == w32.view(np.uint32)) | (np.isnan(g32) & np.isnan(w32))))[0]
        assert bad.size == 0, (f"{name}: at {bad[:6]} got {g.reshape(-1)[bad[:6]].view(np.uint8)}, "
                               f"expected {w.reshape(-1)[bad[:6]].view(np.uint8)}")


def test_the_decode_tables_are_ml_dtypes_values():
    for name, fmt in FORMATS.items():
        codes = np.arange(256, dtype=np.uint8) & ((1 << fmt.width) - 1)
        want = codes.view(getattr(ml_dtypes, name)).astype(np.float32)
        got = np.array([fmt.value(c) for c in range(256)], np.float32)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (name, np.nonzero(~same)[0][:5])


def test_casts_to_every_low_bit_type_round_and_saturate_as_onnx_says(tmp_path):
    """float32 and float16 inputs cast to each type: saturate on and off
    for float8, every round mode for E8M0, and the integers' wrapping."""
    x = _edges()
    nodes, outputs = [], []

    def cast(source, to, **attrs):
        name = f"{source}_to_{TENSOR_TYPES[to]}" + "".join(f"_{k}{v}" for k, v in attrs.items())
        nodes.append(helper.make_node("Cast", [source], [name], to=to, **attrs))
        outputs.append((name, to, [x.size]))

    for source in ("x", "h"):
        for to in FLOAT8:
            cast(source, to, saturate=1)
            cast(source, to, saturate=0)
        cast(source, T.FLOAT4E2M1)
        for to in INTEGERS:
            cast(source, to)
    for mode in ("up", "down", "nearest"):
        cast("x", T.FLOAT8E8M0, saturate=1, round_mode=mode)
        cast("x", T.FLOAT8E8M0, saturate=0, round_mode=mode)
    # ints to ints wrap; from int64 through a low-bit type and back
    nodes.append(helper.make_node("Cast", ["n"], ["n_int4"], to=T.INT4))
    nodes.append(helper.make_node("Cast", ["n_int4"], ["n_back"], to=T.INT64))
    outputs += [("n_int4", T.INT4, [41]), ("n_back", T.INT64, [41])]
    model = _model(nodes, [("x", T.FLOAT, [x.size]), ("h", T.FLOAT16, [x.size]), ("n", T.INT64, [41])], outputs)
    # E8M0 of negative values is left unspecified by ONNX
    with np.errstate(over="ignore"):  # float16 overflows to infinity, as it should
        feeds = {"x": x, "h": x.astype(np.float16), "n": np.arange(-20, 21, dtype=np.int64) * 7}
    got, want = _run_both(model, feeds, tmp_path, "to_low_bit")
    e8m0 = [i for i, (name, *_) in enumerate(outputs) if name.startswith("x_to_float8_e8m0")]
    for i in e8m0:
        keep = ~np.signbit(x)
        got[i], want[i] = got[i][keep], want[i][keep]
    _assert_same_bits(got, want, [name for name, *_ in outputs])


def test_casts_from_every_low_bit_type_are_exact(tmp_path):
    """Every code of every type, as a model input, cast to float32, float16
    and (the integer types) int8 and uint8; and passed through Reshape,
    Transpose and Identity to an output of its own type."""
    nodes, inputs, outputs, feeds = [], [], [], {}
    for kind, name in TENSOR_TYPES.items():
        width = FORMATS[name].width if name in FORMATS else int(name[-1])
        codes = np.arange(1 << width, dtype=np.uint8)
        feeds[name] = codes.view(getattr(ml_dtypes, name))
        inputs.append((name, kind, [codes.size]))
        targets = (T.FLOAT, T.FLOAT16) + ((T.INT8, T.UINT8) if name in ("int4", "uint4", "int2", "uint2") else ())
        for to in targets:
            out = f"{name}_to_{T.DataType.Name(to).lower()}"
            nodes.append(helper.make_node("Cast", [name], [out], to=to))
            outputs.append((out, to, [codes.size]))
        shape = helper.make_tensor(f"{name}_shape", T.INT64, [2], [2, -1])
        nodes += [helper.make_node("Constant", [], [f"{name}_shape"], value=shape),
                  helper.make_node("Reshape", [name, f"{name}_shape"], [f"{name}_2d"]),
                  helper.make_node("Transpose", [f"{name}_2d"], [f"{name}_t"], perm=[1, 0]),
                  helper.make_node("Identity", [f"{name}_t"], [f"{name}_moved"])]
        outputs.append((f"{name}_moved", kind, [codes.size // 2, 2]))
    got, want = _run_both(_model(nodes, inputs, outputs), feeds, tmp_path, "from_low_bit")
    _assert_same_bits(got, want, [name for name, *_ in outputs])


def test_quantize_and_dequantize_with_low_bit_types(tmp_path):
    """QuantizeLinear to each type (the zero point's; saturate off too for
    float8) and DequantizeLinear of the result, per tensor and per axis,
    against the reference."""
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal((3, 40)) * 4, np.tile([[np.nan], [1e6], [-0.0]], (1, 4))], axis=1)
    x = x.astype(np.float32)
    nodes, outputs = [], []
    inits = [numpy_helper.from_array(np.float32(0.25), "scale"),
             numpy_helper.from_array(np.array([0.5, 0.125, 3.0], np.float32), "scale_axis")]
    for per_axis in (False, True):
        how = "axis" if per_axis else "tensor"
        scale, axis = ("scale_axis", {"axis": 0}) if per_axis else ("scale", {})
        for kind, name in TENSOR_TYPES.items():
            if kind == T.FLOAT8E8M0:
                continue  # not a QuantizeLinear type
            dtype = getattr(ml_dtypes, name)
            if name in ("int4", "int2"):
                zero = np.array([1, -1, 0] if per_axis else 1).astype(dtype)
            elif name in ("uint4", "uint2"):
                zero = np.array([1, 2, 0] if per_axis else 2).astype(dtype)
            elif name == "float4_e2m1fn":
                zero = np.array([0.5, -1.0, 0.0] if per_axis else 0.5, np.float32).astype(dtype)
            else:  # float8's zero point is 0
                zero = np.zeros(3 if per_axis else (), dtype)
            inits.append(numpy_helper.from_array(zero, f"{name}_zero_{how}"))
            for saturate in (1, 0) if kind in FLOAT8 else (1,):
                q, y = f"q_{name}_s{saturate}_{how}", f"dq_{name}_s{saturate}_{how}"
                nodes += [helper.make_node("QuantizeLinear", ["x", scale, f"{name}_zero_{how}"], [q],
                                           saturate=saturate, **axis),
                          helper.make_node("DequantizeLinear", [q, scale, f"{name}_zero_{how}"], [y], **axis)]
                outputs += [(q, kind, list(x.shape)), (y, T.FLOAT, list(x.shape))]
    model = _model(nodes, [("x", T.FLOAT, list(x.shape))], outputs, inits)
    with np.errstate(invalid="ignore"):  # the reference's rint(NaN) as int32
        got, want = _run_both(model, {"x": x}, tmp_path, "qdq")
    _assert_same_bits(got, want, [name for name, *_ in outputs])


def test_rounding_to_every_type_is_the_same_on_an_emulated_arm64_core(tmp_path):
    """Each type's rounding (a Cast to it and back to float32) computed
    under qemu for rasp4b64, against the reference, bit for bit."""
    from tests.cross_targets import run_emulated

    x = _edges()
    casts = [(to, {"saturate": saturate}) for to in FLOAT8 for saturate in (1, 0)]
    casts += [(T.FLOAT4E2M1, {}), (T.FLOAT8E8M0, {"round_mode": "nearest"})] + [(to, {}) for to in INTEGERS]
    nodes, parts = [], []
    for number, (to, attrs) in enumerate(casts):
        low = f"{TENSOR_TYPES[to]}_{number}"
        nodes += [helper.make_node("Cast", ["x"], [low], to=to, **attrs),
                  helper.make_node("Cast", [low], [f"{low}_float"], to=T.FLOAT)]
        parts.append(f"{low}_float")
    nodes.append(helper.make_node("Concat", parts, ["y"], axis=0))
    model = _model(nodes, [("x", T.FLOAT, [x.size])], [("y", T.FLOAT, [x.size * len(parts)])])
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = run_emulated(crosscompile.build(model, target="rasp4b64"), "rasp4b64", x, want.shape, str(tmp_path))
    _assert_same_bits([got], [want], ["rounded on rasp4b64"])


def test_int4_weights_dequantized_into_a_matmul(tmp_path):
    """A constant int4 weight with a per-column scale and zero point, as
    weight-only quantized models carry it."""
    rng = np.random.default_rng(3)
    w = rng.integers(-8, 8, (6, 5)).astype(ml_dtypes.int4)
    zero = np.array([0, 1, -2, 3, -8]).astype(ml_dtypes.int4)
    scale = np.array([0.1, 0.2, 0.3, 0.4, 0.5], np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["w", "scale", "zero"], ["wf"], axis=1),
             helper.make_node("MatMul", ["x", "wf"], ["y"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(zero, "zero"),
             numpy_helper.from_array(scale, "scale")]
    model = _model(nodes, [("x", T.FLOAT, [2, 6])], [("y", T.FLOAT, [2, 5])], inits)
    x = rng.standard_normal((2, 6)).astype(np.float32)
    (got,), (want,) = _run_both(model, {"x": x}, tmp_path, "int4_matmul")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_what_stays_refused_is_named():
    """A Cast to a type still refused, or with a round mode ONNX lacks,
    is refused naming the node."""
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=T.COMPLEX64, name="to_complex")],
                   [("x", T.FLOAT, [2])], [("y", T.COMPLEX64, [2])])
    with pytest.raises(crosscompile.BuildError, match=r"'to_complex'.*COMPLEX64 is not supported"):
        crosscompile.build(model)
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=T.FLOAT8E8M0, round_mode="sideways", name="odd")],
                   [("x", T.FLOAT, [2])], [("y", T.FLOAT8E8M0, [2])])
    with pytest.raises(crosscompile.BuildError, match=r"'odd'.*round_mode='sideways'.*up, down, nearest"):
        crosscompile.build(model)
