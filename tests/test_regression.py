"""The regression rule of `tether bench --baseline` on synthetic samples: a planted
10 % slowdown is caught, identical runs do not alarm, whatever the noise's seed."""
import numpy as np
import pytest

from remote.regression import compare, compare_rounds, mark_regressions, parse_threshold

pytest.importorskip("scipy")


def shared_machine(rng, n, scale, noise=0.05):
    """Per-run times as a busy machine gives them: lognormal noise, and one run in
    ten slowed by 20 to 100 % by other work."""
    x = scale * rng.lognormal(0.0, noise, n)
    hit = rng.random(n) < 0.1
    x[hit] *= rng.uniform(1.2, 2.0, hit.sum())
    return x


def test_a_planted_ten_percent_slowdown_is_caught_and_identical_runs_do_not_alarm():
    rng = np.random.default_rng(20261126)
    caught = [compare(shared_machine(rng, 30, 1.10), shared_machine(rng, 30, 1.0)).regression
              for _ in range(40)]
    alarms = [compare(shared_machine(rng, 30, 1.0), shared_machine(rng, 30, 1.0)).regression
              for _ in range(40)]
    assert sum(caught) >= 36, sum(caught)
    assert sum(alarms) == 0, sum(alarms)
    # Ten re-runs of an unchanged module against one baseline: no alarm at all.
    baseline = shared_machine(rng, 30, 1.0)
    assert not any(compare(shared_machine(rng, 30, 1.0), baseline).regression
                   for _ in range(10))


def test_the_comparison_reports_the_ratio_with_its_interval():
    rng = np.random.default_rng(7)
    found = compare(shared_machine(rng, 30, 1.2, 0.02), shared_machine(rng, 30, 1.0, 0.02))
    assert found.regression
    assert found.ci_low <= found.ratio <= found.ci_high
    assert 1.12 < found.ratio < 1.28 and found.p_value < 1e-6
    assert "SLOWER by more than 5%" in found.text() and "95% CI" in found.text()
    faster = compare([0.9] * 5 + [0.91] * 5, [1.0] * 5 + [1.01] * 5)
    assert not faster.regression and faster.ratio < 1 and "within 5%" in faster.text()


def test_thresholds_and_bad_samples_are_named():
    assert parse_threshold("5%") == pytest.approx(0.05)
    assert parse_threshold("0.1") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="--max-regression 'fast'"):
        parse_threshold("fast")
    with pytest.raises(ValueError, match="the baseline needs at least 2 positive samples"):
        compare([1.0, 1.0], [1.0])


def test_each_record_is_marked_against_the_one_before_it_on_its_board():
    rng = np.random.default_rng(3)
    records = [{"id": i, "device_id": "k-1", "samples_s": list(shared_machine(rng, 30, s, 0.02))}
               for i, s in enumerate([1.0, 1.0, 1.2, 1.2, 1.0])]
    records.insert(3, {"id": 99, "device_id": "k-2", "samples_s": [5.0, 5.1, 5.0]})
    marked = mark_regressions(records)
    assert set(marked) == {2}
    assert marked[2]["baseline_id"] == 1 and marked[2]["ratio"] > 1.1


def test_a_machine_busier_between_runs_is_told_from_a_slower_module_by_the_baseline_runs():
    """Five baseline runs taken at different loads (medians 0.9 to 1.25): a new run
    at 1.2 is the machine, not the module; one at 2.2 is beyond what the runs reach
    (their spread puts the limit near 1.7)."""
    rng = np.random.default_rng(11)
    runs = [list(shared_machine(rng, 30, scale, 0.02)) for scale in (1.0, 0.9, 1.25, 1.05, 0.95)]
    first = runs[0]
    drifted = shared_machine(rng, 30, 1.2, 0.02)
    assert compare(drifted, first).regression            # one run cannot tell
    found = compare(drifted, [s for r in runs for s in r], baseline_runs=runs)
    assert not found.regression and found.baseline_runs == 5
    assert "within the 5 baseline runs' limit" in found.text()
    slower = compare(shared_machine(rng, 30, 2.2, 0.02), [s for r in runs for s in r],
                     baseline_runs=runs)
    assert slower.regression and 1.5 < slower.run_limit < 2.0


def drifting_rounds(rng, rounds, slowdown):
    """Samples of a baseline and a new module taken in turns on a machine whose
    speed swings from round to round (0.7x to 1.6x), with the noise and the
    slowed runs of shared_machine on top of each sample."""
    machine = rng.uniform(0.7, 1.6, rounds)
    return (machine * shared_machine(rng, rounds, slowdown),
            machine * shared_machine(rng, rounds, 1.0))


def test_interleaved_rounds_cancel_the_machine_s_drift():
    """Two sets of such samples cannot tell a 10 % slowdown (the swings hide it);
    their per-round ratios can, and identical modules never alarm."""
    rng = np.random.default_rng(20261127)
    caught = [compare_rounds(*drifting_rounds(rng, 30, 1.10)).regression for _ in range(40)]
    alarms = [compare_rounds(*drifting_rounds(rng, 30, 1.0)).regression for _ in range(40)]
    # (Over 200 draws 30 rounds catch 94 % of such slowdowns, 60 rounds 99.5 %;
    # 1 of 500 identical pairs alarmed at 30 rounds, none at 60.)
    assert sum(caught) >= 34, sum(caught)
    assert sum(alarms) == 0, sum(alarms)
    assert sum(compare(*drifting_rounds(rng, 30, 1.10)).regression for _ in range(40)) < 20
    found = compare_rounds(*drifting_rounds(rng, 30, 1.2))
    assert found.regression and found.ci_low <= found.ratio <= found.ci_high
    assert found.method == "interleaved" and 1.12 < found.ratio < 1.28
    assert "30 interleaved rounds): SLOWER by more than 5%" in found.text()


def test_interleaved_rounds_must_pair_up():
    with pytest.raises(ValueError, match="one sample of each module per round, got 3 new and 2"):
        compare_rounds([1.0, 1.0, 1.0], [1.0, 1.0])
    same = compare_rounds([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert not same.regression and same.p_value == 1.0 and same.ratio == 1.0
