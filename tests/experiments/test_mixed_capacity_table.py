"""The mixed-capacity table's statistics (benchmarks/mixed_capacity.py) against sums written
out by hand: each cell's mean and std over seeds, and the paired difference to the column's
best baseline seed by seed."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mixed_capacity

COLUMN = "20 % r = 1 / 80 % r = 0.1"


def test_the_paired_difference_is_taken_seed_by_seed_against_the_best_baseline() -> None:
    cells = {
        ("Collective", COLUMN): {"full": {0: 0.80, 1: 0.70, 2: 0.75},
                                 "r0.1": {0: 0.60, 1: 0.50, 2: 0.55}},
        ("HeteroFL", COLUMN): {"full": {0: 0.78, 1: 0.66, 2: 0.74},
                               "r0.1": {0: 0.70, 1: 0.61, 2: 0.66}},
        ("Small model", COLUMN): {"full": {0: 0.77, 1: 0.69, 2: 0.70},
                                  "r0.1": {0: 0.77, 1: 0.69, 2: 0.70}},
    }
    stats = mixed_capacity.statistics_of(cells)[COLUMN]
    # at full size the best baseline by mean is HeteroFL (0.7267 > 0.72)
    full = stats["full"]["Collective"]
    assert full["mean"] == pytest.approx(0.75)
    assert full["std"] == pytest.approx(0.05)
    d = full["vs-best-baseline"]
    assert d["baseline"] == "HeteroFL"
    assert d["mean"] == pytest.approx((0.02 + 0.04 + 0.01) / 3)
    assert d["std"] == pytest.approx(statistics.stdev([0.02, 0.04, 0.01]))
    assert d["beyond-spread"] is True  # 0.0233 ± 0.0153
    # the stated test: t(0.975, 2) = 4.303, so the interval is ± 4.303 · 0.0153 / √3 = 0.038
    half = mixed_capacity.ci95_half(d["std"], d["n"])
    assert half == pytest.approx(4.303 * statistics.stdev([0.02, 0.04, 0.01]) / 3 ** 0.5)
    assert abs(d["mean"]) < half
    # at r = 0.1 the small model is the best baseline; Collective's deficit is steady
    d = stats["r0.1"]["Collective"]["vs-best-baseline"]
    assert d["baseline"] == "Small model"
    assert d["mean"] == pytest.approx((-0.17 - 0.19 - 0.15) / 3)
    assert d["beyond-spread"] is True  # -0.17 ± 0.02 (n = 3): its t interval excludes 0 too
    assert abs(d["mean"]) > mixed_capacity.ci95_half(d["std"], d["n"])
    table = mixed_capacity.markdown({"statistics": mixed_capacity.statistics_of(cells)})
    assert "(-17.0*)" in table and "(+2.3)" in table  # the mark is the t test's
    # the best baseline is not compared with itself; another baseline is
    assert "vs-best-baseline" not in stats["r0.1"]["Small model"]
    assert stats["r0.1"]["HeteroFL"]["vs-best-baseline"]["baseline"] == "Small model"


def test_a_difference_inside_the_seeds_spread_is_said_so() -> None:
    cells = {("Unbiased", COLUMN): {"full": {0: 0.70, 1: 0.80}},
             ("HeteroFL", COLUMN): {"full": {0: 0.75, 1: 0.74}}}
    d = mixed_capacity.statistics_of(cells)[COLUMN]["full"]["Unbiased"]["vs-best-baseline"]
    assert d["mean"] == pytest.approx(0.005)  # (-0.05 + 0.06) / 2
    assert d["beyond-spread"] is False
    table = mixed_capacity.markdown({"statistics": mixed_capacity.statistics_of(cells)})
    assert "| Unbiased | 75.0 ± 7.1 (+0.5) |" in table


def test_a_block_is_headed_by_its_most_seeds_and_a_tie_by_the_lowest() -> None:
    """Two cells with as many seeds but not the same ones: the block names the lower pair in
    every process (not whichever a set happens to iterate first) and the other cell its own."""
    cells = {("Unbiased", COLUMN): {"full": {0: 0.70, 2: 0.80}},
             ("HeteroFL", COLUMN): {"full": {0: 0.75, 1: 0.74}}}
    table = mixed_capacity.markdown({"statistics": mixed_capacity.statistics_of(cells)})
    assert "mean ± std over seeds 0 and 1)" in table
    assert "| Unbiased | 75.0 ± 7.1 (-5.0) [seeds 0 and 2] |" in table  # paired on seed 0


@pytest.mark.parametrize(("summary", "runner", "counted"), [
    ("finished", "finished", True),
    ("finished", "interrupted", False),  # the runner was stopped after the app finished
    ("finished", None, False),  # no runner record: not a run the runner made
    ("failed", "failed", False),
])
def test_a_run_counts_only_when_the_app_and_the_runner_both_recorded_it_finished(
        tmp_path: Path, summary: str, runner: str | None, counted: bool) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"status": summary}))
    if runner is not None:
        (tmp_path / "runner.json").write_text(json.dumps({"status": runner}))
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"round": 59}) + "\n" + json.dumps({"round": 60, "test-accuracy": 0.5}) + "\n")
    row = mixed_capacity.final_row(tmp_path)
    assert (row == {"round": 60, "test-accuracy": 0.5}) if counted else row is None


def test_the_t_quantiles_are_students() -> None:
    stats = pytest.importorskip("scipy.stats")
    for n in (2, 3, 4, 6, 11, 31, 60, 200):
        half = mixed_capacity.ci95_half(1.0, n)
        assert half == pytest.approx(stats.t.ppf(0.975, n - 1) / n ** 0.5, rel=3e-3)
    assert mixed_capacity.ci95_half(None, 3) is None and mixed_capacity.ci95_half(1.0, 1) is None
