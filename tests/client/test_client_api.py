"""receive()/Shard (your own loop) against references; handle_train on DataLoaders and dicts."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Message
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
    handle_train,
    receive,
)
from fedshard import protocol as P
from fedshard.client.train import frobenius_penalty


def net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                             nn.Linear(8, 3))


def data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def train_message(keep: float = 0.5, **kw: Any) -> Message:
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: object) -> Message:
        return handle_query(msg, keep)

    s = SpectralSharding(sharded_layers=["2"], sharding=Sharding(method="unbiased", **kw),
                         training=LocalTraining(lr=0.05), seed=3,
                         cohort=Cohort(min_train_nodes=1, min_available_nodes=1),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    s.num_rounds = 2
    return next(iter(s.configure_train(1, ArrayRecord(net().state_dict()), ConfigRecord(),
                                  InProcessGrid(app, [{}]))))


def test_shard_model_and_penalty_match_the_dense_reference() -> None:
    msg = train_message()
    shard = receive(msg, net())
    rec = msg.content[P.ARRAYS]
    u, v, w = (rec[f"2.{p}"].numpy().astype(np.float64) for p in ("u", "v", "omega"))
    weight = (u * w) @ v.T  # (8, 8) = U diag(ω) Vᵀ
    ref = net()
    ref[2].weight.data = torch.as_tensor(weight, dtype=torch.float32)
    x = torch.randn(5, 6)
    torch.testing.assert_close(shard.model(x), ref(x), rtol=1e-5, atol=1e-5)
    gamma = shard.settings.frobenius_decay
    penalty = gamma * frobenius_penalty(shard.model)
    assert float(penalty) == pytest.approx(gamma * (weight**2).sum(), rel=1e-5)
    assert isinstance(shard.model[0], nn.Linear) and shard.layers == ("2",)


def test_own_loop_with_shard_helpers_equals_handle_train() -> None:
    msg = train_message()
    loader = DataLoader(data(), batch_size=8, shuffle=False)
    batteries = handle_train(msg, net(), loader)
    shard = receive(msg, net())
    opt = shard.optimizer()
    torch.manual_seed(shard.settings.train_seed)
    for x, y in loader:
        loss = F.cross_entropy(shard.model(x), y)  # the rules add Frobenius decay
        opt.zero_grad()
        loss.backward()
        opt.step()
    mine = shard.reply(num_examples=24, metrics={"my-metric": 2.5})
    for key in batteries.content[P.ARRAYS]:
        np.testing.assert_allclose(mine.content[P.ARRAYS][key].numpy(),
                                   batteries.content[P.ARRAYS][key].numpy(), rtol=1e-6,
                                   atol=1e-7)
    assert mine.content[P.METRICS]["my-metric"] == 2.5
    assert mine.content[P.METRICS][P.NUM_EXAMPLES] == 24
    assert "2.omega" not in mine.content[P.ARRAYS]


def test_reply_refuses_diverged_model_and_bad_metrics() -> None:
    shard = receive(train_message(), net())
    with pytest.raises(TypeError, match=r"metric 'name'='x': expected a number"):
        shard.reply(num_examples=3, metrics={"name": "x"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"num-examples=0: expected a number > 0"):
        shard.reply(num_examples=0)
    with torch.no_grad():
        shard.model[2].u.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=r"Training diverged at lr=.*1/10 of the dense"):
        shard.reply(num_examples=3)


def test_given_dataloader_is_used_as_is(caplog: pytest.LogCaptureFixture) -> None:
    sizes: list[int] = []

    def collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        sizes.append(len(samples))
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    loader = DataLoader(data(), batch_size=5, collate_fn=collate)  # server says batch 32
    with caplog.at_level(logging.INFO, logger="fedshard.client.handlers"):
        reply = handle_train(train_message(), net(), loader)
    assert sizes == [5, 5, 5, 5, 4]
    assert "the server's batch-size=32 is ignored" in caplog.text
    assert reply.content[P.METRICS][P.NUM_EXAMPLES] == 24


class Dicts(torch.utils.data.Dataset):
    def __init__(self, key: str) -> None:
        self.inner, self.key = data(), key

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        x, y = self.inner[i]
        return {self.key: x, "label": y}


@pytest.mark.parametrize("key", ["img", "image"])
def test_dict_samples_train_like_pairs(key: str) -> None:
    msg = train_message()
    pairs = handle_train(msg, net(), data())
    dicts = handle_train(msg, net(), Dicts(key))
    for k, a in pairs.content[P.ARRAYS].items():
        np.testing.assert_array_equal(dicts.content[P.ARRAYS][k].numpy(), a.numpy())


def test_dict_samples_with_other_keys() -> None:
    with pytest.raises(ValueError, match=r"cannot tell the input key of a dict batch: none of "
                       r"the known keys \['img', 'image'"):
        handle_train(train_message(), net(), Dicts("pixels"))
    handle_train(train_message(), net(), Dicts("pixels"), input_key="pixels")


def test_sharding_client_app_turns_a_fedavg_handler_into_a_shard_reply() -> None:
    msg = train_message()
    app = ShardingClientApp(default_keep_ratio=0.5)

    @app.train()
    def _train(msg: Message, context: object) -> Message:  # written for FedAvg
        from flwr.app import MetricRecord, RecordDict
        model = receive(msg, net()).model
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 7, "x": 1.0})}),
                       reply_to=msg)

    grid = InProcessGrid(app, [{}])
    reply = next(iter(grid.send_and_receive([msg])))
    assert not reply.has_error(), reply.error.reason
    sent = msg.content[P.ARRAYS]
    assert set(reply.content[P.ARRAYS]) == set(sent) - {"2.omega"}
    np.testing.assert_array_equal(reply.content[P.ARRAYS]["2.indices"].numpy(),
                                  sent["2.indices"].numpy())
    assert reply.content[P.METRICS]["x"] == 1.0


def test_handle_train_only_reads_the_model_so_one_instance_serves_every_message() -> None:
    """The ClientApp passes one per-process model (fedshard.app.task.template_model) to every
    train message: handle_train must leave it bit for bit as it was, also when it trains the
    dense FedAvg reference copy, and give what a fresh model gives."""
    template = net()
    before = {k: v.clone() for k, v in template.state_dict().items()}
    replies = []
    for kw in ({}, {"fedavg_cosine": True}):
        msg = train_message(**kw)
        shared = handle_train(msg, template, data())
        fresh = handle_train(msg, net(), data())
        replies.append(shared)
        for key in fresh.content[P.ARRAYS]:
            np.testing.assert_array_equal(shared.content[P.ARRAYS][key].numpy(),
                                          fresh.content[P.ARRAYS][key].numpy(), err_msg=key)
    assert P.REFERENCE in replies[1].content.array_records
    for key, value in template.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in template.parameters())


def test_template_model_is_built_once_per_model_setting() -> None:
    from dataclasses import replace

    from fedshard.app.config import RunConfig
    from fedshard.app.task import build_model, template_model

    cfg = RunConfig(model="mlp", model_width=16, dataset="fashion-mnist", seed=5)
    first = template_model(cfg)
    other_settings = RunConfig.from_mapping({"model": "mlp", "model-width": 16, "seed": 5,
                                             "lr": 0.01, "method": "unbiased"})
    assert template_model(other_settings) is first  # not model settings
    for key, value in build_model(cfg).state_dict().items():
        assert torch.equal(first.state_dict()[key], value), key  # the same initialization
    other = template_model(replace(cfg, seed=6))
    name = next(iter(first.state_dict()))
    assert other is not first and not torch.equal(other.state_dict()[name],
                                                  first.state_dict()[name])
    assert template_model(replace(cfg, model_width=8)) is not first
