"""The sharded convolutions in the fast path's forms: :func:`configure_convolutions`, the
explicit switch of a model's sharded convolutions to the form fast options ask for.

Both forms compute the same layer as the plain :class:`~fedshard.spectral.SpectralConv2d`
(same module, parameters, ``state_dict`` and function): padding adds zero terms (exactly
nothing to the output and exactly zero gradient; the parameters keep their ``n`` columns),
merging runs one dense convolution of ``U diag(ω) Vᵀ`` (the same function and gradients up to
rounding). The layer computes each form itself (:attr:`SpectralConv2d.pad_terms_to`,
:attr:`SpectralConv2d.merge_terms`); this module sets them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from fedshard.spectral.conv import SpectralConv2d

if TYPE_CHECKING:
    from fedshard.client.train.config import TrainConfig

__all__ = ["configure_convolutions", "conv_form"]


def conv_form(layer: nn.Module) -> tuple[int, bool]:
    """``(pad_terms_to, merge_terms)`` of a sharded convolution (``(1, False)``: the plain
    form)."""
    return (getattr(layer, "pad_terms_to", 1), getattr(layer, "merge_terms", False))


def configure_convolutions(model: nn.Module, cfg: TrainConfig) -> None:
    """Set every :class:`~fedshard.spectral.SpectralConv2d` of ``model`` to the form ``cfg``'s
    fast options train (:func:`~fedshard.client.train.fast.conv_options`), in place, and leave
    it so: each layer's :attr:`~fedshard.spectral.SpectralConv2d.pad_terms_to` and
    :attr:`~fedshard.spectral.SpectralConv2d.merge_terms` (the same module, parameters, buffers
    and hooks). Set them back to 1 and ``False`` to train it in the plain form. The fast step
    calls this before it builds a :class:`~fedshard.client.train.fast.TrainStep`; a step built
    by hand checks it was done.
    """
    from fedshard.client.train.fast.step import conv_options

    pad, merge = conv_options(model, cfg)
    for m in model.modules():
        if isinstance(m, SpectralConv2d):
            m.pad_terms_to = pad
            m.merge_terms = merge
