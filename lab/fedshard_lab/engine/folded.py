"""A round's clients folded into the channels of one model: :func:`fold` and :func:`folded_step`.

The batched engine trains ``C`` clients of equal sub-model shapes together. ``torch.func.vmap``
over their stacked parameters does that for any model, but it turns each convolution into a
grouped one and runs GroupNorm's backward, which has no batching rule, as a dozen elementwise
operations and reductions: about 3.6 times one client's kernels for ten clients
(``benchmarks/bench_batched_kernels.py``). Folding does the grouping by hand instead. Client
``c``'s channels (or features) are the ``c``-th block of one model's: its inputs are
``(B, C·in, H, W)``, every convolution runs grouped by client, GroupNorm with ``C`` times its
groups, LayerNorm and the linear layers per client, so that autograd runs every operation's
own fused backward once for all the clients: about one client's kernels for all of them.

The folded model keeps the sub-model's parameter names and takes the clients' stacked
tensors (``(C, ...)`` per name) through :func:`torch.func.functional_call`, so the stacked
tensors are the leaves an optimizer steps. Each client's gradient is the gradient of its own
mean loss, the same numbers as one client's step up to rounding
(``tests/app/engine/test_engine_equality.py`` runs the batched engine against Flower's path in
float64).

Folded: ``nn.Conv2d`` (zero padding), :class:`~fedshard.spectral.SpectralConv2d` (zero
padding, neither padded nor merged terms), ``nn.GroupNorm``, ``nn.LayerNorm`` over the last
dimension, ``nn.Linear`` and :class:`~fedshard.spectral.SpectralLinear` on ``(B, features)``,
and modules without parameters or buffers that act on each channel or feature alone (ReLU,
pooling, flatten), inside the forwards of fedshard's ``mlp``, ``resnet18`` (its residual
blocks) and ``lenet`` and of ``nn.Sequential``. Another model's forward could mix the
channels, and so the clients, where no check of its modules can see it: :func:`foldable`
names such a forward and every module beyond that list, and the batched engine then uses vmap.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedshard.spectral.conv import SpectralConv2d
from fedshard.spectral.layers import SpectralLinear

__all__ = ["fold", "foldable", "folded_step"]

#: Modules without parameters that act on each channel or feature alone: folding keeps them.
_PER_CHANNEL = (nn.ReLU, nn.Identity, nn.Flatten, nn.AdaptiveAvgPool2d, nn.AvgPool2d,
                nn.MaxPool2d)


def _known_forwards() -> tuple[type, ...]:
    """The modules with children whose ``forward`` keeps each client's channels apart once
    folded (it only calls its children, ``flatten(1)``, additions and per-element
    functions): a forward that mixes channels (a mean over them, a ``view`` with sizes) would
    mix the clients, which no check of the modules could see, so any other is refused."""
    from torchvision.models.resnet import BasicBlock

    from fedshard.models.lenet import LeNet
    from fedshard.models.mlp import MLP
    from fedshard.models.resnet import ResNet
    return (nn.Sequential, MLP, ResNet, LeNet, BasicBlock)


def foldable(model: nn.Module) -> list[str]:
    """Why ``model`` cannot be folded (empty: it can), one reason per module."""
    reasons = []
    known = _known_forwards()
    for name, m in model.named_modules():
        where = f"{name or 'model'}: {type(m).__name__}"
        if any(True for _ in m.children()) and type(m) not in known:
            reasons.append(f"{where} (a forward folding does not know)")
        elif isinstance(m, SpectralConv2d):
            if m.padding_mode != "zeros" or m.merge_terms or m.pad_terms_to != 1:
                reasons.append(f"{where} with padding mode {m.padding_mode!r}, merged or "
                               "padded terms")
        elif isinstance(m, nn.Conv2d):
            if m.padding_mode != "zeros":
                reasons.append(f"{where} with padding mode {m.padding_mode!r}")
        elif isinstance(m, nn.LayerNorm):
            if len(m.normalized_shape) != 1:
                reasons.append(f"{where} over {len(m.normalized_shape)} dimensions")
        elif isinstance(m, nn.GroupNorm):
            if not m.affine:
                reasons.append(f"{where} without affine weights")
        elif isinstance(m, (nn.Linear, SpectralLinear, *_PER_CHANNEL)):
            continue
        elif any(True for _ in m.parameters(recurse=False)) or any(
                True for _ in m.buffers(recurse=False)):
            reasons.append(f"{where} (not a layer folding knows)")
        elif not any(True for _ in m.children()) and type(m) not in known:
            reasons.append(f"{where} (a leaf module folding does not know)")
    return reasons


class _Folded(nn.Module):
    """A folded layer: the sub-layer's tensors by their names, set by ``functional_call``
    to the clients' stacked tensors (``(C, ...)``)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    u: torch.Tensor  # sharded layers: (C, out, n)
    v: torch.Tensor  # (C, in·k·k or f, n)
    omega: torch.Tensor  # (C, n)

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        for name, t in [*layer.named_parameters(recurse=False),
                        *layer.named_buffers(recurse=False)]:
            self.register_buffer(name, torch.empty(0, dtype=t.dtype), persistent=False)
        for name in ("bias", "weight"):  # an absent bias or affine weight stays None
            if getattr(layer, name, None) is None and hasattr(layer, name):
                setattr(self, name, None)


class _Conv(_Folded):
    def __init__(self, layer: nn.Conv2d) -> None:
        super().__init__(layer)
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation
        self.groups = layer.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C·in, H, W)
        w = self.weight
        assert w is not None  # a convolution always has one
        c = w.shape[0]  # (C, out, in/g, k, k)
        bias = None if self.bias is None else self.bias.reshape(-1)
        return F.conv2d(x, w.reshape(-1, *w.shape[2:]), bias, self.stride, self.padding,
                        self.dilation, c * self.groups)


class _SpectralConv(_Folded):
    def __init__(self, layer: SpectralConv2d) -> None:
        super().__init__(layer)
        self.in_channels, self.kernel_size = layer.in_channels, layer.kernel_size
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C·in, H, W)
        c, _, n = self.v.shape  # v: (C, in·k·k, n); u: (C, out, n); ω: (C, n)
        kernel = self.v.mT.reshape(c * n, self.in_channels, *self.kernel_size)
        hidden = F.conv2d(x, kernel, None, self.stride, self.padding, self.dilation, c)
        uw = (self.u * self.omega[:, None, :]).reshape(-1, n, 1, 1)  # (C·out, n, 1, 1)
        bias = None if self.bias is None else self.bias.reshape(-1)
        return F.conv2d(hidden, uw, bias, groups=c)  # (B, C·out, H', W')


class _GroupNorm(_Folded):
    def __init__(self, layer: nn.GroupNorm) -> None:
        super().__init__(layer)
        self.num_groups, self.eps = layer.num_groups, layer.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C·ch, ...)
        w, b = self.weight, self.bias  # (C, ch) each
        assert w is not None and b is not None  # foldable() refuses one without affine weights
        return F.group_norm(x, w.shape[0] * self.num_groups, w.reshape(-1), b.reshape(-1),
                            self.eps)


def _per_client(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(B, C·f)`` features as ``(B, C, f)``."""
    return x.reshape(x.shape[0], c, -1)


class _LayerNorm(_Folded):
    def __init__(self, layer: nn.LayerNorm) -> None:
        super().__init__(layer)
        self.eps = layer.eps
        self.features = layer.normalized_shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C·f)
        per = x.reshape(x.shape[0], -1, self.features)  # (B, C, f)
        y = F.layer_norm(per, (self.features,), None, None, self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(x.shape)


class _Linear(_Folded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C·f)
        w = self.weight  # (C, out, f)
        assert w is not None
        y = torch.einsum("bcf,cof->bco", _per_client(x, w.shape[0]), w)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(x.shape[0], -1)  # (B, C·out)


class _SpectralLinear(_Folded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C·f)
        c = self.v.shape[0]  # v: (C, f, n); u: (C, out, n); ω: (C, n)
        hidden = torch.einsum("bcf,cfn->bcn", _per_client(x, c), self.v)
        y = torch.einsum("bcn,con->bco", hidden, self.u * self.omega[:, None, :])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(x.shape[0], -1)  # (B, C·out)


def fold(model: nn.Module) -> nn.Module:
    """``model``'s folded form (a copy; ``model`` is not changed): the same structure and
    parameter names, each layer acting on every client's channels at once. Call it with
    :func:`torch.func.functional_call` and the clients' stacked tensors.

    Raises
    ------
    TypeError
        If ``model`` has a module folding does not know (:func:`foldable`).
    """
    reasons = foldable(model)
    if reasons:
        raise TypeError(f"cannot fold the model: {'; '.join(reasons[:3])}")
    out = copy.deepcopy(model)
    for name, m in list(out.named_modules()):
        new: nn.Module | None = None
        if isinstance(m, SpectralConv2d):
            new = _SpectralConv(m)
        elif isinstance(m, nn.Conv2d):
            new = _Conv(m)
        elif isinstance(m, nn.GroupNorm):
            new = _GroupNorm(m)
        elif isinstance(m, nn.LayerNorm):
            new = _LayerNorm(m)
        elif isinstance(m, SpectralLinear):
            new = _SpectralLinear(m)
        elif isinstance(m, nn.Linear):
            new = _Linear(m)
        if new is not None:
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, child, new)
    return out


def folded_step(folded: nn.Module) -> Any:
    """A function of ``(params, buffers, inputs, targets, weights)`` with the clients' stacked
    tensors, ``(C, B, ...)`` inputs, ``(C, B)`` class targets and ``(C, B)`` example weights
    (0: padding), returning each client's gradient of its own weighted mean cross-entropy
    (``(C, ...)`` per trainable name) and its ``(loss sum, correct, weight sum)``, each
    ``(C,)``: what ``vmap(grad(loss, has_aux=True))`` returns for the same loss."""

    def step(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
             inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
             ) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
        if targets.ndim != 2:
            raise ValueError(f"targets of shape {tuple(targets.shape)}: the folded step takes "
                             "one class per example, (C, B)")
        c, b = targets.shape
        leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
        x = inputs.transpose(0, 1).reshape(b, c * inputs.shape[2], *inputs.shape[3:])
        logits = functional_call(folded, {**buffers, **leaves}, (x,))  # (B, C·classes)
        logits = logits.reshape(b, c, -1)  # (B, C, classes)
        w = weights.T * (targets.T != -100).to(weights.dtype)  # (B, C)
        per_target = F.cross_entropy(logits.permute(0, 2, 1), targets.T, reduction="none")
        loss_sum = (per_target * w).sum(0)  # (C,)
        seen = w.sum(0)
        correct = ((logits.argmax(-1) == targets.T).to(w.dtype) * w).sum(0)
        # each client's term depends on its own tensors only: the sum's gradient is each one's
        objective = (loss_sum / seen.clamp_min(1)).sum()
        names = list(leaves)
        grads = torch.autograd.grad(objective, [leaves[n] for n in names], allow_unused=True)
        # a tensor the loss does not reach gets a zero gradient, as vmap(grad) gives it
        out = {n: torch.zeros_like(leaves[n]) if g is None else g
               for n, g in zip(names, grads, strict=True)}
        return out, (loss_sum.detach(), correct, seen)

    return step
