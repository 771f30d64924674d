"""The strategy's callbacks (fedshard.server.callbacks): the hooks are called in the order a
run goes, with the run's rounds; a callback stops the run; the strategy's own checks are
callbacks a user may leave out; and every callback's on_end runs however the run ends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message
from test_strategy import grid_with, initial, strategy

from fedshard.server import (
    RoundCallback,
    StopOnDivergence,
    StopRun,
    StopWhenUntrained,
    default_callbacks,
)


class Recorder(RoundCallback):
    """Writes down every call, in order."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.stop_at = stop_at
        self.result: Any = "not ended"

    def on_configure(self, strategy: Any, server_round: int, config: ConfigRecord,
                     messages: Sequence[Message]) -> None:
        assert len(messages) == 2 and strategy.current_arrays is not None
        self.calls.append(("configure", server_round))

    def on_aggregate(self, strategy: Any, server_round: int, metrics: Mapping[str, float],
                     state: Any) -> None:
        assert metrics["replies-used"] == 2.0
        self.calls.append(("aggregate", server_round))

    def on_round(self, strategy: Any, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        self.calls.append(("round", server_round))
        if server_round == self.stop_at:
            raise StopRun(f"stopped after round {server_round}")
        return {"mine": float(server_round)}

    def on_end(self, strategy: Any, result: Any) -> None:
        self.calls.append(("end", -1))
        self.result = result


def test_hooks_come_in_run_order_and_their_metrics_go_to_flower() -> None:
    rec = Recorder()
    s = strategy(num_rounds=2, callbacks=[*default_callbacks(), rec])
    result = s.start(grid=grid_with([0.5, 0.5]), initial_arrays=initial(), num_rounds=2,
                     timeout=5)
    assert rec.calls == [("round", 0), ("configure", 1), ("aggregate", 1), ("round", 1),
                         ("configure", 2), ("aggregate", 2), ("round", 2), ("end", -1)]
    assert rec.result is result
    assert result.evaluate_metrics_serverapp[2]["mine"] == 2.0


def test_a_callback_stops_the_run_and_every_on_end_still_runs() -> None:
    rec, after = Recorder(stop_at=1), Recorder()
    s = strategy(num_rounds=3, callbacks=[rec, after])
    with pytest.raises(StopRun, match="stopped after round 1"):
        s.start(grid=grid_with([0.5, 0.5]), initial_arrays=initial(), num_rounds=3, timeout=5)
    assert ("configure", 2) not in rec.calls  # round 2 never started
    assert rec.calls[-1] == ("end", -1) and after.calls[-1] == ("end", -1)
    assert rec.result is None  # the run did not finish
    assert s.rounds_trained == 1


def test_the_strategys_own_checks_are_callbacks_a_user_may_leave_out() -> None:
    assert [type(c) for c in strategy().callbacks] == [type(c) for c in default_callbacks()]
    # without StopWhenUntrained a run that trains nothing ends without the error
    nothing = [c for c in default_callbacks() if not isinstance(c, StopWhenUntrained)]
    s = strategy(num_rounds=1, callbacks=nothing)
    s.start(grid=grid_with([None, None]), initial_arrays=initial(), num_rounds=1, timeout=5)
    assert s.rounds_trained == 0
    with pytest.raises(RuntimeError, match="No round trained"):
        strategy(num_rounds=1).start(grid=grid_with([None, None]), initial_arrays=initial(),
                                     num_rounds=1, timeout=5)
    assert any(isinstance(c, StopOnDivergence) for c in default_callbacks())


def test_callbacks_are_checked_when_the_strategy_is_built() -> None:
    with pytest.raises(ValueError, match=r"callbacks=.*expected RoundCallback objects"):
        strategy(callbacks=[lambda *a: None])
