"""build() with LLVM work spread over forked processes (crosscompile.backend)
gives a module that computes what one process's module computes."""
import os

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile
from llvmlite import ir

import crosscompile
import minirt
from crosscompile import BuildError
from crosscompile.backend import INLINE_CANDIDATE, JOBS_ENV, compile_jobs, compile_objects
from crosscompile.target import resolve_target
from tests.onnx_models import rand
from tests.test_crosscompile_passes import small_cnn


def exported_symbols(path) -> set:
    with open(path, "rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        return {(s.name, s["st_info"]["type"]) for s in dynsym.iter_symbols() if s["st_shndx"] != "SHN_UNDEF"}


def test_serial_and_parallel_builds_run_the_same(tmp_path):
    model = small_cnn()
    feeds = {"x": rand(1, 3, 11, 13, seed=11)}
    serial = crosscompile.build(model, "host", jobs=1)
    parallel = crosscompile.build(model, "host", jobs=2)
    assert [name for name, _ in serial.objects] == ["module.o", "params.o"]
    assert len(parallel.objects) > 3, "the kernels were not split between processes"
    assert parallel.metadata == serial.metadata
    paths = [lib.export_library(tmp_path / f"{n}.so") for n, lib in (("serial", serial), ("parallel", parallel))]
    assert exported_symbols(paths[0]) == exported_symbols(paths[1])
    outputs = [minirt.load(p).run(feeds) for p in paths]
    for got, want in zip(outputs[1], outputs[0]):
        np.testing.assert_array_equal(got, want)


def test_compile_jobs_come_from_the_argument_then_the_environment_else_one(monkeypatch):
    monkeypatch.setenv(JOBS_ENV, "3")
    assert compile_jobs(None) == 3
    assert compile_jobs(1) == 1
    monkeypatch.setenv(JOBS_ENV, "many")
    with pytest.raises(BuildError, match=JOBS_ENV):
        compile_jobs(None)
    with pytest.raises(BuildError, match="0 .every core. or more"):
        compile_jobs(-1)
    assert compile_jobs(0) == len(os.sched_getaffinity(0))
    monkeypatch.delenv(JOBS_ENV)
    assert compile_jobs(None) == 1


def _kernel(module: ir.Module, name: str, broken: bool) -> ir.Function:
    """An internal kernel y[i] = x[i] + 1 unrolled past INLINE_CANDIDATE
    instructions; broken leaves its last block without a terminator."""
    f32p = ir.FloatType().as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [f32p, f32p]), name=name)
    fn.linkage = "internal"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    for i in range(INLINE_CANDIDATE):
        at = [ir.Constant(ir.IntType(64), i)]
        b.store(b.fadd(b.load(b.gep(fn.args[0], at)), ir.Constant(ir.FloatType(), 1.0)), b.gep(fn.args[1], at))
    if not broken:
        b.ret_void()
    return fn


def test_a_kernel_that_fails_in_a_worker_is_named():
    module = ir.Module(name="broken")
    target = resolve_target("host")
    module.triple = target.triple
    kernels = [_kernel(module, "node0_Good", False), _kernel(module, "node1_Bad", True)]
    f32p = ir.FloatType().as_pointer()
    run = ir.Function(module, ir.FunctionType(ir.VoidType(), [f32p, f32p]), name="tether_run")
    b = ir.IRBuilder(run.append_basic_block("entry"))
    for kernel in kernels:
        b.call(kernel, run.args)
    b.ret_void()
    with pytest.raises(BuildError, match=r"IR of kernel\(s\) node1_Bad is invalid"):
        compile_objects(module, target, jobs=2)
    ir.IRBuilder(kernels[1].blocks[-1]).ret_void()
    assert len(compile_objects(module, target, jobs=2)) == 3
