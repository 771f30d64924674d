"""Spectral model sharding on the client side: decomposition, factorized layers, surgery.

Torch only (no Flower). Typical client flow::

    sub = build_submodel(model, {name: LayerFactors(u, v, omega), ...})
    train(sub, loader, cfg)                      # fedshard.client.train.loop
    factors = extract_factors(sub)               # name -> (U, V), sent back to the server
"""

from fedshard.spectral.conv import SpectralConv2d
from fedshard.spectral.decompose import check_indices, compose, decompose, num_terms, take_terms
from fedshard.spectral.layers import SpectralLayer, SpectralLinear
from fedshard.spectral.selection import (
    check_shardable,
    multipliers_can_compound,
    sharded_layer_names,
)
from fedshard.spectral.surgery import (
    LayerFactors,
    build_submodel,
    extract_factors,
    shard_model,
)

__all__ = [
    "LayerFactors",
    "SpectralConv2d",
    "SpectralLayer",
    "SpectralLinear",
    "build_submodel",
    "check_indices",
    "check_shardable",
    "compose",
    "decompose",
    "extract_factors",
    "multipliers_can_compound",
    "num_terms",
    "shard_model",
    "sharded_layer_names",
    "take_terms",
]
