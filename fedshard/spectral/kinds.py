"""Which dense layer becomes which spectral layer: the one table that surgery and the layer
selection share."""

from __future__ import annotations

from torch import nn

from fedshard.spectral.conv import SpectralConv2d
from fedshard.spectral.layers import SpectralLayer, SpectralLinear
from fedshard.spectral.transposed import (
    SpectralConvTranspose1d,
    SpectralConvTranspose2d,
    SpectralConvTranspose3d,
)

__all__ = ["SHARDABLE_NAMES", "SPECTRAL_CLASSES"]

#: Exact dense type -> the spectral layer that replaces it (subclasses are not replaced:
#: a subclass may read ``.weight`` itself, as ``nn.MultiheadAttention``'s ``out_proj``).
SPECTRAL_CLASSES: dict[type[nn.Module], type[SpectralLayer]] = {
    nn.Linear: SpectralLinear,
    nn.Conv2d: SpectralConv2d,
    nn.ConvTranspose1d: SpectralConvTranspose1d,
    nn.ConvTranspose2d: SpectralConvTranspose2d,
    nn.ConvTranspose3d: SpectralConvTranspose3d,
}

#: The dense types, as messages name them.
SHARDABLE_NAMES = "nn.Linear, nn.Conv2d and nn.ConvTranspose1d/2d/3d"
