"""build(): ONNX model → one shared object for a target board."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import llvmlite.binding as llvm

from . import codegen
from .errors import BuildError
from .frontend import import_onnx
from .link import link_shared
from .passes import optimize, plan_memory
from .target import Target, resolve_target

__version__ = "0.1.0"
PRODUCER = f"tether-crosscompile {__version__}"


@dataclass(frozen=True)
class CompiledModule:
    """A compiled module: the shared object's bytes and its metadata."""

    so_bytes: bytes
    metadata: dict
    target: Target

    def export_library(self, path: "str | os.PathLike") -> str:
        """Write the shared object to path and return the path.

        >>> crosscompile.build(model, "rasp4b64").export_library("net.so")  # doctest: +SKIP
        'net.so'
        """
        path = os.fspath(path)
        with open(path, "wb") as f:
            f.write(self.so_bytes)
        return path


def build(model, target: "str | Target" = "host", input_shapes: "dict | None" = None) -> CompiledModule:
    """Compile an ONNX model (path or onnx.ModelProto) for a target.

    >>> lib = build("model.onnx", target="rasp4b64")  # doctest: +SKIP
    >>> lib.export_library("net.so")                   # doctest: +SKIP
    """
    target = resolve_target(target)
    graph = optimize(import_onnx(model, input_shapes))
    plan = plan_memory(graph)
    metadata = {
        "abi_version": codegen.ABI_VERSION,
        "name": graph.name,
        "target": target.to_dict(),
        "inputs": [_spec(graph.tensors[n]) for n in graph.inputs],
        "outputs": [_spec(graph.tensors[n]) for n in graph.outputs],
        "workspace_bytes": plan.workspace_bytes,
        "param_bytes": codegen.param_bytes(graph, plan),
        "ops": sorted({node.op_type for node in graph.nodes}),
        "producer": PRODUCER,
    }
    machine = _target_machine(target)
    module = codegen.generate(graph, plan, metadata, target.triple, str(machine.target_data))
    obj = _compile(module, machine)
    soname = re.sub(r"[^A-Za-z0-9_.-]", "_", graph.name) + ".so"
    return CompiledModule(link_shared(obj, soname), metadata, target)


def _spec(tensor) -> dict:
    return {"name": tensor.name, "shape": list(tensor.shape), "dtype": tensor.dtype}


def _target_machine(target: Target) -> llvm.TargetMachine:
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    try:
        llvm_target = llvm.Target.from_triple(target.triple)
    except RuntimeError as exc:
        raise BuildError(f"LLVM cannot generate code for triple {target.triple!r}: {exc}") from None
    return llvm_target.create_target_machine(cpu=target.cpu, features=target.features,
                                             opt=3, reloc="pic", codemodel="default")


def _compile(module, machine: llvm.TargetMachine) -> bytes:
    try:
        parsed = llvm.parse_assembly(codegen.render(module))
        parsed.verify()
    except RuntimeError as exc:  # a bug in an op's lowering, not in the user's model
        raise BuildError(f"internal error: generated LLVM IR is invalid: {exc}") from None
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)
    tuning.loop_vectorization = True
    tuning.slp_vectorization = True
    builder = llvm.create_pass_builder(machine, tuning)
    builder.getModulePassManager().run(parsed, builder)
    return machine.emit_object(parsed)
