"""The paper's client rules come with the sub-model and act on the optimizer they are attached
to, and on nothing else: a plain loop whose optimizer has ``shard.rules`` attached trains as
fedshard's own loop does, no rule is applied twice, two shards trained in one process keep
two independent rule sets; and keep ratios of a user project in one line."""

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
from fedshard.client.train.rules import ClientRules


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


def message(gamma: float = 0.05, tau: float | None = 1.0, seed: int = 3) -> Message:
    """A real train message (Unbiased r = 0.5: ω up to ~1/π > τ, so ClipLR acts)."""
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: object) -> Message:
        return handle_query(msg, 0.5)

    s = SpectralSharding(sharded_layers=["2", "4"], sharding=Sharding(method="unbiased"),
                         training=LocalTraining(lr=0.1, momentum=0.9, frobenius_decay=gamma,
                                                clip_lr_tau=tau),
                         num_rounds=2, seed=seed,
                         cohort=Cohort(min_train_nodes=1, min_available_nodes=1),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    return next(iter(s.configure_train(1, ArrayRecord(net().float().state_dict()),
                                       ConfigRecord(), InProcessGrid(app, [{}]))))


def plain_loop(model: nn.Module, lr: float, *, rules: Any = None) -> dict[str, torch.Tensor]:
    """A user's loop: a torch optimizer over all parameters, with ``rules`` attached if given."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if rules is not None:
        rules.attach(opt)
    for x, y in batches():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_plain_loop_gets_the_rules_of_fedshards_train_in_float64() -> None:
    msg = message()
    hooked = receive(msg, net())
    mine = plain_loop(hooked.model, hooked.settings.lr, rules=hooked.rules)
    bare = receive(msg, net())
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in batches()]),
                                      torch.cat([y for _, y in batches()])), batch_size=8)
    train(bare.model, loader, bare.train_config())  # fedshard's loop: SGD-m, FD, ClipLR
    ref = bare.model.state_dict()
    for key, value in mine.items():
        torch.testing.assert_close(value, ref[key], rtol=1e-12, atol=1e-12, msg=key)
    # ... and the rules did something: without them the same loop ends elsewhere
    plain = plain_loop(receive(msg, net()).model, hooked.settings.lr)  # nothing attached
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
    bare = receive(msg, net())
    F.cross_entropy(bare.model(x), y).backward()
    g_data = bare.model[2].u.grad.numpy()
    u, v, w = (layer.u.detach().numpy().copy(), layer.v.detach().numpy().copy(),
               layer.omega.numpy().copy())
    expected = (g_data + 2 * 0.05 * u @ (np.outer(w, w) * (v.T @ v))) * np.minimum(1, 1.0 / w)
    opt = torch.optim.SGD(shard.model.parameters(), lr=0.1)
    shard.rules.attach(opt)
    F.cross_entropy(shard.model(x), y).backward()
    opt.step()
    np.testing.assert_allclose(layer.u.detach().numpy(), u - 0.1 * expected, rtol=1e-10,
                               atol=1e-14)
    scaled = int((w > 1.0).sum() + (shard.model[4].omega > 1.0).sum())
    assert (w > 1.0).any() and shard.rules.report().scaled_columns == scaled


def _one_step_against_formula(shard: Any, x: torch.Tensor, y: torch.Tensor, gamma: float,
                              tau: float, opt: torch.optim.Optimizer) -> None:
    """One plain-SGD step (lr 0.1) of ``shard`` against numpy's
    u' = u - lr·(∂CE/∂u + 2γ U(ωωᵀ ⊙ VᵀV))·min(1, τ/ω), with the ω the layer holds now."""
    layer = shard.model[2]
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(shard.model(x), y).backward()
    g_data = layer.u.grad.numpy().copy()
    u, v, w = (layer.u.detach().numpy().copy(), layer.v.detach().numpy().copy(),
               layer.omega.numpy().copy())
    expected = (g_data + 2 * gamma * u @ (np.outer(w, w) * (v.T @ v))) * np.minimum(1, tau / w)
    opt.step()
    np.testing.assert_allclose(layer.u.detach().numpy(), u - 0.1 * expected, rtol=1e-10,
                               atol=1e-14)


def test_the_rules_follow_an_omega_written_between_steps() -> None:
    """What ω gives the rules is kept between steps; writing ω in place (as a CUDA graph's
    static buffer is written) is seen at the next step, for decay and ClipLR alike, and a step
    where ClipLR scales no column is the optimizer's own step exactly."""
    msg = message(gamma=0.05, tau=1.0)
    shard = receive(msg, net())
    layer = shard.model[2]
    opt = torch.optim.SGD(shard.model.parameters(), lr=0.1)
    shard.rules.attach(opt)
    x, y = batches()[0]
    assert (layer.omega > 1.0).any()  # ClipLR scales some columns
    _one_step_against_formula(shard, x, y, 0.05, 1.0, opt)
    with torch.no_grad():
        layer.omega.mul_(0.5)  # in place: same tensor, new values
    _one_step_against_formula(shard, x, y, 0.05, 1.0, opt)
    with torch.no_grad():
        layer.omega.clamp_(max=0.9)  # now ClipLR scales no column of this layer
        shard.model[4].omega.clamp_(max=0.9)
    plain = receive(msg, net())
    plain.model.load_state_dict(shard.model.state_dict())
    plain_opt = torch.optim.SGD(plain.model.parameters(), lr=0.1)
    ClientRules([plain.model[2], plain.model[4]], frobenius_decay=0.05).attach(plain_opt)
    _one_step_against_formula(shard, x, y, 0.05, 1.0, opt)
    _one_step_against_formula(plain, x, y, 0.05, 1.0, plain_opt)
    for a, b in zip(shard.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(a, b)  # bit for bit: no ClipLR is the step itself


def test_shard_helpers_and_fedshards_loop_do_not_apply_the_rules_twice() -> None:
    """A shard trained by Shard.optimizer() or by fedshard's own loop (optimizers they attach
    the rules to) ends where a plain SGD loop with the rules attached once does; attaching
    them twice to one optimizer, or to another model's optimizer, is refused."""
    msg = message()
    mine = receive(msg, net())
    plain = plain_loop(mine.model, 0.1, rules=mine.rules)
    hooked = receive(msg, net())
    opt = hooked.optimizer()
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (1, 1)
    with pytest.raises(ValueError, match=r"already attached to this SGD optimizer; a second "
                                         r"attachment would apply every rule twice"):
        hooked.rules.attach(opt)
    assert len(opt._optimizer_step_pre_hooks) == 1  # nothing was added
    helpers = user_loop_with(hooked.model, opt)
    looped = receive(msg, net())
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in batches()]),
                                      torch.cat([y for _, y in batches()])), batch_size=8)
    train(looped.model, loader, looped.train_config(log_every_epoch=False))
    for key, value in plain.items():
        torch.testing.assert_close(helpers[key], value, rtol=1e-12, atol=1e-12, msg=key)
        torch.testing.assert_close(looped.model.state_dict()[key], value, rtol=1e-12,
                                   atol=1e-12, msg=key)
    other = torch.optim.SGD(receive(msg, net()).model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"the SGD optimizer steps none of the factors \(u, v\) "
                                         r"of the 2 sharded layer\(s\) these rules were made for"):
        mine.rules.attach(other)
    assert not other._optimizer_step_pre_hooks


def _step_moves(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One step of ``opt`` on ``model``'s loss; what it moved each factor by."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return {k: v.detach() - before[k] for k, v in model.state_dict().items()
            if k.endswith((".u", ".v"))}


def test_two_shards_in_one_process_keep_two_independent_rule_sets() -> None:
    """Two shards of different ω (another seed) and τ, trained in one process, each with its
    own optimizer: each factor column moves min(1, τ/ω_i) times what the same plain SGD step
    moves it (τ and ω read from the messages, the scale computed here with numpy); a third
    model trained alongside without rules moves exactly as plain SGD; each rule set counts
    only its own optimizer's steps; and one optimizer over both models with both rule sets
    attached scales each model's columns by its own rule."""
    msgs = {"a": message(gamma=0.0, tau=1.0, seed=3), "b": message(gamma=0.0, tau=2.5, seed=11)}
    taus = {"a": 1.0, "b": 2.5}
    omegas = {name: {layer: m.content[P.ARRAYS][f"{layer}.omega"].numpy().astype(np.float64)
                     for layer in ("2", "4")} for name, m in msgs.items()}
    assert not np.array_equal(omegas["a"]["2"], omegas["b"]["2"])  # different ω
    for name, tau in taus.items():  # ClipLR acts, and not on every column
        w = np.concatenate(list(omegas[name].values()))
        assert (w > tau).any() and (w <= tau).any(), (name, w)

    def scale(name: str, layer: str) -> torch.Tensor:  # (n,): min(1, τ/ω_i), by hand
        return torch.from_numpy(np.minimum(1.0, taus[name] / omegas[name][layer]))

    shards = {name: receive(m, net()) for name, m in msgs.items()}
    twins = {name: receive(m, net()) for name, m in msgs.items()}  # plain: no rules attached
    bystander = receive(msgs["a"], net())  # a third model trained alongside, no rules
    bystander_twin = receive(msgs["a"], net())
    opts = {name: torch.optim.SGD(sh.model.parameters(), lr=0.1) for name, sh in shards.items()}
    plain_opts = {name: torch.optim.SGD(tw.model.parameters(), lr=0.1)
                  for name, tw in twins.items()}
    handles = {name: shards[name].rules.attach(opts[name]) for name in shards}
    assert all(h.attached and h.layers == 2 for h in handles.values())
    by_opt = torch.optim.SGD(bystander.model.parameters(), lr=0.1)
    by_twin_opt = torch.optim.SGD(bystander_twin.model.parameters(), lr=0.1)
    steps = {"a": 0, "b": 0}
    for i, (x, y) in enumerate(batches()):
        name = "a" if i % 2 == 0 else "b"  # the two models' steps interleave
        # the same state for the twin as for the shard: copy, then one step of each
        twins[name].model.load_state_dict(shards[name].model.state_dict())
        moved = _step_moves(shards[name].model, opts[name], x, y)
        plain = _step_moves(twins[name].model, plain_opts[name], x, y)
        steps[name] += 1
        for key, move in moved.items():
            layer = key.split(".")[0]
            torch.testing.assert_close(move, plain[key] * scale(name, layer), rtol=1e-12,
                                       atol=1e-15, msg=f"{name} {key}")
        bystander_twin.model.load_state_dict(bystander.model.state_dict())
        by_moved = _step_moves(bystander.model, by_opt, x, y)
        by_plain = _step_moves(bystander_twin.model, by_twin_opt, x, y)
        for key, move in by_moved.items():  # neither rule set acts on it
            torch.testing.assert_close(move, by_plain[key], rtol=0, atol=0, msg=key)
    assert {n: sh.rules.report().steps for n, sh in shards.items()} == steps == {"a": 2, "b": 2}
    assert bystander.rules.report().steps == 0

    # one optimizer over both models, each model's rules attached to it: its own scales each
    both = {name: receive(m, net()) for name, m in msgs.items()}
    both_twins = {name: receive(m, net()) for name, m in msgs.items()}
    joint = torch.optim.SGD([*both["a"].model.parameters(), *both["b"].model.parameters()],
                            lr=0.1)
    joint_plain = torch.optim.SGD([*both_twins["a"].model.parameters(),
                                   *both_twins["b"].model.parameters()], lr=0.1)
    for sh in both.values():
        sh.rules.attach(joint)
    x, y = batches()[0]

    def joint_moves(models: dict[str, Any], opt: torch.optim.Optimizer) -> dict[str, Any]:
        before = {n: {k: v.detach().clone() for k, v in m.model.state_dict().items()}
                  for n, m in models.items()}
        opt.zero_grad()
        sum(F.cross_entropy(m.model(x), y) for m in models.values()).backward()
        opt.step()
        return {n: {k: v.detach() - before[n][k] for k, v in m.model.state_dict().items()
                    if k.endswith((".u", ".v"))} for n, m in models.items()}

    moved, plain = joint_moves(both, joint), joint_moves(both_twins, joint_plain)
    for name in both:
        for key, move in moved[name].items():
            torch.testing.assert_close(move, plain[name][key] * scale(name, key.split(".")[0]),
                                       rtol=1e-12, atol=1e-15, msg=f"joint {name} {key}")
        assert both[name].rules.report().steps == 1


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
    """A loop that updates the parameters by hand (no torch optimizer), or with an optimizer
    the rules were not attached to, trains without the rules: the reply says ClipLR scaled
    nothing and the node logs which rules were skipped and how to attach them; with the rules
    attached the reply counts the terms ClipLR scaled."""
    msg = message(gamma=0.05, tau=1.0)
    shard = receive(msg, net())
    for x, y in batches():
        shard.model.zero_grad()
        F.cross_entropy(shard.model(x), y).backward()
        with torch.no_grad():
            for p in shard.model.parameters():
                if p.grad is not None:  # ω, frozen, has none
                    p -= 0.1 * p.grad
    caplog.set_level(logging.WARNING, logger="fedshard")
    reply = shard.reply(num_examples=32)
    assert reply.content[P.METRICS]["clip-lr-terms"] == 0.0
    assert "The client rules were not applied this round: Frobenius decay (γ=0.05), ClipLR " \
           "(τ=1" in caplog.text
    caplog.clear()
    forgot = receive(msg, net())  # an optimizer the rules were never attached to
    plain_loop(forgot.model, 0.1)
    assert forgot.reply(num_examples=32).content[P.METRICS]["clip-lr-terms"] == 0.0
    assert "Attach them to the optimizer that trains shard.model " \
           "(shard.rules.attach(optimizer)" in caplog.text
    caplog.clear()
    stepped = receive(msg, net())
    plain_loop(stepped.model, 0.1, rules=stepped.rules)
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
        shard = receive(msg, net().float())
        model = shard.model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        shard.rules.attach(opt)
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
        shard = receive(msg, net().float())
        model = shard.model
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        shard.rules.attach(opt)
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
