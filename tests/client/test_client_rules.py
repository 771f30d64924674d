"""The paper's client rules travel with the sub-model: any torch optimizer that steps
``receive()``'s factors applies Frobenius decay and ClipLR, so a plain loop trains as
fedshard's own loop does, and no rule is applied twice; and keep ratios of a user project in
one line."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedshard import (
    Cohort,
    LocalTraining,
    NodePolicy,
    Sharding,
    ShardingClientApp,
    SpectralSharding,
    handle_query,
    keep_ratio_of,
    receive,
    train,
)
from fedshard import protocol as P
from fedshard.app.config import RunConfig
from fedshard.app.task import declared_keep_ratio
from fedshard.client.keep_ratios import KeepRatioMixture


def net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                             nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=g)
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]


def message(gamma: float = 0.05, tau: float | None = 1.0) -> Message:
    """A real train message (Unbiased r = 0.5: ω up to ~1/π > τ, so ClipLR acts)."""
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: object) -> Message:
        return handle_query(msg, 0.5)

    s = SpectralSharding(sharded_layers=["2", "4"], sharding=Sharding(method="unbiased"),
                         training=LocalTraining(lr=0.1, momentum=0.9, frobenius_decay=gamma,
                                                clip_lr_tau=tau),
                         num_rounds=2, seed=3,
                         cohort=Cohort(min_train_nodes=1, min_available_nodes=1),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    return next(iter(s.configure_train(1, ArrayRecord(net().float().state_dict()),
                                       ConfigRecord(), InProcessGrid(app, [{}]))))


def plain_loop(model: nn.Module, lr: float, *, extra: Any = None) -> dict[str, torch.Tensor]:
    """A user's loop: any torch optimizer over all parameters, nothing of fedshard's."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches():
        loss = F.cross_entropy(model(x), y) + (extra() if extra else 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_plain_loop_gets_the_rules_of_fedshards_train_in_float64() -> None:
    msg = message()
    hooked = receive(msg, net())
    mine = plain_loop(hooked.model, hooked.settings.lr)
    bare = receive(msg, net(), client_rules=False)
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in batches()]),
                                      torch.cat([y for _, y in batches()])), batch_size=8)
    train(bare.model, loader, bare.train_config())  # fedshard's loop: SGD-m, FD, ClipLR
    ref = bare.model.state_dict()
    for key, value in mine.items():
        torch.testing.assert_close(value, ref[key], rtol=1e-12, atol=1e-12, msg=key)
    # ... and the rules did something: without them the same loop ends elsewhere
    plain = plain_loop(receive(msg, net(), client_rules=False).model, hooked.settings.lr)
    assert not torch.allclose(plain["2.u"], mine["2.u"], rtol=1e-6, atol=1e-9)
    omega = msg.content[P.ARRAYS]["2.omega"].numpy()
    assert omega.max() > 1.0  # τ = 1 clips those columns


def test_each_rule_against_its_formula() -> None:
    """One step of plain SGD (no momentum) in a user's loop:
    u' = u - lr·(∂CE/∂u + 2γ U(ωωᵀ ⊙ VᵀV))·min(1, τ/ω), computed here with numpy from the
    received factors."""
    msg = message(gamma=0.05, tau=1.0)
    shard = receive(msg, net())
    layer = shard.model[2]
    x, y = batches()[0]
    bare = receive(msg, net(), client_rules=False)
    F.cross_entropy(bare.model(x), y).backward()
    g_data = bare.model[2].u.grad.numpy()
    u, v, w = (layer.u.detach().numpy().copy(), layer.v.detach().numpy().copy(),
               layer.omega.numpy().copy())
    expected = (g_data + 2 * 0.05 * u @ (np.outer(w, w) * (v.T @ v))) * np.minimum(1, 1.0 / w)
    opt = torch.optim.SGD(shard.model.parameters(), lr=0.1)
    F.cross_entropy(shard.model(x), y).backward()
    opt.step()
    np.testing.assert_allclose(layer.u.detach().numpy(), u - 0.1 * expected, rtol=1e-10,
                               atol=1e-14)
    scaled = int((w > 1.0).sum() + (shard.model[4].omega > 1.0).sum())
    assert (w > 1.0).any() and shard.rules.report().scaled_columns == scaled


def test_shard_helpers_and_fedshards_loop_do_not_apply_the_rules_twice() -> None:
    """A followed shard trained by Shard.optimizer() or by fedshard's own loop (optimizers
    with the rules attached) ends where a plain SGD loop over it does: the rules once."""
    msg = message()
    plain = plain_loop(receive(msg, net()).model, 0.1)
    hooked = receive(msg, net())
    opt = hooked.optimizer()
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (1, 1)
    helpers = user_loop_with(hooked.model, opt)
    looped = receive(msg, net())
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in batches()]),
                                      torch.cat([y for _, y in batches()])), batch_size=8)
    train(looped.model, loader, looped.train_config(log_every_epoch=False))
    for key, value in plain.items():
        torch.testing.assert_close(helpers[key], value, rtol=1e-12, atol=1e-12, msg=key)
        torch.testing.assert_close(looped.model.state_dict()[key], value, rtol=1e-12,
                                   atol=1e-12, msg=key)
    with pytest.raises(TypeError, match=r"receive\(client_rules='yes'\): expected True"):
        receive(msg, net(), client_rules="yes")  # type: ignore[arg-type]


def user_loop_with(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    for x, y in batches():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- keep ratios
SIMULATED = [{"partition-id": i, "num-partitions": 10} for i in range(10)]


def query(app: ClientApp, node_config: dict[str, Any],
          run_config: dict[str, Any] | None = None) -> Message:
    grid = InProcessGrid(app, [node_config], run_config=run_config)
    return next(iter(grid.send_and_receive([P.query_message(1000)])))


def declared(reply: Message) -> float:
    caps, reason = P.read_capabilities(reply)
    assert caps is not None, reason or reply.error.reason
    return caps.keep_ratio


def test_sharding_client_app_keep_ratios_in_one_line() -> None:
    mix = "0.25:0.5,0.5:0.5"
    app = ShardingClientApp(keep_ratios=mix)
    cfg = RunConfig.from_mapping({"keep-ratios": mix, "num-partitions": 10})
    for nc in SIMULATED:  # the same rule as fedshard's own app, partition by partition
        assert declared(query(app, nc)) == declared_keep_ratio(cfg, nc)
    assert [declared(query(app, nc)) for nc in SIMULATED] == [0.25] * 5 + [0.5] * 5
    # a deployed node's own keep-ratio wins; without one it is told what to set
    assert declared(query(app, {"keep-ratio": 0.8, "data-dir": "/d"})) == 0.8
    reply = query(app, {"data-dir": "/d"})
    assert reply.has_error() and "restarted with --node-config" in reply.error.reason
    # a function of the node config
    fn = ShardingClientApp(keep_ratios=lambda nc: 0.1 * (1 + nc["partition-id"] % 2))
    assert [declared(query(fn, nc)) for nc in SIMULATED[:2]] == [0.1, 0.2]
    with pytest.raises(ValueError, match=r"keep-ratios='0.25:0.5,0.5:0.4': shares sum to 0.9"):
        ShardingClientApp(keep_ratios="0.25:0.5,0.5:0.4")
    with pytest.raises(TypeError, match=r"ShardingClientApp\(keep_ratios=0.5\): expected a mix"):
        ShardingClientApp(keep_ratios=0.5)  # type: ignore[arg-type]
    assert isinstance(app.keep_ratios, KeepRatioMixture)


def test_run_config_keep_ratios_work_in_a_user_project(caplog: pytest.LogCaptureFixture) -> None:
    run_config = {"keep-ratios": "0.25:0.5,0.5:0.5"}  # README's path, no code change
    app = ShardingClientApp()
    assert [declared(query(app, nc, run_config)) for nc in SIMULATED] == [0.25] * 5 + [0.5] * 5
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(),
                  run_config={"keep-ratios": "0.3:1.5"})
    with pytest.raises(ValueError, match=r"run config keep-ratios='0.3:1.5': share 1.5 is "
                                         r"outside \(0, 1\]; this node cannot take part"):
        keep_ratio_of(ctx)
    with caplog.at_level(logging.WARNING):
        ctx.node_config["keep-ratio"] = 0.7  # the node's own wins
        assert keep_ratio_of(ctx) == 0.7


def test_a_round_without_an_optimizer_step_says_the_rules_were_not_applied(
        caplog: pytest.LogCaptureFixture) -> None:
    """A loop that updates the parameters by hand (no torch optimizer) trains without the
    rules: the reply says ClipLR scaled nothing and the node logs which rules were skipped;
    with an optimizer the reply counts the terms ClipLR scaled."""
    msg = message(gamma=0.05, tau=1.0)
    shard = receive(msg, net())
    for x, y in batches():
        shard.model.zero_grad()
        F.cross_entropy(shard.model(x), y).backward()
        with torch.no_grad():
            for p in shard.model.parameters():
                p -= 0.1 * p.grad
    caplog.set_level(logging.WARNING, logger="fedshard")
    reply = shard.reply(num_examples=32)
    assert reply.content[P.METRICS]["clip-lr-terms"] == 0.0
    assert "The client rules were not applied this round: Frobenius decay (γ=0.05), ClipLR " \
           "(τ=1" in caplog.text
    caplog.clear()
    stepped = receive(msg, net())
    plain_loop(stepped.model, 0.1)
    reply = stepped.reply(num_examples=32)
    omegas = [msg.content[P.ARRAYS][f"{layer}.omega"].numpy() for layer in ("2", "4")]
    assert reply.content[P.METRICS]["clip-lr-terms"] == sum(int((w > 1.0).sum()) for w in omegas)
    assert reply.content[P.METRICS]["clip-lr-terms"] > 0 and "not applied" not in caplog.text


def test_a_users_mod_that_reads_the_round_config_sees_only_its_messages() -> None:
    """A TensorBoard-style mod (as in Flower's examples) reads msg.content["config"]
    ["server-round"]: fedshard's capability query is answered before it, so it never meets a
    message without a config, and the run trains."""
    seen: list[tuple[str, int]] = []

    def round_logger(msg: Message, context: Context, call_next: Any) -> Message:
        seen.append((msg.metadata.message_type, int(msg.content["config"]["server-round"])))
        return call_next(msg, context)

    app = ShardingClientApp(keep_ratios="0.5:1.0", mods=[round_logger])

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        model = receive(msg, net().float()).model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for x, y in batches():
            opt.zero_grad()
            F.cross_entropy(model(x.float()), y).backward()
            opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 32})}),
                       reply_to=msg)

    s = SpectralSharding(sharded_layers=["2", "4"], num_rounds=2,
                         cohort=Cohort(min_train_nodes=2, min_available_nodes=2,
                                       fraction_evaluate=0.0),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    grid = InProcessGrid(app, [{"partition-id": i, "num-partitions": 2} for i in range(2)])
    s.start(grid=grid, initial_arrays=ArrayRecord(net().float().state_dict()), num_rounds=2,
            timeout=5)
    assert s.rounds_trained == 2
    assert sorted(seen) == [("train", 1), ("train", 1), ("train", 2), ("train", 2)]


def test_receipts_tell_the_server_what_the_nodes_trained_with(
        caplog: pytest.LogCaptureFixture) -> None:
    """Nodes that train with their own Adam at lr 1e-3 while the server sends 0.05: the
    replies say so, the server warns once (not every round) with the count, and the totals
    sum the run; a node's forged receipt is counted unreadable, its arrays still used."""
    from fedshard.server import TrainingReceipts

    app = ShardingClientApp(keep_ratios="0.5:1.0")

    @app.train()
    def _train(msg: Message, context: Context) -> Message:
        model = receive(msg, net().float()).model
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for x, y in batches():
            opt.zero_grad()
            F.cross_entropy(model(x.float()), y).backward()
            opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 32})}),
                       reply_to=msg)

    s = SpectralSharding(sharded_layers=["2", "4"], num_rounds=2,
                         cohort=Cohort(min_train_nodes=3, min_available_nodes=3,
                                       fraction_evaluate=0.0),
                         training=LocalTraining(lr=0.05),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    grid = InProcessGrid(app, [{"partition-id": i, "num-partitions": 3} for i in range(3)])

    def forge(reply: Message) -> Message:
        reply.content["config"]["trained-optimizer"] = "Adam\nERROR forged line"
        return reply

    grid.tamper[1002] = forge
    caplog.set_level(logging.WARNING, logger="fedshard")
    s.start(grid=grid, initial_arrays=ArrayRecord(net().float().state_dict()), num_rounds=2,
            timeout=5)
    assert s.rounds_trained == 2
    warned = [r.getMessage() for r in caplog.records
              if "trained with Adam at lr 0.001, not the lr 0.05 sent" in r.getMessage()]
    assert len(warned) == 1 and "2 of 3 nodes" in warned[0]
    (receipts,) = [c for c in s.callbacks if isinstance(c, TrainingReceipts)]
    assert receipts.totals["nodes"] == 6 and receipts.totals["unreadable"] == 2
    assert receipts.totals["lr-differs"] == 4  # both rounds (round 2's cosine lr is 0.025)
    assert receipts.totals["optimizers"] == {"Adam": 4}
