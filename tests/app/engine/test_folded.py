"""The batched engine's folded step (``fedshard_lab.engine.folded``) against two independent
routes, in float64: each client's own autograd step on the unfolded sub-model, and vmap of
grad over the stacked clients (the batched engine's other route). Sub-models of fedshard's
``mlp`` (sharded Linear, LayerNorm), ``resnet18`` (sharded convolutions, GroupNorm) and
``lenet`` (sharded convolution and Linear, pooling, a flatten in its ``forward``), three
clients with different parameters and data, one of them with a padded batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import grad, vmap

from fedshard.models import lenet, mlp, resnet18
from fedshard.spectral import decompose, shard_model
from fedshard.spectral.selection import sharded_layer_names
from fedshard_lab.engine.batched import _client_loss, step_route
from fedshard_lab.engine.folded import fold, foldable, folded_step

C, B = 3, 4


def _submodel(dense: nn.Module, ratio: float) -> nn.Module:
    indices, omegas = {}, {}
    for name in sharded_layer_names(dense):
        _, _, lam = decompose(dense.get_submodule(name).weight)
        n = max(1, int(ratio * len(lam)))
        indices[name] = list(range(n))
        omegas[name] = torch.linspace(1.0, 3.0, n, dtype=torch.float64)
    sub, _ = shard_model(dense, indices, omegas)
    return sub.double().train()


def _case(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "mlp":
        return _submodel(mlp(784, 10, width=12, depth=3).double(), 0.5), \
            torch.randn(C, B, 1, 28, 28, dtype=torch.float64)
    if kind == "lenet":
        return _submodel(lenet(10).double(), 0.5), \
            torch.randn(C, B, 1, 28, 28, dtype=torch.float64)
    return _submodel(resnet18(10, 3, width=4, seed=0).double(), 0.5), \
        torch.randn(C, B, 3, 16, 16, dtype=torch.float64)


def _stacked(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    params = {n: p.detach().unsqueeze(0).repeat(C, *[1] * p.ndim)
              + 0.05 * torch.randn(C, *p.shape, generator=gen, dtype=p.dtype)
              for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: t.detach().unsqueeze(0).repeat(C, *[1] * t.ndim)
               for n, t in [*model.named_buffers(),
                            *((n, p) for n, p in model.named_parameters() if not p.requires_grad)]}
    return params, buffers


@pytest.mark.parametrize("kind", ["mlp", "resnet", "lenet"])
def test_each_client_gets_its_own_gradient(kind: str) -> None:
    model, x = _case(kind)
    assert foldable(model) == [] and step_route(model) == "folded"
    params, buffers = _stacked(model)
    y = torch.randint(0, 10, (C, B), generator=torch.Generator().manual_seed(2))
    weights = torch.ones(C, B, dtype=torch.float64)
    weights[1, -1] = 0  # client 1's batch is one example shorter: padded
    grads, (loss_sum, correct, seen) = folded_step(fold(model))(params, buffers, x, y, weights)
    via_vmap, (v_loss, v_correct, v_seen) = vmap(grad(_client_loss(model), has_aux=True))(
        params, buffers, x, y, weights)
    worst = 0.0
    for c in range(C):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n][c] if n in params else buffers[n][c])
        model.zero_grad(set_to_none=True)
        keep = weights[c] > 0
        logits = model(x[c][keep])
        nn.functional.cross_entropy(logits, y[c][keep]).backward()
        assert torch.allclose(loss_sum[c], nn.functional.cross_entropy(
            logits, y[c][keep], reduction="sum").detach(), rtol=1e-12)
        assert int(seen[c]) == int(keep.sum())
        assert int(correct[c]) == int((logits.argmax(-1) == y[c][keep]).sum())
        for n, p in model.named_parameters():
            if p.requires_grad:
                scale = float(p.grad.abs().max())
                worst = max(worst, float((grads[n][c] - p.grad).abs().max()) / scale,
                            float((grads[n][c] - via_vmap[n][c]).abs().max()) / scale)
    assert worst < 1e-10
    assert torch.allclose(loss_sum, v_loss) and torch.equal(seen, v_seen)
    assert torch.equal(correct, v_correct)


def test_it_names_what_it_cannot_fold() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.conv = nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")
            self.norm = nn.GroupNorm(1, 3, affine=False)
            self.act = nn.GELU()

        def forward(self, x: Any) -> Any:
            return x

    reasons = foldable(Odd())
    assert len(reasons) == 5, reasons
    assert any("model: Odd (a forward folding does not know)" in r for r in reasons)
    assert any("embed: Embedding" in r for r in reasons)
    assert any("padding mode 'reflect'" in r for r in reasons)
    assert any("without affine weights" in r for r in reasons)
    assert any("act: GELU" in r for r in reasons)
    with pytest.raises(TypeError, match="cannot fold the model: model: Odd"):
        fold(Odd())


def test_a_forward_it_does_not_know_is_refused_even_with_known_layers() -> None:
    """Layers folding knows, in a forward that mixes the channels (and so, folded, the
    clients): refused, as no check of the modules could see the mixing."""
    class Mixing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.fc = nn.Linear(4, 2)

        def forward(self, x: Any) -> Any:
            return self.fc(self.conv(x).mean(dim=(1, 2)).unsqueeze(-1).expand(-1, 4))

    assert foldable(Mixing()) == ["model: Mixing (a forward folding does not know)"]
    # and the batched engine's step for it is vmap, with that reason
    assert step_route(Mixing()) == "vmap: model: Mixing (a forward folding does not know)"


def test_targets_per_token_are_refused() -> None:
    model, x = _case("mlp")
    params, buffers = _stacked(model)
    with pytest.raises(ValueError, match="one class per example"):
        folded_step(fold(model))(params, buffers, x, torch.zeros(C, B, 2, dtype=torch.long),
                                 torch.ones(C, B, dtype=torch.float64))
