"""Forged results (security review, finding 1): what a node reports as metrics lives in its
own namespace (``client/<name>``), so it can neither overwrite a server statistic nor pose as
a test metric in ``metrics.jsonl``, ``summary.json`` or the experiment report; and a reply's
metric names and count are bounded."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fault_setup import grid, one_round, replace_metrics, run_app, set_metric, strategy
from flwr.app import Message

from fedshard import protocol as P
from fedshard.protocol.bounds import MAX_METRIC_NAME, MAX_REPLY_METRICS
from fedshard.server.metrics import CLIENT_PREFIX


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    logging.getLogger("flwr").addHandler(caplog.handler)
    yield caplog
    logging.getLogger("flwr").removeHandler(caplog.handler)


def _forge(reply: Message) -> Message:
    """A node that reports the server's own statistics and a test accuracy as train metrics."""
    for key, value in {"replies-used": 99.0, "replies-dropped": 0.0, "test-accuracy": 0.99,
                       "clipped-update-norm": 0.0, "update-ratio-max": 0.0,
                       "rounds-trained": 50.0, "num-examples-total": 1.0}.items():
        set_metric(key, value)(reply)
    return reply


def test_forged_server_statistics_do_not_overwrite_the_servers() -> None:
    g = grid()
    g.tamper[1000] = _forge
    g.tamper[1001] = set_metric("update-ratio-max", 0.0)
    _, row = one_round(strategy(max_update_ratio=1e-9), g)  # every reply is clipped
    # the server's own counts, independent of what the node wrote
    assert row["replies-used"] == 3.0 and row["replies-dropped"] == 0.0
    assert row["clipped-update-norm"] == 3.0 and row["update-ratio-max"] > 1e-9
    assert row["rounds-trained"] == 1.0
    assert "test-accuracy" not in row
    # the node's values are kept, under the client namespace only
    # (the mean over the replies that report a name: only node 1000's)
    assert row[f"{CLIENT_PREFIX}test-accuracy"] == pytest.approx(0.99)
    assert row[f"{CLIENT_PREFIX}replies-used"] == 99.0
    # honest metric names still reach the report's columns
    assert 0 < row["train-loss"] < 10 and 0 <= row["train-accuracy"] <= 1


def test_a_forged_test_accuracy_reaches_neither_metrics_nor_summary(tmp_path: Path) -> None:
    summary, _ = run_app(tmp_path, {"eval-every": 0}, tamper={1001: _forge})
    rows = [json.loads(x) for x in (tmp_path / "out/run/metrics.jsonl").read_text().splitlines()]
    assert all("test-accuracy" not in r for r in rows)
    assert [r["replies-used"] for r in rows[1:]] == [3.0, 3.0]
    assert summary["best-test-accuracy"] is None and summary["final-test-accuracy"] is None
    saved = json.loads((tmp_path / "out/run/summary.json").read_text())
    assert saved["best-test-accuracy"] is None


def test_a_forged_round_or_wall_time_cannot_overwrite_the_row(tmp_path: Path) -> None:
    from fedshard.app.results import RunRecorder

    with RunRecorder(tmp_path / "run", {}, 2) as recorder:
        row = recorder.record_round(1, {"round": 7.0, "wall-s": -1.0, "test-loss": 0.5})
    assert row["round"] == 1 and row["wall-s"] >= 0 and row["test-loss"] == 0.5


def test_a_reply_with_10000_metric_keys_is_bounded_logged_and_counted(flower_logs) -> None:
    g = grid()
    many = {f"m{i}": float(i) for i in range(10_000)}
    g.tamper[1000] = replace_metrics({"num-examples": 24, "train-loss": 1.0, **many})
    long_name = "x" * (MAX_METRIC_NAME + 1)
    g.tamper[1001] = set_metric(long_name, 1.0)
    _, row = one_round(strategy(), g)
    assert row["replies-used"] == 3.0
    client_keys = [k for k in row if k.startswith(CLIENT_PREFIX)]
    assert len(client_keys) <= MAX_REPLY_METRICS + 2  # node 1000's cap, plus the others' two
    assert len(row) < 100
    assert f"{CLIENT_PREFIX}{long_name}" not in row
    # 10,001 values sent by node 1000, MAX_REPLY_METRICS kept; node 1001's long name left out
    assert row["ignored-metrics"] == 10_001 - MAX_REPLY_METRICS + 1
    assert (f"node 1000 sent metrics that are not averaged ({10_001 - MAX_REPLY_METRICS} "
            f"metric(s) beyond the first {MAX_REPLY_METRICS}") in flower_logs.text
    assert f"a metric name of {MAX_METRIC_NAME + 1} characters" in flower_logs.text
    assert len(max(flower_logs.messages, key=len)) < 2000  # one readable line, not 10,000 keys


def test_client_eval_metrics_stay_in_their_namespace() -> None:
    from flwr.app import MetricRecord, RecordDict

    s = strategy(fraction_evaluate=1.0)
    reply = Message(RecordDict({P.METRICS: MetricRecord({
        "num-examples": 10, "eval-loss": 0.5, "eval-accuracy": 0.25, "test-accuracy": 0.99,
        "eval-nodes": 40.0})}), dst_node_id=0, message_type="evaluate")
    reply.metadata.__dict__["_src_node_id"] = 1000
    s.aggregate_evaluate(1, [reply])
    row = s.history[1]
    assert "test-accuracy" not in row and row["eval-nodes"] == 1.0
    assert row["eval-loss"] == 0.5 and row["eval-accuracy"] == 0.25  # documented names kept
    assert row[f"{CLIENT_PREFIX}test-accuracy"] == 0.99
