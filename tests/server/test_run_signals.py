"""A project that builds fedshard's strategy itself gets the app's signals: the run ends with
the line on what sharding bought (bytes from the rounds' messages; forward FLOPs with an
example input), and a run that stops says ``RUN FAILED:`` in its ERROR line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from flower_grid import InProcessGrid
from test_strategy import client, initial, make_net, strategy

from fedshard import SpectralSharding
from fedshard.server.savings import SavingsReport
from fedshard.server.strategy import NoRoundTrainedError


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_finished_run_ends_with_what_sharding_bought(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedshard")
    s = strategy(num_rounds=2)
    s.start(grid=InProcessGrid(client, [{"keep-ratio": 0.5}] * 3), initial_arrays=initial(),
            num_rounds=2, timeout=5)
    (line,) = _lines(caplog, "what sharding bought")
    assert line.startswith("what sharding bought, per client and round against the dense "
                           "model (")
    assert "r = 0.5: received " in line and "MFLOP" not in line  # no example input
    report = next(c for c in s.callbacks if isinstance(c, SavingsReport))
    assert report.savings is not None
    ratio = report.savings["clients"]["r0.5"]["bytes-received-ratio"]
    # the rounds' own measurement of what a node received, averaged over the two rounds
    measured = [s.history[r]["bytes-sent-ratio-r0.5"] for r in (1, 2)]
    assert ratio == pytest.approx(sum(measured) / 2, rel=1e-12)
    caplog.clear()
    model = make_net()
    flops = SpectralSharding.from_model(model, example_input=torch.zeros(1, 1, 8, 8),
                                        num_rounds=1, lr=0.05, fraction_evaluate=0.0,
                                        query_timeout=5, node_wait_timeout=5,
                                        min_available_nodes=3)
    flops.start(grid=InProcessGrid(client, [{"keep-ratio": 0.5}] * 3),
                initial_arrays=initial(), num_rounds=1, timeout=5)
    (line,) = _lines(caplog, "what sharding bought")
    assert "MFLOP/example" in line and "forward " in line


def test_a_run_that_trains_nothing_says_run_failed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedshard")
    s = strategy(num_rounds=2, min_keep_ratio=1.0)  # every node declares 0.5: all idle
    with pytest.raises(NoRoundTrainedError):
        s.start(grid=InProcessGrid(client, [{"keep-ratio": 0.5}] * 2),
                initial_arrays=initial(), num_rounds=2, timeout=5)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors[-1].startswith("RUN FAILED: No round trained: none of the 2 round(s)"), errors
    assert not _lines(caplog, "what sharding bought")


def test_a_width_slicing_run_ends_with_what_its_narrow_models_cost(
        caplog: pytest.LogCaptureFixture) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "width"))
    import test_width_strategy as w

    caplog.set_level(logging.INFO, logger="fedshard")
    w._run(w._strategy("heterofl"), w._grid([0.5, 0.5, 1.0, 1.0]), 2)
    (line,) = _lines(caplog, "what sharding bought")
    assert "r = 0.5: received " in line and "r = 1: received " in line
    assert not _lines(caplog, "could not be counted")
