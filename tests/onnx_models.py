"""Small deterministic ONNX models for tests, built with onnx.helper.

Shared by the compiler, runtime and end-to-end tests:

    from tests.onnx_models import mlp
    model = mlp()                      # input "input" (1, 1, 28, 28) -> output "output" (1, 10)
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import crosscompile
import minirt

OPSET = 13
# IR version 8 (onnx 1.10) is read by every onnxruntime release the tests meet;
# onnx.helper would otherwise stamp its newest IR, which older runtimes refuse.
IR_VERSION = 8


def make_model(nodes, inputs, outputs, initializers=(), opset: int = OPSET,
               name: str = "model") -> onnx.ModelProto:
    """A model from nodes plus {name: shape} inputs/outputs and {name: array} initializers.

    Output shapes may be None (left for the compiler to infer).
    """
    graph = helper.make_graph(
        list(nodes), name,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in dict(inputs).items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in dict(outputs).items()],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in dict(initializers).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="tether-tests", ir_version=IR_VERSION)
    if all(shape is not None for shape in dict(outputs).values()):
        onnx.checker.check_model(model)  # it insists on declared output shapes
    return model


def single_op(op_type, inputs, initializers=(), opset=13, **attrs):
    """A one-node model: runtime inputs {name: shape}, initializers {name: array}."""
    names = list(dict(inputs)) + list(dict(initializers))
    node = helper.make_node(op_type, names, ["y"], name=f"the_{op_type.lower()}", **attrs)
    return make_model([node], inputs, {"y": None}, initializers, opset=opset)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _layer(rng, fan_in: int, fan_out: int):
    weight = (rng.standard_normal((fan_out, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(fan_out)).astype(np.float32)
    return weight, bias


def mlp(sizes=(784, 128, 64, 10), batch: int = 1, seed: int = 0,
        softmax: bool = True) -> onnx.ModelProto:
    """Flatten -> (Gemm[transB] -> Relu)* -> Gemm [-> Softmax], as PyTorch exports it.

    Input "input" has shape (batch, 1, 28, 28) when sizes[0] == 784, else
    (batch, sizes[0]); output "output" has shape (batch, sizes[-1]).
    """
    rng = np.random.default_rng(seed)
    in_shape = (batch, 1, 28, 28) if sizes[0] == 784 else (batch, sizes[0])
    nodes = [helper.make_node("Flatten", ["input"], ["x0"], name="flatten", axis=1)]
    inits = {}
    current = "x0"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        inits[f"fc{i}.weight"], inits[f"fc{i}.bias"] = _layer(rng, fan_in, fan_out)
        last = i == len(sizes) - 2
        gemm_out = ("logits" if softmax else "output") if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [current, f"fc{i}.weight", f"fc{i}.bias"], [gemm_out],
                                      name=f"fc{i}", transB=1))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm_out], [f"a{i}"], name=f"relu{i}"))
            current = f"a{i}"
    if softmax:
        nodes.append(helper.make_node("Softmax", ["logits"], ["output"], name="softmax", axis=-1))
    return make_model(nodes, {"input": in_shape}, {"output": (batch, sizes[-1])}, inits, name="mlp")


def matmul_mlp(sizes=(20, 17, 3), batch: int = 2, seed: int = 0) -> onnx.ModelProto:
    """(MatMul -> Add -> Relu -> Dropout)* -> MatMul -> Add -> Reshape[0, 1, -1] -> Identity.

    Input "input" (batch, sizes[0]); output "output" (batch, 1, sizes[-1]).
    """
    rng = np.random.default_rng(seed)
    nodes, inits = [], {"out_shape": np.array([0, 1, -1], dtype=np.int64)}
    current = "input"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        weight, bias = _layer(rng, fan_in, fan_out)
        inits[f"w{i}"], inits[f"b{i}"] = weight.T.copy(), bias
        nodes += [helper.make_node("MatMul", [current, f"w{i}"], [f"m{i}"], name=f"matmul{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"z{i}"], name=f"add{i}")]
        current = f"z{i}"
        if i < len(sizes) - 2:
            nodes += [helper.make_node("Relu", [current], [f"r{i}"], name=f"relu{i}"),
                      helper.make_node("Dropout", [f"r{i}"], [f"d{i}"], name=f"dropout{i}")]
            current = f"d{i}"
    nodes += [helper.make_node("Reshape", [current, "out_shape"], ["reshaped"], name="reshape"),
              helper.make_node("Identity", ["reshaped"], ["output"], name="identity")]
    return make_model(nodes, {"input": (batch, sizes[0])}, {"output": (batch, 1, sizes[-1])},
                      inits, name="matmul_mlp")


def conv_relu_model(x_shape, w_shape, attrs: dict) -> onnx.ModelProto:
    """Conv (with bias) then Relu, random weights scaled by 1/sqrt(fan-in) as
    in trained nets, so the sums stay O(1) and an absolute tolerance fits
    whatever order the reduction takes."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs),
             helper.make_node("Relu", ["c"], ["y"])]
    weight = (rand(*w_shape, seed=1) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    return make_model(nodes, {"x": x_shape}, {"y": None},
                      {"w": weight, "b": rand(w_shape[0], seed=2)})


def sample_input(model: onnx.ModelProto, seed: int = 1, uniform: bool = False) -> dict:
    """Random float32 inputs for every graph input (a symbolic dimension
    taken as 1): standard normal, or with ``uniform`` in [0, 1) (an image's range)."""
    rng = np.random.default_rng(seed)
    initializers = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = (rng.random(shape, dtype=np.float32) if uniform
                          else rng.standard_normal(shape).astype(np.float32))
    return feeds


def reference(model: onnx.ModelProto, feeds: dict) -> list:
    """Outputs of onnxruntime on the CPU, the ground truth for the tests."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


# Small models sum few terms: float32 results stay this close to onnxruntime's.
RTOL, ATOL = 1e-5, 1e-6


def run_host(model, tmp_path, feeds=None, close=None, **build_args):
    """Compile for the host, load with minirt, run, and compare to onnxruntime
    (within RTOL/ATOL, or with ``close(got, want)`` when given)."""
    feeds = feeds or sample_input(model)
    lib = crosscompile.build(model, target="host", **build_args)
    module = minirt.load(lib.export_library(tmp_path / "m.so"))
    got = module.run(feeds)
    want = reference(model, feeds)
    if close is not None:
        close(got, want)
        return lib
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    return lib


# Zoo tolerance: rtol 1e-4 plus atol 1e-5 x the largest reference value. The
# models are deep (up to 121 convolutions) and float32 sums taken in a
# different order than onnxruntime's differ by about 1e-6 of the magnitude of
# the numbers summed; outputs that nearly cancel (logits close to 0 next to
# logits of 1e4) therefore need an absolute floor scaled to the output.
ZOO_RTOL, ZOO_ATOL_SCALE = 1e-4, 1e-5


def assert_zoo_close(got: list, want: list) -> None:
    """Outputs agree with the reference within the zoo tolerance."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=ZOO_RTOL,
                                   atol=ZOO_ATOL_SCALE * float(np.abs(w).max()))


def assert_zoo_matches(got: list, want: list) -> None:
    """assert_zoo_close, and the predicted class (argmax of the first output's
    first row, the logits when zoo_model exposes them) is the reference's."""
    assert_zoo_close(got, want)
    assert got[0][0].argmax() == want[0][0].argmax()


# -- the onnx package's bundled model zoo -------------------------------------------------

ZOO = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
       "shufflenet", "squeezenet", "vgg19", "zfnet512"]


def zoo_path(name: str) -> str:
    import os
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                        f"light_{name}.onnx")


def zoo_model(name: str, seed: int = 0, logits: bool = True) -> onnx.ModelProto:
    """A light zoo model with random parameters instead of its constant fill.

    The bundled models fill every weight with one value (ConstantOfShape), so
    every spatial position and channel computes the same number and indexing
    bugs would cancel out; random parameters make each output element
    distinct. Weights are scaled so activations stay in range; 1-D
    parameters (biases, BatchNorm scale/mean/var) are drawn from [0.5, 1.5].
    """
    model = onnx.load(zoo_path(name))
    graph = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    rng = np.random.default_rng(seed)
    kept, params = [], []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in inits[node.input[0]])
            if len(shape) >= 2:
                # He scaling for convolutions; the classifier gets a tenth
                # of it so that the final softmax does not saturate.
                fan_in = int(np.prod(shape[1:]))
                gain = 2.0 if len(shape) > 2 else 0.01
                value = rng.standard_normal(shape) * np.sqrt(gain / fan_in)
            else:
                value = rng.uniform(0.5, 1.5, shape)
            params.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in kept for name in node.input}
    unused = [i for i in graph.initializer if i.name not in used]
    for init in unused:  # the shapes of the fills just replaced
        graph.initializer.remove(init)
    gone = {i.name for i in unused}
    for vi in [vi for vi in graph.input if vi.name in gone]:
        graph.input.remove(vi)
    graph.initializer.extend(params)
    if logits and kept[-1].op_type == "Softmax":
        # Also expose the logits: a saturated softmax would hide errors.
        graph.output.append(helper.make_tensor_value_info(kept[-1].input[0], TensorProto.FLOAT, None))
    return model


def zoo_input(model: onnx.ModelProto, seed: int = 1) -> dict:
    """Random input for the zoo model's one runtime input."""
    inits = {i.name for i in model.graph.initializer}
    (vi,) = [vi for vi in model.graph.input if vi.name not in inits]
    shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    return {vi.name: np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}
