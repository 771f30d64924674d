"""Drop-in behaviour: num_rounds once, lr schedule, any client metric, FedAvg's
defaults, one-line drop warnings, TensorBoard."""

from __future__ import annotations

import inspect
import logging
import math

import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from test_strategy import grid_with, initial, strategy

from fedshard import SpectralSharding
from fedshard import protocol as P
from fedshard.app.config import RunConfig
from fedshard.server.schedule import schedule_length


def test_num_rounds_given_twice_and_differently_is_refused() -> None:
    s = strategy(num_rounds=4)
    with pytest.raises(ValueError, match=r"SpectralSharding\(num_rounds=4\) but "
                                         r"start\(num_rounds=2\)"):
        s.start(grid=grid_with([0.5]), initial_arrays=initial(), num_rounds=2, timeout=5)


def test_num_rounds_once_sets_the_schedule() -> None:
    s = strategy(num_rounds=None)
    result = s.start(grid=grid_with([0.5, 1.0]), initial_arrays=initial(), num_rounds=3,
                     timeout=5)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    # cosine over the 3 rounds given to start (independent formula)
    for r in (1, 2, 3):
        cosine = 0.05 * 0.5 * (1 + math.cos(math.pi * (r - 1) / 3))
        assert s.history[r]["lr"] == pytest.approx(cosine)
    only_ctor = strategy(num_rounds=2)
    res = only_ctor.start(grid=grid_with([0.5]), initial_arrays=initial(), timeout=5)
    assert sorted(res.train_metrics_clientapp) == [1, 2]


def test_resumed_schedule_is_the_total() -> None:
    assert schedule_length(10, 7, completed=3) == 10
    assert schedule_length(None, 7, completed=3) == 10
    assert schedule_length(None, None) == 3  # Flower's default
    with pytest.raises(ValueError, match=r"after 3 completed rounds, i.e. 9 rounds in all"):
        schedule_length(10, 6, completed=3)


def test_constant_schedule_and_lr_from_train_config(caplog: pytest.LogCaptureFixture) -> None:
    s = strategy(lr=None, lr_schedule="constant", num_rounds=None)
    s.start(grid=grid_with([0.5]), initial_arrays=initial(), num_rounds=2, timeout=5,
            train_config=ConfigRecord({"lr": 0.02}))
    assert [s.history[r]["lr"] for r in (1, 2)] == [0.02, 0.02]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the caller's lr wins over the strategy's
        s2 = strategy(lr=0.05, num_rounds=None)
        s2.start(grid=grid_with([0.5]), initial_arrays=initial(), num_rounds=2, timeout=5,
                 train_config=ConfigRecord({"lr": 0.02}))
    assert [s2.history[r]["lr"] for r in (1, 2)] == [0.02, 0.02]
    assert caplog.text.count("config['lr']=0.02 is sent to the nodes as is") == 1
    with pytest.raises(ValueError, match=r"lr_schedule='step': expected one of"):
        strategy(lr_schedule="step")
    assert RunConfig.from_mapping({"lr-schedule": "constant"}).training.lr_schedule == "constant"


def test_any_client_metric_is_aggregated_and_server_statistics_stay_out() -> None:
    grid = grid_with([0.5, 0.5])

    def rename(reply: Message) -> Message:  # a client reporting other metric names
        m = reply.content[P.METRICS]
        reply.content[P.METRICS] = MetricRecord({P.NUM_EXAMPLES: m[P.NUM_EXAMPLES],
                                                 "eval_acc": 0.25, "eval_loss": 4.0})
        return reply

    grid.tamper[1001] = rename
    s = strategy(num_rounds=1)
    result = s.start(grid=grid, initial_arrays=initial(), num_rounds=1, timeout=5)
    m = result.train_metrics_clientapp[1]
    assert m["eval_acc"] == 0.25 and m["eval_loss"] == 4.0  # only node 1001 reports them
    assert m[P.NUM_EXAMPLES] == 48 and "train-loss" in m
    assert not {"replies-used", "svd-s", "anme", "bytes-sent-mean", "lr"} & set(m)
    # in the history, what nodes report is kept apart from the server's statistics
    assert {"replies-used", "svd-s", "anme", "client/eval_acc", "train-loss"} <= set(s.history[1])
    assert "eval_acc" not in s.history[1]

    def mine(records: list[RecordDict], key: str) -> MetricRecord:
        return MetricRecord({"n": len(records)})

    s2 = strategy(num_rounds=1, train_metrics_aggr_fn=mine)
    res2 = s2.start(grid=grid_with([0.5, 0.5]), initial_arrays=initial(), num_rounds=1,
                    timeout=5)
    assert dict(res2.train_metrics_clientapp[1]) == {"n": 2}


def test_min_node_defaults_are_fedavgs() -> None:
    ours = inspect.signature(SpectralSharding).parameters
    theirs = inspect.signature(FedAvg).parameters
    # FedAvg's own, one object per concern, and the callbacks
    assert len(ours) <= 16, list(ours)
    for name in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes",
                 "fraction_train", "fraction_evaluate"):
        assert ours[name].default == theirs[name].default, name


def test_drop_warning_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    grid = grid_with([0.5, 0.5])
    reason = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::run()\n"
              "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
              "\nException ClientAppException occurred. Message: FloatingPointError('Training "
              "diverged at lr=0.1')'>")
    grid.tamper[1000] = lambda r: Message(Error(code=0, reason=reason), reply_to=grid.sent[-1])
    s = strategy(num_rounds=1)
    with caplog.at_level(logging.DEBUG):
        s.start(grid=grid, initial_arrays=initial(), num_rounds=1, timeout=5)
    drops = [r for r in caplog.records if "dropping the reply of node 1000" in r.getMessage()]
    assert len(drops) == 1 and drops[0].levelno == logging.WARNING
    assert "\n" not in drops[0].getMessage()
    assert "FloatingPointError('Training diverged at lr=0.1')" in drops[0].getMessage()
    assert any("Traceback" in r.getMessage() and r.levelno == logging.DEBUG
               for r in caplog.records)
