"""The optimizer side of local training (paper, Sec. 3.3): SGD with momentum over two
parameter groups (:func:`build_optimizer`), ClipLR (:class:`ClipLR`) and Frobenius decay
(:func:`frobenius_penalty`, :class:`FrobeniusDecay`).

Usable with any training loop: :func:`attach_client_rules` puts both rules on the factors'
gradients (what :func:`fedshard.client.receive` does by default, so a plain loop with any
optimizer applies them); or attach :class:`ClipLR` to an optimizer and add
:func:`frobenius_penalty` to the loss (or :class:`FrobeniusDecay`'s gradient after
``backward()``, which fedshard's own step does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedshard.client.train.config import TrainConfig, finite_real
from fedshard.client.train.hooks import before_step
from fedshard.client.train.precondition import (
    FACTOR_STEPS,
    DenseFactorStep,
    dense_factor_gradient,
)
from fedshard.spectral.layers import SpectralLayer

__all__ = ["ClipLR", "FrobeniusDecay", "attach_client_rules", "build_optimizer",
           "frobenius_penalty"]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.SGD:
    """SGD with momentum for ``model``, with :class:`ClipLR` attached (if ``cfg.clip_lr_tau``)
    and, under ``cfg.factor_step == "dense"``, :class:`DenseFactorStep` before it.

    Parameters
    ----------
    model : nn.Module
        The (sub-)model to train.
    cfg : TrainConfig
        Provides ``lr``, ``momentum``, ``weight_decay`` and ``clip_lr_tau``.

    Returns
    -------
    torch.optim.SGD
        A plain torch optimizer (``zero_grad``, ``step``, ``state_dict``, schedulers) with two
        parameter groups: the spectral factors ``u``, ``v`` with ``weight_decay=0`` (they get
        Frobenius decay instead, see :func:`frobenius_penalty`), and all other trainable
        parameters with ``cfg.weight_decay``. Empty groups are left out. Each ``step()``
        transforms the factor gradients first (step pre-hooks: the dense factor step if
        asked, then ClipLR).

    Raises
    ------
    ValueError
        If ``model`` has no trainable parameter.
    """
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
    if not groups:
        raise ValueError("the model has no trainable parameters; there is nothing to train.")
    sgd = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.factor_step == "dense":
        DenseFactorStep(sgd, model)  # registered first: ClipLR scales its gradient
    ClipLR(sgd, model, cfg.clip_lr_tau)  # registers itself on sgd; sgd keeps it alive
    return sgd


class ClipLR:
    """Scales the gradient of factor column ``i`` by ``min(1, τ/ω_i)`` before each step of an
    optimizer.

    Attaches to any :class:`torch.optim.Optimizer` through its public
    :meth:`~torch.optim.Optimizer.register_step_pre_hook`: the optimizer stays what it was
    (its parameter groups, state, ``state_dict()``, learning-rate schedulers), and every
    ``optimizer.step()`` scales the factor gradients first. In your own training loop::

        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ClipLR(opt, model, tau=10)  # then opt.zero_grad(); loss.backward(); opt.step()

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer to attach to (e.g. SGD with momentum).
    model : nn.Module
        Its :class:`~fedshard.spectral.SpectralLayer` modules provide ``(u, v, ω)``.
    tau : float or None
        Threshold ``τ > 0``; ``None`` attaches nothing (the optimizer is left as it is).

    Attributes
    ----------
    handle : torch.utils.hooks.RemovableHandle or None
        The registered hook (``None`` when ``tau`` is ``None`` or ``model`` has no spectral
        layer: then there is nothing to scale); :meth:`remove` detaches it.

    Raises
    ------
    TypeError
        If ``optimizer`` is not a ``torch.optim.Optimizer``.
    ValueError
        If ``tau`` is not ``None`` or a finite number ``> 0``.

    Notes
    -----
    Paper, Sec. 3.3 ("Effective learning rate"): since ``∂L/∂U = (∂L/∂Ŵ) V Ω`` the multiplier
    ``ω_i`` scales the effective learning rate of ``u'_i`` and ``v'_i``;
    ``∂L/∂u'_i <- ∂L/∂u'_i · min(1, τ/ω_i)`` (and the same for ``v'_i``) bounds it by ``τ``
    times the nominal rate. The scaling acts on the full gradient (data loss plus Frobenius
    decay) right before the step, so momentum accumulates the clipped gradients. The rule is
    the one method :meth:`column_scale` (override it for another rule), as in Opacus'
    ``DPOptimizer``. It is evaluated from the layers' current ω at every step, so ω may be
    replaced or overwritten (``load_state_dict``) between steps. With a closure
    (``step(closure)``) the closure runs first, then the scaling, then the step; optimizers
    that evaluate the closure several times per step (L-BFGS) are not supported.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, tau: float | None
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"ClipLR attaches to a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "build e.g. torch.optim.SGD(model.parameters(), ...) first."
            )
        if tau is not None and (not finite_real(tau) or tau <= 0):
            raise ValueError(f"ClipLR tau={tau!r}: expected a finite number > 0 or None.")
        self.tau = tau
        self.layers = [m for m in model.modules() if isinstance(m, SpectralLayer)]
        # no spectral layer, nothing to scale: no hook (one call less in every step)
        self.handle = None if tau is None or not self.layers else \
            optimizer.register_step_pre_hook(before_step(self.clip_gradients))

    def column_scale(self, omega: torch.Tensor) -> torch.Tensor:
        """Per-column gradient factor ``min(1, τ/ω)``, shape ``(n,)``."""
        assert self.tau is not None
        return torch.clamp(self.tau / omega, max=1.0)

    @torch.no_grad()
    def clip_gradients(self) -> None:
        """Scale ``u.grad`` and ``v.grad`` of every spectral layer in place, column by column."""
        if self.tau is None:
            return
        for layer in self.layers:
            scale = self.column_scale(layer.omega)  # (n,), broadcast over the rows
            for factor in (layer.u, layer.v):
                if factor.grad is not None:
                    factor.grad.mul_(scale)  # (rows, n)

    def remove(self) -> None:
        """Detach from the optimizer: later steps are the optimizer's own."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tau={self.tau}, layers={len(self.layers)})"


def frobenius_penalty(model: nn.Module) -> torch.Tensor:
    """``Σ_layers ‖U Ω V^T‖_F^2`` over the spectral layers of ``model`` (differentiable).

    Parameters
    ----------
    model : nn.Module
        The sub-model.

    Returns
    -------
    torch.Tensor
        Scalar; ``0.`` if there are no spectral layers.

    Notes
    -----
    Frobenius decay (paper, Sec. 3.3, after Khodak et al. 2022); each term comes from
    ``n x n`` Gram matrices, see :meth:`SpectralLayer.frobenius_norm_sq`. :func:`train` does
    not differentiate this: it adds the analytic gradient, see :class:`FrobeniusDecay`.
    """
    terms = [m.frobenius_norm_sq() for m in model.modules() if isinstance(m, SpectralLayer)]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()


class FrobeniusDecay:
    """Adds the gradient of ``γ Σ_layers ‖U Ω V^T‖_F^2`` to the factor gradients in place.

    Parameters
    ----------
    model : nn.Module
        Its :class:`~fedshard.spectral.SpectralLayer` modules.
    gamma : float
        ``γ >= 0``.

    Notes
    -----
    With ``G_U = U^T U`` and ``G_V = V^T V`` (``n x n``) the penalty is
    ``γ tr(Ω G_U Ω G_V)`` (paper, Sec. 3.3), so ``∂/∂U = U (2γ ωω^T ⊙ G_V)`` and
    ``∂/∂V = V (2γ ωω^T ⊙ G_U)``: per layer two small Gram products and two ``addmm_``
    instead of differentiating the penalty through autograd (the same gradient to rounding,
    without a forward graph). ``2γ ωω^T`` is built from the layers' current ω at each call.
    """

    def __init__(self, model: nn.Module, gamma: float) -> None:
        self.gamma = gamma
        self.layers = [m for m in model.modules() if isinstance(m, SpectralLayer)]

    @torch.no_grad()
    def add_gradient_(self) -> None:
        """``u.grad += ∂/∂U``, ``v.grad += ∂/∂V`` for every layer (``None`` grads become it)."""
        if self.gamma == 0:
            return
        for layer in self.layers:
            weight = 2.0 * self.gamma * torch.outer(layer.omega, layer.omega)  # 2γ ωω^T, (n, n)
            gram_u, gram_v = layer.u.mT @ layer.u, layer.v.mT @ layer.v  # (n, n) each
            # U's gradient mixes with V's Gram matrix and vice versa
            for factor, gram in ((layer.u, gram_v), (layer.v, gram_u)):
                if not factor.requires_grad:
                    continue
                if factor.grad is None:
                    factor.grad = torch.zeros_like(factor)
                factor.grad.addmm_(factor, gram * weight)  # (rows, n) += (rows, n) @ (n, n)


def attach_client_rules(model: nn.Module, gamma: float, tau: float | None,
                        factor_step: str = "plain") -> list[torch.utils.hooks.RemovableHandle]:
    """Put Frobenius decay, ClipLR and the factor step on the gradients of every factor ``u``,
    ``v`` of ``model``, so that any loop and any optimizer applies them.

    Parameters
    ----------
    model : nn.Module
        Its :class:`~fedshard.spectral.SpectralLayer` modules provide ``(u, v, ω)``.
    gamma : float
        Frobenius decay's γ ≥ 0 (0: none).
    tau : float or None
        ClipLR's τ > 0 (``None``: none).
    factor_step : str
        ``"plain"`` (the paper's) or ``"dense"``: the gradient becomes
        :func:`~fedshard.client.train.precondition.dense_factor_gradient`'s, so that an SGD
        step moves ``W = U Ω Vᵀ`` as a dense step at the same lr.

    Returns
    -------
    list of RemovableHandle
        One per hooked factor; ``handle.remove()`` takes the rule off.

    Notes
    -----
    A gradient hook per factor (``Tensor.register_hook``) returns, for column i,
    ``(∂L/∂u_i + ∂R/∂u_i) · min(1, τ/ω_i)`` with ``R = γ ‖U Ω Vᵀ‖²_F`` (paper, Sec. 3.3;
    ``∂R/∂U = U (2γ ωωᵀ ⊙ VᵀV)``, :class:`FrobeniusDecay`) and the same for ``v``; with
    ``factor_step="dense"`` the dense-step transform comes between the two. That is
    fedshard's step exactly (decay added after ``backward()``, then the transform and ClipLR
    on the full gradient before ``step()``): all are linear in the gradient and read only the
    factors (unchanged during ``backward()``), so applying them before it reaches ``.grad``
    is the same for SGD, momentum included. The decay is added once per
    ``backward()``: with gradient accumulation over k backward passes per step it counts k
    times (divide γ by k). ω is read from the layer at each call.
    """
    bad_tau = tau is not None and (not finite_real(tau) or tau <= 0)
    if not finite_real(gamma) or gamma < 0 or bad_tau or factor_step not in FACTOR_STEPS:
        raise ValueError(f"attach_client_rules(gamma={gamma!r}, tau={tau!r}, factor_step="
                         f"{factor_step!r}): expected γ ≥ 0, τ > 0 or None and a factor step "
                         f"in {FACTOR_STEPS}; no rule was attached.")
    handles: list[torch.utils.hooks.RemovableHandle] = []
    dense = factor_step == "dense"
    if gamma == 0 and tau is None and not dense:
        return handles
    for layer in (m for m in model.modules() if isinstance(m, SpectralLayer)):
        for factor, other in ((layer.u, layer.v), (layer.v, layer.u)):
            if factor.requires_grad:
                handles.append(factor.register_hook(
                    _rule(layer, factor, other, gamma, tau, dense)))
    return handles


def _rule(layer: SpectralLayer, factor: torch.Tensor, other: torch.Tensor, gamma: float,
          tau: float | None, dense: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:  # (rows, n)
        with torch.no_grad():
            omega = layer.omega.to(grad.dtype)
            if gamma:
                weight = 2.0 * gamma * torch.outer(omega, omega)  # 2γ ωωᵀ, (n, n)
                grad = grad + factor.detach() @ ((other.detach().mT @ other.detach()) * weight)
            if dense:
                grad = dense_factor_gradient(grad, factor, other, omega)
            if tau is not None:
                grad = grad * torch.clamp(tau / omega, max=1.0)  # (n,) over the rows
        return grad

    return hook
