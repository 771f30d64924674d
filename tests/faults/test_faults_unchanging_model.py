"""A run whose global model stops changing says so: at lr 5e-324 every step vanishes in
float32, the nodes return what they were sent, and after ``UnchangingModel.patience`` rounds
in a row a WARNING names the likely causes (an honest run is not warned)."""

from __future__ import annotations

import logging

import pytest
from fault_setup import grid, initial, strategy

from fedshard.server.callbacks import UnchangingModel, default_callbacks


@pytest.fixture
def library_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="fedshard")
    return caplog


def _warnings(logs: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in logs.records
            if r.levelno == logging.WARNING and "has not changed" in r.getMessage()]


def test_lr_5e_324_is_warned_after_patience_rounds_naming_the_causes(library_logs) -> None:
    rounds = UnchangingModel.patience + 1
    s = strategy(lr=5e-324, num_rounds=rounds)
    s.start(grid=grid(), initial_arrays=initial(), num_rounds=rounds, timeout=5)
    assert s.rounds_trained == rounds  # every round "trained": replies used, model applied
    (warning,) = _warnings(library_logs)  # once, not every round after
    assert warning.startswith(
        f"Round {UnchangingModel.patience}: the global model has not changed for "
        f"{UnchangingModel.patience} rounds in a row (rounds 1-{UnchangingModel.patience})")
    assert "the strategy's lr: 4.94066e-324" in warning
    assert "the nodes returned the arrays they were sent (update-ratio-max=0)" in warning


def test_an_honest_run_is_not_warned(library_logs) -> None:
    rounds = UnchangingModel.patience
    s = strategy(num_rounds=rounds)
    s.start(grid=grid(), initial_arrays=initial(), num_rounds=rounds, timeout=5)
    assert s.rounds_trained == rounds and not _warnings(library_logs)
    assert isinstance(default_callbacks()[-1], UnchangingModel)
