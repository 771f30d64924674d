"""Drop-in behaviour: the run's rounds, lr schedule, any client metric, FedAvg's
defaults, one-line drop warnings."""

from __future__ import annotations

import inspect
import logging
import math

import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from test_strategy import grid_with, initial, make_net, strategy

from fedshard import Cohort, SpectralSharding
from fedshard import protocol as P
from fedshard.app.config import RunConfig
from fedshard.server.schedule import RunRounds


def test_more_rounds_than_the_strategys_are_refused_before_they_start() -> None:
    """Flower's start() is not overridden: it runs the rounds it is given, and a round beyond
    the strategy's num_rounds (its schedule's length, its last round) is refused before any
    of its messages is sent."""
    s = strategy(num_rounds=2)
    grid = grid_with([0.5])
    with pytest.raises(ValueError, match=r"Round 3 of a run the strategy was built for with "
                                         r"num_rounds=2 .*Flower's start\(\) was given more "
                                         r"rounds than the strategy.*round 3 is not started"):
        s.start(grid=grid, initial_arrays=initial(), num_rounds=4, timeout=5)
    assert sorted(s.history) == [1, 2]
    assert {m.content["config"]["server-round"] for m in grid.sent
            if m.metadata.message_type == "train"} == {1, 2}


def test_num_rounds_of_the_strategy_sets_the_schedule(caplog: pytest.LogCaptureFixture) -> None:
    s = strategy(num_rounds=3)
    result = s.start(grid=grid_with([0.5, 1.0]), initial_arrays=initial(), num_rounds=3,
                     timeout=5)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    # cosine over the strategy's 3 rounds (independent formula)
    for r in (1, 2, 3):
        cosine = 0.05 * 0.5 * (1 + math.cos(math.pi * (r - 1) / 3))
        assert s.history[r]["lr"] == pytest.approx(cosine)
    # start()'s number of rounds alone is not the strategy's: the base lr, said once
    unknown = strategy(num_rounds=None)
    with caplog.at_level(logging.WARNING):
        unknown.start(grid=grid_with([0.5]), initial_arrays=initial(), num_rounds=2, timeout=5)
    assert [unknown.history[r]["lr"] for r in (1, 2)] == [0.05, 0.05]
    assert caplog.text.count("The cosine lr schedule needs the run's number of rounds") == 1


def test_a_resumed_run_counts_its_rounds_on() -> None:
    rounds = RunRounds(10, completed=3)
    assert [rounds.of(k) for k in (1, 7)] == [4, 10]  # Flower's rounds 1..7 of this launch
    assert rounds.is_last(10) and not rounds.is_last(9)
    with pytest.raises(ValueError, match=r"Round 11 of a run .*num_rounds=10 .*after 3 "
                                         r"completed rounds, i.e. num_rounds=7 for this "
                                         r"launch; round 11 is not started"):
        rounds.of(8)
    unknown = RunRounds(None, completed=3)
    assert unknown.of(100) == 103 and not unknown.is_last(103)


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
    # one object per concern, FedAvg's sampling among them (Cohort), and the callbacks
    assert len(ours) <= 15, list(ours)
    cohort = Cohort()
    for name in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes",
                 "fraction_train", "fraction_evaluate"):
        assert getattr(cohort, name) == theirs[name].default, name
    # FedAvg's names still reach the strategy through from_model (routed to its Cohort)
    s = SpectralSharding.from_model(make_net(),
                                    fraction_train=0.5, min_available_nodes=3)
    assert (s.fraction_train, s.min_available_nodes) == (0.5, 3)
    assert s.cohort == Cohort(fraction_train=0.5, min_available_nodes=3)
    with pytest.raises(ValueError, match=r"fraction_train=1.5: expected a share in \[0, 1\]"):
        Cohort(fraction_train=1.5)


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
