"""Spectral model sharding on the client side: decomposition, factorized layers, surgery.

Torch only (no Flower). Typical client flow::

    sub = build_submodel(model, {name: LayerFactors(u, v, omega), ...})
    train(sub, loader, cfg)                      # fedshard.client.train.loop
    factors = extract_factors(sub)               # name -> (U, V), sent back to the server

Before the first round, :func:`sharding_budget` says what each keep ratio will receive, send
and compute against the dense model (:func:`budget_summary`, :func:`budget_warnings`), and
``sharded_layer_names(model, policy="by-size", keep_ratio=r)`` picks the layers that hold
the weights. For DP-SGD with Opacus, :func:`register_grad_samplers` gives it the factorized
layers' per-example gradients (:func:`per_sample_gradients`). On a device short of memory,
:func:`low_memory` (``TrainConfig(low_memory=True)`` in fedshard's loop) keeps each block's
rank-n bottlenecks for the backward pass and recomputes its full-width tensors there.
"""

from fedshard.spectral.budget import (
    RatioBudget,
    ShardingBudget,
    UnshardedLayer,
    budget_summary,
    budget_warnings,
    forward_flops,
    sharding_budget,
    submodel_at,
)
from fedshard.spectral.conv import SpectralConv2d
from fedshard.spectral.cost import LayerCost, array_bytes, layer_cost
from fedshard.spectral.decompose import check_indices, compose, decompose, num_terms, take_terms
from fedshard.spectral.layers import SpectralLayer, SpectralLinear
from fedshard.spectral.per_sample import per_sample_gradients, register_grad_samplers
from fedshard.spectral.recompute import blocks_of, low_memory
from fedshard.spectral.selection import (
    LAYER_POLICIES,
    check_shardable,
    multipliers_can_compound,
    shardable_layers,
    sharded_layer_names,
)
from fedshard.spectral.surgery import (
    LayerFactors,
    build_submodel,
    extract_factors,
    shard_model,
)
from fedshard.spectral.transposed import (
    SpectralConvTranspose1d,
    SpectralConvTranspose2d,
    SpectralConvTranspose3d,
)

__all__ = [
    "LAYER_POLICIES",
    "LayerCost",
    "LayerFactors",
    "RatioBudget",
    "ShardingBudget",
    "SpectralConv2d",
    "SpectralConvTranspose1d",
    "SpectralConvTranspose2d",
    "SpectralConvTranspose3d",
    "SpectralLayer",
    "SpectralLinear",
    "UnshardedLayer",
    "array_bytes",
    "blocks_of",
    "budget_summary",
    "budget_warnings",
    "build_submodel",
    "check_indices",
    "check_shardable",
    "compose",
    "decompose",
    "extract_factors",
    "forward_flops",
    "layer_cost",
    "low_memory",
    "multipliers_can_compound",
    "num_terms",
    "per_sample_gradients",
    "register_grad_samplers",
    "shard_model",
    "shardable_layers",
    "sharded_layer_names",
    "sharding_budget",
    "submodel_at",
    "take_terms",
]
