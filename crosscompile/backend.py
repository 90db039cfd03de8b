"""LLVM module → relocatable object files, optimised in parallel.

Optimising and emitting a large model's kernels takes most of a build, and
kernels compile independently of each other: the module is split into parts
(the entry points with the small kernels they may inline, then groups of the
other kernels, each group with every kernel that shares a micro-kernel with
one of its members), and forked worker processes optimise and emit one part
each. Kernels called across parts become hidden symbols, so the link resolves
them without a GOT or PLT; helpers a part calls (micro-kernels, the barrier)
are defined, internal, in each part that calls them.

How many processes: build(jobs=...), else $TETHER_COMPILE_JOBS (0: the
cores this process may run on, os.sched_getaffinity), else 1, which compiles
the whole module in this process as one object. One process stays the
default because a split module is not quite the same code: a kernel called
from another part is an external function to LLVM, so what it learns from
the whole module (constant arguments, a private calling convention, inlining
of micro-kernels by their number of callers) is lost, and some kernels come
out a little different (the outputs are the same; EfficientNet-B0 counted
221,205,419 instructions per inference on the Cortex-A72 split in 7 parts,
221,214,282 whole).
Workers are forked: in a process whose other threads may be inside LLVM
at the time (building other modules), keep jobs at 1, since a child could
inherit a lock one of them holds.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from dataclasses import dataclass

import llvmlite.binding as llvm
from llvmlite import ir

from . import codegen
from .errors import BuildError

JOBS_ENV = "TETHER_COMPILE_JOBS"
# Kernels of at most this many IR instructions stay in the part of the
# entry points (tether_run*), which LLVM may inline them into.
INLINE_CANDIDATE = 64
# Parts per worker process: more parts even out their different costs.
PARTS_PER_JOB = 3


def compile_jobs(jobs: "int | None" = None) -> int:
    """The number of worker processes: jobs, else $TETHER_COMPILE_JOBS, else
    1; 0 means the cores this process may run on."""
    if jobs is None:
        text = os.environ.get(JOBS_ENV, "").strip() or "1"
        try:
            jobs = int(text)
        except ValueError:
            raise BuildError(f"{JOBS_ENV}={text!r} is not a number of processes; set it to a whole "
                             "number (1 compiles in this process, 0 uses every core)") from None
    if jobs == 0:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if jobs < 0:
        raise BuildError(f"compile jobs must be 0 (every core) or more, not {jobs}")
    return jobs


def target_machine(target) -> llvm.TargetMachine:
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    try:
        llvm_target = llvm.Target.from_triple(target.triple)
    except RuntimeError as exc:
        raise BuildError(f"LLVM cannot generate code for triple {target.triple!r}: {exc}") from None
    return llvm_target.create_target_machine(cpu=target.cpu, features=target.features,
                                             opt=3, reloc="pic", codemodel="default")


def compile_objects(module: ir.Module, target, jobs: int) -> "list[bytes]":
    """Optimise and emit the module: one object, or with jobs > 1 and enough
    kernels, one per part, compiled by `jobs` forked processes."""
    parts = _partition(module, jobs * PARTS_PER_JOB) if jobs > 1 else []
    if len(parts) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [_optimise_and_emit(codegen.render(module), target_machine(target), "the module")]
    global _FORKED
    _FORKED = (module, parts, target)
    try:
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(parts)),
                                                    mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_compile_part, i) for i in range(len(parts))]
            objects = []
            for i, future in enumerate(futures):
                try:
                    objects.append(future.result())
                except concurrent.futures.process.BrokenProcessPool:
                    raise BuildError(f"internal error: the LLVM process compiling {_describe(parts[i])} "
                                     "died; set TETHER_COMPILE_JOBS=1 to compile in this process and "
                                     "see the error") from None
    finally:
        _FORKED = None
    return objects


# What forked workers read: (module, parts, target), set for the pool's life.
_FORKED = None


def _compile_part(index: int) -> bytes:
    """In a forked worker: the object of part `index`."""
    module, parts, target = _FORKED
    return _optimise_and_emit(_render_part(module, parts, index), target_machine(target), _describe(parts[index]))


def _render_part(module: ir.Module, parts: "list[_Part]", index: int) -> str:
    """The LLVM assembly of part `index`: the functions it defines, the others
    declared. A worker compiles several parts, so the module is put back."""
    part = parts[index]
    crossing = set().union(*(p.roots for p in parts[1:]))  # kernels part 0 calls in other parts
    saved = [(fn, fn.blocks, fn.linkage) for fn in module.functions if fn.blocks]
    try:
        for fn, _, linkage in saved:
            if fn.name not in part.defined:
                fn.blocks = []  # a declaration now
                fn.linkage = "hidden" if fn.name in crossing else ""
            elif fn.name in crossing:
                fn.linkage = "hidden"  # external, resolved at link time without a GOT
        return codegen.render(module)
    finally:
        for fn, blocks, linkage in saved:
            fn.blocks, fn.linkage = blocks, linkage


def _optimise_and_emit(text: str, machine: llvm.TargetMachine, what: str) -> bytes:
    try:
        parsed = llvm.parse_assembly(text)
        parsed.verify()
    except RuntimeError as exc:  # a bug in an op's lowering, not in the user's model
        raise BuildError(f"internal error: generated LLVM IR of {what} is invalid: {exc}") from None
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)
    tuning.loop_vectorization = True
    tuning.slp_vectorization = True
    builder = llvm.create_pass_builder(machine, tuning)
    builder.getModulePassManager().run(parsed, builder)
    return machine.emit_object(parsed)


@dataclass(frozen=True)
class _Part:
    """The kernels a part owns (roots) and every function it defines (roots
    and the helpers they call)."""

    roots: frozenset
    defined: frozenset


def _describe(part: _Part) -> str:
    names = sorted(n for n in part.roots if n.startswith("node"))
    if not names:
        return "the entry points"
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"kernel(s) {shown}"


def _partition(module: ir.Module, count: int) -> "list[_Part]":
    """Part 0: every externally visible function and the small kernels; then
    up to count groups of the other kernels, balanced by IR size. Kernels
    that call a common micro-kernel stay in one group (so LLVM sees the same
    callers of it as in the whole module). Empty when there is nothing to split."""
    functions = {f.name: f for f in module.functions if f.blocks}
    calls = {name: {i.callee.name for b in f.blocks for i in b.instructions
                    if isinstance(i, ir.CallInstr) and isinstance(i.callee, ir.Function)
                    and i.callee.name in functions}
             for name, f in functions.items()}
    size = {name: sum(len(b.instructions) for b in f.blocks) for name, f in functions.items()}
    kernels = [n for n, f in functions.items() if f.linkage == "internal" and n.startswith("node")
               and size[n] > INLINE_CANDIDATE]
    # Union kernels through the micro-kernels they call (not through the
    # barrier, which every parallel kernel calls and which stays small).
    parent = {n: n for n in kernels}

    def root(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n
    users: dict = {}
    for n in kernels:
        for callee in calls[n]:
            if callee != "tether.barrier" and callee not in parent:
                users.setdefault(callee, []).append(n)
    for group in users.values():
        for other in group[1:]:
            parent[root(other)] = root(group[0])
    groups: dict = {}
    for n in kernels:
        groups.setdefault(root(n), []).append(n)
    if len(groups) < 2:
        return []

    def closure(names):
        seen, todo = set(), list(names)
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += [c for c in calls[n] if c not in parent or c in names]
        return frozenset(seen)

    def weight(names):
        return sum(size[n] for n in closure(names))
    bins = [[] for _ in range(min(count, len(groups)))]
    loads = [0] * len(bins)
    for group in sorted(groups.values(), key=weight, reverse=True):
        lightest = loads.index(min(loads))
        bins[lightest] += group
        loads[lightest] += weight(group)
    first = [n for n in functions if n not in parent and (functions[n].linkage != "internal" or n.startswith("node"))]
    return [_Part(frozenset(roots), closure(roots)) for roots in [first] + [b for b in bins if b]]
