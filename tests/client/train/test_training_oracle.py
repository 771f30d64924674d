"""The fused training step against the pre-change step (float64, trained factors to 1e-12).

``_Reference*`` / ``_reference_*`` below are the REFERENCE IMPLEMENTATION: a literal copy of
the penalty, ClipLR and training-step logic of ``fedshard/client/train/loop.py`` at commit 20529be
(before the fused training step), with logging and the per-epoch bookkeeping removed. It
adds ``γ Σ ‖U Ω V^T‖_F^2`` to the loss and differentiates it with autograd, scales the factor
gradients layer by layer and checks the loss on the host every step. Do not "update" it to
follow the library: its whole point is to be independent of the code under test.
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
from fedshard.spectral import SpectralLayer, SpectralLinear, shard_model

# ---------------------------------------------------------------------------------------------
# REFERENCE IMPLEMENTATION, copied from fedshard/client/train/loop.py at commit 20529be.
# ---------------------------------------------------------------------------------------------


class _ReferenceClipLR:
    def __init__(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, tau: float | None
    ) -> None:
        self.optimizer = optimizer
        self.tau = tau
        self.layers = [m for m in model.modules() if isinstance(m, SpectralLayer)]

    def column_scale(self, omega: torch.Tensor) -> torch.Tensor:
        assert self.tau is not None
        return torch.clamp(self.tau / omega, max=1.0)

    @torch.no_grad()
    def clip_gradients(self) -> None:
        if self.tau is None:
            return
        for layer in self.layers:
            scale = self.column_scale(layer.omega)  # (n,), broadcast over rows
            for factor in (layer.u, layer.v):
                if factor.grad is not None:
                    factor.grad.mul_(scale)  # (rows, n) * (n,)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self.clip_gradients()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _reference_build_optimizer(model: nn.Module, cfg: TrainConfig) -> _ReferenceClipLR:
    factors: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, SpectralLayer):
            factors += [p for p in (m.u, m.v) if p.requires_grad]
    factor_ids = {id(p) for p in factors}
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in factor_ids]
    groups: list[dict[str, Any]] = []
    if factors:
        groups.append({"params": factors, "weight_decay": 0.0})
    if dense:
        groups.append({"params": dense, "weight_decay": cfg.weight_decay})
    sgd = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return _ReferenceClipLR(sgd, model, cfg.clip_lr_tau)


def _reference_frobenius_penalty(model: nn.Module) -> torch.Tensor:
    terms = []
    for m in model.modules():
        if isinstance(m, SpectralLayer):
            gram_u = m.u.mT @ m.u  # (n, n)
            gram_v = m.v.mT @ m.v  # (n, n)
            terms.append((gram_u * gram_v * torch.outer(m.omega, m.omega)).sum())
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()


def _reference_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (B*T, C)
    flat_targets = targets.reshape(-1)  # (B*T,)
    valid = flat_targets != -100
    loss_sum = F.cross_entropy(flat_logits, flat_targets, reduction="sum")
    correct = ((flat_logits.argmax(dim=-1) == flat_targets) & valid).sum()
    return loss_sum, correct, int(valid.sum())


def _reference_train(model: nn.Module, loader: DataLoader[Any], cfg: TrainConfig) -> None:
    model.train()
    optimizer = _reference_build_optimizer(model, cfg)
    gamma = cfg.frobenius_decay
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(cfg.seed)
        for epoch in range(cfg.local_epochs):
            for inputs, targets in loader:
                targets = targets.long()
                optimizer.zero_grad(set_to_none=True)
                loss_sum, _correct, count = _reference_cross_entropy(model(inputs), targets)
                loss = loss_sum / max(count, 1)
                if gamma > 0:
                    loss = loss + gamma * _reference_frobenius_penalty(model)
                if not bool(torch.isfinite(loss)):
                    raise FloatingPointError(
                        f"training loss became {loss.item()} in epoch {epoch + 1}; training "
                        "stopped. Lower the learning rate or enable ClipLR (clip_lr_tau)."
                    )
                loss.backward()
                optimizer.step()


# ---------------------------------------------------------------------------------------------
# End of the reference implementation.
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
def test_fused_step_matches_the_reference_step_in_float64(
    build: Callable[[], nn.Module],
    data: Callable[[], TensorDataset],
    batch: int,
    clip_lr_tau: float | None,
    gamma: float,
    weight_decay: float,
) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(
        local_epochs=2,
        lr=0.05,
        momentum=0.9,
        frobenius_decay=gamma,
        clip_lr_tau=clip_lr_tau,
        weight_decay=weight_decay,
        log_every_epoch=False,
        seed=3,
    )
    # the last batch of _vectors is short (20 = 3 * 6 + 2): a different shape on purpose
    loader = DataLoader(data(), batch_size=batch, shuffle=True)
    reference, fused = build(), build()
    _reference_train(reference, loader, cfg)
    train(fused, loader, cfg)
    _assert_same_state(fused, reference)
    moved = sum(
        float((a - b).abs().max())
        for a, b in zip(fused.state_dict().values(), build().state_dict().values(), strict=True)
    )
    assert moved > 1e-3  # the comparison is not between two untouched models
