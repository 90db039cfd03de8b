"""Graph + memory plan → LLVM module implementing the module ABI
(docs/module-abi.md): tether_abi_version, tether_metadata, tether_run,
tether_run_parallel and tether_run_profiled, and for a dynamic batch
tether_run_dims and tether_run_parallel_dims."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from .emit import F32_PTR, I32, Kernel, barrier_function, shared_range
from .ir import Graph
from .ops import OPS
from .memory import ALIGNMENT, Location, MemoryPlan

ABI_VERSION = 1
# tether_run return codes, as documented in docs/module-abi.md.
RUN_OK = 0
RUN_NULL_POINTER = 1
RUN_BAD_DIMS = 2

I8 = ir.IntType(8)
I8_PTR = I8.as_pointer()


@dataclass(frozen=True)
class GeneratedCode:
    """What code generation hands to build(): the LLVM module, the bytes of
    the parameters it declares (symbol -> bytes, defined outside the module
    by elfdata.data_object) and how many distinct node kernels it defines."""

    module: ir.Module
    params: dict
    kernels: int


def generate(graph: Graph, plan: MemoryPlan, metadata: dict, target, data_layout: str,
             progress=None) -> GeneratedCode:
    """Build the module: one internal kernel per node plus the ABI entry points.
    ``progress(what, done, total)``, when given, hears of every node."""
    module = _new_module(graph.name, metadata, target, data_layout)
    kernels = _node_kernels(module, graph, plan, target, {}, {}, "node", progress)
    params = _Parameters(module)
    for parallel, profiled in ((False, False), (True, False), (False, True)):
        _emit_run(module, graph, plan, kernels, params, target, parallel, profiled)
    return _generated(module, params)


def generate_dynamic(plans: list, dims: dict, metadata: dict, target, data_layout: str,
                     progress=None) -> GeneratedCode:
    """Build a module with a dynamic dimension (crosscompile.dynamic):
    `plans` holds (size, graph, memory plan) for each plan size, largest
    first (the upper bound), and `dims` the metadata's "dynamic" entry.
    tether_run, tether_run_parallel and tether_run_profiled run the largest
    plan (the shapes the metadata lists); tether_run_dims and
    tether_run_parallel_dims take the actual size and run the plans chunk
    by chunk (dims has "chunks") or the plan of that size. The plans share
    kernels of equal shapes and parameters of equal bytes."""
    _, graph, plan = plans[0]
    module = _new_module(graph.name, metadata, target, data_layout)
    cache, tiles = {}, {}
    compiled = [(size, size_graph, size_plan,
                 _node_kernels(module, size_graph, size_plan, target, cache, tiles, f"node{size}x", progress))
                for size, size_graph, size_plan in plans]
    params = _Parameters(module)
    kernels = compiled[0][3]
    for parallel, profiled in ((False, False), (True, False), (False, True)):
        _emit_run(module, graph, plan, kernels, params, target, parallel, profiled)
    for parallel in (False, True):
        _emit_run_dims(module, compiled, dims, params, target, parallel)
    return _generated(module, params)


def _new_module(name: str, metadata: dict, target, data_layout: str) -> ir.Module:
    module = ir.Module(name=name)
    module.triple = target.triple
    module.data_layout = data_layout
    _define_abi_version(module)
    _define_metadata(module, json.dumps(metadata, separators=(",", ":")))
    return module


def _generated(module: ir.Module, params: "_Parameters") -> GeneratedCode:
    defined = [f for f in module.functions if f.name.startswith("node") and f.blocks]
    return GeneratedCode(module, params.data, len(defined))


def _node_kernels(module: ir.Module, graph: Graph, plan: MemoryPlan, target, cache: dict, tiles: dict,
                  prefix: str, progress=None) -> list:
    """(node, kernel function) for each node that needs code, in order."""
    kernels = []
    # Kernels depend on shapes and attributes only (data comes in through
    # pointers), so repeated blocks of a network share one function.
    # Micro-kernels (gemm.py) are shared between the node kernels through tiles, by key.
    for pos, node in enumerate(graph.nodes):
        if progress is not None:
            progress("generating kernels", pos + 1, len(graph.nodes))
        if node.name in plan.aliased_nodes:
            continue
        ins = [graph.tensors[t] for t in node.inputs]
        outs = [graph.tensors[t] for t in node.outputs]
        key = repr((node.op_type, [(t.shape, t.dtype) for t in ins], [(t.shape, t.dtype) for t in outs], node.attrs))
        if key not in cache:
            cache[key] = _lower(module, f"{prefix}{pos}_{_symbol(node.op_type)}", node, ins, outs, target, tiles)
        kernels.append((node, cache[key]))
    return kernels


def _lower(module: ir.Module, name: str, node, ins, outs, target, tiles: dict) -> ir.Function:
    epilogue = [_activation(op_type, attrs) for op_type, attrs in node.attrs.get("epilogue", ())]
    scratch = OPS[node.op_type].scratch_bytes(ins, outs, node.attrs) > 0
    k = Kernel(module, name, len(ins), len(outs), target, epilogue, scratch,
               parallel=OPS[node.op_type].parallel(node.attrs), tiles=tiles)
    k.epilogue_key = repr(node.attrs.get("epilogue", ()))
    OPS[node.op_type].lower(k, ins, outs, node.attrs)
    if epilogue and not k.activated:
        # The op stores intermediate values (e.g. Softmax): one extra pass,
        # split between the threads of a parallel kernel once all have stored.
        k.barrier()
        size = outs[0].size
        blocks = -(-size // EPILOGUE_BLOCK)
        out = k.typed(k.outputs[0], outs[0].dtype)
        with k.share(blocks) as (lo, hi):
            end = k.smin(k.builder.mul(hi, k.i64(EPILOGUE_BLOCK)), k.i64(size))
            with k.loop(end, start=k.builder.mul(lo, k.i64(EPILOGUE_BLOCK))) as i:
                k.store(k.activate(k.load(out, i)), out, i)
    k.finish()
    return k.function


# Elements of an output that the threads take at a time for a separate
# epilogue pass.
EPILOGUE_BLOCK = 1024


def _activation(op_type: str, attrs: dict):
    op = OPS[op_type]

    def apply(k, value):
        return op.apply(k, value, attrs)
    apply.vectorizable = op.vectorizable
    return apply


def _define_abi_version(module: ir.Module) -> None:
    fn = ir.Function(module, ir.FunctionType(I32, []), name="tether_abi_version")
    ir.IRBuilder(fn.append_basic_block()).ret(ir.Constant(I32, ABI_VERSION))


def _define_metadata(module: ir.Module, text: str) -> None:
    data = bytearray(text.encode("utf-8") + b"\0")
    gv = _constant_bytes(module, "tether.metadata", data, align=1)
    fn = ir.Function(module, ir.FunctionType(I8_PTR, []), name="tether_metadata")
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(b.bitcast(gv, I8_PTR))


def _constant_bytes(module: ir.Module, name: str, data: bytearray, align: int) -> ir.GlobalVariable:
    gv = ir.GlobalVariable(module, ir.ArrayType(I8, len(data)), name=name)
    gv.global_constant = True
    gv.linkage = "internal"
    gv.align = align
    gv.initializer = ir.Constant(ir.ArrayType(I8, len(data)), data)
    return gv


class _Parameters:
    """The parameter globals of a module, declared outside the LLVM module
    and recorded in `data` (symbol -> bytes).

    LLVM only takes constants as IR text (seconds and gigabytes for a large
    model), so the bytes go into a separate object (elfdata.data_object)
    and the code refers to them as hidden external symbols. Constants of
    equal bytes share one symbol (the plans of a dynamic module share
    their weights so).
    """

    def __init__(self, module: ir.Module):
        self.module = module
        self.data: dict = {}
        self._by_name: dict = {}
        self._by_content: dict = {}

    def get(self, graph: Graph, name: str) -> ir.GlobalVariable:
        key = (id(graph), name)
        if key not in self._by_name:
            dtype = np.dtype(graph.tensors[name].dtype).newbyteorder("<")
            data = np.ascontiguousarray(graph.constants[name], dtype=dtype).tobytes()
            digest = (len(data), hashlib.sha256(data).digest())
            if digest not in self._by_content:
                gv = ir.GlobalVariable(self.module, ir.ArrayType(I8, len(data)), name=f"param.{len(self.data)}")
                gv.global_constant = True
                gv.align = ALIGNMENT
                self.data[gv.name] = data
                self._by_content[digest] = gv
            self._by_name[key] = self._by_content[digest]
        return self._by_name[key]


def render(module: ir.Module) -> str:
    """The module's LLVM assembly, with parameter declarations marked hidden
    (llvmlite does not print visibility) so references need no GOT."""
    lines = str(module).split("\n")
    for pos, line in enumerate(lines):
        if line.startswith('@"param.'):
            lines[pos] = line.replace(" = external constant ", " = external hidden constant ", 1)
    return "\n".join(lines)


def _emit_run(module: ir.Module, graph: Graph, plan: MemoryPlan, kernels, params: _Parameters,
              target, parallel: bool, profiled: bool = False) -> None:
    """tether_run, or with parallel tether_run_parallel(inputs, outputs,
    workspace, thread, threads, state): every one of `threads` threads calls
    it at once with the same buffers and a zeroed struct tether_sync.
    Parallel kernels share their work out between the threads (Kernel.share);
    each run of the others in a row is one item that the first thread to
    come takes, and a barrier follows every step, which waits for the
    work handed out, not for the threads (emit.barrier_function): a thread
    that is late finds the steps it missed done and passes them.
    With profiled, tether_run_profiled(inputs, outputs, workspace, mark, ctx):
    one thread, calling mark(ctx, i) before kernel i and mark(ctx, n) after
    the last."""
    name = "tether_run_profiled" if profiled else "tether_run_parallel" if parallel else "tether_run"
    entry = _Entry(module, name, graph, plan.workspace_bytes, target, parallel, profiled)
    _emit_steps(entry, graph, plan, kernels, entry.slots, params)
    if profiled:
        entry.b.call(entry.fn.args[3], [entry.fn.args[4], ir.Constant(I32, len(kernels))])
    entry.b.ret(ir.Constant(I32, RUN_OK))


def _emit_run_dims(module: ir.Module, compiled: list, dims: dict, params: _Parameters, target,
                   parallel: bool) -> None:
    """tether_run_dims(inputs, outputs, workspace, dims), or with parallel
    tether_run_parallel_dims(inputs, outputs, workspace, dims, thread,
    threads, state): dims[0] (an int64) is the actual size of the dynamic
    dimension. Out of [min, max] it returns RUN_BAD_DIMS. A chunked
    (leading, separable) dimension runs the plans, largest first, each as
    often as it fits in what is left (dynamic.chunks), on the rows at the
    current offset; otherwise the plan of that size runs. Every thread
    takes the same plans, so the barriers of the parallel form line up as
    in tether_run_parallel."""
    _, graph, plan, _ = compiled[0]
    name = "tether_run_parallel_dims" if parallel else "tether_run_dims"
    workspace_bytes = max(p.workspace_bytes for _, _, p, _ in compiled)
    entry = _Entry(module, name, graph, workspace_bytes, target, parallel, False, dims=True)
    b, i64 = entry.b, ir.IntType(64)
    size = b.load(b.gep(entry.fn.args[3], [ir.Constant(I32, 0)]))
    outside = b.or_(b.icmp_signed("<", size, ir.Constant(i64, dims["min"])),
                    b.icmp_signed(">", size, ir.Constant(i64, dims["max"])))
    with b.if_then(outside, likely=False):
        b.ret(ir.Constant(I32, RUN_BAD_DIMS))
    if "chunks" not in dims:
        # One plan per size: run the one of this size on the whole buffers.
        for plan_size, plan_graph, size_plan, kernels in compiled:
            with b.if_then(b.icmp_signed("==", size, ir.Constant(i64, plan_size))):
                _emit_steps(entry, plan_graph, size_plan, kernels, entry.slots, params)
                b.ret(ir.Constant(I32, RUN_OK))
        b.ret(ir.Constant(I32, RUN_BAD_DIMS))
        return
    offset = b.alloca(i64)
    b.store(ir.Constant(i64, 0), offset)
    for chunk, chunk_graph, chunk_plan, kernels in compiled:
        test = b.append_basic_block(f"chunk{chunk}.test")
        body = b.append_basic_block(f"chunk{chunk}.body")
        done = b.append_basic_block(f"chunk{chunk}.done")
        b.branch(test)
        b.position_at_end(test)
        at = b.load(offset)
        b.cbranch(b.icmp_signed(">=", b.sub(size, at), ir.Constant(i64, chunk)), body, done)
        b.position_at_end(body)
        slots = {}
        for kind, names in (("input", chunk_graph.inputs), ("output", chunk_graph.outputs)):
            for i, tensor in enumerate(names):
                row = chunk_graph.tensors[tensor].nbytes // chunk
                slots[(kind, i)] = b.gep(entry.slots[(kind, i)], [b.mul(at, ir.Constant(i64, row))])
        _emit_steps(entry, chunk_graph, chunk_plan, kernels, slots, params)
        b.store(b.add(at, ir.Constant(i64, chunk)), offset)
        b.branch(test)
        b.position_at_end(done)
    b.ret(ir.Constant(I32, RUN_OK))


class _Entry:
    """An exported run function under construction: its arguments checked
    for NULL, the input and output pointers loaded (slots), and the
    thread's sync state and cursor (Kernel.share)."""

    def __init__(self, module: ir.Module, name: str, graph: Graph, workspace_bytes: int, target,
                 parallel: bool, profiled: bool, dims: bool = False):
        args = [I8_PTR.as_pointer(), I8_PTR.as_pointer(), I8_PTR]
        mark_type = ir.FunctionType(ir.VoidType(), [I8_PTR, I32])
        if dims:
            args += [ir.IntType(64).as_pointer()]
        if parallel:
            args += [I32, I32, I32.as_pointer()]
        if profiled:
            args += [mark_type.as_pointer(), I8_PTR]
        fn = ir.Function(module, ir.FunctionType(I32, args), name=name)
        # The mark callback must not unwind; saying so keeps ARM's EHABI
        # personality routine (a libc++ symbol) out of the module.
        fn.attributes.add("nounwind")
        self.fn, self.module, self.target = fn, module, target
        self.parallel, self.profiled = parallel, profiled
        self.inputs, self.outputs, self.workspace = fn.args[:3]
        self.b = b = ir.IRBuilder(fn.append_basic_block("entry"))
        first = 4 if dims else 3
        if parallel:
            self.thread, self.threads, self.state = fn.args[first:first + 3]
        else:
            # One thread: parallel kernels take every shared range at once from
            # a private sync state (without a syscall pointer, so never a
            # system call).
            self.thread, self.threads = ir.Constant(I32, 0), ir.Constant(I32, 1)
            self.state = b.alloca(I32, ir.Constant(I32, 4))
            for i in range(4):
                b.store(ir.Constant(I32, 0), b.gep(self.state, [ir.Constant(I32, i)]))
        # This thread's cursor: where its next shared range starts (Kernel.share).
        self.cursor = b.alloca(I32)
        b.store(ir.Constant(I32, 0), self.cursor)

        # Reject NULL pointers up front: a caller bug should not crash the board.
        checks = [self.inputs] if graph.inputs else []
        checks += [self.outputs] if graph.outputs else []
        checks += [self.workspace] if workspace_bytes else []
        checks += [fn.args[3]] if profiled or dims else []
        bad = ir.Constant(ir.IntType(1), 0)
        for ptr in checks:
            bad = b.or_(bad, b.icmp_unsigned("==", ptr, ir.Constant(ptr.type, None)))
        arrays = {"input": (self.inputs, len(graph.inputs)), "output": (self.outputs, len(graph.outputs))}
        self.slots = {}
        with b.if_then(bad, likely=False):
            b.ret(ir.Constant(I32, RUN_NULL_POINTER))
        for kind, (array, count) in arrays.items():
            for i in range(count):
                self.slots[(kind, i)] = b.load(b.gep(array, [ir.Constant(I32, i)]))
                with b.if_then(b.icmp_unsigned("==", self.slots[(kind, i)], ir.Constant(I8_PTR, None)),
                               likely=False):
                    b.ret(ir.Constant(I32, RUN_NULL_POINTER))


def _emit_steps(entry: _Entry, graph: Graph, plan: MemoryPlan, kernels, slots: dict, params: _Parameters) -> None:
    """Call the kernels of one plan in order, on the input and output
    pointers in slots (with barriers and shared serial stretches in a
    parallel entry, marks in a profiled one)."""
    b, workspace, module = entry.b, entry.workspace, entry.module
    parallel = entry.parallel
    thread, threads, state, cursor = entry.thread, entry.threads, entry.state, entry.cursor

    def pointer(tensor: str):
        loc: Location = plan.locations[tensor]
        if loc.kind in ("input", "output"):
            raw = slots[(loc.kind, loc.index)]
        elif loc.kind == "workspace":
            raw = b.gep(workspace, [ir.Constant(ir.IntType(64), loc.index)])
        else:
            raw = params.get(graph, loc.name)
        return b.bitcast(raw, F32_PTR)

    scratch = b.bitcast(b.gep(workspace, [ir.Constant(ir.IntType(64), plan.workspace_bytes - plan.scratch_bytes)]),
                        F32_PTR) if plan.scratch_bytes else None
    barrier = barrier_function(module, entry.target)
    serial = []  # (kernel, buffers) of serial steps not yet emitted (parallel runs)

    def run_serial() -> None:
        # One item for whichever thread comes first, then a barrier before
        # anybody reads what it computed.
        with shared_range(b, entry.target, state, threads, cursor, 1):
            for kernel_fn, args in serial:
                b.call(kernel_fn, args)
        b.call(barrier, [state, threads, cursor])
        serial.clear()

    for step, (node, kernel) in enumerate(kernels):
        if entry.profiled:
            b.call(entry.fn.args[3], [entry.fn.args[4], ir.Constant(I32, step)])
        buffers = [pointer(t) for t in node.inputs + node.outputs]
        if plan.scratch_bytes and OPS[node.op_type].scratch_bytes(
                [graph.tensors[t] for t in node.inputs], [graph.tensors[t] for t in node.outputs], node.attrs):
            buffers.append(scratch)
        if OPS[node.op_type].parallel(node.attrs):
            if serial:
                run_serial()
            b.call(kernel, buffers + [thread, threads, state, cursor])
            if parallel:
                b.call(barrier, [state, threads, cursor])
        elif parallel:
            serial.append((kernel, buffers))
        else:
            b.call(kernel, buffers)
    if serial:
        run_serial()


def _symbol(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)
