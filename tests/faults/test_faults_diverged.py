"""A run whose nodes diverge stops at once and says what to change; a minority that diverges is
dropped and the run goes on. The nodes are fedshard's real handlers on a small network: at an
absurd lr their training really produces inf/NaN, so the error replies are the ClientApp's own."""

from __future__ import annotations

import logging

import pytest
from fault_setup import grid, one_round, strategy
from flwr.app import Error, Message

from fedshard import protocol as P
from fedshard.server import TrainingDivergedError
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


def test_max_diverged_fraction_one_never_stops_and_zero_stops_at_the_first() -> None:
    s, g = strategy(max_diverged_fraction=1.0, lr=1e36, local_epochs=3), grid()
    new, metrics = one_round(s, g, 1)  # nothing to aggregate, but no stop
    assert new is None and metrics["dropped-diverged"] == 3.0
    s, g = strategy(max_diverged_fraction=0.0), grid()
    g.tamper[1000] = _diverged_reply(g)
    with pytest.raises(TrainingDivergedError, match=r"on 1 of the 3 nodes"):
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
