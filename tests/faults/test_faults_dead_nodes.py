"""Dead nodes: an error reply the SuperLink writes for a node that died
names no useful sender; it is mapped back to the node its message was sent to, counted once."""

from __future__ import annotations

import logging

import pytest
from fault_setup import grid, one_round, strategy
from flwr.app import Error, Message


def _dead(reply: Message) -> Message:
    err = Message(Error(code=2, reason="node 1001 is offline"), reply_to=reply)
    err.metadata.__dict__["_reply_to_message_id"] = reply.metadata.reply_to_message_id
    err.metadata.__dict__["_src_node_id"] = 1  # as from the SuperLink, not the node
    return err


def test_a_dead_nodes_error_reply_is_counted_once_for_that_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        g = grid()
        g.tamper[1001] = _dead
        new, metrics = one_round(strategy(), g)
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    assert new is not None
    assert metrics["replies-dropped"] == 1.0 and metrics["dropped-error-reply"] == 1.0
    assert metrics["replies-missing"] == 0.0 and metrics["replies-used"] == 2.0
    assert "dropping the reply of node 1001 (error-reply" in caplog.text
    assert "node 1 (" not in caplog.text


def test_a_reply_from_another_node_than_addressed_is_dropped() -> None:
    def spoof(reply: Message) -> Message:
        reply.metadata.__dict__["_src_node_id"] = 1002
        return reply

    g = grid()
    g.tamper[1000] = spoof
    _, metrics = one_round(strategy(), g)
    assert metrics["dropped-wrong-sender"] == 1.0 and metrics["replies-used"] == 2.0
