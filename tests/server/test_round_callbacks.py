"""The strategy's callbacks (fedshard.server.callbacks): the hooks are called in the order a
run goes, with the run's rounds; a callback stops the run; the strategy's own checks are
callbacks a user may leave out; the last round's on_end, and none after a stop."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from test_strategy import grid_with, initial, strategy
from torch import nn

from fedshard import SpectralSharding
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
        self.arrays: Any = "not ended"

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

    def on_end(self, strategy: Any, arrays: Any) -> None:
        self.calls.append(("end", -1))
        self.arrays = arrays


def test_hooks_come_in_run_order_and_their_metrics_go_to_the_history() -> None:
    """Flower's own start() (the strategy overrides neither it nor summary()) drives the
    hooks, and the hooks call the callbacks: round 0 when round 1 is configured, each round's
    end when its replies are aggregated (no client-side evaluation), the run's end after the
    last."""
    rec = Recorder()
    s = strategy(num_rounds=2, callbacks=[*default_callbacks(), rec])
    result = s.start(grid=grid_with([0.5, 0.5]), initial_arrays=initial(), num_rounds=2,
                     timeout=5)
    assert rec.calls == [("round", 0), ("configure", 1), ("aggregate", 1), ("round", 1),
                         ("configure", 2), ("aggregate", 2), ("round", 2), ("end", -1)]
    assert rec.arrays is result.arrays  # the final model
    assert s.history[0] == {"mine": 0.0} and s.history[2]["mine"] == 2.0
    assert s.history[2]["replies-used"] == 2.0  # beside the strategy's own statistics


def test_with_client_side_evaluation_a_round_ends_after_it() -> None:
    seen: dict[int, dict[str, float]] = {}

    class Rows(RoundCallback):
        def on_round(self, strategy: Any, server_round: int, arrays: ArrayRecord,
                     metrics: Mapping[str, float]) -> None:
            seen[server_round] = dict(metrics)

    s = strategy(num_rounds=2, fraction_evaluate=1.0, callbacks=[Rows()])
    s.start(grid=grid_with([0.5, 0.5]), initial_arrays=initial(), num_rounds=2, timeout=5)
    assert sorted(seen) == [0, 1, 2]
    assert seen[2]["eval-nodes"] == 2.0 and "replies-used" in seen[2]  # the whole round


def test_a_callback_stops_the_run_and_no_round_or_end_follows() -> None:
    rec, after = Recorder(stop_at=1), Recorder()
    s = strategy(num_rounds=3, callbacks=[rec, after])
    with pytest.raises(StopRun, match="stopped after round 1"):
        s.start(grid=grid_with([0.5, 0.5]), initial_arrays=initial(), num_rounds=3, timeout=5)
    assert ("configure", 2) not in rec.calls  # round 2 never started
    assert rec.calls[-1] == ("round", 1) and after.calls[-1] == ("aggregate", 1)
    assert rec.arrays == "not ended"  # the run did not reach its end
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


class AutoEncoder(nn.Module):
    """784→64→3→64→784: the two rank-3 bottleneck layers are the paper's default layers,
    the two 784×64 layers hold ~99 % of the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1, self.enc2 = nn.Linear(784, 64), nn.Linear(64, 3)
        self.dec1, self.dec2 = nn.Linear(3, 64), nn.Linear(64, 784)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec2(torch.relu(self.dec1(self.enc2(torch.relu(self.enc1(x))))))


def test_round_1_says_what_each_keep_ratio_saves_and_warns_when_it_saves_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """The default layers of this autoencoder are its bottleneck: nodes at r = 0.25 receive
    0.9995× the dense model and at r = 0.5 more than it; round 1 says so, names the 784×64
    layers and the line that shards them, and says which factors cost more than their layer."""
    ae = AutoEncoder()
    s = SpectralSharding.from_model(ae, example_input=torch.zeros(1, 784), method="top-n",
                                    min_train_nodes=1, min_available_nodes=1,
                                    query_timeout=5, node_wait_timeout=5)
    assert s.sharded_layers == ("enc2", "dec1")
    caplog.set_level(logging.INFO, logger="fedshard")
    list(s.configure_train(1, ArrayRecord(ae.state_dict()), ConfigRecord(),
                           grid_with([0.25, 0.5])))
    text = caplog.text
    assert "r = 0.25: receives 0.9995x of the dense model's bytes" in text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("enc1" in w and "dec2" in w and "policy='by-size'" in w for w in warnings)
    assert any("cost more" in w and "dec1" in w for w in warnings)
    caplog.clear()  # round 2, the same keep ratios: nothing new to say
    list(s.configure_train(2, ArrayRecord(ae.state_dict()), ConfigRecord(),
                           grid_with([0.25, 0.5])))
    assert "receives" not in caplog.text
    # ResNet-style models that shard what they hold: the report, and no warning
    big = SpectralSharding.from_model(nn.Sequential(nn.Linear(8, 256), nn.ReLU(),
                                                    nn.Linear(256, 256), nn.ReLU(),
                                                    nn.Linear(256, 256), nn.ReLU(),
                                                    nn.Linear(256, 4)),
                                      method="top-n", min_train_nodes=1,
                                      min_available_nodes=1, query_timeout=5,
                                      node_wait_timeout=5)
    caplog.clear()
    list(big.configure_train(1, ArrayRecord(big.budget_model.state_dict()), ConfigRecord(),
                             grid_with([0.25, 0.25])))
    assert "r = 0.25: receives" in caplog.text
    assert not [r for r in caplog.records if r.levelno == logging.WARNING
                and "dense model" in r.getMessage()]


@pytest.mark.parametrize(("nodes", "kappa", "warned"), [
    (2, 2.0, True),    # the bound needs 3 replies: said once, at round 1
    (3, 2.0, False),   # enough for the bound to act
    (2, 0.0, False),   # the bound is off: nothing to say about it
])
def test_a_round_too_small_for_the_spread_bound_is_said_once(
        nodes: int, kappa: float, warned: bool, caplog: pytest.LogCaptureFixture) -> None:
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        s = strategy(num_rounds=2, max_update_spread=kappa)
        s.start(grid=grid_with([0.5] * nodes), initial_arrays=initial(), num_rounds=2,
                timeout=5)
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "needs at least 3 replies" in
             r.getMessage()]
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert lines[0].startswith("Round 1 is sent to 2 node(s)")
        assert "2f + 1" in lines[0]
