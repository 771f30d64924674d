"""Exact sampling core of fedshard (numpy only).

Names: :data:`SHARDING_METHODS` (what a run can use), :data:`SAMPLING_DESIGNS` (the designs with
exact marginals); :data:`METHODS` and :data:`DESIGNS` are the lower-level sets accepted by
:func:`inclusion_probabilities` and :func:`draw_subsets`.

Inclusion probabilities and auxiliary multipliers of the sharding strategies (Unbiased,
Collective, Top-n, PriSM), the sampling designs that realise them (conditional Poisson, Brewer,
minimum support, successive, top-n), Fog's approximation of the Wallenius mean and the ANME
exploration measure of Korzhenkov & Louizos (NeurIPS 2024).

>>> pi, omega = inclusion_probabilities([3.0, 2.0, 1.0, 0.5], 2, "unbiased")
>>> subsets = draw_subsets(pi, 5, design="cps", rng=0)  # (5, 2) sorted term indices
"""

from fedshard.sampling.anneal import (
    ANNEALED_METHODS,
    anneal_exponent,
    annealed_probabilities,
    base_method,
)
from fedshard.sampling.cps import ConditionalPoisson
from fedshard.sampling.designs import (
    DESIGNS,
    Brewer,
    MinimumSupport,
    draw_subsets,
    successive_sample,
)
from fedshard.sampling.entropy import anme, normalized_marginal_entropy
from fedshard.sampling.plan import (
    SAMPLING_DESIGNS,
    SCALABLE_METHODS,
    SHARDING_METHODS,
    RoundPlan,
    draw_layer,
    num_terms,
    plan_round,
)
from fedshard.sampling.probabilities import (
    METHODS,
    default_prism_exponent,
    inclusion_probabilities,
    scaled_multipliers,
)
from fedshard.sampling.streams import Stream, stream_rng
from fedshard.sampling.validation import as_keep_ratio
from fedshard.sampling.wallenius import wallenius_mean

__all__ = [
    "ANNEALED_METHODS",
    "DESIGNS",
    "METHODS",
    "SAMPLING_DESIGNS",
    "SCALABLE_METHODS",
    "SHARDING_METHODS",
    "Brewer",
    "ConditionalPoisson",
    "MinimumSupport",
    "RoundPlan",
    "Stream",
    "anme",
    "anneal_exponent",
    "annealed_probabilities",
    "as_keep_ratio",
    "base_method",
    "default_prism_exponent",
    "draw_layer",
    "draw_subsets",
    "inclusion_probabilities",
    "normalized_marginal_entropy",
    "num_terms",
    "plan_round",
    "scaled_multipliers",
    "stream_rng",
    "successive_sample",
    "wallenius_mean",
]
