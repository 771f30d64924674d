"""Exact sampling core of fedshard (numpy only).

Inclusion probabilities and auxiliary multipliers of the sharding strategies (Unbiased,
Collective, Top-n, PriSM), the sampling designs that realise them (conditional Poisson, Brewer,
minimum support, successive, top-n), Fog's approximation of the Wallenius mean and the ANME
exploration measure of Korzhenkov & Louizos (NeurIPS 2024).

>>> pi, omega = inclusion_probabilities([3.0, 2.0, 1.0, 0.5], 2, "unbiased")
>>> subsets = draw_subsets(pi, 5, design="cps", rng=0)  # (5, 2) sorted term indices
"""

from fedshard.sampling.cps import ConditionalPoisson
from fedshard.sampling.designs import (
    DESIGNS,
    Brewer,
    MinimumSupport,
    draw_subsets,
    successive_sample,
)
from fedshard.sampling.entropy import anme, normalized_marginal_entropy
from fedshard.sampling.probabilities import (
    METHODS,
    default_prism_exponent,
    inclusion_probabilities,
    scaled_multipliers,
)
from fedshard.sampling.wallenius import wallenius_mean

__all__ = [
    "DESIGNS",
    "METHODS",
    "Brewer",
    "ConditionalPoisson",
    "MinimumSupport",
    "anme",
    "default_prism_exponent",
    "draw_subsets",
    "inclusion_probabilities",
    "normalized_marginal_entropy",
    "scaled_multipliers",
    "successive_sample",
    "wallenius_mean",
]
