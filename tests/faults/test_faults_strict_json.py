"""The run's files are strict JSON: finite losses near the float64 limit are averaged without
overflow, and a value that is not finite all the same is logged, counted and left out, never
written as ``Infinity`` or ``NaN`` (which no strict JSON reader accepts)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from fault_setup import run_app, set_metric

from fedshard.app.results import RunRecorder
from fedshard.server.metrics import weighted_means


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_train_losses_of_1_7e308_give_a_finite_mean_and_strict_json(tmp_path: Path) -> None:
    huge = {n: set_metric("train-loss", 1.7e308) for n in (1000, 1001, 1002)}
    run_app(tmp_path, {"eval-every": 0}, tamper=huge)
    run = tmp_path / "out/run"
    rows = [_strict(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train-loss"] for r in rows[1:]] == [1.7e308, 1.7e308]
    assert [r["client/train-loss"] for r in rows[1:]] == [1.7e308, 1.7e308]
    _strict((run / "summary.json").read_text())
    _strict((run / "config.json").read_text())


def test_weighted_means_do_not_overflow_where_the_mean_is_finite() -> None:
    rows = [(3.0, {"x": 1.7e308}), (1.0, {"x": -1.0e308}), (2**53, {"y": 1e308}),
            (1.0, {"y": 1e308})]
    out = weighted_means(rows, ["x", "y"])
    assert out["x"] == pytest.approx((3 * 1.7 - 1.0) / 4 * 1e308)
    assert out["y"] == pytest.approx(1e308)
    # the plain sum where it does not overflow: bit for bit what it always was
    small = [(3.0, {"x": 0.1}), (7.0, {"x": 0.3})]
    assert weighted_means(small, ["x"])["x"] == (3.0 * 0.1 + 7.0 * 0.3) / 10.0


def test_a_non_finite_metric_is_logged_counted_and_never_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    with RunRecorder(tmp_path / "run", {"lr": 0.1}, 2) as recorder:
        recorder.record_round(1, {"test-loss": math.inf, "test-accuracy": math.nan,
                                  "train-loss": 0.5})
        recorder.record_round(2, {"test-accuracy": 0.5})
        summary = recorder.finish({})
    rows = [_strict(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert "test-loss" not in rows[0] and "test-accuracy" not in rows[0]
    assert rows[0]["train-loss"] == 0.5 and rows[0]["non-finite-metrics"] == 2.0
    assert summary["best-test-accuracy"] == 0.5
    _strict((tmp_path / "run/summary.json").read_text())
    assert any(r.levelno == logging.WARNING and "Round 1: test-accuracy=nan, test-loss=inf "
               "are not finite" in r.getMessage() for r in caplog.records)
