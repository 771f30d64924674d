"""Rounds that train nothing: counted, and a run in which no round trained
ends loudly (an ERROR from the strategy, a RuntimeError from run_server after the results)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fault_setup import grid, initial, one_round, run_app, strategy


def test_a_run_whose_nodes_never_reply_raises_after_writing_results(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        with pytest.raises(RuntimeError, match=r"No round trained: none of the 2 round\(s\)"):
            run_app(tmp_path, {}, silent={1000, 1001, 1002})
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    rows = [json.loads(x) for x in (tmp_path / "out/run/metrics.jsonl").read_text().splitlines()]
    assert [r.get("rounds-trained") for r in rows[1:]] == [0.0, 0.0]
    assert all(r["replies-missing"] == 3.0 for r in rows[1:])
    assert (tmp_path / "out/run/model.pt").exists()
    assert any(r.levelname == "ERROR" and "No round trained" in r.getMessage()
               for r in caplog.records)


def test_rounds_trained_counts_only_rounds_that_changed_the_model() -> None:
    s, g = strategy(), grid()
    g.silent.update(g.contexts)
    _, m1 = one_round(s, g, 1)
    g.silent.clear()
    new, m2 = one_round(s, g, 2, initial())
    assert new is not None and (m1["rounds-trained"], m2["rounds-trained"]) == (0.0, 1.0)
    assert s.rounds_trained == 1
