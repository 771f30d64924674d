"""Values from a node that used to crash the ServerApp: non-scalar or
non-finite metrics, a node key that ``isdigit`` but is no integer, malformed capabilities."""

from __future__ import annotations

import logging
import zlib

import numpy as np
import pytest
from fault_setup import grid, initial, one_round, set_metric, strategy
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedshard import protocol as P


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    logging.getLogger("flwr").addHandler(caplog.handler)
    yield caplog
    logging.getLogger("flwr").removeHandler(caplog.handler)


def test_a_list_train_loss_is_left_out_and_the_arrays_still_used(flower_logs) -> None:
    g = grid()
    g.tamper[1000] = set_metric("train-loss", [1.0, 2.0])
    g.tamper[1001] = set_metric("train-accuracy", float("inf"))
    new, metrics = one_round(strategy(), g)
    assert new is not None and metrics["replies-used"] == 3.0
    assert metrics["ignored-metrics"] == 2.0 and np.isfinite(metrics["train-loss"])
    assert "train-loss=[1.0, 2.0] is not a scalar" in flower_logs.text


def test_a_list_eval_loss_is_left_out() -> None:
    s = strategy(fraction_evaluate=1.0)
    reply = Message(RecordDict({P.METRICS: MetricRecord({"num-examples": 10, "eval-loss": [1.0],
                                                         "eval-accuracy": 0.5})}),
                    dst_node_id=0, message_type="evaluate")
    reply.metadata.__dict__["_src_node_id"] = 1000
    out = s.aggregate_evaluate(1, [reply])
    assert out is not None and "eval-loss" not in out and out["eval-accuracy"] == 0.5


@pytest.mark.parametrize("key", ["²", "١٢", "9" * 40, "node-3"])
def test_a_node_key_that_is_not_plain_ascii_digits_is_hashed(key: str) -> None:
    assert P.Capabilities(0.5, key).stream == zlib.crc32(key.encode())
    assert P.Capabilities(0.5, "0042").stream == 42
    g = grid()
    g.contexts[1000].node_config["node-key"] = key
    g.contexts[1001].node_config["node-key"] = "7"
    msgs = list(strategy().configure_train(1, initial(), ConfigRecord(), g))
    assert len(msgs) == 3


@pytest.mark.parametrize("value", [[0.5], "0.5", float("nan"), 2.0])
def test_malformed_keep_ratios_are_refused_not_raised(value: object) -> None:
    query = P.query_message(1000)
    reply = Message(RecordDict({P.CAPABILITIES: ConfigRecord({P.KEEP_RATIO: value})}),
                    reply_to=query)
    caps, reason = P.read_capabilities(reply)
    assert caps is None and "keep-ratio" in reason
