"""A run whose global model stops changing says so: at lr 1e-30 every step vanishes in
float32, the nodes return what they were sent, and after ``UnchangingModel.patience`` rounds
in a row a WARNING names the likely causes (an honest run is not warned; batch normalization's
statistics, which move whatever the lr, are not a change). An lr below float32's smallest
normal number (lr 5e-324 is 0 in float32) is refused before round 1."""

from __future__ import annotations

import logging

import pytest
import torch
from fault_setup import grid, initial, local_data, strategy
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from fedshard import handle_query, handle_train
from fedshard.app.config import ConfigError, RunConfig
from fedshard.server.callbacks import default_callbacks
from fedshard.server.stops import UnchangingModel
from fedshard.settings import MIN_LR, SettingsError


@pytest.fixture
def library_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="fedshard")
    return caplog


def _warnings(logs: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in logs.records
            if r.levelno == logging.WARNING and "has not changed" in r.getMessage()]


def test_lr_5e_324_is_refused_before_round_1() -> None:
    assert torch.tensor(5e-324, dtype=torch.float32).item() == 0.0  # every step is 0
    expected = (r"lr=5e-324: expected a finite number ≥ 1\.2e-38 \(float32's smallest normal "
                r"number; below it every update of a float32 model vanishes, so nothing would "
                r"train\)")
    with pytest.raises(SettingsError, match=expected):
        strategy(lr=5e-324)
    with pytest.raises(ConfigError, match=expected):
        RunConfig.from_mapping({"lr": 5e-324})
    assert strategy(lr=MIN_LR).base_lr == MIN_LR


def test_lr_1e_30_is_warned_after_patience_rounds_naming_the_causes(library_logs) -> None:
    rounds = UnchangingModel.patience + 1
    s = strategy(lr=1e-30, num_rounds=rounds)
    s.start(grid=grid(), initial_arrays=initial(), num_rounds=rounds, timeout=5)
    assert s.rounds_trained == rounds  # every round "trained": replies used, model applied
    (warning,) = _warnings(library_logs)  # once, not every round after
    assert warning.startswith(
        f"Round {UnchangingModel.patience}: the global model has not changed for "
        f"{UnchangingModel.patience} rounds in a row (rounds 1-{UnchangingModel.patience})")
    assert "the strategy's lr: 1e-30" in warning
    assert "the nodes returned the arrays they were sent (update-ratio-max=0)" in warning


def test_an_honest_run_is_not_warned(library_logs) -> None:
    rounds = UnchangingModel.patience
    s = strategy(num_rounds=rounds)
    s.start(grid=grid(), initial_arrays=initial(), num_rounds=rounds, timeout=5)
    assert s.rounds_trained == rounds and not _warnings(library_logs)
    assert any(isinstance(c, UnchangingModel) for c in default_callbacks())


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 12)
        self.hidden = nn.Linear(12, 10)
        self.norm = nn.BatchNorm1d(10)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        return self.head(torch.relu(self.norm(self.hidden(x))))


def _batch_norm_net() -> _BatchNormNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _BatchNormNet()


def test_batch_norm_statistics_moving_are_not_a_change(library_logs) -> None:
    """At lr 1e-30 a model with batch normalization trains nothing, but every forward pass
    moves its running statistics: the run is still warned."""
    from flower_grid import InProcessGrid

    app = ClientApp()

    @app.query()
    def _query(msg: Message, context: Context) -> Message:
        return handle_query(msg, 0.5)

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        return handle_train(msg, _batch_norm_net(), local_data(context.node_id))

    rounds = UnchangingModel.patience
    s = strategy(lr=1e-30, num_rounds=rounds)
    start = ArrayRecord(_batch_norm_net().state_dict())
    result = s.start(grid=InProcessGrid(app, [{} for _ in range(3)]), initial_arrays=start,
                     num_rounds=rounds, timeout=5)
    moved = result.arrays["norm.running_mean"].numpy() - start["norm.running_mean"].numpy()
    assert abs(moved).max() > 0  # the statistics did move
    (warning,) = _warnings(library_logs)
    assert warning.startswith(f"Round {rounds}: the global model has not changed")
