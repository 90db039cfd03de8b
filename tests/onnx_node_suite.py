"""The ONNX backend node tests shipped in the onnx package, run through
crosscompile on the host: the node cases (generated in memory by
onnx.backend.test.case.node, since wheels do not ship their data files) and
the pytorch-converted and pytorch-operator directories.

A case is in scope when every op in its model is one crosscompile supports
and its floating-point tensors are float32. Inputs an op needs at compile
time (shapes, axes, pads) and every input of the ops evaluated at compile
time are given to the compiler as constants: crosscompile specialises a
module on them, as it does for an exporter's initializers. Other int64,
int32 and bool inputs (indices, masks) stay runtime inputs.

    python -m tests.onnx_node_suite            # pass count per op
"""
from __future__ import annotations

import glob
import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
SUITES = ("pytorch-converted", "pytorch-operator")


@dataclass
class Case:
    suite: str
    name: str
    ops: list
    path: str = ""       # model.onnx of a directory case
    generated: object = None  # an onnx.backend.test.case TestCase

    def load(self):
        """(model, inputs, expected outputs) of the first data set."""
        if self.generated is not None:
            inputs, outputs = self.generated.data_sets[0]
            model = onnx.ModelProto()
            model.CopyFrom(self.generated.model)
            return model, [np.asarray(v) for v in inputs], [np.asarray(v) for v in outputs]
        return (onnx.load(self.path), *_load_data(os.path.dirname(self.path)))


@dataclass
class Result:
    case: Case
    status: str  # "pass", "mismatch", "rejected" (a BuildError), "crash"
    detail: str = ""


def supported_op_types() -> set:
    from crosscompile.frontend import supported_ops
    return set(supported_ops())


def discover() -> list:
    """All cases whose ops are all supported and whose float tensors are float32."""
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    supported = supported_op_types()
    cases = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generated = collect_testcases(None)
    for case in generated:
        model = case.model
        ops = sorted({n.op_type for n in model.graph.node})
        if (ops and all(n.domain in ("", "ai.onnx") for n in model.graph.node)
                and set(ops) <= supported and _float32_io(model)):
            cases.append(Case("node", case.name, ops, generated=case))
    for suite in SUITES:
        for path in sorted(glob.glob(os.path.join(DATA, suite, "*", "model.onnx"))):
            model = onnx.load(path, load_external_data=False)
            ops = sorted({n.op_type for n in model.graph.node})
            if not ops or any(n.domain not in ("", "ai.onnx") for n in model.graph.node):
                continue
            if not set(ops) <= supported or not _float32_io(model):
                continue
            cases.append(Case(suite, os.path.basename(os.path.dirname(path)), ops, path=path))
    return cases


# Model output dtypes a module can have (crosscompile.frontend.SUPPORTED_DTYPES).
OUTPUT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL}
RUNTIME_DTYPES = {np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.bool_)}


def _float32_io(model) -> bool:
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
              onnx.TensorProto.BFLOAT16}
    io = list(model.graph.input) + list(model.graph.output)
    kinds = [vi.type.tensor_type.elem_type for vi in io]
    if not all(vi.type.HasField("tensor_type") for vi in io):
        return False
    out_kinds = [vi.type.tensor_type.elem_type for vi in model.graph.output]
    return (all(k in OUTPUT_TYPES for k in out_kinds)
            and all(k == onnx.TensorProto.FLOAT or k not in floats for k in kinds))


def _load_data(case_dir: str):
    data_dir = os.path.join(case_dir, "test_data_set_0")
    inputs = [numpy_helper.to_array(_read(p)) for p in sorted(glob.glob(os.path.join(data_dir, "input_*.pb")))]
    outputs = [numpy_helper.to_array(_read(p)) for p in sorted(glob.glob(os.path.join(data_dir, "output_*.pb")))]
    return inputs, outputs


def _read(path):
    tensor = onnx.TensorProto()
    with open(path, "rb") as f:
        tensor.ParseFromString(f.read())
    return tensor


# Cases whose expected data (from the ONNX reference) onnxruntime, which
# compiled modules follow, does not reproduce: they are checked against
# onnxruntime instead.
ONNXRUNTIME_DIFFERS = {
    # align_corners with a scale that gives no whole length: onnxruntime (and
    # torch) divide by the rounded length, the reference by in_size * scale.
    "test_resize_downsample_scales_linear_align_corners",
}


def run_case(case: Case, workdir: str, rtol=1e-4, atol=1e-5) -> Result:
    """Compile and run one case. Generated cases carry their own tolerance
    (some expected outputs are rounded to 4 decimals); directory cases use
    rtol/atol."""
    import crosscompile
    import minirt
    from crosscompile.ops import OPS

    model, inputs, expected = case.load()
    if case.generated is not None:
        rtol, atol = max(rtol, case.generated.rtol), case.generated.atol
    # Float inputs an op needs at compile time (Clip's bounds, Pad's value).
    from crosscompile.frontend import FRONTEND_OPS
    compile_time = {name for node in model.graph.node if node.op_type in OPS
                    for pos, name in enumerate(node.input) if pos in OPS[node.op_type].compile_time_inputs}
    compile_time |= {name for node in model.graph.node if node.op_type in FRONTEND_OPS for name in node.input}
    graph_inputs = [vi for vi in model.graph.input if vi.name not in {i.name for i in model.graph.initializer}]
    feeds = {}
    for vi, value in zip(graph_inputs, inputs):
        if value.dtype == object:
            return Result(case, "rejected", f"input {vi.name!r} is not a plain tensor")
        if value.dtype in RUNTIME_DTYPES and vi.name not in compile_time:
            feeds[vi.name] = value
        else:  # compile-time input: becomes a constant
            model.graph.initializer.append(numpy_helper.from_array(value, vi.name))
    kept = [vi for vi in model.graph.input if vi.name not in {i.name for i in model.graph.initializer}]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    try:
        lib = crosscompile.build(model, "host", input_shapes={n: v.shape for n, v in feeds.items()})
    except crosscompile.BuildError as exc:
        return Result(case, "rejected", str(exc).splitlines()[0][:300])
    except Exception as exc:  # noqa: BLE001 - any other exception is a compiler bug
        return Result(case, "crash", f"{type(exc).__name__}: {exc}"[:300])
    path = lib.export_library(os.path.join(workdir, f"{case.name}.so"))
    got = minirt.load(path).run(feeds)
    if case.name in ONNXRUNTIME_DIFFERS:
        from tests.onnx_models import reference
        expected = reference(model, feeds)
    for i, (g, w) in enumerate(zip(got, expected)):
        if g.shape != w.shape:
            return Result(case, "mismatch", f"output {i}: shape {g.shape}, expected {w.shape}")
        if not np.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True):
            err = float(np.max(np.abs(g - w)))
            return Result(case, "mismatch", f"output {i}: max abs error {err:g}")
    return Result(case, "pass")


def run_all(cases=None) -> list:
    cases = discover() if cases is None else cases
    with tempfile.TemporaryDirectory(prefix="tether-node-") as tmp:
        return [run_case(c, tmp) for c in cases]


def per_op(results) -> dict:
    """op -> {status: count}; a case counts for every op in its model."""
    table = defaultdict(lambda: defaultdict(int))
    for r in results:
        for op in r.case.ops:
            table[op][r.status] += 1
    return table


def main() -> int:
    results = run_all()
    table = per_op(results)
    print(f"{'op':22} {'pass':>5} {'reject':>7} {'mismatch':>9} {'crash':>6}")
    for op in sorted(table):
        row = table[op]
        print(f"{op:22} {row['pass']:5} {row['rejected']:7} {row['mismatch']:9} {row['crash']:6}")
    counts = defaultdict(int)
    for r in results:
        counts[r.status] += 1
    print(f"total: {len(results)} cases, " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for r in results:
        if r.status != "pass":
            print(f"  {r.status:8} {r.case.suite}/{r.case.name}: {r.detail}")
    return 0 if not counts["mismatch"] and not counts["crash"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
