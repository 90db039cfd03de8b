"""Is a model slower than its baseline? Decided on the raw samples, with statistics.

Each benchmark sample is one per-run time. A comparison reports the ratio of
the medians (new / baseline) with a bootstrap confidence interval, and the
one-sided Mann-Whitney U test of "the new runs take longer than the
baseline's". The run is a regression when all three agree: the test is
significant (p below ``alpha``), the ratio of medians is past the threshold,
and so is the interval's lower end past half of it. On synthetic samples with
5 % noise and one run in ten slowed by 20 to 100 % by other work (the shape of
a shared CI machine), 20 samples a side catch a 10 % slowdown against a 5 %
threshold 89 % of the time and 30 samples 96 %, and no identical pair of
500 alarmed (tests/test_regression.py keeps the rule honest).

Samples taken at another time share neither the machine's load nor its
clock: a shared machine swings by more than 10 % between runs, and no test on
two runs' samples can tell that from a slower module. ``compare_rounds`` is
for a baseline measured in the same session, interleaved with the new module
in rounds (one sample of each per round, in alternating order): each round's
ratio new / baseline cancels what the machine was doing in that round, and
the verdict comes from those ratios alone (their median with a bootstrap
interval over the rounds, and the one-sided sign test: in how many rounds was
the new module the slower one).

    >>> c = compare([1.10, 1.11, 1.09] * 10, [1.0, 1.01, 0.99] * 10, max_regression=0.05)
    >>> c.regression, round(c.ratio, 2)
    (True, 1.1)

Pure functions over lists of numbers: no I/O, no clock.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

ALPHA = 0.01
CONFIDENCE = 0.95
RESAMPLES = 4000


@dataclass
class Comparison:
    ratio: float            # median(new) / median(baseline)
    ci_low: float           # bootstrap confidence interval of the ratio
    ci_high: float
    confidence: float
    p_value: float          # Mann-Whitney U, one-sided: new slower than baseline
    max_regression: float
    regression: bool
    new_samples: int
    baseline_samples: int
    # With three or more baseline runs: the highest median a run of the
    # baseline's is expected to reach (one-sided prediction interval of the
    # runs' medians), and how many runs it came from; else None and 1.
    run_limit: Optional[float] = None
    baseline_runs: int = 1
    # "samples": two sets of samples compared (compare); "interleaved": per-round
    # ratios of samples taken in turns in one session (compare_rounds).
    method: str = "samples"

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        verdict = (f"SLOWER by more than {self.max_regression:.0%}" if self.regression
                   else f"within {self.max_regression:.0%}")
        if self.method == "interleaved":
            return (f"median per-round ratio {self.ratio:.3f} [{self.ci_low:.3f}, "
                    f"{self.ci_high:.3f}] ({self.confidence:.0%} CI), sign test "
                    f"p={self.p_value:.2g} ({self.new_samples} interleaved rounds): {verdict}")
        runs = (f", above the {self.baseline_runs} baseline runs' limit "
                f"{self.run_limit * 1e3:.4g} ms" if self.run_limit is not None and
                self.regression else
                f", within the {self.baseline_runs} baseline runs' limit "
                f"{self.run_limit * 1e3:.4g} ms" if self.run_limit is not None else "")
        return (f"median ratio {self.ratio:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}] "
                f"({self.confidence:.0%} CI), Mann-Whitney p={self.p_value:.2g} "
                f"({self.new_samples} vs {self.baseline_samples} samples{runs}): {verdict}")


def parse_threshold(text: str) -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"--max-regression {text!r}: give a percentage such as 5%") from None
    if not 0 <= value < 10:
        raise ValueError(f"--max-regression {text!r}: give a percentage such as 5%")
    return value


def _clean(samples: Sequence[float], what: str) -> np.ndarray:
    values = np.asarray(list(samples), dtype=np.float64)
    if values.size < 2 or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"the {what} needs at least 2 positive samples, got {values.size}")
    return values


def ratio_interval(new: np.ndarray, base: np.ndarray, confidence: float = CONFIDENCE,
                   resamples: int = RESAMPLES, seed: int = 0):
    """Percentile bootstrap interval of median(new) / median(base)."""
    rng = np.random.default_rng(seed)
    new_medians = np.median(new[rng.integers(0, new.size, (resamples, new.size))], axis=1)
    base_medians = np.median(base[rng.integers(0, base.size, (resamples, base.size))], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(new_medians / base_medians, [tail, 100 - tail])
    return float(low), float(high)


def run_limit(runs: Sequence[Sequence[float]], alpha: float = ALPHA) -> Optional[float]:
    """The median a further run of the baseline stays under with probability
    1 - alpha, from the spread of its runs' medians (log scale, Student's t
    prediction interval); None with fewer than three runs.

    Samples of one run share the machine's state of that moment; a machine
    that is busier an hour later moves a whole run. Only the spread between
    runs shows how far that goes."""
    from scipy.stats import t

    medians = np.log([np.median(run) for run in runs if len(run)])
    if medians.size < 3:
        return None
    spread = float(np.std(medians, ddof=1))
    return float(np.exp(medians.mean() + t.ppf(1 - alpha, medians.size - 1) * spread
                        * np.sqrt(1 + 1 / medians.size)))


def compare(new: Sequence[float], baseline: Sequence[float], max_regression: float = 0.05,
            alpha: float = ALPHA, confidence: float = CONFIDENCE,
            baseline_runs: Optional[Sequence[Sequence[float]]] = None) -> Comparison:
    """The new samples against the baseline's (both per-run times).
    ``baseline_runs``, the baseline's samples run by run, adds the between-run
    check (run_limit) when there are three or more runs."""
    from scipy.stats import mannwhitneyu

    new_a, base_a = _clean(new, "new run"), _clean(baseline, "baseline")
    ratio = float(np.median(new_a) / np.median(base_a))
    low, high = ratio_interval(new_a, base_a, confidence)
    p_value = float(mannwhitneyu(new_a, base_a, alternative="greater").pvalue)
    slower = (p_value < alpha and ratio > 1 + max_regression
              and low > 1 + max_regression / 2)
    limit = run_limit(baseline_runs or [], alpha)
    if limit is not None:
        slower = slower and float(np.median(new_a)) > limit
    return Comparison(ratio=ratio, ci_low=low, ci_high=high, confidence=confidence,
                      p_value=p_value, max_regression=max_regression, regression=bool(slower),
                      new_samples=int(new_a.size), baseline_samples=int(base_a.size),
                      run_limit=limit, baseline_runs=len(baseline_runs or []) or 1)


def compare_rounds(new: Sequence[float], baseline: Sequence[float], max_regression: float = 0.05,
                   alpha: float = ALPHA, confidence: float = CONFIDENCE,
                   resamples: int = RESAMPLES, seed: int = 0) -> Comparison:
    """New and baseline samples taken in turns, ``new[i]`` and ``baseline[i]``
    in round i: a regression when the one-sided sign test on the rounds'
    ratios is significant (p below ``alpha``: the new module was the slower
    in more rounds than chance gives), their median ratio is past the
    threshold and the bootstrap interval's lower end past half of it (the
    rule of ``compare``, on ratios the machine's drift cancels from).

    The sign test, not Wilcoxon's signed-rank test: on a busy machine a few
    rounds in which one module was held up by other work give ratios of 2 or
    0.3, and signed ranks let those few outweigh the many ordinary rounds
    (measured: a module 6 % slower in its median round, p=0.6); each round is
    one vote in the sign test.

    >>> c = compare_rounds([1.1, 2.2, 1.21, 3.3] * 5, [1.0, 2.0, 1.1, 3.0] * 5)
    >>> c.regression, round(c.ratio, 2)
    (True, 1.1)
    """
    from scipy.stats import binomtest

    new_a, base_a = _clean(new, "new module"), _clean(baseline, "baseline module")
    if new_a.size != base_a.size:
        raise ValueError(f"interleaved rounds need one sample of each module per round, got "
                         f"{new_a.size} new and {base_a.size} baseline samples")
    logs = np.log(new_a / base_a)
    ratio = float(np.exp(np.median(logs)))
    rng = np.random.default_rng(seed)
    medians = np.median(logs[rng.integers(0, logs.size, (resamples, logs.size))], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.exp(np.percentile(medians, [tail, 100 - tail]))
    # Rounds timed alike to the clock's resolution say nothing either way; with
    # every round so, there is nothing to test.
    slower_rounds, voting = int(np.sum(logs > 0)), int(np.sum(logs != 0))
    p_value = (float(binomtest(slower_rounds, voting, alternative="greater").pvalue) if voting
               else 1.0)
    slower = (p_value < alpha and ratio > 1 + max_regression
              and low > 1 + max_regression / 2)
    return Comparison(ratio=ratio, ci_low=float(low), ci_high=float(high),
                      confidence=confidence, p_value=p_value, max_regression=max_regression,
                      regression=bool(slower), new_samples=int(new_a.size),
                      baseline_samples=int(base_a.size), method="interleaved")


def mark_regressions(records: List[dict], max_regression: float = 0.05) -> Dict[int, dict]:
    """For benchmark records of one model and key, oldest first: each one that
    is a regression against the record before it on the same board
    ({record id: comparison as a dict})."""
    last: Dict[str, dict] = {}
    marked = {}
    for record in records:
        board = record.get("device_id") or ""
        before = last.get(board)
        last[board] = record
        if before is None:
            continue
        try:
            found = compare(record["samples_s"], before["samples_s"], max_regression)
        except ValueError:
            continue
        if found.regression:
            marked[record["id"]] = {**found.as_dict(), "baseline_id": before["id"]}
    return marked
