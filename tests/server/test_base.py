"""The two strategy families are siblings on one small base that keeps Flower's ``start()`` and
``summary()``: the run around the rounds is the callbacks', called from the round hooks, and a
resumed run maps Flower's rounds to its own in one place."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import pytest
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg, Strategy
from test_strategy import grid_with, initial, strategy

from fedshard import Sharding, Slicing, SpectralSharding, WidthSlicing
from fedshard.server import KeepRatioStrategy, RoundCallback
from fedshard.settings import SettingsError


def test_the_two_families_are_siblings_on_one_base() -> None:
    for kind in (SpectralSharding, WidthSlicing):
        assert issubclass(kind, KeepRatioStrategy) and issubclass(kind, FedAvg)
    assert not issubclass(WidthSlicing, SpectralSharding)
    assert not issubclass(SpectralSharding, WidthSlicing)
    # neither takes the other's constructor: each names its own arguments
    spectral = set(inspect.signature(SpectralSharding).parameters)
    width = set(inspect.signature(WidthSlicing).parameters)
    assert "sharded_layers" in spectral - width and "family" in width - spectral
    shared = set(inspect.signature(KeepRatioStrategy).parameters) - {"problems"}
    assert shared <= spectral and shared <= width


def test_no_strategy_overrides_start_or_summary() -> None:
    for kind in (KeepRatioStrategy, SpectralSharding, WidthSlicing):
        assert kind.start is Strategy.start, kind.__name__
        assert kind.summary is FedAvg.summary, kind.__name__


def test_the_constructors_take_the_settings_objects() -> None:
    params = inspect.signature(SpectralSharding).parameters
    assert len(params) <= 15, list(params)
    assert {"sharding", "training", "replies", "nodes", "cohort"} <= set(params)
    # FedAvg's loose arguments are one object now
    assert not {"fraction_train", "min_available_nodes"} & set(params)
    with pytest.raises(SettingsError, match=r"(?s)SpectralSharding arguments.*"
                                            r"cohort=.*expected a Cohort \(fedshard.settings\)"
                                            r".*num_rounds=0: expected ≥ 1"):
        SpectralSharding(sharded_layers=["a"], cohort={"fraction_train": 0.5},  # type: ignore[arg-type]
                         num_rounds=0)


def test_width_slicing_reports_its_problems_with_the_bases_at_once() -> None:
    with pytest.raises(SettingsError, match=r"(?s)WidthSlicing arguments \(3 problem.*"
                                            r"num_rounds=-1: expected ≥ 1.*"
                                            r"method='collective'.*use fedshard.SpectralSharding"
                                            r".*family='mlp': expected a fedshard.width."
                                            r"WidthFamily"):
        WidthSlicing(family="mlp", num_rounds=-1,  # type: ignore[arg-type]
                     sharding=Sharding(method="collective"),
                     slicing=Slicing(width_match="keep-ratio"))
    with pytest.raises(TypeError, match=r"WidthSlicing.from_model: unknown argument\(s\) "
                                        r"\['fraction'\]"):
        WidthSlicing.from_model(None, family=None, fraction=0.5)  # type: ignore[arg-type]


class Rounds(RoundCallback):
    def __init__(self) -> None:
        self.rounds: list[int] = []
        self.ended: list[int] = []

    def on_round(self, strategy: Any, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> None:
        self.rounds.append(server_round)

    def on_end(self, strategy: Any, arrays: ArrayRecord) -> None:
        self.ended.append(len(self.rounds))


def test_a_resumed_run_goes_on_at_its_own_rounds_under_flowers_start() -> None:
    """Stopped after 2 of 4 rounds, a run resumes with Flower's start() of the 2 rounds left:
    its messages, history and callbacks count the run's rounds 3 and 4, there is no round 0,
    and the last round ends the run; its lr continues the schedule over the 4 rounds."""
    first, again = Rounds(), Rounds()
    whole = strategy(num_rounds=4, callbacks=[first])
    whole.start(grid=grid_with([0.5, 0.5]), initial_arrays=initial(), num_rounds=4, timeout=5)
    resumed = strategy(num_rounds=4, callbacks=[again])
    resumed.resume(2, whole.capability_table(), {r: whole.history[r] for r in (1, 2)})
    grid = grid_with([0.5, 0.5])
    resumed.start(grid=grid, initial_arrays=initial(), num_rounds=2, timeout=5)
    assert first.rounds == [0, 1, 2, 3, 4] and first.ended == [5]
    assert again.rounds == [3, 4] and again.ended == [2]
    assert sorted(resumed.history) == [1, 2, 3, 4]
    assert {m.content["config"]["server-round"] for m in grid.sent
            if m.metadata.message_type == "train"} == {3, 4}
    assert [resumed.history[r]["lr"] for r in (3, 4)] == [whole.history[r]["lr"] for r in (3, 4)]
    with pytest.raises(ValueError, match=r"completed_rounds=4: expected in \[0, num_rounds=4\)"):
        strategy(num_rounds=4).resume(4, {}, {})


def test_the_settings_are_logged_once_at_the_first_round(
        caplog: pytest.LogCaptureFixture) -> None:
    s = strategy(num_rounds=2)
    with caplog.at_level(logging.INFO, logger="fedshard"):
        s.start(grid=grid_with([0.5, 0.5]), initial_arrays=initial(), num_rounds=2, timeout=5)
    lines = [r.getMessage() for r in caplog.records]
    assert sum(x.startswith("SpectralSharding: method=collective design=cps") for x in lines) == 1
    assert sum(x.startswith("sharded layers (2): body, hidden") for x in lines) == 1
    assert sum(x.startswith("local training: lr=0.05 (cosine over 2 rounds") for x in lines) == 1
