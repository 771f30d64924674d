"""Low-memory training (fedshard.spectral.recompute): the plain step's gradients, less kept.

The reference is fedshard's plain factorized step on the same sub-model, batches and torch
seed (dropout and drop-path included), in float64: low-memory mode must train the same model
to 1e-10 (relative, per entry), with momentum, Frobenius decay and ClipLR acting. The memory it
saves is counted from the tensors autograd keeps for the backward pass."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from fedshard.client.train import EagerStep, TrainConfig
from fedshard.client.train.fast import FastOptions
from fedshard.client.train.rules import ClientRules
from fedshard.models import cct_6_3x2, char_transformer, lenet, mlp, resnet18
from fedshard.settings import LocalTraining
from fedshard.spectral import (
    blocks_of,
    decompose,
    low_memory,
    num_terms,
    shard_model,
    sharded_layer_names,
)


def _sub(dense: nn.Module, ratio: float) -> nn.Module:
    """``dense`` (float64) with its top ``ceil(rN)`` terms per sharded layer and ω from 1 to
    20 (ClipLR at τ = 5 scales the steps of the terms with ω > 5)."""
    dense = dense.double()
    indices, omegas = {}, {}
    for name in sharded_layer_names(dense):
        _, _, lam = decompose(dense.get_submodule(name).weight)
        n = num_terms(len(lam), ratio)
        indices[name] = list(range(n))
        omegas[name] = torch.linspace(1.0, 20.0, n, dtype=torch.float64)
    return shard_model(dense, indices, omegas)[0]


def _images(batch: int, channels: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(batch, channels, size, size, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (batch,), generator=g))


def _text(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 81, (batch, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


torch.manual_seed(0)
MODELS = {
    "resnet18-gn": (lambda: resnet18(10, 3, 8, seed=0), lambda: _images(4, 3, 16), 8),
    "char-gpt": (lambda: char_transformer(81, n_embd=12), lambda: _text(3, 20), 3),
    "mlp": (lambda: mlp(64, 10, width=32), lambda: _images(5, 1, 8), 2),
    "cct": (lambda: cct_6_3x2(10, in_channels=3, img_size=16), lambda: _images(2, 3, 16), 7),
}


def _train(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], low: bool,
           steps: int = 3) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model).train()
    recipe = LocalTraining(lr=0.05, momentum=0.9, frobenius_decay=1e-3, clip_lr_tau=5.0)
    step = EagerStep(model, TrainConfig(recipe=recipe, low_memory=low, log_every_epoch=False))
    with torch.random.fork_rng():
        torch.manual_seed(7)  # dropout / drop-path draws, the same in both runs
        for _ in range(steps):
            step(*batch)
    report = step.rules.report()
    assert report.scaled_columns > 0  # ClipLR acted (the comparison covers it)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_low_memory_trains_the_plain_steps_model_in_float64(family: str) -> None:
    build, batch, blocks = MODELS[family]
    sub = _sub(build(), 0.3)
    assert len(blocks_of(sub)) == blocks
    data = batch()
    plain, low = _train(sub, data, False), _train(sub, data, True)
    start = sub.state_dict()
    moved = 0
    for key, want in plain.items():
        if not want.is_floating_point():
            continue
        err = (low[key] - want).norm() / want.norm().clamp_min(1e-300)
        assert err <= 1e-10, (family, key, float(err))
        moved += int(not torch.equal(want, start[key]))
    assert moved > 10  # the steps trained the model: equal models of an untrained run prove little


def _saved_bytes(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                 low: bool) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of one forward."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    x, y = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if low:
            with low_memory(model):
                loss = nn.functional.cross_entropy(model(x), y)
        else:
            loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return sum(seen.values())


def test_low_memory_keeps_the_bottlenecks_and_block_inputs_only() -> None:
    # ResNet-18 at r = 0.1: per block, its input and the n-wide products; a plain factorized
    # block keeps four or five full-width tensors.
    sub = _sub(resnet18(10, 3, 16, seed=0), 0.1).float()
    batch = (_images(8, 3, 16)[0].float(), _images(8, 3, 16)[1])
    plain, low = _saved_bytes(sub, batch, False), _saved_bytes(sub, batch, True)
    assert low < 0.45 * plain, (low, plain)


def test_the_users_own_loop_and_optimizer_with_client_rules() -> None:
    # A project's own loop: its optimizer with fedshard's rules attached, the forward pass
    # inside low_memory(model), backward after it (the blocks are recomputed there).
    sub = _sub(resnet18(10, 3, 8, seed=0), 0.3)
    batch = _images(4, 3, 16)
    recipe = LocalTraining(lr=0.05, frobenius_decay=1e-3, clip_lr_tau=5.0)
    results = []
    for low in (False, True):
        model = copy.deepcopy(sub).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ClientRules.of(model, recipe).attach(opt)
        for _ in range(2):
            opt.zero_grad()
            if low:
                with low_memory(model):
                    loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
            else:
                loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
        results.append(model.state_dict())
    for key, want in results[0].items():
        assert torch.allclose(results[1][key], want, rtol=1e-10, atol=0), key


def test_low_memory_leaves_the_model_as_it_was() -> None:
    sub = _sub(mlp(64, 10, width=32), 0.3)
    keys = list(sub.state_dict())
    with low_memory(sub) as blocks:
        assert blocks and "forward" in vars(sub.net)  # the Sequential's blocks, redirected
    assert "forward" not in vars(sub.net) and list(sub.state_dict()) == keys
    with torch.no_grad(), low_memory(sub):  # no graph: the plain forward, nothing kept
        out = sub(torch.randn(2, 1, 8, 8, dtype=torch.float64))
    assert out.shape == (2, 10)


def test_a_model_without_blocks_trains_as_before_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    # LeNet's sharded layers are attributes of the model itself: no block to recompute.
    sub = _sub(lenet(10, in_channels=1, image_size=28), 0.5)
    assert blocks_of(sub) == []
    with caplog.at_level(logging.WARNING):
        EagerStep(sub, TrainConfig(low_memory=True, log_every_epoch=False))
    assert "found no block to recompute in LeNet" in caplog.text


def test_blocks_of_a_dense_model_are_the_checkpointing_baselines() -> None:
    dense = resnet18(10, 3, 8, seed=0)
    layers = {id(dense.get_submodule(n)) for n in sharded_layer_names(dense)}
    names = [b.name for b in blocks_of(dense, lambda m: id(m) in layers)]
    assert names == [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]
    assert blocks_of(dense) == []  # no sharded layer: nothing is a block


def test_low_memory_refuses_the_fast_path_and_another_step() -> None:
    with pytest.raises(ValueError, match=r"low_memory=True, fast=.*expected low_memory=False"):
        TrainConfig(low_memory=True, fast=FastOptions(compile=True))
    with pytest.raises(ValueError, match=r"low_memory=True.*another step"):
        TrainConfig(low_memory=True, step=lambda model, cfg: EagerStep(model, cfg))
    with pytest.raises(ValueError, match=r"TrainConfig.low_memory=1: expected True or False"):
        TrainConfig(low_memory=1)  # type: ignore[arg-type]


def test_low_memory_refuses_opacus_per_sample_hooks() -> None:
    opacus = pytest.importorskip("opacus")
    sub = _sub(mlp(64, 10, width=32), 0.3).float()
    from fedshard.spectral import register_grad_samplers

    register_grad_samplers()
    wrapped = opacus.GradSampleModule(sub)
    with pytest.raises(ValueError, match="Opacus's per-sample hooks"), low_memory(wrapped):
        pass


def test_a_dense_model_in_low_memory_mode_is_named_as_dense(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        EagerStep(mlp(64, 10, width=32), TrainConfig(low_memory=True, log_every_epoch=False))
    assert "MLP has no sharded layer (a dense model" in caplog.text
    assert "found no block" not in caplog.text
