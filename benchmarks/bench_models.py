"""Model latency of ours and onnxruntime (1 and 2 threads each) and Apache
TVM (relax, llvm target, untuned, its default threads) side by side, then
GFLOP/s of the main convolution shapes against the machine's peak.

    python benchmarks/bench_models.py [model ...] [--repeat N] [--no-tvm] [--threads 1] [--busy N] [--int8] [--cpu-time]

Every model of the onnx package's light zoo (random parameters, as in
tests/test_zoo.py), or MobileNetV2, EfficientNet-B0 and RegNetX-400MF as
torchvision builds them (tests/architectures.py) when named, one 1x3x224x224 image. Latencies are medians in ms;
ratios are ours / peer (> 1: we are slower). Ours and onnxruntime run
interleaved, one run of each in turn, so that load from other processes
on a shared machine hits both alike. TVM is timed on one run after
a warm-up (untuned it takes seconds per image); it is skipped with a note
when `import tvm` fails.

Ours and onnxruntime at 1 and at 2 threads take turns in one window of
time, so that ours at 2 threads over ours at 1 (the last column) and
ours over onnxruntime compare runs under the same load.

--busy N runs N spinning processes (started and stopped by pid) while
ours and onnxruntime are timed, as the other work of a busy board would,
and alternates them one run each rather than in blocks: a block of runs
back to back lets a spinner's time slice fall in the other side's block.

--cpu-time (with --threads 1) reads the calling thread's CPU time
around each run instead of the wall clock: both engines run one thread
in the caller's, so time other processes take from the core is left out.

--int8 first quantizes each model (crosscompile.quantizer: QDQ, uint8
activations, int8 weights per channel, 4 random calibration samples) and
times ours and onnxruntime on the same quantized model.

The first lines name the machine (CPU model, widest vector extension),
the target ours is compiled for (the host's by default, or --target's) and
the kernels onnxruntime runs. onnxruntime picks its kernels from the CPU it
runs on, so with --target alone an AVX2 target on an AVX-512 host times
ours with AVX2 against onnxruntime with AVX-512. --avx2 times AVX2 against
AVX2 on such a host: ours compiled for AVX2 (AVX2_TARGET unless --target
names another) and onnxruntime with AVX-512 hidden from its CPU probe
(benchmarks/onnxruntime_avx2.py), both running natively.

Peak = cores x clock x flop/cycle/core, with the clock read from
/proc/cpuinfo and --flop-per-cycle (default 32: two 256-bit FMA pipes, as on
Zen 4, whose AVX-512 runs at that rate; use 64 for two 512-bit FMA units).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
import minirt  # noqa: E402
from crosscompile.target import resolve_target  # noqa: E402
from tests import architectures  # noqa: E402
from tests.competing_load import CompetingLoad  # noqa: E402
from tests.onnx_models import ZOO, make_model, zoo_input, zoo_model  # noqa: E402

# Ours with --avx2: AVX2 and FMA, 16 vector registers.
AVX2_TARGET = "x86_64-linux-gnu/haswell/+avx,+avx2,+fma"

# ResNet-50's convolutions (input, weight, pad) and SqueezeNet's largest.
CONV_SHAPES = [
    ((1, 64, 56, 56), (64, 64, 3, 3), 1),
    ((1, 256, 56, 56), (64, 256, 1, 1), 0),
    ((1, 128, 28, 28), (128, 128, 3, 3), 1),
    ((1, 256, 14, 14), (256, 256, 3, 3), 1),
    ((1, 1024, 14, 14), (256, 1024, 1, 1), 0),
    ((1, 512, 7, 7), (512, 512, 3, 3), 1),
    ((1, 64, 55, 55), (256, 64, 3, 3), 1),
]

# Torchvision-like models built here (tests/architectures.py) by name.
ARCHITECTURES = {"mobilenet_v2": architectures.mobilenet_v2, "efficientnet_b0": architectures.efficientnet_b0,
                 "regnet_x_400mf": architectures.regnet_x_400mf}


def median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def interleaved_medians(fns: list, repeat: int, block: int = 5, settle_s: float = 0.05,
                        clock=time.perf_counter) -> list:
    """Median seconds of each callable over `repeat` timed runs, taken in
    alternating blocks of `block` runs so that machine load hits every
    callable alike. Each block starts with one untimed run after a pause of
    `settle_s`: onnxruntime's pool threads spin for a while after a run, and
    would otherwise take a core from whatever runs next (with 2 threads on 2
    cores that halved our speed when runs alternated one by one). clock
    is what is read around each run (time.thread_time: the CPU time of
    this thread, what a one-thread run costs whatever else the machine runs)."""
    samples = [[] for _ in fns]
    while any(len(times) < repeat for times in samples):
        for fn, times in zip(fns, samples):
            time.sleep(settle_s)
            fn()
            for _ in range(min(block, repeat - len(times))):
                started = clock()
                fn()
                times.append(clock() - started)
    return [statistics.median(times) for times in samples]


def ort_session(model, threads: int):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def tvm_runner(model, feeds):
    """A callable running the model with TVM relax, untuned, llvm for the host CPU."""
    import llvmlite.binding as llvm
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    mod = relax.get_pipeline("zero")(from_onnx(model, keep_params_in_input=False))
    target = tvm.target.Target({"kind": "llvm", "mcpu": llvm.get_host_cpu_name()})
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    return lambda: vm["main"](*args)


def host_target_and_peer(parser, avx2: bool) -> tuple:
    """(the target ours compiles for, what onnxruntime runs) on this host;
    with avx2, AVX2 against AVX2 on an AVX-512 machine (parser.error if
    onnxruntime cannot be held to AVX2)."""
    if not avx2:
        return "host", "onnxruntime picks its kernels for this CPU"
    from benchmarks.onnxruntime_avx2 import Avx2Unavailable, use_avx2_onnxruntime
    try:
        return AVX2_TARGET, use_avx2_onnxruntime()
    except Avx2Unavailable as exc:
        parser.error(f"--avx2: {exc}")


def machine_description() -> str:
    """The CPU model and its widest x86 vector extension (or the machine
    name elsewhere), from /proc/cpuinfo."""
    model, flags = platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
    except OSError:
        pass
    widest = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"))
                   if flag in flags), "no AVX2")
    return f"{model}, {widest}, {os.cpu_count()} cores"


def peak_gflops(cores: int, flop_per_cycle: int, ghz: "float | None") -> tuple[float, float]:
    if ghz:
        return ghz, cores * ghz * flop_per_cycle
    mhz = []
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    except OSError:
        pass
    clock = max(mhz) / 1e3 if mhz else 3.0
    return clock, cores * clock * flop_per_cycle


def conv_model(x_shape, w_shape, pad):
    from onnx import helper
    rng = np.random.default_rng(0)
    inits = {"w": (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32),
             "b": rng.standard_normal(w_shape[0]).astype(np.float32)}
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[pad] * 4)
    return make_model([node], {"x": x_shape}, {"y": None}, inits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=ZOO, choices=ZOO + sorted(ARCHITECTURES),
                        metavar="model", help=f"default: all of {', '.join(ZOO)}; also "
                                              f"{', '.join(sorted(ARCHITECTURES))} (random weights)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--no-tvm", action="store_true", help="leave TVM out")
    parser.add_argument("--threads", type=int, choices=(1, 2), action="append",
                        help="time ours and onnxruntime on this many threads only (repeatable; default 1 and 2)")
    parser.add_argument("--no-convs", action="store_true", help="leave out the convolution GFLOP/s table")
    parser.add_argument("--flop-per-cycle", type=int, default=32, help="float32 flop per cycle per core")
    parser.add_argument("--target", default=None,
                        help="compile ours for this target (a preset or triple/cpu/features, default: host)")
    parser.add_argument("--avx2", action="store_true",
                        help="AVX2 against AVX2 on an AVX-512 machine: ours for AVX2, onnxruntime with AVX-512 "
                             "hidden from its CPU probe")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="time ours and onnxruntime while N spinning processes compete for the cores")
    parser.add_argument("--int8", action="store_true",
                        help="time the models quantized to int8 (QDQ), ours and onnxruntime alike")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the calling thread's CPU time rather than the wall clock (with --threads 1 "
                             "only: both engines then run in that thread), steadier on a loaded machine")
    parser.add_argument("--ghz", type=float, help="core clock (default: /proc/cpuinfo, which in a VM "
                                                   "may be the base clock, below the boost clock)")
    args = parser.parse_args()
    if args.cpu_time and args.threads != [1]:
        parser.error("--cpu-time needs --threads 1: other threads' time is not the calling thread's")

    use_tvm = not args.no_tvm
    if use_tvm:
        try:
            import tvm  # noqa: F401
        except ImportError as exc:
            print(f"TVM left out: {exc} (pip install apache-tvm)")
            use_tvm = False
    cores = os.cpu_count() or 1
    thread_counts = sorted(set(args.threads or (1, 2)))
    peer = "onnxruntime picks its kernels for this CPU"
    if args.avx2:
        from benchmarks.onnxruntime_avx2 import Avx2Unavailable, use_avx2_onnxruntime
        try:
            peer = use_avx2_onnxruntime()
        except Avx2Unavailable as exc:
            parser.error(f"--avx2: {exc}")
    target = resolve_target(args.target or (AVX2_TARGET if args.avx2 else "host"))
    print(f"machine: {machine_description()}; ours compiled for {target.name} ({32 * target.lanes}-bit vectors, "
          f"{target.vector_registers} registers); {peer}")
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.busy:
        print(f"competing load: {args.busy} spinning processes while ours and onnxruntime are timed, "
              "alternating one run each")
    print(f"{'model':14} {'compile s':>9} {'ours1 ms':>8} {'ours2 ms':>8} {'ort1 ms':>8} {'ort2 ms':>8} "
          f"{'tvm ms':>8} {'ours1/ort1':>10} {'ours2/ort2':>10} {'ours2/tvm':>9} {'ours2/ours1':>11}")
    pacing = {"block": 1, "settle_s": 0.0} if args.busy else {}
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        for name in args.models:
            model = zoo_model(name, logits=False) if name in ZOO else ARCHITECTURES[name]()
            feeds = zoo_input(model)
            if args.int8:
                from crosscompile.quantizer import quantize_model
                quantized = os.path.join(tmp, f"{name}-int8.onnx")
                quantize_model(model, quantized, random=4)
                model = onnx.load(quantized)
            started = time.perf_counter()
            lib = crosscompile.build(model, target=target)
            compile_s = time.perf_counter() - started
            path = lib.export_library(os.path.join(tmp, f"{name}.so"))
            ours, peers = [float("nan")] * 2, [float("nan")] * 2
            # Every thread count of ours and onnxruntime in turn, in one
            # window of load, so that ours2/ours1 compares runs under the
            # same load as ours2/ort2 does.
            modules = [minirt.load(path, threads=threads) for threads in thread_counts]
            sessions = [ort_session(model, threads) for threads in thread_counts]
            fns = []
            for module, session in zip(modules, sessions):
                fns += [lambda module=module: module.run(feeds), lambda session=session: session.run(None, feeds)]
            with CompetingLoad(args.busy):
                medians = interleaved_medians(fns, args.repeat, **pacing,
                                                  clock=time.thread_time if args.cpu_time else time.perf_counter)
            for i, threads in enumerate(thread_counts):
                ours[threads - 1], peers[threads - 1] = medians[2 * i], medians[2 * i + 1]
            for module in modules:
                module.close()
            tvm_s = float("nan")
            if use_tvm:
                tvm_s = median_seconds(tvm_runner(model, feeds), 1)
            print(f"{name:14} {compile_s:9.1f} {ours[0] * 1e3:8.1f} {ours[1] * 1e3:8.1f} {peers[0] * 1e3:8.1f} "
                  f"{peers[1] * 1e3:8.1f} {tvm_s * 1e3:8.0f} {ours[0] / peers[0]:10.2f} {ours[1] / peers[1]:10.2f} "
                  f"{ours[1] / tvm_s:9.3f} {ours[1] / ours[0]:11.2f}  load {os.getloadavg()[0]:.2f}", flush=True)
        if args.no_convs:
            return 0

        clock, peak = peak_gflops(cores, args.flop_per_cycle, args.ghz)
        print(f"\nconvolution GFLOP/s, 1 thread; machine peak {peak:.0f} GFLOP/s "
              f"({cores} cores x {clock:.2f} GHz x {args.flop_per_cycle} flop/cycle), "
              f"one core {peak / cores:.0f}")
        print(f"{'input':>18} {'weight':>18} {'ours':>7} {'ort1':>7} {'ours/ort1':>9} {'ours % core peak':>16}")
        for x_shape, w_shape, pad in CONV_SHAPES:
            model = conv_model(x_shape, w_shape, pad)
            feeds = {"x": np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)}
            lib = crosscompile.build(model, target=target)
            module = minirt.load(lib.export_library(os.path.join(tmp, f"conv{len(os.listdir(tmp))}.so")),
                                 threads=1)
            session = ort_session(model, 1)
            ours, peer = interleaved_medians([lambda: module.run(feeds), lambda: session.run(None, feeds)],
                                             args.repeat)
            out_pixels = np.prod(module.run(feeds)[0].shape[2:])
            flop = 2 * np.prod(w_shape) * out_pixels
            print(f"{str(x_shape):>18} {str(w_shape):>18} {flop / ours / 1e9:7.1f} {flop / peer / 1e9:7.1f} "
                  f"{ours / peer:9.2f} {100 * flop / ours / 1e9 / (peak / cores):15.0f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
