"""The factor step that moves ``W = U Ω Vᵀ`` as a dense step would (``factor-step = "dense"``):
the dense model's learning rate then works for the factorized one.

Why it is needed: the received factors carry ``√λ`` each, so plain SGD on ``U`` and ``V``
moves ``W`` by ``-η (G·VΩ²Vᵀ + UΩ²Uᵀ·G)`` to first order (``G = ∂L/∂W``): term ``i``'s
direction takes ``2 ω_i² λ_i`` times the dense step. Trained layers' top singular values are
above 1 (1.3-2.4 in LeNet, the MLP and ResNet-18 on Fashion-MNIST), so along their strongest
terms the same lr is a 2.6-4.7 times larger step (more with ω > 1), and an lr at which the
dense model trains can diverge (``docs/results.md``).

The fix is a gradient transform, applied to the factors' gradients before the optimizer's step
by the client rules (:class:`~fedshard.client.train.rules.ClientRules` with
``factor_step="dense"``), with fedshard's loop and with any optimizer that steps a received
shard. Made for SGD (with momentum): an adaptive optimizer such as Adam rescales every
coordinate itself, and its step does not follow the gradient's scale. The paper's plain factor
step stays the default.
"""

from __future__ import annotations

from typing import Any

import torch

from fedshard.settings import FACTOR_STEPS  # re-exported: the setting's values

__all__ = ["DAMPING", "FACTOR_STEPS", "dense_factor_gradient", "dense_layer_gradients"]

#: Relative damping δ of the Gram matrices: ``(BᵀB + δ·tr(BᵀB)/n · I)⁻¹``. Keeps the step of a
#: term with a near-zero singular value finite (its factor step is at most ``1/δ`` times the
#: plain one at the mean singular value); the others' steps change by about δ (relative).
DAMPING = 1e-3


@torch.no_grad()
def dense_factor_gradient(grad: torch.Tensor, factor: torch.Tensor, other: torch.Tensor,
                          omega: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """The gradient that makes an SGD step on ``factor`` a share of the dense step of ``W``.

    Parameters
    ----------
    grad : torch.Tensor
        ``(rows, n)``: ``∂L/∂factor`` (data loss, plus Frobenius decay if applied).
    factor : torch.Tensor
        ``(rows, n)``: the factor being updated (``U`` or ``V``).
    other : torch.Tensor
        ``(rows', n)``: the other factor (``V`` or ``U``).
    omega : torch.Tensor
        ``(n,)`` multipliers ω.
    damping : float
        δ ≥ 0, see :data:`DAMPING`.

    Returns
    -------
    torch.Tensor
        ``(rows, n)`` in ``grad``'s dtype: ``(I - ½ P_A) · grad · (BᵀB + εI)⁻¹`` with
        ``A = factor·Ω``, ``B = other·Ω``, ``P_A = A (AᵀA + εI)⁻¹ Aᵀ``.

    Notes
    -----
    With ``∂L/∂U = G V Ω`` and ``∂L/∂V = Gᵀ U Ω`` the two transformed steps move
    ``W = U Ω Vᵀ`` by ``-η (P_U G + G P_V - P_U G P_V)`` to first order (``P_U``, ``P_V`` the
    orthogonal projections onto the columns of ``U`` and ``V``): the dense step ``-η G``
    projected orthogonally (in the Frobenius inner product) onto the tangent space of the
    matrices of rank ``n`` at ``W``. So it is never larger than the dense step, it does not
    depend on λ or ω, and with all terms (keep ratio 1) one of ``P_U``, ``P_V`` is the identity
    and it *is* the dense step. The factor ``(BᵀB)⁻¹`` is scaled gradient descent for low-rank
    factors (Tong, Ma & Chi 2021, "Accelerating ill-conditioned low-rank matrix estimation via
    scaled gradient descent", JMLR 22(150)) with ω folded into the factors; ScaledGD alone gives
    ``-η (P_U G + G P_V)``, twice the dense step on the common part, which ``(I - ½P_A)``
    removes. Frobenius decay's gradient ``2γ U Ω VᵀV Ω`` becomes ``2γ U``: the dense weight
    decay ``2γ W`` of ``γ‖W‖²_F``.
    """
    work = torch.promote_types(grad.dtype, torch.float32)  # half precision is solved in float32
    a = factor.detach().to(work) * omega.to(work)  # (rows, n)
    b = other.detach().to(work) * omega.to(work)  # (rows', n)
    return _transform(grad, a, _gram_inverse(a, damping), _gram_inverse(b, damping))


@torch.no_grad()
def dense_layer_gradients(layer: Any, damping: float = DAMPING
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`dense_factor_gradient` of ``layer.u.grad`` and ``layer.v.grad`` (``None`` stays
    ``None``), the two Gram inverses computed once for both."""
    u, v = layer.u, layer.v
    grads = (u.grad, v.grad)
    if grads == (None, None):
        return None, None
    work = torch.promote_types(u.dtype, torch.float32)
    a = u.detach().to(work) * layer.omega.to(work)  # U Ω, (c_out, n)
    b = v.detach().to(work) * layer.omega.to(work)  # V Ω, (fan_in, n)
    inv_a, inv_b = _gram_inverse(a, damping), _gram_inverse(b, damping)
    gu = None if grads[0] is None else _transform(grads[0], a, inv_a, inv_b)
    gv = None if grads[1] is None else _transform(grads[1], b, inv_b, inv_a)
    return gu, gv


def _transform(grad: torch.Tensor, a: torch.Tensor, inv_a: torch.Tensor,
               inv_b: torch.Tensor) -> torch.Tensor:
    """``(I - ½ P_A) grad (BᵀB + εI)⁻¹`` from the inverses of both damped Gram matrices."""
    step = grad.to(a.dtype) @ inv_b  # (rows, n)
    step = step - 0.5 * (a @ (inv_a @ (a.mT @ step)))  # minus ½ A (AᵀA + εI)⁻¹ Aᵀ step
    return step.to(grad.dtype)


def _gram_inverse(x: torch.Tensor, damping: float) -> torch.Tensor:
    """``(xᵀx + εI)⁻¹``, ``ε = δ·tr(xᵀx)/n``, by Cholesky (``cholesky_ex``: no host sync;
    the explicit n x n inverse is cheaper to apply than two triangular solves)."""
    gram = x.mT @ x  # (n, n)
    eps = damping * torch.diagonal(gram).mean() + torch.finfo(gram.dtype).tiny
    chol, _ = torch.linalg.cholesky_ex(gram + torch.diag(eps.expand(gram.shape[0])))
    return torch.cholesky_inverse(chol)
