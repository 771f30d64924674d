"""``max_steps``: a round stops after that many optimizer steps, the same steps a hand-written
SGD loop takes over the first batches; it travels in the train config."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedshard import protocol as P
from fedshard.client.train import TrainConfig, train
from fedshard.settings import LocalTraining


def _setup() -> tuple[nn.Module, DataLoader]:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g))
    torch.manual_seed(0)
    return nn.Linear(5, 3), DataLoader(data, batch_size=4)  # 10 batches, in order


def test_training_stops_after_max_steps_across_epochs() -> None:
    model, loader = _setup()
    by_hand = copy.deepcopy(model)
    cfg = TrainConfig(recipe=LocalTraining(lr=0.1, momentum=0.0, local_epochs=2, max_steps=13,
                                           weight_decay=0.0), log_every_epoch=False)
    result = train(model, loader, cfg)
    batches = list(loader)
    with torch.no_grad():
        for x, y in (batches + batches)[:13]:  # one whole epoch, then 3 batches of the next
            by_hand.zero_grad()
            with torch.enable_grad():
                F.cross_entropy(by_hand(x), y).backward()
            for p in by_hand.parameters():
                p -= 0.1 * p.grad
    for a, b in zip(model.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert result.num_examples == 40  # the node's weight: its data, not the steps


def test_no_cap_trains_every_batch_of_every_epoch() -> None:
    model, loader = _setup()
    capped = copy.deepcopy(model)
    recipe = LocalTraining(lr=0.1, momentum=0.0, local_epochs=2)
    train(model, loader, TrainConfig(recipe=recipe, log_every_epoch=False))
    train(capped, loader, TrainConfig(recipe=LocalTraining(
        lr=0.1, momentum=0.0, local_epochs=2, max_steps=20), log_every_epoch=False))
    for a, b in zip(model.parameters(), capped.parameters(), strict=True):
        assert torch.equal(a, b)  # 20 steps are all of them: the same model


def test_max_steps_travels_and_an_older_config_means_no_cap() -> None:
    settings = P.TrainSettings.of(LocalTraining(lr=0.1, max_steps=7), lr=0.1, server_round=1,
                                  keep_ratio=0.5, method="collective", train_seed=1)
    record = settings.to_record()
    assert record["max-steps"] == 7
    assert P.TrainSettings.from_record(record).max_steps == 7
    del record["max-steps"]
    assert P.TrainSettings.from_record(record).max_steps == 0
