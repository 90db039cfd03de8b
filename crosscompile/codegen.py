"""Graph + memory plan → LLVM module implementing the module ABI
(docs/module-abi.md): tether_abi_version, tether_metadata, tether_run,
tether_run_parallel and tether_run_profiled."""
from __future__ import annotations

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
    module = ir.Module(name=graph.name)
    module.triple = target.triple
    module.data_layout = data_layout

    kernels = []
    # Kernels depend on shapes and attributes only (data comes in through
    # pointers), so repeated blocks of a network share one function.
    cache: dict[str, ir.Function] = {}
    # Micro-kernels (gemm.py) shared between the node kernels, by key.
    tiles: dict = {}
    for pos, node in enumerate(graph.nodes):
        if progress is not None:
            progress("generating kernels", pos + 1, len(graph.nodes))
        if node.name in plan.aliased_nodes:
            continue
        ins = [graph.tensors[t] for t in node.inputs]
        outs = [graph.tensors[t] for t in node.outputs]
        key = repr((node.op_type, [(t.shape, t.dtype) for t in ins], [(t.shape, t.dtype) for t in outs], node.attrs))
        if key not in cache:
            cache[key] = _lower(module, f"node{pos}_{_symbol(node.op_type)}", node, ins, outs, target, tiles)
        kernels.append((node, cache[key]))

    _define_abi_version(module)
    _define_metadata(module, json.dumps(metadata, separators=(",", ":")))
    declared: dict = {}  # constant name -> its parameter global
    params: dict = {}  # parameter symbol -> bytes
    for parallel, profiled in ((False, False), (True, False), (False, True)):
        _emit_run(module, graph, plan, kernels, declared, params, target, parallel, profiled)
    defined = [f for f in module.functions if f.name.startswith("node") and f.blocks]
    return GeneratedCode(module, params, len(defined))


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


def _declare_param(module: ir.Module, name: str, data: bytes, params: dict) -> ir.GlobalVariable:
    """Declare a parameter global defined outside the LLVM module and
    record its bytes in params.

    LLVM only takes constants as IR text (seconds and gigabytes for a large
    model), so the bytes go into a separate object (elfdata.data_object)
    and the code refers to them as hidden external symbols.
    """
    gv = ir.GlobalVariable(module, ir.ArrayType(I8, len(data)), name=name)
    gv.global_constant = True
    gv.align = ALIGNMENT
    params[name] = data
    return gv


def render(module: ir.Module) -> str:
    """The module's LLVM assembly, with parameter declarations marked hidden
    (llvmlite does not print visibility) so references need no GOT."""
    lines = str(module).split("\n")
    for pos, line in enumerate(lines):
        if line.startswith('@"param.'):
            lines[pos] = line.replace(" = external constant ", " = external hidden constant ", 1)
    return "\n".join(lines)


def _emit_run(module: ir.Module, graph: Graph, plan: MemoryPlan, kernels, declared: dict,
              params: dict, target, parallel: bool, profiled: bool = False) -> None:
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
    args = [I8_PTR.as_pointer(), I8_PTR.as_pointer(), I8_PTR]
    mark_type = ir.FunctionType(ir.VoidType(), [I8_PTR, I32])
    if parallel:
        args += [I32, I32, I32.as_pointer()]
    if profiled:
        args += [mark_type.as_pointer(), I8_PTR]
    name = "tether_run_profiled" if profiled else "tether_run_parallel" if parallel else "tether_run"
    fn = ir.Function(module, ir.FunctionType(I32, args), name=name)
    # The mark callback must not unwind; saying so keeps ARM's EHABI
    # personality routine (a libc++ symbol) out of the module.
    fn.attributes.add("nounwind")
    inputs, outputs, workspace = fn.args[:3]
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    if parallel:
        thread, threads, state = fn.args[3:]
    else:
        # One thread: parallel kernels take every shared range at once from
        # a private sync state (without a syscall pointer, so never a
        # system call).
        thread, threads = ir.Constant(I32, 0), ir.Constant(I32, 1)
        state = b.alloca(I32, ir.Constant(I32, 4))
        for i in range(4):
            b.store(ir.Constant(I32, 0), b.gep(state, [ir.Constant(I32, i)]))
    # This thread's cursor: where its next shared range starts (Kernel.share).
    cursor = b.alloca(I32)
    b.store(ir.Constant(I32, 0), cursor)

    # Reject NULL pointers up front: a caller bug should not crash the board.
    checks = [inputs] if graph.inputs else []
    checks += [outputs] if graph.outputs else []
    checks += [workspace] if plan.workspace_bytes else []
    checks += [fn.args[3]] if profiled else []
    bad = ir.Constant(ir.IntType(1), 0)
    for ptr in checks:
        bad = b.or_(bad, b.icmp_unsigned("==", ptr, ir.Constant(ptr.type, None)))
    arrays = {"input": (inputs, len(graph.inputs)), "output": (outputs, len(graph.outputs))}
    slots = {}
    with b.if_then(bad, likely=False):
        b.ret(ir.Constant(I32, RUN_NULL_POINTER))
    for kind, (array, count) in arrays.items():
        for i in range(count):
            slots[(kind, i)] = b.load(b.gep(array, [ir.Constant(I32, i)]))
            with b.if_then(b.icmp_unsigned("==", slots[(kind, i)], ir.Constant(I8_PTR, None)), likely=False):
                b.ret(ir.Constant(I32, RUN_NULL_POINTER))

    def pointer(tensor: str):
        loc: Location = plan.locations[tensor]
        if loc.kind in ("input", "output"):
            raw = slots[(loc.kind, loc.index)]
        elif loc.kind == "workspace":
            raw = b.gep(workspace, [ir.Constant(ir.IntType(64), loc.index)])
        else:
            if loc.name not in declared:
                dtype = np.dtype(graph.tensors[loc.name].dtype).newbyteorder("<")
                data = np.ascontiguousarray(graph.constants[loc.name], dtype=dtype).tobytes()
                declared[loc.name] = _declare_param(module, f"param.{len(declared)}", data, params)
            raw = declared[loc.name]
        return b.bitcast(raw, F32_PTR)

    scratch = b.bitcast(b.gep(workspace, [ir.Constant(ir.IntType(64), plan.workspace_bytes - plan.scratch_bytes)]),
                        F32_PTR) if plan.scratch_bytes else None
    barrier = barrier_function(module, target)
    serial = []  # (kernel, buffers) of serial steps not yet emitted (parallel runs)

    def run_serial() -> None:
        # One item for whichever thread comes first, then a barrier before
        # anybody reads what it computed.
        with shared_range(b, target, state, threads, cursor, 1):
            for kernel_fn, args in serial:
                b.call(kernel_fn, args)
        b.call(barrier, [state, threads, cursor])
        serial.clear()

    for step, (node, kernel) in enumerate(kernels):
        if profiled:
            b.call(fn.args[3], [fn.args[4], ir.Constant(I32, step)])
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
    if profiled:
        b.call(fn.args[3], [fn.args[4], ir.Constant(I32, len(kernels))])
    b.ret(ir.Constant(I32, RUN_OK))


def _symbol(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)
