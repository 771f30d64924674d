"""fedavg-cosine: a node's dense reference copy reaches a metric only; a bad or missing one is
left out with a logged reason and never touches the aggregation."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from fault_setup import grid, one_round, strategy
from flwr.app import Array, Message

from fedshard import protocol as P


def _nan_reference(reply: Message) -> Message:
    rec = reply.content[P.REFERENCE]
    key = next(k for k in rec if k.endswith("weight"))
    rec[key] = Array(np.full(rec[key].numpy().shape, np.nan, dtype=rec[key].numpy().dtype))
    return reply


def _no_reference(reply: Message) -> Message:
    del reply.content[P.REFERENCE]
    return reply


def test_bad_or_missing_references_are_left_out_of_the_cosine_only(caplog):
    g = grid(3)
    nodes = sorted(g.contexts)
    g.tamper[nodes[0]] = _nan_reference
    g.tamper[nodes[1]] = _no_reference
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        new, metrics = one_round(strategy(fedavg_cosine=True), g)
        base_new, base = one_round(strategy(), grid(3))
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    assert metrics["replies-used"] == 3.0 and metrics["fedavg-references"] == 1.0
    assert -1.0 <= metrics["fedavg-cosine"] <= 1.0
    assert "dense reference is not used for fedavg-cosine (fedavg-reference: " in caplog.text
    assert "holds NaN or inf" in caplog.text and "no 'fedavg-reference' record" in caplog.text
    # the aggregate is the one without fedavg-cosine: the references never reach the model
    assert new is not None and base_new is not None
    for key in base_new:
        np.testing.assert_array_equal(new[key].numpy(), base_new[key].numpy())
    assert "fedavg-cosine" not in base


def test_no_usable_reference_gives_no_cosine_but_a_count():
    g = grid(2)
    for node in g.contexts:
        g.tamper[node] = _no_reference
    _, metrics = one_round(strategy(fedavg_cosine=True), g)
    assert metrics["fedavg-references"] == 0.0 and "fedavg-cosine" not in metrics
    assert metrics["replies-used"] == 2.0


@pytest.mark.parametrize("method", ["none", "collective"])
def test_the_reference_is_sent_only_when_asked(method):
    g = grid(2)
    s = strategy(method=method, fedavg_cosine=True)
    one_round(s, g)
    train = [m for m in g.sent if m.metadata.message_type == "train"]
    assert len(train) == 2 and all(P.REFERENCE in m.content.array_records for m in train)
    g2 = grid(2)
    one_round(strategy(method=method), g2)
    assert not any(P.REFERENCE in m.content.array_records for m in g2.sent)
