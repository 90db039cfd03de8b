"""build(): ONNX model → one shared object for a target board."""
from __future__ import annotations

import io
import json
import os
import re
import tarfile
from dataclasses import dataclass, field

import llvmlite.binding as llvm

from . import codegen
from .backend import compile_jobs, compile_objects, target_machine
from .elfdata import data_object
from .errors import BuildError
from .dynamic import CHECK_SIZES, MAX_SPECIALIZED, check_separable, dynamic_spec, input_shapes_at, output_axes
from .frontend import import_onnx, load_model
from .link import link_shared
from .metadata import module_metadata
from .patterns import fuse_attention, fuse_gelu, fuse_layer_norm, fuse_swish
from .quantized import lower_qdq
from .memory import plan_memory
from .precision import check_precision, mark_precision
from .passes import (crop_dead_taps, split_tap_regions, eliminate_dead_code, fold_batchnorm, fold_channel_affine, fuse_elementwise,
                     fuse_matmul_affine, fuse_residual_add, mark_split, pack_conv_weights, pack_matmul_weights,
                     transpose_recurrent_weights)
from .schedule import assign_tiles, tile_table
from .target import Target, resolve_target

__version__ = "0.1.0"
PRODUCER = f"tether-crosscompile {__version__}"


@dataclass(frozen=True)
class CompiledModule:
    """A compiled module: the shared object's bytes and its metadata."""

    so_bytes: bytes
    metadata: dict
    target: Target
    objects: tuple = ()  # (file name, bytes) of the relocatable objects
    # ops, kernels, fused ops, ops folded into Conv, workspace/param/code bytes.
    summary: dict = field(default_factory=dict)

    def export_library(self, path: "str | os.PathLike") -> str:
        """Write the shared object (or, for a path ending in .tar, the object
        files plus metadata.json for linking on the board) and return the path.

        >>> crosscompile.build(model, "rasp4b64").export_library("net.so")  # doctest: +SKIP
        'net.so'
        """
        path = os.fspath(path)
        data = self.object_tar() if path.endswith(".tar") else self.so_bytes
        with open(path, "wb") as f:
            f.write(data)
        return path

    def object_tar(self) -> bytes:
        """A tar of module.o, params.o and metadata.json; on the board
        `cc -shared -o net.so *.o` links it into the same module."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            members = list(self.objects) + [("metadata.json", json.dumps(self.metadata, indent=2).encode())]
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()


def build(model, target: "str | Target" = "host", input_shapes: "dict | None" = None,
          schedules=None, precision: str = "fp32", progress=None, jobs: "int | None" = None,
          dynamic: "dict | None" = None) -> CompiledModule:
    """Compile an ONNX model (path or onnx.ModelProto) for a target.

    precision "fp16" computes convolutions and matrix products in half
    precision on targets with FP16 arithmetic (Target.has_fp16_arithmetic:
    rasp5, android-arm64), the module's inputs and outputs staying float32;
    see crosscompile.precision. Other targets refuse it with a BuildError.

    schedules picks each convolution's register tile by its shape: a
    crosscompile.tuning.TuningCache or a mapping {ConvShape.key: (mr, nv)} ((mr, nv, pixels) for
    a transposed tile, see gemm.emit_channel_gemm);
    shapes it does not name get the target's default tile.

    progress(what, done, total), when given, is called as the build moves from
    step to step (and from node to node while kernels are generated); the
    CLI draws it as a ticking line.

    jobs: how many processes optimise and emit the kernels with LLVM (see
    crosscompile.backend); default $TETHER_COMPILE_JOBS, else 1 (everything
    in this process); 0 takes every core this process may use. Several
    processes compute the same outputs with slightly different code (LLVM
    no longer sees the whole module at once).

    dynamic {"batch": (min, max)} names one of the model's symbolic
    dimensions and its bounds: the module then runs any size within them
    (crosscompile.dynamic, docs/dynamic-batch.md; tether_run_dims in
    docs/module-abi.md): a leading one whose rows every op keeps apart in
    chunks, any other one with a plan per size (at most 16 sizes); a wider
    range is a BuildError naming why.

    >>> lib = build("model.onnx", target="rasp4b64")  # doctest: +SKIP
    >>> lib.export_library("net.so")                   # doctest: +SKIP
    >>> build("model.onnx", target="rasp5", precision="fp16")  # doctest: +SKIP
    >>> build("model.onnx", dynamic={"batch": (1, 16)})  # doctest: +SKIP
    """
    report = progress or (lambda _what, _done, _total: None)
    target = resolve_target(target)
    check_precision(precision, target)  # before the model is read
    jobs = compile_jobs(jobs)
    report("importing and rewriting the graph", 0, 1)
    table = tile_table(target, schedules)
    data_layout = str(target_machine(target).target_data)
    if dynamic is None:
        imported, folded, graph = lowered_graph(model, target, input_shapes, table, precision)
        plan = plan_memory(graph)
        metadata = module_metadata(imported, graph, plan, target, PRODUCER)
        code = codegen.generate(graph, plan, metadata, target, data_layout, report)
    else:
        imported, folded, graph, plan, metadata, code = _build_dynamic(
            model, target, input_shapes, table, precision, dynamic, data_layout, report)
    report(f"optimising and emitting {code.kernels} kernels with LLVM", 0, 1)
    compiled = compile_objects(code.module, target, jobs)
    objects = [("module.o" if i == 0 else f"module{i}.o", obj) for i, obj in enumerate(compiled)]
    if code.params:
        objects.append(("params.o", data_object(compiled[0], list(code.params.items()))))
    soname = re.sub(r"[^A-Za-z0-9_.-]", "_", graph.name) + ".so"
    report("linking", 0, 1)
    summary = {
        "ops": len(imported.nodes),
        "kernels": code.kernels,
        "fused_ops": len(folded.nodes) - len(graph.nodes),
        "fused_kernels": sum(1 for n in graph.nodes if n.attrs.get("epilogue")),
        "folded_into_conv": len(imported.nodes) - len(folded.nodes),
        "workspace_bytes": metadata["workspace_bytes"],
        "param_bytes": metadata["param_bytes"],
        "code_bytes": sum(_code_bytes(obj) for obj in compiled),
        "tuned_convs": sum(1 for tile in metadata["gemm_tiles"] if tile["tuned"]),
        "gemm_convs": len(metadata["gemm_tiles"]),
        "fp16_kernels": sum(1 for n in graph.nodes if n.attrs.get("precision") == "fp16"),
    }
    return CompiledModule(link_shared([o for _, o in objects], soname), metadata, target,
                          tuple(objects), summary)


def _build_dynamic(model, target: Target, input_shapes, table, precision: str, dynamic: dict,
                   data_layout: str, report):
    """build()'s middle for a dynamic dimension (crosscompile.dynamic): a
    leading one proved separable at two sizes runs in chunks, any other one
    plan per size; the graph is lowered and planned once per plan size
    (largest first) into one module. Returns what build() reads of the
    largest plan, whose shapes the metadata lists."""
    proto = load_model(model)
    spec = dynamic_spec(proto, dynamic)
    if spec.chunked:
        checked = {size: eliminate_dead_code(import_onnx(proto, input_shapes_at(proto, spec, size, input_shapes)))
                   for size in CHECK_SIZES}
        try:
            check_separable(checked, spec.name)
        except BuildError as mixed:
            try:
                spec = spec.specialized()
            except BuildError:
                raise BuildError(f"{mixed}, or narrow {spec.name} to at most {MAX_SPECIALIZED} sizes (compiled "
                                 f"one plan each; {spec.low}..{spec.high} is {spec.high - spec.low + 1})") from None
    if not spec.chunked and spec.low == spec.high:
        raise BuildError(f"dynamic[{spec.name!r}] = ({spec.low}, {spec.high}) is one size: give it with "
                         "input_shapes instead")
    plans = []
    for size in spec.sizes:
        report(f"lowering the plan for {spec.name} {size}", 0, 1)
        imported, folded, graph = lowered_graph(proto, target, input_shapes_at(proto, spec, size, input_shapes),
                                                table, precision)
        plans.append((size, imported, folded, graph, plan_memory(graph)))
    _, imported, folded, graph, plan = plans[0]
    counted = [name for name in graph.outputs if name in graph.counts]
    if counted:
        # Chunks would each leave a count of their own in one workspace.
        raise BuildError(f"graph outputs {counted} have sizes that depend on the data, which a module with a "
                         f"dynamic dimension does not support yet; compile with fixed shapes (input_shapes)")
    metadata = module_metadata(imported, graph, plan, target, PRODUCER)
    metadata["dynamic"] = [spec.to_dict()]
    outputs = ([[0]] * len(graph.outputs) if spec.chunked
               else output_axes({size: imported for size, imported, *_ in plans}, spec.name))
    for entry, axes in zip(metadata["inputs"] + metadata["outputs"], list(spec.axes) + outputs):
        entry["dynamic_axes"] = list(axes)
    # Plans share parameters of equal bytes; one whose kernels read another
    # layout (a batch-1 matrix product reads its weights unpacked) has its own.
    metadata["param_bytes"] = sum(len(data) for data in {
        _constant_bytes(g, loc.name) for *_, g, p in plans for node in g.nodes if node.name not in p.aliased_nodes
        for loc in (p.locations[t] for t in node.inputs) if loc.kind == "constant"})
    # The chunks run one after another in the same workspace: the largest
    # plan's (the upper bound's) is enough for every size.
    metadata["workspace_bytes"] = max(p.workspace_bytes for *_, p in plans)
    code = codegen.generate_dynamic([(size, g, p) for size, _, _, g, p in plans], spec.to_dict(), metadata,
                                    target, data_layout, report)
    return imported, folded, graph, plan, metadata, code


def _constant_bytes(graph, name: str) -> bytes:
    return graph.constants[name].tobytes()


def tiled_graph(model, target: Target, input_shapes, table, precision: str = "fp32"):
    """(imported, folded, tiled) graphs of a model: build()'s graph passes up
    to schedule.assign_tiles, which writes each GEMM convolution's tile
    (from `table`, see schedule.tile_table) into the graph, after
    precision.mark_precision has marked the nodes that compute in half."""
    imported = eliminate_dead_code(import_onnx(model, input_shapes))
    folded = fold_channel_affine(fold_batchnorm(lower_qdq(imported, target)))
    patterned = fuse_swish(fuse_gelu(fuse_layer_norm(split_tap_regions(crop_dead_taps(folded)))))
    fused = fuse_attention(fuse_matmul_affine(patterned))
    marked = mark_precision(fuse_residual_add(fuse_elementwise(fused)), target, precision)
    tiled = assign_tiles(marked, target, table)
    return imported, folded, tiled


def lowered_graph(model, target: Target, input_shapes, table, precision: str = "fp32"):
    """(imported, folded, lowered) graphs of a model: all graph passes of build()."""
    imported, folded, tiled = tiled_graph(model, target, input_shapes, table, precision)
    return imported, folded, mark_split(transpose_recurrent_weights(pack_matmul_weights(pack_conv_weights(tiled))))


def _code_bytes(obj: bytes) -> int:
    """Size of the executable sections of an object file."""
    return sum(s.size() for s in llvm.ObjectFileRef.from_data(obj).sections() if s.is_text())
