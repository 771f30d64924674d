"""The sharded convolutions in the fast path's forms: :class:`FastSpectralConv2d` and
:func:`configure_convolutions`, the explicit switch of a model's sharded convolutions to them.

Both forms compute the same layer as :class:`~fedshard.spectral.SpectralConv2d` (same
parameters, ``state_dict`` and function): padding adds zero terms (exactly nothing to the
output and exactly zero gradient; the parameters keep their ``n`` columns), merging runs one
dense convolution of ``U diag(ω) Vᵀ`` (the same function and gradients up to rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.spectral.conv import SpectralConv2d

if TYPE_CHECKING:
    from fedshard.client.train.config import TrainConfig

__all__ = ["FastSpectralConv2d", "configure_convolutions", "conv_form"]


class FastSpectralConv2d(SpectralConv2d):
    """A :class:`~fedshard.spectral.SpectralConv2d` trained in a fast form.

    Attributes
    ----------
    pad_terms_to : int
        Pad the ``n`` intermediate channels with zero terms to a multiple of this (1: off):
        cuDNN runs thin convolutions whose channel count is not a multiple of 8 on slower
        kernels (``benchmarks/README.md``). Only the real ``n`` columns are
        parameters, so what is trained and sent is unchanged.
    merge_terms : bool
        Run one dense k×k convolution with the kernel ``U diag(ω) Vᵀ`` built each step instead
        of the two thin ones: the same map and gradients of ``u``, ``v`` (autograd through the
        product), fewer and larger kernels (a step bound by kernel launches or latency, as a
        small sub-model's on a GPU) for the dense FLOPs.
    """

    pad_terms_to: int = 1
    merge_terms: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(B, in_channels, H, W)``."""
        v: torch.Tensor = self.v
        u = self.u * self.omega  # ω folded into the 1x1 conv's (c_out, n) weight
        if self.merge_terms:
            # (c_out, n) @ (n, c_in·k_h·k_w), reshaped as decompose() flattens W
            weight = (u @ v.mT).reshape(u.shape[0], self.in_channels, *self.kernel_size)
            return self._spatial_conv(x, weight, self.bias)
        rank = self.rank
        pad = -rank % self.pad_terms_to
        if pad:
            v, u = F.pad(v, (0, pad)), F.pad(u, (0, pad))  # zero columns n .. n+pad-1
            rank += pad
        kernel = v.mT.reshape(rank, self.in_channels, *self.kernel_size)
        hidden = self._spatial_conv(x, kernel, None)
        return F.conv2d(hidden, u[:, :, None, None], self.bias)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, pad_terms_to={self.pad_terms_to}, "
                f"merge_terms={self.merge_terms}")


def conv_form(layer: nn.Module) -> tuple[int, bool]:
    """``(pad_terms_to, merge_terms)`` of a sharded convolution (``(1, False)``: the plain
    layer)."""
    return (getattr(layer, "pad_terms_to", 1), getattr(layer, "merge_terms", False))


def configure_convolutions(model: nn.Module, cfg: TrainConfig) -> None:
    """Set every :class:`~fedshard.spectral.SpectralConv2d` of ``model`` to the form ``cfg``'s
    fast options train (:func:`~fedshard.client.train.fast.conv_options`), in place, and leave
    it so: a layer becomes a :class:`FastSpectralConv2d` (the same object, parameters and
    buffers) with ``pad_terms_to`` and ``merge_terms`` set. Set the two attributes back to 1
    and ``False`` to train it as the plain layer. The fast step calls this before it builds
    a :class:`~fedshard.client.train.fast.TrainStep`; a step built by hand checks it was done.
    """
    from fedshard.client.train.fast.step import conv_options

    pad, merge = conv_options(model, cfg)
    for m in model.modules():
        if isinstance(m, SpectralConv2d):
            if not isinstance(m, FastSpectralConv2d):
                m.__class__ = FastSpectralConv2d  # the same module, in the fast path's form
            assert isinstance(m, FastSpectralConv2d)
            m.pad_terms_to = pad
            m.merge_terms = merge
