"""A run whose nodes diverge stops at once and says what to change; a minority that diverges is
dropped and the run goes on. The nodes are fedshard's real handlers on a small network: at an
absurd lr their training really produces inf/NaN, so the error replies are the ClientApp's own."""

from __future__ import annotations

import logging

import fault_setup
import pytest
from fault_setup import grid, one_round, strategy
from flwr.app import ConfigRecord, Error, Message

from fedshard import protocol as P
from fedshard.server import TrainingDivergedError
from fedshard.server.stops import StopOnDivergence
from fedshard.settings import ReplyPolicy, SettingsError


def test_a_round_in_which_every_node_diverges_stops_the_run_naming_the_lr_and_the_switch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, g = strategy(lr=1e36, local_epochs=3), grid()
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        with pytest.raises(TrainingDivergedError, match=(
                r"Round 1: training diverged \(NaN or inf\) on 3 of the 3 nodes that replied .*"
                r"lower the lr the nodes are sent \(lr=1e\+36.*factor_step='dense'")):
            one_round(s, g, 1)
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    assert s.rounds_trained == 0 and s.history[1]["dropped-diverged"] == 3.0
    assert any(r.levelno == logging.ERROR and "training diverged" in r.getMessage()
               for r in caplog.records)


def test_the_dense_factor_step_is_not_advised_when_it_is_already_on() -> None:
    s, g = strategy(lr=1e36, local_epochs=3, factor_step="dense"), grid()
    with pytest.raises(TrainingDivergedError) as err:
        one_round(s, g, 1)
    assert "lr=1e+36" in str(err.value) and "factor_step" not in str(err.value)


def _diverged_reply(g):  # a tamper hook of the in-process grid
    def hook(reply: Message) -> Message:
        return Message(Error(code=0, reason=f"FloatingPointError('{P.DIVERGED} at lr=0.05')"),
                       reply_to=g.sent[-1])
    return hook


def test_one_diverged_node_of_three_is_dropped_and_the_round_trains() -> None:
    s, g = strategy(), grid()
    g.tamper[1000] = _diverged_reply(g)
    new, metrics = one_round(s, g, 1)
    assert new is not None and s.rounds_trained == 1
    assert metrics["dropped-diverged"] == 1.0 and metrics["replies-used"] == 2.0


def test_max_diverged_fraction_one_never_stops_and_zero_stops_at_two_nodes() -> None:
    s, g = strategy(max_diverged_fraction=1.0, lr=1e36, local_epochs=3), grid()
    new, metrics = one_round(s, g, 1)  # nothing to aggregate, but no stop
    assert new is None and metrics["dropped-diverged"] == 3.0
    s, g = strategy(max_diverged_fraction=0.0), grid()
    g.tamper[1000] = g.tamper[1001] = _diverged_reply(g)
    with pytest.raises(TrainingDivergedError, match=r"on 2 of the 3 nodes"):
        one_round(s, g, 1)


def test_a_plain_error_reply_is_not_counted_as_divergence() -> None:
    s, g = strategy(max_diverged_fraction=0.0), grid()
    g.tamper[1000] = lambda r: Message(Error(code=0, reason="OSError('disk')"),
                                       reply_to=g.sent[-1])
    _, metrics = one_round(s, g, 1)
    assert metrics["dropped-error-reply"] == 1.0 and "dropped-diverged" not in metrics


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_max_diverged_fraction_is_validated(bad: float) -> None:
    with pytest.raises(SettingsError, match=r"max_diverged_fraction=.*expected a share in "
                                            r"\[0, 1\]"):
        ReplyPolicy(max_diverged_fraction=bad)


def _diverged(to: Message) -> Message:
    reply = Message(Error(code=0, reason=f"FloatingPointError('{P.DIVERGED} at lr=0.05')"),
                    reply_to=to)
    reply.metadata.__dict__["_src_node_id"] = to.metadata.dst_node_id
    return reply


def test_ten_diverged_replies_of_one_node_to_one_message_count_once() -> None:
    s, g = strategy(), grid()
    msgs = list(s.configure_train(1, fault_setup.initial(), ConfigRecord(), g))
    replies = [r for r in g.send_and_receive(msgs) if r.metadata.src_node_id != 1000]
    to_1000 = next(m for m in msgs if m.metadata.dst_node_id == 1000)
    new, _ = s.aggregate_train(1, replies + [_diverged(to_1000) for _ in range(10)])
    row = s.history[1]
    assert new is not None and row["replies-used"] == 2.0
    assert row["dropped-diverged"] == 1.0 and row["dropped-duplicate"] == 9.0


def test_a_lone_node_claiming_divergence_cannot_stop_the_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, g = strategy(), grid(1)
    g.tamper[1000] = _diverged_reply(g)
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        new, row = one_round(s, g, 1)  # one node sampled, and it says it diverged
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    assert new is None and row["dropped-diverged"] == 1.0
    assert ("Round 1: 1 of the 1 nodes that replied report that training diverged; the run "
            "goes on: StopOnDivergence stops it only when at least 2 nodes") in caplog.text


def test_the_stop_never_needs_fewer_than_two_nodes() -> None:
    with pytest.raises(ValueError, match=r"StopOnDivergence\(min_nodes=1\): expected an integer "
                                         r"≥ 2 \(one node alone must not stop a run\)"):
        StopOnDivergence(min_nodes=1)
