"""The optimizer side of local training: ClipLR and Frobenius decay (paper, Sec. 3.3).

Usable with any training loop: wrap any optimizer in :class:`ClipLR`, add
:func:`frobenius_penalty` to the loss (or :class:`FrobeniusDecay`'s gradient after
``backward()``, which fedshard's own step does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedshard.client.train.config import finite_real
from fedshard.spectral.layers import SpectralLayer

__all__ = ["ClipLR", "FrobeniusDecay", "frobenius_penalty"]


class ClipLR(torch.optim.Optimizer):
    """Optimizer scaling the gradient of factor column ``i`` by ``min(1, τ/ω_i)``, then stepping.

    A real :class:`torch.optim.Optimizer` that wraps another one: parameter groups, state,
    ``state_dict()`` / ``load_state_dict()``, ``zero_grad`` and learning-rate schedulers all act
    on the wrapped optimizer, which owns them.

    In your own training loop, wrap any optimizer over the model's parameters, e.g.
    ``opt = ClipLR(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, tau=10)``.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The wrapped optimizer (e.g. SGD with momentum).
    model : nn.Module
        Its :class:`~fedshard.spectral.SpectralLayer` modules provide ``(u, v, ω)``.
    tau : float or None
        Threshold ``τ > 0``; ``None`` makes the wrapper a pass-through.

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
    ``DPOptimizer``. ω is a frozen buffer: the scales are computed once per ``omega`` tensor
    (again only if a layer's ``omega`` is replaced, e.g. by ``model.to(device)``) and applied
    with one fused ``torch._foreach_mul_`` over all factor gradients.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, tau: float | None
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"ClipLR wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "build e.g. torch.optim.SGD(model.parameters(), ...) first."
            )
        if tau is not None and (not finite_real(tau) or tau <= 0):
            raise ValueError(f"ClipLR tau={tau!r}: expected a finite number > 0 or None.")
        # Optimizer.__init__ is not called: it would build a second set of parameter groups.
        # Groups, state and defaults stay the wrapped optimizer's (Opacus' DPOptimizer does
        # the same); only the hook tables the base class' step wrapper needs are set up here.
        self.optimizer = optimizer
        self.tau = tau
        self.layers = [m for m in model.modules() if isinstance(m, SpectralLayer)]
        self._scales: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    # -- the rule ----------------------------------------------------------------------------
    def column_scale(self, omega: torch.Tensor) -> torch.Tensor:
        """Per-column gradient factor ``min(1, τ/ω)``, shape ``(n,)``."""
        assert self.tau is not None
        return torch.clamp(self.tau / omega, max=1.0)

    def _factor_scales(self, layer: SpectralLayer, index: int) -> tuple[torch.Tensor, ...]:
        """``column_scale(ω)`` broadcast to ``u``'s and ``v``'s shapes, cached per ω tensor."""
        cached = self._scales.get(index)
        if cached is None or cached[0] is not layer.omega:
            scale = self.column_scale(layer.omega)  # (n,)
            # Full-shape copies so that the fused multiply takes the multi-tensor fast path
            # (it needs equal shapes); (rows, n) each, as small as the factors.
            cached = (
                layer.omega,
                scale.expand_as(layer.u).contiguous(),
                scale.expand_as(layer.v).contiguous(),
            )
            self._scales[index] = cached
        return cached[1:]

    @torch.no_grad()
    def refresh_scales_(self) -> None:
        """Recompute the cached scales in place from the layers' current ω.

        For a step that reuses this optimizer for another model of the same shapes, whose ω
        was copied into the same tensors (:class:`fedshard.client.train.fast.StepPool`): a replayed
        CUDA graph reads the cached scale tensors, so they are refilled, not replaced.
        """
        if self.tau is None:
            return
        for index, (omega, scale_u, scale_v) in self._scales.items():
            layer = self.layers[index]
            assert omega is layer.omega, "refresh_scales_ after ω was replaced, not copied"
            scale = self.column_scale(layer.omega)  # (n,)
            scale_u.copy_(scale.expand_as(scale_u))
            scale_v.copy_(scale.expand_as(scale_v))

    @torch.no_grad()
    def clip_gradients(self) -> None:
        """Scale ``u.grad`` and ``v.grad`` of every spectral layer in place, column by column."""
        if self.tau is None:
            return
        grads: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for index, layer in enumerate(self.layers):
            for factor, scale in zip(
                (layer.u, layer.v), self._factor_scales(layer, index), strict=True
            ):
                if factor.grad is not None:
                    grads.append(factor.grad)  # (rows, n)
                    scales.append(scale)  # (rows, n)
        if grads:
            torch._foreach_mul_(grads, scales)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Evaluate ``closure`` (if given), clip the factor gradients, step the wrapped optimizer.

        Returns
        -------
        float or None
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.clip_gradients()
        self.optimizer.step()
        return loss

    # -- everything else belongs to the wrapped optimizer -------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forward to the wrapped optimizer."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Forward to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (ClipLR itself has no state beyond ``tau``)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (schedulers edit their ``lr`` here)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (momentum buffers)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __repr__(self) -> str:
        return f"ClipLR(tau={self.tau}, {self.optimizer!r})"


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
        Its :class:`~fedshard.spectral.SpectralLayer` modules; their ω is read once here.
    gamma : float
        ``γ >= 0``.

    Notes
    -----
    With ``G_U = U^T U`` and ``G_V = V^T V`` (``n x n``) the penalty is
    ``γ tr(Ω G_U Ω G_V)`` (paper, Sec. 3.3), so ``∂/∂U = U (2γ ωω^T ⊙ G_V)`` and
    ``∂/∂V = V (2γ ωω^T ⊙ G_U)``: two Gram products and two ``addmm_`` per layer plus one
    fused multiply for all layers, instead of differentiating the penalty through autograd
    (the same gradient to rounding, without a forward graph and ~3x fewer kernels). The
    matrices ``2γ ωω^T`` are built once, since ω is frozen during local training.
    """

    def __init__(self, model: nn.Module, gamma: float) -> None:
        self.gamma = gamma
        self.layers = [m for m in model.modules() if isinstance(m, SpectralLayer)]
        # 2γ ωω^T, (n, n) per layer
        self.weights = [2.0 * gamma * torch.outer(m.omega, m.omega) for m in self.layers]

    @torch.no_grad()
    def refresh_(self) -> None:
        """Rebuild ``2γ ωω^T`` in place from the layers' current ω (see
        :meth:`ClipLR.refresh_scales_`: a replayed graph reads these tensors)."""
        for weight, m in zip(self.weights, self.layers, strict=True):
            weight.copy_(2.0 * self.gamma * torch.outer(m.omega, m.omega))

    @torch.no_grad()
    def add_gradient_(self) -> None:
        """``u.grad += ∂/∂U``, ``v.grad += ∂/∂V`` for every layer (``None`` grads become it)."""
        if self.gamma == 0 or not self.layers:
            return
        grams = [m.u.mT @ m.u for m in self.layers] + [m.v.mT @ m.v for m in self.layers]
        mixed = torch._foreach_mul(grams, self.weights + self.weights)  # 2γ ωω^T ⊙ G, (n, n)
        count = len(self.layers)
        for i, layer in enumerate(self.layers):
            # U's gradient mixes with V's Gram matrix and vice versa
            for factor, weight in ((layer.u, mixed[count + i]), (layer.v, mixed[i])):
                if not factor.requires_grad:
                    continue
                if factor.grad is None:
                    factor.grad = torch.zeros_like(factor)
                factor.grad.addmm_(factor, weight)  # (rows, n) += (rows, n) @ (n, n)

