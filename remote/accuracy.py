"""How far a board's outputs are from a reference's: the measures of ``tether check``.

Per output, over every input set: the largest absolute error, that error
relative to the reference's largest magnitude, the lowest cosine similarity,
for a classifier's scores (one row of classes per batch item) the share of
rows whose top-1 class agrees and the mean share of the reference's top-k
found in the board's top-k, and for an image (N, C, H, W with 1 to 4 channels)
the lowest PSNR over the reference's range. Then the verdict against the
tolerances.

    >>> m = measure("y", [np.array([[0.1, 0.7, 0.2]])], [np.array([[0.1, 0.7, 0.2]])])
    >>> m["max_abs"], m["top1"], verdict(m, Tolerances())[0]
    (0.0, 1.0, True)

Pure functions over numpy arrays.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np


@dataclass
class Tolerances:
    atol: float = 1e-4          # max |board - reference| <= atol + rtol * max |reference|
    rtol: float = 1e-3
    min_cosine: float = 0.9999
    min_top1: float = 1.0       # share of classifier rows whose top class agrees
    top_k: int = 5
    min_psnr: float = 40.0      # dB, images only

    def as_dict(self) -> dict:
        return asdict(self)


def scores_rows(array: np.ndarray) -> Optional[np.ndarray]:
    """A classifier's scores as (rows, classes), or None when the output is not
    one: floats whose last non-unit axis is the classes, one row per batch item."""
    if array.dtype.kind != "f" or array.ndim == 0:
        return None
    shape = [d for d in array.shape if d > 1]
    if len(shape) == 1:
        return array.reshape(1, -1)
    if array.ndim == 2 and array.shape[1] > 1:
        return array
    return None


def is_image(array: np.ndarray) -> bool:
    return (array.ndim == 4 and 1 <= array.shape[1] <= 4 and array.shape[2] >= 8
            and array.shape[3] >= 8)


def measure(name: str, board: Sequence[np.ndarray], reference: Sequence[np.ndarray],
            k: int = 5) -> dict:
    """The measures of one output over its input sets (lists of arrays, one per set)."""
    out = {"name": name, "shape": list(np.shape(reference[0])), "max_abs": 0.0,
           "max_rel": 0.0, "cosine": 1.0, "top1": None, "topk": None, "k": None, "psnr": None}
    top1, topk, psnr = [], [], []
    for got, want in zip(board, reference):
        got = np.asarray(got, dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            raise ValueError(f"output {name}: the board gave shape {list(got.shape)}, the "
                             f"reference {list(want.shape)}")
        diff = np.abs(got - want)
        largest = float(np.max(np.abs(want))) if want.size else 0.0
        worst = float(diff.max()) if diff.size else 0.0
        out["max_abs"] = max(out["max_abs"], worst)
        out["max_rel"] = max(out["max_rel"], worst / largest if largest else
                             (0.0 if worst == 0 else float("inf")))
        norms = float(np.linalg.norm(got) * np.linalg.norm(want))
        cosine = float(np.dot(got.ravel(), want.ravel()) / norms) if norms else \
            (1.0 if worst == 0 else 0.0)
        out["cosine"] = min(out["cosine"], cosine)
        rows_got, rows_want = scores_rows(got), scores_rows(want)
        if rows_want is not None and rows_got is not None:
            kk = min(k, rows_want.shape[1])
            top1 += list(rows_got.argmax(axis=1) == rows_want.argmax(axis=1))
            for g, w in zip(rows_got, rows_want):
                topk.append(len(set(np.argsort(g)[::-1][:kk]) & set(np.argsort(w)[::-1][:kk]))
                            / kk)
            out["k"] = kk
        if is_image(want):
            rmse = float(np.sqrt(np.mean((got - want) ** 2)))
            peak = float(want.max() - want.min()) or 1.0
            psnr.append(float("inf") if rmse == 0 else 20 * np.log10(peak / rmse))
    if top1:
        out["top1"] = float(np.mean(top1))
        out["topk"] = float(np.mean(topk))
    if psnr:
        out["psnr"] = min(psnr)
    out["reference_max"] = max(float(np.max(np.abs(np.asarray(w)))) if np.size(w) else 0.0
                               for w in reference)
    return out


def verdict(m: dict, tol: Tolerances) -> Tuple[bool, List[str]]:
    """Whether one output's measures are within the tolerances, and what is not."""
    why = []
    allowed = tol.atol + tol.rtol * m["reference_max"]
    if not m["max_abs"] <= allowed:
        why.append(f"max abs error {m['max_abs']:.3g} > {allowed:.3g} "
                   f"(atol {tol.atol:g} + rtol {tol.rtol:g} x {m['reference_max']:.3g})")
    if not m["cosine"] >= tol.min_cosine:
        why.append(f"cosine {m['cosine']:.6f} < {tol.min_cosine:g}")
    if m["top1"] is not None and not m["top1"] >= tol.min_top1:
        why.append(f"top-1 agreement {m['top1']:.1%} < {tol.min_top1:.1%}")
    if m["psnr"] is not None and not m["psnr"] >= tol.min_psnr:
        why.append(f"PSNR {m['psnr']:.1f} dB < {tol.min_psnr:g} dB")
    return not why, why
