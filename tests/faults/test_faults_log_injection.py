"""What a node sends reaches the server's log only escaped and bounded: a metric name or an
error reason holding a newline or a terminal escape cannot forge log lines, a node key of a
million characters is refused, and a flood of bad replies is one WARNING line per reason."""

from __future__ import annotations

import logging

import pytest
from fault_setup import grid, initial, one_round, set_metric, strategy
from flwr.app import ConfigRecord, Error, Message

from fedshard.protocol.capabilities import MAX_NODE_KEY
from fedshard.server import StopRun


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="flwr")  # Flower's logger propagates to caplog's
    return caplog


FORGED = "\n2026-01-01 12:00:00 ERROR replies-used=99"


def _lines(logs: pytest.LogCaptureFixture) -> list[str]:
    return [line for r in logs.records for line in r.getMessage().splitlines()]


def test_a_metric_name_with_a_newline_or_an_escape_forges_no_log_line(flower_logs) -> None:
    g = grid()
    g.tamper[1000] = set_metric("loss" + FORGED, 1.0)
    g.tamper[1001] = set_metric("acc\x1b[2K\rforged", 1.0)
    _, row = one_round(strategy(), g)
    assert row["replies-used"] == 3.0  # the arrays are still used
    assert row["ignored-metrics"] == 2.0  # the names are left out, and counted
    assert not any(k.startswith("client/loss") or k.startswith("client/acc") for k in row)
    assert not any(line.startswith("2026-01-01") for line in _lines(flower_logs))
    assert not any("\x1b" in r.getMessage() or "\r" in r.getMessage()
                   for r in flower_logs.records)
    # the reason names the metric, escaped
    assert "a metric name with control characters ('loss\\n2026-01-01" in flower_logs.text


def test_an_error_reason_with_newlines_is_escaped_in_every_log_line(flower_logs) -> None:
    g = grid()
    for node in (1000, 1001, 1002):  # each answers the message it was sent with the error
        g.tamper[node] = lambda r: Message(Error(code=0, reason="boom" + FORGED),
                                           reply_to=g.sent[-1])
    with pytest.raises(StopRun, match=r"every one of the 3 nodes answered with the same error"
                                      r".*boom\\n2026-01-01"):
        one_round(strategy(), g)
    assert not any(line.startswith("2026-01-01") for line in _lines(flower_logs))


def test_a_node_key_of_a_million_characters_is_refused_and_logged(flower_logs) -> None:
    g = grid()
    g.contexts[1000].node_config["node-key"] = "k" * 1_000_000
    s = strategy()
    msgs = list(s.configure_train(1, initial(), ConfigRecord(), g))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [1001, 1002]
    assert 1000 not in s.capabilities
    assert (f"Node 1000 gave no usable keep ratio (node-key of 1000000 characters: expected at "
            f"most {MAX_NODE_KEY}") in flower_logs.text
    assert len(max(flower_logs.messages, key=len)) < 2000
    g.contexts[1000].node_config["node-key"] = "k" * MAX_NODE_KEY  # the longest one kept
    s.configure_train(2, initial(), ConfigRecord(), g)
    assert s.capabilities[1000].key == "k" * MAX_NODE_KEY


def test_10000_duplicate_replies_give_one_warning_line(flower_logs) -> None:
    s, g = strategy(), grid()
    msgs = list(s.configure_train(1, initial(), ConfigRecord(), g))
    replies = list(g.send_and_receive(msgs))
    flood = [r for r in replies if r.metadata.src_node_id == 1000] * 10_000
    s.aggregate_train(1, replies + flood)
    row = s.history[1]
    assert row["replies-used"] == 3.0 and row["dropped-duplicate"] == 10_000.0
    warnings = [r.getMessage() for r in flower_logs.records if r.levelno == logging.WARNING]
    duplicate = [m for m in warnings if "duplicate" in m]
    assert len(duplicate) == 1 and len(warnings) < 10
    assert duplicate[0].startswith("Round 1: dropping 10000 replies (duplicate) of node(s) "
                                   "1000: duplicate: a second reply")
    debug = [r for r in flower_logs.records
             if r.levelno == logging.DEBUG and "second reply" in r.getMessage()]
    assert len(debug) == 10_000  # the full detail, one line per reply
