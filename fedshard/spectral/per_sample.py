"""Per-example gradients of the factorized layers, for DP-SGD: :func:`per_sample_gradients`.

DP-SGD clips each example's gradient before summing (Abadi et al. 2016, Algorithm 1), so it
needs the gradient of every parameter for every example of a batch. Opacus computes them from
what a layer saw (its input, the *activations*) and what came back (the gradient of the loss
with respect to its output, the *backprops*), with one formula per layer type, its *grad
sampler*; for a layer type it has none for, it falls back to ``torch.func`` (a ``vmap`` of the
layer's gradient, which re-runs the layer per example and leaves a local function on the layer
that cannot be pickled). :func:`register_grad_samplers` gives Opacus the formulas of
:class:`~fedshard.spectral.layers.SpectralLinear` and
:class:`~fedshard.spectral.conv.SpectralConv2d`: exact, a few products of the skinny
factors, the same whichever form (:attr:`~fedshard.spectral.conv.SpectralConv2d.merge_terms`,
padded terms) the forward pass takes. ω is frozen and gets none.

This module imports no Opacus at import time: :func:`per_sample_gradients` is plain torch, and
:func:`register_grad_samplers` imports Opacus when it is called (fedshard calls it when a shard
is received with Opacus already imported, and when the client rules are attached to an Opacus
``DPOptimizer``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.spectral.conv import SpectralConv2d
from fedshard.spectral.layers import SpectralLayer, SpectralLinear

__all__ = ["per_sample_gradients", "register_grad_samplers", "register_if_opacus_loaded"]


def per_sample_gradients(layer: SpectralLayer, activations: Sequence[torch.Tensor] | torch.Tensor,
                         backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Each example's gradient of ``layer``'s trainable ``u``, ``v`` and ``bias``.

    Parameters
    ----------
    layer : SpectralLayer
        A :class:`SpectralLinear` or :class:`SpectralConv2d`.
    activations : torch.Tensor or sequence of one
        The layer's input: ``(B, ..., in_features)`` or ``(B, c_in, H, W)`` (Opacus passes a
        list holding it).
    backprops : torch.Tensor
        ``∂L/∂output`` per example: ``(B, ..., out_features)`` or ``(B, c_out, H', W')``,
        for the loss whose per-example gradients are wanted (Opacus scales a mean loss's by
        the batch size first).

    Returns
    -------
    dict of nn.Parameter to torch.Tensor
        ``u`` → ``(B, c_out, n)``, ``v`` → ``(B, fan_in, n)``, ``bias`` → ``(B, c_out)``,
        for those that require a gradient; in ``backprops``' dtype.

    Raises
    ------
    TypeError
        For a layer of another type.

    Notes
    -----
    With ``y = U Ω Vᵀ x + b`` per position, ``h = Vᵀ x`` ``(n,)`` and ``g = ∂L/∂y``: ``∂L/∂U =
    Σ_pos g (ω ⊙ h)ᵀ``, ``∂L/∂V = Σ_pos x (ω ⊙ Uᵀ g)ᵀ``, ``∂L/∂b = Σ_pos g``, summed per
    example over its positions (a sequence's tokens; a convolution's output pixels, with ``x``
    the unfolded input patch, as Opacus's own ``nn.Conv2d`` sampler does).
    """
    x = activations if isinstance(activations, torch.Tensor) else activations[0]
    x = x.to(backprops.dtype)
    if isinstance(layer, SpectralConv2d):
        x, g = _patches(layer, x), backprops.flatten(2)  # (B, fan_in, L), (B, c_out, L)
        batch = g.shape[0]
    elif isinstance(layer, SpectralLinear):
        batch = backprops.shape[0]
        # tokens of one example along one axis: (B, L, in), (B, L, out)
        x = x.reshape(batch, -1, x.shape[-1]).mT  # (B, in, L)
        g = backprops.reshape(batch, -1, backprops.shape[-1]).mT  # (B, out, L)
    else:
        raise TypeError(f"per_sample_gradients() expects a SpectralLinear or SpectralConv2d, "
                        f"got {type(layer).__name__}; no gradient was computed.")
    omega = layer.omega.detach().to(g.dtype)
    u, v = layer.u.detach().to(g.dtype), layer.v.detach().to(g.dtype)
    out: dict[nn.Parameter, torch.Tensor] = {}
    if layer.u.requires_grad:
        hidden = torch.einsum("bfl,fn->bnl", x, v)  # Vᵀ x per position, (B, n, L)
        out[layer.u] = torch.einsum("bol,bnl->bon", g, hidden) * omega  # (B, c_out, n)
    if layer.v.requires_grad:
        back = torch.einsum("on,bol->bnl", u, g)  # Uᵀ g per position, (B, n, L)
        out[layer.v] = torch.einsum("bfl,bnl->bfn", x, back) * omega  # (B, fan_in, n)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = g.sum(dim=2)  # (B, c_out)
    assert all(t.shape[0] == batch for t in out.values())
    return out


def _patches(layer: SpectralConv2d, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, c_in, H, W)`` unfolded into the patches the k×k convolution sees,
    ``(B, c_in·k_h·k_w, L)``, rows ordered as ``v``'s (channel, then kernel row, column)."""
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    if any(layer._pad):
        x = F.pad(x, layer._pad, mode=mode)
    return F.unfold(x, layer.kernel_size, dilation=layer.dilation, padding=0,
                    stride=layer.stride)


def register_grad_samplers() -> None:
    """Give Opacus :func:`per_sample_gradients` as the grad sampler of
    :class:`SpectralLinear` and :class:`SpectralConv2d` (idempotent).

    Opacus keeps its grad samplers in one table per process, keyed by layer class; this adds
    fedshard's two classes to it and changes nothing for any other layer. Opacus looks the
    table up at every backward pass, so a model made private before this call uses these
    formulas from its next step on.

    Raises
    ------
    ModuleNotFoundError
        Without Opacus (``pip install "fedshard[dp]"``).
    """
    from opacus.grad_sample import register_grad_sampler

    register_grad_sampler([SpectralLinear, SpectralConv2d])(per_sample_gradients)


def register_if_opacus_loaded() -> bool:
    """:func:`register_grad_samplers` if Opacus is already imported in this process (nothing
    is imported otherwise); whether it was."""
    if "opacus" not in sys.modules:
        return False
    register_grad_samplers()
    return True
