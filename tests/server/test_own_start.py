"""Adopting fedshard never fails silently: a project's own ``SpectralSharding``
subclass with its own ``start()`` and an lr schedule in ``configure_train``, a stateful
``ShardingClientApp`` with its own loop, 10 simulated nodes in two keep-ratio groups."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from test_strategy import client as ratio_client
from test_strategy import initial, local_data, make_net, strategy
from torch import nn

from fedshard import ShardingClientApp, SpectralSharding, receive
from fedshard import protocol as P
from fedshard.server import RoundCallback
from fedshard.server.strategy import NO_TRAINING_PATIENCE, NoRoundTrainedError


# --------------------------------------------------------------------------- the user's project
class BestModelSharding(SpectralSharding):
    """The user's subclass: its own ``start()`` (keeps the best model, never calls ours) and
    an lr schedule of its own in ``configure_train`` (halved from round 5)."""

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn: Any = None) -> Result:
        train_config = train_config if train_config is not None else ConfigRecord()
        arrays, self.best = initial_arrays, initial_arrays
        for r in range(1, (num_rounds or 3) + 1):
            messages = list(self.configure_train(r, arrays, train_config, grid))
            new, _ = self.aggregate_train(r, grid.send_and_receive(messages, timeout=timeout))
            if new is not None:
                arrays = self.best = new
        return Result(arrays=arrays)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Any:
        if server_round >= 5:
            config = ConfigRecord({**config, "lr": float(config["lr"]) / 2})
        return super().configure_train(server_round, arrays, config, grid)


RECEIVED: list[tuple[int, float, float]] = []  # (round, lr, keep ratio) as each node got them

user_client = ShardingClientApp(keep_ratios="0.25:0.5,0.5:0.5")


@user_client.train()
def _train(msg: Message, context: Context) -> Message:
    cfg = msg.content["config"]
    RECEIVED.append((int(cfg["server-round"]), float(cfg["lr"]), float(cfg["keep-ratio"])))
    model = receive(msg, make_net()).model
    x, y = local_data(int(context.node_config["partition-id"])).tensors
    opt = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]))
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(y)})}),
                   reply_to=msg)


def ten_simulated_nodes(app: ClientApp = user_client) -> InProcessGrid:
    return InProcessGrid(app, [{"partition-id": i, "num-partitions": 10} for i in range(10)])


no_ratio_client = ClientApp()  # a project that forgot ShardingClientApp: queries fail

# nodes that fail each in its own way (a stop at round 1 needs one error from every node)
varied_client = ClientApp()


@varied_client.query()
def _varied_query(msg: Message, context: Context) -> Message:
    raise RuntimeError(f"node {context.node_id} is not ready")


def user_strategy(**kw: Any) -> BestModelSharding:
    args: dict = dict(num_rounds=None, lr=None, fraction_evaluate=0.0, min_train_nodes=1,
                      min_available_nodes=1, query_timeout=5, node_wait_timeout=5)
    args.update(kw)
    return BestModelSharding.from_model(make_net(), example_input=torch.zeros(1, 1, 8, 8),
                                        **args)


# --------------------------------------------------------------------------- tests
def test_own_start_and_lr_schedule_reach_the_clients(caplog: pytest.LogCaptureFixture) -> None:
    RECEIVED.clear()
    s = user_strategy(num_rounds=6)
    with caplog.at_level(logging.INFO):
        s.start(ten_simulated_nodes(), initial(), num_rounds=6,
                train_config=ConfigRecord({"lr": 0.1}))
    assert s.rounds_trained == 6
    lrs = {r: {lr for rr, lr, _ in RECEIVED if rr == r} for r in range(1, 7)}
    # the project's own schedule, not fedshard's cosine: 0.1, halved from round 5
    assert lrs == {1: {0.1}, 2: {0.1}, 3: {0.1}, 4: {0.1}, 5: {0.05}, 6: {0.05}}
    assert [s.history[r]["lr"] for r in (4, 5)] == [0.1, 0.05]
    # keep ratios from ShardingClientApp(keep_ratios=...): partitions 0-4 at 0.25, 5-9 at 0.5
    assert sorted(k for r, _, k in RECEIVED if r == 1) == [0.25] * 5 + [0.5] * 5
    assert "sent to the nodes as is" in caplog.text


def test_lr_in_the_returned_messages_is_recorded() -> None:
    class Late(SpectralSharding):
        def configure_train(self, server_round: int, arrays: ArrayRecord,
                            config: ConfigRecord, grid: Grid) -> Any:
            messages = list(super().configure_train(server_round, arrays, config, grid))
            for m in messages:
                m.content["config"]["lr"] = 0.003
            return messages

    RECEIVED.clear()
    s = Late.from_model(make_net(), example_input=torch.zeros(1, 1, 8, 8), lr=0.05,
                        fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1)
    s.start(ten_simulated_nodes(), initial(), num_rounds=1)
    assert {lr for _, lr, _ in RECEIVED} == {0.003} and s.history[1]["lr"] == 0.003


def test_every_recipe_key_of_the_config_wins_and_is_checked() -> None:
    s = strategy(num_rounds=4, lr=0.05)
    config = ConfigRecord({"lr": 0.3, "local-epochs": 2, "momentum": 0.0, "clip-lr-tau": 0.0,
                           "my-key": 7, "keep-ratio": 0.9})
    msgs = list(s.configure_train(2, initial(), config, InProcessGrid(ratio_client,
                                  [{"keep-ratio": 0.5}, {"keep-ratio": 0.25}])))
    for m in msgs:
        got = P.TrainSettings.from_record(m.content[P.CONFIG])
        assert (got.lr, got.local_epochs, got.momentum, got.clip_lr_tau) == (0.3, 2, 0.0, None)
        assert m.content[P.CONFIG]["my-key"] == 7
        assert got.keep_ratio in (0.5, 0.25)  # per node: always the strategy's
    assert dict(config)["lr"] == 0.3  # the caller's record is not modified
    # keys the config does not set: the strategy's, lr on its cosine schedule (own formula)
    m = next(iter(s.configure_train(2, initial(), ConfigRecord(), InProcessGrid(
        ratio_client, [{"keep-ratio": 0.5}]))))
    assert m.content[P.CONFIG]["lr"] == pytest.approx(0.05 * (1 + math.cos(math.pi / 4)) / 2)
    assert m.content[P.CONFIG]["local-epochs"] == 1
    with pytest.raises(ValueError, match=r"train config of round 1 .*this round is not "
                                         r"started:\n  - local-epochs=0: expected an integer"):
        list(s.configure_train(1, initial(), ConfigRecord({"local-epochs": 0}),
                               InProcessGrid(ratio_client, [{"keep-ratio": 0.5}])))


def test_schedule_length_without_start(caplog: pytest.LogCaptureFixture) -> None:
    grid = InProcessGrid(ratio_client, [{"keep-ratio": 0.5}])
    given = strategy(num_rounds=4)  # the constructor's num_rounds, no start() at all
    lr2 = next(iter(given.configure_train(2, initial(), ConfigRecord(), grid)))
    assert lr2.content[P.CONFIG]["lr"] == pytest.approx(0.05 * (1 + math.cos(math.pi / 4)) / 2)
    unknown = strategy(num_rounds=None)
    with caplog.at_level(logging.INFO):
        lrs = [next(iter(unknown.configure_train(r, initial(), ConfigRecord(), grid)))
               .content[P.CONFIG]["lr"] for r in (1, 2, 3)]
    assert lrs == [0.05, 0.05, 0.05]  # constant: no length to anneal over
    warned = [r for r in caplog.records
              if "cosine lr schedule needs the run's number of rounds" in r.message]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "SpectralSharding(num_rounds=...) was not given" in warned[0].message
    assert "None rounds" not in caplog.text
    # the settings, logged once at the first round (SettingsSummary), say so too
    assert caplog.text.count("constant: the cosine schedule needs num_rounds") == 1


def test_a_run_that_trains_nothing_raises_whoever_wrote_start(
        caplog: pytest.LogCaptureFixture) -> None:
    # every node failing the same way: round 1 stops the run, whoever drives it
    for s in (user_strategy(num_rounds=2), user_strategy()):
        with caplog.at_level(logging.ERROR), pytest.raises(
                NoRoundTrainedError, match=r"No round trained: in round 1 every one of the 10 "
                                           r"connected nodes .*No query function registered"):
            s.start(ten_simulated_nodes(no_ratio_client), initial(), num_rounds=2)
    # the user's start(), length known from the constructor: raises after the last round
    s = user_strategy(num_rounds=2)
    caplog.clear()
    with caplog.at_level(logging.ERROR), \
            pytest.raises(RuntimeError, match=r"No round trained: none of the 2 round\(s\) .*"
                                              r"declare no keep ratio"):
        s.start(ten_simulated_nodes(varied_client), initial(), num_rounds=2)
    assert any(r.levelno == logging.ERROR and "No round trained" in r.message
               for r in caplog.records)
    # length unknown: raises after NO_TRAINING_PATIENCE untrained rounds, not later
    s = user_strategy()
    with pytest.raises(RuntimeError, match=rf"stops after {NO_TRAINING_PATIENCE} untrained"):
        s.start(ten_simulated_nodes(varied_client), initial(), num_rounds=10)
    assert max(s.history, default=0) <= NO_TRAINING_PATIENCE
    # Flower's own start(): every round runs and ends (on_round), then NoRoundTrainedError
    ours = SpectralSharding.from_model(make_net(), example_input=torch.zeros(1, 1, 8, 8),
                                       num_rounds=2, fraction_evaluate=0.0, min_train_nodes=1,
                                       min_available_nodes=1, query_timeout=5)
    ended: list[int] = []

    class Ends(RoundCallback):
        def on_round(self, strategy: Any, server_round: int, arrays: ArrayRecord,
                     metrics: Any) -> None:
            ended.append(server_round)

    ours.callbacks.append(Ends())
    with pytest.raises(NoRoundTrainedError, match=r"none of the 2 round"):
        ours.start(ten_simulated_nodes(varied_client), initial(), num_rounds=2)
    assert ended == [0, 1, 2]


def test_a_lone_node_in_a_keep_ratio_group_is_named(caplog: pytest.LogCaptureFixture) -> None:
    grid = InProcessGrid(ratio_client, [{"keep-ratio": 0.25}, {"keep-ratio": 0.5},
                                        {"keep-ratio": 0.5}])
    collective = strategy(method="collective")
    with caplog.at_level(logging.INFO):
        list(collective.configure_train(3, initial(), ConfigRecord(), grid))
        list(collective.configure_train(4, initial(), ConfigRecord(), grid))
    lone = [r for r in caplog.records if "single sampled node" in r.message]
    assert [r.levelno for r in lone] == [logging.WARNING, logging.INFO]  # said once, then INFO
    assert "Round 3: keep-ratio group(s) r=0.25 have a single" in lone[0].message
    assert "Top-n" in lone[0].message and "sample more nodes" in lone[0].message
    assert lone[1].message.startswith("Round 4: keep-ratio group(s) r=0.25 again have")
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # Unbiased's ω = 1/π does not depend on C
        list(strategy(method="unbiased").configure_train(3, initial(), ConfigRecord(), grid))
    assert "single sampled node" not in caplog.text


class NoNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8),
                                          nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


@pytest.mark.parametrize(("method", "ratios", "warns"), [
    ("collective", [0.5, 0.5], True),     # C = 2, ω up to 2
    ("collective", [0.25, 0.5], False),   # C = 1 per group: ω = 1 (Top-n)
    ("unbiased", [1.0, 1.0], False),      # r = 1: π = 1, ω = 1
    ("top-n", [0.5, 0.5], False),
    ("unbiased", [0.5], True),
])
def test_compounding_warning_only_when_omega_exceeds_one(
        method: str, ratios: list[float], warns: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        s = SpectralSharding.from_model(NoNorm(), method=method, num_rounds=2,
                                        min_train_nodes=1, min_available_nodes=1,
                                        query_timeout=5)
        grid = InProcessGrid(ratio_client, [{"keep-ratio": r} for r in ratios])
        for r in (1, 2):
            list(s.configure_train(r, ArrayRecord(NoNorm().state_dict()), ConfigRecord(), grid))
    found = [r for r in caplog.records if "no normalization layer" in r.message]
    assert len(found) == (1 if warns else 0), caplog.text
