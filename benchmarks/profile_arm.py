"""Where a compiled module spends its guest instructions on an emulated ARM
core: one inference, counted by kernel (each node kernel is a function of
the module; nodes of one shape share one).

    python benchmarks/profile_arm.py resnet50 [--int8] [--target rasp5] [--top 30]
    python benchmarks/profile_arm.py model.onnx --target rasp4b64

Models by bench_arm.py's names (quantized with --int8 as bench_arm.py
quantizes them) or an ONNX file. The counting qemu plugin
(deploy_recipes/guest_instructions.c, with its blocks= argument) counts the
instructions of each translated block by its guest address while the root filesystem's python3 runs the module once
(as deploy_recipes/instruction_count.py runs it, same input); the addresses
inside the module are mapped to its symbols (an ARM-capable nm: llvm-nm or
binutils' aarch64-linux-gnu-nm). What runs outside the module (Python,
numpy, loading) is printed as one line. A count, not a time: use it to see
which kernels to work on, then count the whole model with bench_arm.py.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

import onnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crosscompile  # noqa: E402
from benchmarks.bench_arm import MODELS, RELEASE, model_inputs  # noqa: E402
from crosscompile.quantizer import quantize_model  # noqa: E402
from crosscompile.target import resolve_target  # noqa: E402
from deploy_recipes import instruction_count  # noqa: E402
from deploy_recipes.devicecode import PROJECT_ROOT  # noqa: E402

# Runs in the guest: module, file for /proc/self/maps, then NAME=DxDxD per
# input (the values instruction_count's guest script feeds).
GUEST_SCRIPT = r'''
import sys
import numpy as np
import minirt

path, maps = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
feeds = {}
for spec in sys.argv[3:]:
    name, dims = spec.rsplit("=", 1)
    feeds[name] = rng.standard_normal([int(d) for d in dims.split("x")]).astype(np.float32)
module = minirt.load(path, threads=1)
with open("/proc/self/maps") as source, open(maps, "w") as copy:
    copy.write(source.read())
module.run(feeds)
'''


def symbols(path: str) -> list:
    """(address, name) of the module's functions, by address."""
    nm = shutil.which("llvm-nm") or shutil.which("aarch64-linux-gnu-nm")
    if nm is None:
        sys.exit("mapping addresses to kernels needs an ARM-capable nm: apt-get install llvm "
                 "(or binutils-aarch64-linux-gnu)")
    listing = subprocess.run([nm, "-n", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return [(int(address, 16), name) for address, kind, name in
            (line.split()[:3] for line in listing.splitlines() if len(line.split()) >= 3) if kind in "tT"]


def module_range(maps: str, path: str) -> "tuple[int, int]":
    """(load base, end) of the module's mappings in the guest."""
    rows = [line.split() for line in open(maps) if line.rstrip().endswith(os.path.abspath(path))]
    if not rows:
        sys.exit(f"{path} is not in the guest's memory map")
    spans = [tuple(int(v, 16) for v in row[0].split("-")) + (int(row[2], 16),) for row in rows]
    base = min(start - offset for start, _, offset in spans)
    return base, max(end for _, end, _ in spans)


def profile(path: str, inputs: dict, arch: str, cpu: str) -> "tuple[collections.Counter, int]":
    """({kernel symbol: instructions}, instructions outside the module) of one inference."""
    counter = instruction_count._Counter(RELEASE, arch, cpu, [PROJECT_ROOT], fake_cpuinfo=False)
    with tempfile.TemporaryDirectory(prefix="tether-profile-") as folder:
        out = os.path.join(folder, "blocks.txt")
        # The plugin's arguments follow its path, comma-separated: blocks= before out=.
        plugin = f"{instruction_count._build_plugin(folder)},blocks={out}"
        script, maps = os.path.join(folder, "guest.py"), os.path.join(folder, "maps.txt")
        with open(script, "w") as f:
            f.write(GUEST_SCRIPT)
        argv = ["setarch", "-R", *counter._python(plugin, os.path.join(folder, "total.txt")), script, os.path.abspath(path), maps,
                *instruction_count._shape_args(inputs)]
        run = subprocess.run(argv, env=counter._env(folder), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
        if run.returncode != 0:
            sys.exit(f"the guest run failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        base, end = module_range(maps, path)
        table = symbols(path)
        starts = [address for address, _ in table]
        per, outside = collections.Counter(), 0
        for line in open(out):
            address, count = (int(v, radix) for v, radix in zip(line.split(), (16, 10)))
            if base <= address < end and starts and address - base >= starts[0]:
                per[table[bisect.bisect_right(starts, address - base) - 1][1]] += count
            else:
                outside += count
    return per, outside


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help=f"one of {', '.join(MODELS)}, or an .onnx file")
    parser.add_argument("--target", default="rasp5", help="an ARM preset (default rasp5)")
    parser.add_argument("--int8", action="store_true", help="quantize the model first (QDQ, as bench_arm.py)")
    parser.add_argument("--top", type=int, default=30, help="kernels listed, largest first")
    args = parser.parse_args()
    target = resolve_target(args.target)
    arch, cpu = instruction_count.emulated_core(target)
    with tempfile.TemporaryDirectory(prefix="tether-profile-") as folder:
        model = onnx.load(args.model) if args.model.endswith(".onnx") else MODELS[args.model]()
        if args.int8:
            path = os.path.join(folder, "int8.onnx")
            quantize_model(model, path, random=4)
            model = onnx.load(path)
        module = crosscompile.build(model, target=args.target).export_library(os.path.join(folder, "net.so"))
        per, outside = profile(module, model_inputs(model), arch, cpu)
    total = sum(per.values())
    by_op = collections.Counter()
    for name, count in per.items():
        by_op[re.sub(r"^node\d+x?\d*_", "", name)] += count
    print(f"{args.model} on {cpu} ({args.target}): {total / 1e6:.2f} M instructions in the module, "
          f"{outside / 1e6:.2f} M outside it (Python, numpy, loading)")
    for op, count in by_op.most_common():
        print(f"{count / 1e6:10.2f} M  {count / total:6.1%}  {op}")
    print("kernels:")
    for name, count in per.most_common(args.top):
        print(f"{count / 1e6:10.2f} M  {count / total:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
