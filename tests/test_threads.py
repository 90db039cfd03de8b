"""Modules split large ops across threads (tether_run_parallel): the same
results for any thread count, and old modules still run on one thread."""
import functools
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
from onnx import helper

import crosscompile
import minirt
from minirt import InputError
from minirt.timing import time_module
from tests.competing_load import CompetingLoad, cores
from tests.cross_targets import emulated_tools
from tests.onnx_models import make_model, rand, reference
from tests.quantized_models import calibration, input_shape, quantized_model


def small_cnn(batch=2):
    """im2col convs (scratch reused per image and group), a pointwise conv, a
    grouped and a depthwise conv and serial ops in between, so threads hand
    work back and forth."""
    def w(*shape, seed):
        return (rand(*shape, seed=seed) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"]),
             helper.make_node("Conv", ["c2", "w3"], ["c3"], group=2, pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["c3", "w4"], ["c4"], group=26, pads=[1, 1, 1, 1]),
             helper.make_node("Tanh", ["c4"], ["y"])]
    inits = {"w1": w(40, 3, 3, 3, seed=1), "b1": rand(40, seed=2), "w2": w(30, 40, 1, 1, seed=3),
             "b2": rand(30, seed=4), "w3": w(26, 15, 3, 3, seed=5),
             "w4": w(26, 1, 3, 3, seed=6)}
    return make_model(nodes, {"x": (batch, 3, 37, 41)}, {"y": None}, inits)


@pytest.fixture(scope="module")
def cnn_module(tmp_path_factory):
    model = small_cnn()
    path = tmp_path_factory.mktemp("threads") / "cnn.so"
    return model, minirt.load(crosscompile.build(model).export_library(path))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_single_thread_result(cnn_module, threads):
    model, module = cnn_module
    x = rand(2, 3, 37, 41, seed=9)
    want = reference(model, {"x": x})[0]
    module.set_threads(threads)
    assert module.threads == threads
    for _ in range(20):  # races would show as differing runs
        got = module.run({"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_timing_runs_on_the_threads_run_uses(tmp_path):
    """minirt.timing (what RemoteModule.benchmark runs on the board) takes
    run()'s path: a module set to 3 threads starts its 2 workers when timed."""
    def workers():
        return sum(t.name.startswith("minirt-worker-") for t in threading.enumerate())

    module = minirt.load(crosscompile.build(small_cnn(batch=1)).export_library(tmp_path / "m.so"), threads=3)
    before = workers()
    samples, _ = time_module(module, {"x": rand(1, 3, 37, 41, seed=9)}, number=2, repeat=2)
    assert len(samples) == 2
    assert workers() == before + 2
    module.close()


def test_default_thread_count_is_the_number_of_cores(cnn_module, tmp_path):
    module = minirt.load(crosscompile.build(small_cnn(batch=1)).export_library(tmp_path / "m.so"))
    assert module.threads == (os.cpu_count() or 1)


def test_bad_thread_count_is_an_input_error(cnn_module):
    _, module = cnn_module
    with pytest.raises(InputError, match="threads must be a positive integer, got 0"):
        module.set_threads(0)
    with pytest.raises(InputError, match="threads must be at most 255 .*got 256"):
        module.set_threads(256)


def test_module_without_the_parallel_entry_point_runs_on_one_thread(tmp_path):
    """A module from before tether_run_parallel (optional in the module ABI):
    today's module with that export renamed, so that the loader looks it up
    and finds nothing, as in an old file."""
    model = small_cnn(batch=1)
    so = crosscompile.build(model).so_bytes
    assert b"tether_run_parallel\0" in so
    old = tmp_path / "old.so"
    old.write_bytes(so.replace(b"tether_run_parallel\0", b"TETHER_RUN_PARALLEL\0"))
    module = minirt.load(old, threads=2)
    assert module.threads == 1
    x = rand(1, 3, 37, 41, seed=3)
    np.testing.assert_allclose(module.run({"x": x})[0], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


PARALLEL_DRIVER_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct tether_sync { int32_t arrived, generation; long (*syscall)(long, ...); };
typedef int32_t (*run_parallel_fn)(void *const *, void *const *, void *, int32_t, int32_t,
                                   struct tether_sync *);
static run_parallel_fn run;
static void *ins[1], *outs[1], *workspace;
static struct tether_sync sync_state;
static int32_t threads, status[16];

static void *work(void *arg) {
    int32_t t = (int32_t)(intptr_t)arg;
    status[t] = run(ins, outs, workspace, t, threads, &sync_state);
    return NULL;
}

/* "held": a thread of the driver's own stops the workers again and again
   in the middle of the run, as a busy board's scheduler does: a signal
   whose handler sleeps for 3 ms wherever the worker is (often inside a
   chunk of work it took), then 0.3 ms to run before the next one. */
static pthread_t ids[16];
static volatile int running;
static void hold(int sig) {
    (void)sig;
    struct timespec pause = {0, 3000000};
    nanosleep(&pause, NULL);
}
static void *holder(void *arg) {
    (void)arg;
    struct timespec gap = {0, 3300000};
    while (running) {
        for (int t = 1; t < threads; t++) pthread_kill(ids[t], SIGUSR1);
        nanosleep(&gap, NULL);
    }
    return NULL;
}

/* driver MODULE.so WORKSPACE_BYTES IN.bin N_IN OUT.bin N_OUT THREADS [RUNS [late|held]]:
   OUT.bin gets the outputs of RUNS runs (default 1) one after another.
   With "late", thread 0 runs alone and the other threads only call in
   after it has returned, as threads the system never ran in time: they
   must return without writing to the outputs or the workspace. */
int main(int argc, char **argv) {
    if (argc < 8 || argc > 10) { fprintf(stderr, "usage\n"); return 2; }
    int runs = argc >= 9 ? atoi(argv[8]) : 1;
    int late = argc == 10 && strcmp(argv[9], "late") == 0;
    int held = argc == 10 && strcmp(argv[9], "held") == 0;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = hold;
    sigaction(SIGUSR1, &action, NULL);
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 3; }
    run = (run_parallel_fn)dlsym(lib, "tether_run_parallel");
    if (!run) { fprintf(stderr, "missing tether_run_parallel\n"); return 4; }
    size_t ws = strtoul(argv[2], NULL, 10), n_in = strtoul(argv[4], NULL, 10), n_out = strtoul(argv[6], NULL, 10);
    threads = atoi(argv[7]);
    workspace = aligned_alloc(64, ws ? ws : 64);
    float *in = malloc(n_in * sizeof(float)), *out = malloc(n_out * sizeof(float));
    FILE *f = fopen(argv[3], "rb");
    if (!f || fread(in, sizeof(float), n_in, f) != n_in) { fprintf(stderr, "read\n"); return 5; }
    fclose(f);
    ins[0] = in; outs[0] = out;
    f = fopen(argv[5], "wb");
    for (int run = 0; run < runs; run++) {
        sync_state.arrived = sync_state.generation = 0;
        sync_state.syscall = syscall;
        memset(out, 0, n_out * sizeof(float));
        if (late) {
            work((void *)0);
            fwrite(out, sizeof(float), n_out, f);
            unsigned char *before = malloc(ws ? ws : 1);
            memcpy(before, workspace, ws);
            memset(out, 0xFF, n_out * sizeof(float));
            for (int t = 1; t < threads; t++) work((void *)(intptr_t)t);
            for (size_t i = 0; i < n_out * sizeof(float); i++)
                if (((unsigned char *)out)[i] != 0xFF) { fprintf(stderr, "a late thread wrote output byte %zu\n", i); return 7; }
            if (memcmp(before, workspace, ws) != 0) { fprintf(stderr, "a late thread wrote to the workspace\n"); return 8; }
            free(before);
        } else {
            pthread_t holding;
            running = 1;
            for (int t = 1; t < threads; t++) pthread_create(&ids[t], NULL, work, (void *)(intptr_t)t);
            if (held) pthread_create(&holding, NULL, holder, NULL);
            work((void *)0);
            running = 0;
            if (held) pthread_join(holding, NULL);
            for (int t = 1; t < threads; t++) pthread_join(ids[t], NULL);
        }
        for (int t = 0; t < threads; t++)
            if (status[t] != 0) { fprintf(stderr, "thread %d: %d\n", t, status[t]); return 6; }
        if (!late) fwrite(out, sizeof(float), n_out, f);
    }
    fclose(f);
    return 0;
}
"""


# A quantized model of two images whose convolutions run on the integer
# tile kernels (int8_dot on ARM, int8_x86 on the host): see conv_stack.
INT8_FORM = "convs_qdq_per_channel_u8s8"


def model_and_input(which: str):
    """("cnn": small_cnn, "int8": the INT8_FORM model) and its input."""
    if which == "int8":
        return quantized_model(INT8_FORM), calibration(1, seed=21, shape=input_shape(INT8_FORM))[0]["x"]
    return small_cnn(), rand(2, 3, 37, 41, seed=9)


@functools.lru_cache(maxsize=None)
def built_for(preset: str, which: str = "cnn"):
    """The model compiled for preset: (the module's bytes, its workspace
    size), built once for every test that runs it."""
    lib = crosscompile.build(model_and_input(which)[0], target=preset)
    return lib.so_bytes, lib.metadata["workspace_bytes"]


def run_on_emulated_board(tmp_path, preset, threads: int, runs: int = 1, mode: str = "", which: str = "cnn"):
    """The model's (small_cnn's, or see model_and_input) outputs of `runs`
    runs on `threads` threads, through tether_run_parallel under qemu (the
    host's C compiler and no qemu for preset "host"), and onnxruntime's
    (None for "int8", whose reference is the module's own 1-thread run).
    With mode "late", the other threads call in only after thread 0 has
    returned; with "held", they are stopped for 3 ms after every 0.3 ms
    they run (see PARALLEL_DRIVER_C)."""
    if preset == "host":
        gcc = shutil.which("cc") or pytest.skip("no C compiler (cc) on this host")
        launch = []
    else:
        qemu, gcc, sysroot = emulated_tools(preset)
        launch = [qemu, "-L", sysroot]
    model, x = model_and_input(which)
    want = reference(model, {"x": x})[0] if which == "cnn" else None
    shape = want.shape if want is not None else tuple(d.dim_value for d in
                                                      model.graph.output[0].type.tensor_type.shape.dim)
    size = int(np.prod(shape))
    so_bytes, workspace_bytes = built_for(preset, which)
    so = tmp_path / "cnn.so"
    so.write_bytes(so_bytes)
    (tmp_path / "driver.c").write_text(PARALLEL_DRIVER_C)
    subprocess.run([gcc, "-O1", "-pthread", "-o", str(tmp_path / "driver"), str(tmp_path / "driver.c"), "-ldl"],
                   check=True, capture_output=True)
    x.tofile(tmp_path / "in.bin")
    proc = subprocess.run(launch + [str(tmp_path / "driver"), str(so),
                           str(workspace_bytes), str(tmp_path / "in.bin"),
                           str(x.size), str(tmp_path / "out.bin"), str(size), str(threads), str(runs)]
                          + ([mode] if mode else []),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape((runs,) + shape)
    return got, want


def assert_arm_close(got, want):
    # ARMv7 NEON rounds differently (no fused multiply-add, flush to zero):
    # an absolute floor scaled to the output, as in tests/test_zoo.py.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("preset", ["rasp4b64", "rasp3b"])
def test_parallel_run_on_emulated_arm_boards(tmp_path, preset):
    got, want = run_on_emulated_board(tmp_path, preset, threads=3)
    assert_arm_close(got[0], want)


@pytest.mark.parametrize("preset", ["host", "rasp4b64"])
def test_threads_that_never_ran_hold_nobody_up(tmp_path, preset):
    """Thread 0 of 3 runs the whole model alone when the other two have not
    started (descheduled all along) and its outputs are right; when they
    call in afterwards they find every step done and return without
    writing to the outputs or the workspace."""
    got, want = run_on_emulated_board(tmp_path, preset, threads=3, runs=2, mode="late")
    for run in got:
        assert_arm_close(run, want)


@pytest.mark.parametrize("preset, runs", [("host", 30), ("rasp4b64", 4)])
def test_workers_held_in_the_middle_of_their_work(tmp_path, preset, runs):
    """Workers stopped again and again wherever they are, at times holding
    a chunk that thread 0 then waits for (asleep on the futex, woken when
    the held worker finishes it), or before they took any: every run's
    outputs are still right."""
    got, want = run_on_emulated_board(tmp_path, preset, threads=3, runs=runs, mode="held")
    for run in got:
        assert_arm_close(run, want)


@pytest.fixture
def busy_cores():
    """A spinning process on every core this process may use, for the
    duration of the test: the module's threads then get the cores only
    part of the time, and one at a time."""
    with CompetingLoad(cores()) as load:
        yield load


@pytest.mark.parametrize("threads", [2, 3])
def test_busy_cores_give_the_single_thread_result(cnn_module, busy_cores, threads):
    """With every core also running a spinner, a thread is often
    descheduled in the middle of a kernel: the others take its share of
    the work, and every run still gives onnxruntime's result."""
    model, module = cnn_module
    x = rand(2, 3, 37, 41, seed=9)
    want = reference(model, {"x": x})[0]
    module.set_threads(threads)
    for _ in range(15):
        np.testing.assert_allclose(module.run({"x": x})[0], want, rtol=1e-5, atol=1e-6)
    assert all(p.poll() is None for p in busy_cores.processes), "the load ended before the runs"


def test_busy_cores_on_an_emulated_arm_board(tmp_path, busy_cores):
    """The same on an emulated Cortex-A72 board (aarch64's weaker memory
    order than x86's), 3 threads on cores that every spinner also wants."""
    got, want = run_on_emulated_board(tmp_path, "rasp4b64", threads=3, runs=3)
    for run in got:
        assert_arm_close(run, want)
    assert all(p.poll() is None for p in busy_cores.processes), "the load ended before the runs"


@pytest.fixture(scope="module")
def int8_module(tmp_path_factory):
    """The quantized model on the host, and its 1-thread output."""
    model, x = model_and_input("int8")
    module = minirt.load(crosscompile.build(model).export_library(tmp_path_factory.mktemp("int8") / "int8.so"))
    module.set_threads(1)
    return module, x, module.run({"x": x})[0]


@pytest.mark.parametrize("threads", [2, 3])
def test_int8_kernels_on_threads_give_the_single_thread_result(int8_module, threads):
    """The integer convolutions' packing and tiles handed out to 2 or 3
    threads, quiet and then with a spinner on every core: every run's
    output is the 1-thread output, bit for bit."""
    module, x, want = int8_module
    module.set_threads(threads)
    for _ in range(10):
        np.testing.assert_array_equal(module.run({"x": x})[0], want)
    with CompetingLoad(cores()) as load:
        for _ in range(10):
            np.testing.assert_array_equal(module.run({"x": x})[0], want)
        assert all(p.poll() is None for p in load.processes), "the load ended before the runs"


def test_int8_kernels_on_threads_of_an_emulated_arm_board(tmp_path):
    """The same on an emulated Cortex-A72 (the "quads" tiles of int8_dot):
    2 threads quiet, 3 with a spinner on every core, against the module's
    own 1-thread run."""
    want = run_on_emulated_board(tmp_path, "rasp4b64", threads=1, which="int8")[0][0]
    got = run_on_emulated_board(tmp_path, "rasp4b64", threads=2, runs=2, which="int8")[0]
    with CompetingLoad(cores()) as load:
        busy = run_on_emulated_board(tmp_path, "rasp4b64", threads=3, runs=3, which="int8")[0]
        assert all(p.poll() is None for p in load.processes), "the load ended before the runs"
    for run in (*got, *busy):
        np.testing.assert_array_equal(run, want)
