"""Rounds that train nothing: counted, and a run in which no round trained
ends loudly (an ERROR from the strategy, a RuntimeError from run_server after the results)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fault_setup import grid, initial, one_round, run_app, strategy
from flwr.app import Message

from fedshard.server import StopRun


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
    summary = json.loads((tmp_path / "out/run/summary.json").read_text())
    assert summary["status"] == "failed" and "No round trained" in summary["failure"]


def test_rounds_trained_counts_only_rounds_that_changed_the_model() -> None:
    s, g = strategy(), grid()
    g.silent.update(g.contexts)
    _, m1 = one_round(s, g, 1)
    g.silent.clear()
    new, m2 = one_round(s, g, 2, initial())
    assert new is not None and (m1["rounds-trained"], m2["rounds-trained"]) == (0.0, 1.0)
    assert s.rounds_trained == 1


def test_a_run_whose_every_reply_is_one_error_stops_at_round_1_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ClientApp that loads the sent arrays into its dense model (no receive()) answers every
    round with the same error: the run stops after round 1 (not after the last), the error in
    full with the likely fix, and summary.json says the run failed and why."""
    reason = ("Error(s) in loading state_dict for Net:\n\tMissing key(s) in state_dict: "
              "\"net.4.weight\", \"net.7.weight\".\n\tUnexpected key(s) in state_dict: "
              "\"net.4.u\", \"net.4.v\", \"net.4.omega\", \"net.4.indices\".")

    import client_app

    def fail(*args: object, **kwargs: object) -> Message:
        raise RuntimeError(reason)  # what load_state_dict raises, as the ClientApp would

    monkeypatch.setattr(client_app, "train_node", fail)
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        with pytest.raises(StopRun, match=r"(?s)Round 1: every one of the 3 nodes answered with "
                                          r"the same error.*net\.4\.indices.*Likely fix: .*"
                                          r"receive"):
            run_app(tmp_path, {"num-server-rounds": 5})
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    rows = [json.loads(x) for x in (tmp_path / "out/run/metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0]  # round 1 never became a row: it stopped there
    summary = json.loads((tmp_path / "out/run/summary.json").read_text())
    assert summary["status"] == "failed" and "net.4.indices" in summary["failure"]
    assert "RUN FAILED" in caplog.records[-1].getMessage()


def test_a_finished_run_says_so_in_its_summary(tmp_path: Path) -> None:
    summary, _ = run_app(tmp_path, {"num-server-rounds": 1})
    assert summary["status"] == "finished"
    saved = json.loads((tmp_path / "out/run/summary.json").read_text())
    assert saved["status"] == "finished" and "failure" not in saved
