"""Timing a loaded module on the board itself.

The loop follows the usual time-evaluator rules: each of ``repeat`` samples
times ``number`` back-to-back runs and records their mean; with
``min_repeat_ms`` the number of runs grows until one sample lasts at least that
long, so that very fast modules are not measured at the clock's resolution.

>>> m = minirt.load("net.so")                                   # doctest: +SKIP
>>> samples, number = time_module(m, {"input": x}, number=10, repeat=3)  # doctest: +SKIP
>>> summarize(samples)["median"]                                 # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import math
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

from .errors import RunError
from .module import RUN_ERRORS, Module, _aligned_address

# Growing `number` stops here even if a run is too fast to reach min_repeat_ms.
MAX_NUMBER = 1 << 30


def bound_call(module: Module, inputs) -> Callable[[], None]:
    """A no-argument function that runs ``module`` on ``inputs`` with buffers made once.

    Module.run checks inputs and allocates outputs on every call; the timing loop
    must measure the module, not that bookkeeping. Each call takes the path
    run() takes: over ``module.threads`` threads where the module has
    tether_run_parallel, so a benchmark times what run() does.
    """
    arrays = module._check_inputs(inputs)
    outputs = module._new_outputs(arrays)
    dims = module._dims(arrays)
    workspace = module._new_workspace()
    in_ptrs = (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
    out_ptrs = (ctypes.c_void_p * max(len(outputs), 1))(*[a.ctypes.data for a in outputs])
    ws = _aligned_address(workspace)
    run = module._call
    keep = (arrays, outputs, workspace, dims)  # the pointers above point into these

    def call():
        status = run(in_ptrs, out_ptrs, ws, dims)
        if status != 0:
            raise RunError(f"{module.path}: tether_run returned {status} "
                           f"({RUN_ERRORS.get(status, 'unknown error code')})")
        return keep

    return call


def time_calls(call: Callable[[], object], number: int = 10, repeat: int = 3,
               min_repeat_ms: float = 0.0, cooldown_ms: float = 0.0) -> Tuple[List[float], int]:
    """Seconds per call, one sample per repeat, and the number of calls each sample averaged."""
    if number < 1 or repeat < 1:
        raise ValueError(f"number ({number}) and repeat ({repeat}) must be at least 1")
    if min_repeat_ms < 0 or cooldown_ms < 0:
        raise ValueError("min_repeat_ms and cooldown_ms must not be negative")
    clock = time.perf_counter
    call()  # warm caches and page in the parameters before the first sample
    if min_repeat_ms > 0:
        while number < MAX_NUMBER:
            start = clock()
            for _ in range(number):
                call()
            elapsed_ms = (clock() - start) * 1e3
            if elapsed_ms >= min_repeat_ms:
                break
            # Aim a little past the target so one more round usually suffices.
            scale = 1.2 * min_repeat_ms / max(elapsed_ms, 1e-3)
            number = min(MAX_NUMBER, max(number * 2, int(math.ceil(number * scale))))
    samples = []
    for i in range(repeat):
        if cooldown_ms and i:
            time.sleep(cooldown_ms / 1e3)
        start = clock()
        for _ in range(number):
            call()
        samples.append((clock() - start) / number)
    return samples, number


def time_module(module: Module, inputs, **options) -> Tuple[List[float], int]:
    """``time_calls`` on one run of ``module`` with ``inputs``."""
    return time_calls(bound_call(module, inputs), **options)


def summarize(samples: List[float]) -> Dict[str, float]:
    """mean, median, std, min, max, p90 and p99 of ``samples``.

    >>> summarize([1.0, 2.0, 3.0])["median"]
    2.0
    """
    a = np.asarray(samples, dtype=np.float64)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "min": float(a.min()), "max": float(a.max()),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}
