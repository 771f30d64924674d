"""fedshard's training step (the client rules on torch's SGD) against an independent
reference written here, in float64: the trained parameters agree to 1e-12 (relative).

The reference is the paper's recipe (Sec. 3.3) written out with no fedshard code and no
torch optimizer: the loss ``CE + γ Σ ‖U Ω Vᵀ‖²_F`` differentiated by autograd (not the rules'
analytic gradient), ClipLR as the paper states it (each factor column's *gradient* scaled by
``min(1, τ/ω_i)`` before momentum), weight decay on every parameter that is not a factor,
and heavy-ball momentum ``b ← μ b + g``, ``θ ← θ − η b`` by hand. Which parameters are
factors it decides from their names (``<layer>.u`` / ``<layer>.v`` of a layer with an
``omega`` buffer), not by the library's grouping. fedshard scales each column's *move*
instead (the same for SGD with momentum: ``s`` is constant, the buffer is linear in the
gradients), so this is also the proof that the two forms of ClipLR agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedshard.client.train import TrainConfig, train
from fedshard.models import resnet18
from fedshard.settings import LocalTraining
from fedshard.spectral import SpectralLinear, shard_model

# ---------------------------------------------------------------------------------------------
# REFERENCE: the paper's local training, by hand.
# ---------------------------------------------------------------------------------------------


def _factor_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> module, for every module with trainable ``u``, ``v`` and a frozen
    ``omega`` (a parameter without gradient)."""
    return {name: m for name, m in model.named_modules()
            if {"u", "v", "omega"} <= set(dict(m.named_parameters(recurse=False)))
            and m.u.requires_grad and m.v.requires_grad and not m.omega.requires_grad}


def _reference_penalty(layers: dict[str, nn.Module]) -> torch.Tensor:
    """Σ ‖U Ω Vᵀ‖²_F = Σ tr(Ω UᵀU Ω VᵀV) (differentiated by autograd; the trace form keeps
    float64 rounding at the level of the rules' analytic gradient, which forming the dense
    weight would not)."""
    total = torch.zeros((), dtype=torch.float64)
    for m in layers.values():
        gram_u, gram_v = m.u.mT @ m.u, m.v.mT @ m.v  # (n, n)
        total = total + (gram_u * gram_v * torch.outer(m.omega, m.omega)).sum()
    return total


def _reference_train(model: nn.Module, loader: DataLoader[Any], recipe: LocalTraining,
                     seed: int) -> None:
    model.train()
    layers = _factor_layers(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    momenta: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        for _ in range(recipe.local_epochs):
            for inputs, targets in loader:
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(inputs), targets.long())
                if recipe.frobenius_decay:
                    loss = loss + recipe.frobenius_decay * _reference_penalty(layers)
                loss.backward()
                with torch.no_grad():
                    for name, p in params.items():
                        owner, _, part = name.rpartition(".")
                        g = p.grad.clone()
                        if owner in layers and part in ("u", "v"):
                            if recipe.clip_lr_tau is not None:
                                omega = layers[owner].omega
                                g = g * torch.clamp(recipe.clip_lr_tau / omega, max=1.0)
                        else:
                            g = g + recipe.weight_decay * p
                        b = g if name not in momenta else recipe.momentum * momenta[name] + g
                        momenta[name] = b
                        p -= recipe.base_lr * b


# ---------------------------------------------------------------------------------------------
# End of the reference.
# ---------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _resnet_submodel() -> nn.Module:
    """A float64 ResNet-18 (width 8) sub-model, ω from 1 to 30 so that ClipLR (τ = 10) bites."""
    dense = resnet18(num_classes=5, width=8, seed=0).double()
    layers = {
        "layer1.0.conv1": [0, 2, 4],
        "layer1.1.conv2": [1, 3],
        "layer2.0.conv1": [0, 1, 2, 5],
        "layer3.0.downsample.0": [1, 5],
        "layer4.1.conv2": [0, 7, 9],
    }
    omegas = {
        name: torch.linspace(1.0, 30.0, len(i), dtype=torch.float64) for name, i in layers.items()
    }
    sub, _ = shard_model(dense, layers, omegas)
    return sub


def _mlp() -> nn.Module:
    g = _gen(3)
    first = SpectralLinear(
        torch.randn(12, 4, generator=g, dtype=torch.float64) / 2,
        torch.randn(6, 4, generator=g, dtype=torch.float64) / 2,
        torch.tensor([0.5, 3.0, 11.0, 14.0], dtype=torch.float64),
        torch.randn(12, generator=g, dtype=torch.float64),
    )
    second = SpectralLinear(
        torch.randn(3, 2, generator=g, dtype=torch.float64),
        torch.randn(12, 2, generator=g, dtype=torch.float64),
        torch.tensor([12.0, 1.0], dtype=torch.float64),
        None,
    )
    return nn.Sequential(first, nn.Tanh(), second)


def _images() -> TensorDataset:
    g = _gen(4)
    x = torch.randn(12, 3, 8, 8, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, 5, (12,), generator=g))


def _vectors() -> TensorDataset:
    g = _gen(5)
    x = torch.randn(20, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, 3, (20,), generator=g))


def _assert_same_state(got: nn.Module, want: nn.Module) -> None:
    want_state = want.state_dict()
    for key, value in got.state_dict().items():
        ref = want_state[key]
        scale = ref.abs().max().clamp_min(1e-300)
        err = float((value - ref).abs().max() / scale)
        assert err <= 1e-12, f"{key}: max |Δ| / max |ref| = {err:.3g} > 1e-12"


@pytest.mark.parametrize(
    ("build", "data", "batch"), [(_resnet_submodel, _images, 4), (_mlp, _vectors, 6)]
)
@pytest.mark.parametrize(
    ("clip_lr_tau", "gamma", "weight_decay"),
    [(10.0, 1e-2, 0.0), (None, 1e-4, 0.1), (2.0, 0.0, 0.0)],
)
def test_training_matches_the_papers_recipe_by_hand_in_float64(
    build: Callable[[], nn.Module],
    data: Callable[[], TensorDataset],
    batch: int,
    clip_lr_tau: float | None,
    gamma: float,
    weight_decay: float,
) -> None:
    torch.set_num_threads(1)
    # lr 0.01: at 0.05 the MLP (ω up to 14) diverges in its second epoch, where float64
    # rounding grows exponentially and no two orders of operations agree to 1e-12
    recipe = LocalTraining(local_epochs=2, lr=0.01, momentum=0.9, frobenius_decay=gamma,
                           clip_lr_tau=clip_lr_tau, weight_decay=weight_decay)
    cfg = TrainConfig(recipe=recipe, log_every_epoch=False, torch_seed=3)
    # the last batch of _vectors is short (20 = 3 * 6 + 2): a different shape on purpose
    loader = DataLoader(data(), batch_size=batch, shuffle=True)
    reference, fused = build(), build()
    _reference_train(reference, loader, recipe, seed=3)
    result = train(fused, loader, cfg)
    _assert_same_state(fused, reference)
    if clip_lr_tau is not None:  # ClipLR acts: some ω above τ
        assert result.rules is not None and result.rules.scaled_columns > 0
    moved = sum(
        float((a - b).abs().max())
        for a, b in zip(fused.state_dict().values(), build().state_dict().values(), strict=True)
    )
    assert moved > 1e-3  # the comparison is not between two untouched models
