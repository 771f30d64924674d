"""One round's plan: which terms of which layer each client gets, and their multipliers ω.

Numpy only. :func:`plan_round` takes the singular values λ of every sharded layer and the
sampled clients with their keep ratios, groups the clients by keep ratio, and per group and
layer computes the method's inclusion probabilities π and multipliers ω and draws one subset
of n = ⌈rN⌉ terms per client with the method's sampling design. The names of the methods and
designs, and which design each method uses, live here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedshard.sampling.anneal import ANNEALED_METHODS, annealed_probabilities
from fedshard.sampling.designs import draw_subsets
from fedshard.sampling.entropy import anme
from fedshard.sampling.probabilities import (
    default_prism_exponent,
    inclusion_probabilities,
    scaled_multipliers,
)
from fedshard.sampling.streams import Stream, stream_rng

__all__ = [
    "SAMPLING_DESIGNS",
    "SCALABLE_METHODS",
    "SHARDING_METHODS",
    "RoundPlan",
    "draw_layer",
    "num_terms",
    "plan_round",
]

#: Strategies a run can use (``"none"``: no sharding, FedAvg of the dense model).
SHARDING_METHODS = ("unbiased", "collective", "top-n", "prism", "prism-wallenius",
                    *ANNEALED_METHODS, "none")
#: Designs with exact marginals π, for ``unbiased`` and ``collective`` (and their annealed
#: versions, :mod:`fedshard.sampling.anneal`).
SAMPLING_DESIGNS = ("cps", "brewer", "min-support")
#: Methods whose ω may be replaced by +Scaled's (the others' ω are part of the method).
SCALABLE_METHODS = ("top-n", "prism")

Terms = tuple[np.ndarray, np.ndarray]  # (n,) sorted term indices, (n,) their ω


def num_terms(total: int, keep_ratio: float) -> int:
    """Number of terms ``n = ⌈rN⌉`` a client keeps out of ``N = total`` (paper, Sec. 3.1).

    ``max(1, ceil(r N - 1e-9))``; the ``1e-9`` guards against float error such as
    ``0.07 * 100 = 7.000000000000001`` becoming 8.

    Raises
    ------
    ValueError
        If ``total < 1`` or ``keep_ratio`` is outside ``(0, 1]``.
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"num_terms() expects a number of terms N >= 1, got {total!r}.")
    if not (isinstance(keep_ratio, (int, float)) and 0.0 < keep_ratio <= 1.0):
        raise ValueError(
            f"num_terms() expects a keep ratio r in (0, 1], got {keep_ratio!r}; "
            "no number of terms can be derived from it."
        )
    return max(1, math.ceil(keep_ratio * total - 1e-9))


@dataclass(frozen=True)
class RoundPlan:
    """What :func:`plan_round` decided.

    Attributes
    ----------
    terms : dict
        client -> layer -> ``(indices (n,) int64 sorted, ω (n,) float64)``.
    anme : dict
        ``"anme-r<r>"`` per keep-ratio group (the paper's exploration measure over the
        group's layers) and ``"anme"``, their mean weighted by group size; also
        ``"untrained-energy"``: the share of ``Σ_layers Σᵢ λᵢ²`` held by terms no client can
        draw this round (π = 0 in every group; Top-n: the tail beyond the largest ``⌈rN⌉``).
    """

    terms: dict[int, dict[str, Terms]]
    anme: dict[str, float]


def draw_layer(
    lam: np.ndarray,
    keep_ratio: float,
    num_clients: int,
    method: str,
    design: str,
    rng: np.random.Generator,
    prism_exponent: float | None = None,
    gamma: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Subsets ``(C, n)``, ω ``(N,)`` and π ``(N,)`` of one layer for one keep-ratio group.

    Notes
    -----
    ``unbiased``: Theorem 1 (ω = 1/π); ``collective``: Theorem 2 with C = ``num_clients``
    (ω = C/(1+π(C−1))), both drawn with ``design``. ``prism`` / ``prism-wallenius``: successive
    sampling ∝ λᵏ (numpy's ``choice``; k = ``prism_exponent`` or the paper's default), ω = 1
    or 1/π with π the Wallenius mean. ``top-n``: the n largest terms, ω = 1.
    ``anneal-unbiased`` / ``anneal-collective``: Theorem 1 / 2 on ``λ^gamma``
    (:func:`~fedshard.sampling.anneal.annealed_probabilities`), drawn with ``design``.
    """
    n = num_terms(lam.size, keep_ratio)
    if method in ("prism", "prism-wallenius"):
        k = prism_exponent or default_prism_exponent(n, lam.size)
        pi, omega = inclusion_probabilities(lam, n, method, prism_exponent=k)
        # λ scaled by max λ so λ^k cannot underflow for the leading terms.
        weights = (lam / lam.max()) ** k if lam.max() > 0 else np.ones_like(lam)
        subsets = draw_subsets(pi, num_clients, design="successive", rng=rng, weights=weights)
    elif method == "top-n":
        pi, omega = inclusion_probabilities(lam, n, "top-n")
        subsets = draw_subsets(pi, num_clients, design="top-n", rng=rng)
    elif method in ANNEALED_METHODS:
        pi, omega = annealed_probabilities(lam, n, method, gamma, num_clients)
        subsets = draw_subsets(pi, num_clients, design=design, rng=rng)
    else:
        pi, omega = inclusion_probabilities(lam, n, method, num_clients=num_clients)
        subsets = draw_subsets(pi, num_clients, design=design, rng=rng)
    return np.asarray(subsets, dtype=np.int64), np.asarray(omega, dtype=np.float64), pi


def plan_round(
    spectra: Mapping[str, np.ndarray],
    clients: Sequence[tuple[int, float]],
    method: str,
    design: str,
    *,
    seed: int,
    server_round: int,
    scaled: bool = False,
    prism_exponent: float | None = None,
    gamma: float = 1.0,
) -> RoundPlan:
    """Per client and layer: the term indices and their ω.

    Parameters
    ----------
    spectra : mapping of str to np.ndarray
        Layer -> its singular values λ ``(N,)`` (descending), in a fixed layer order.
    clients : sequence of (int, float)
        ``(client, keep ratio)`` in a canonical order (the strategy orders by stable node key);
        within a keep-ratio group, clients receive the group's subsets in this order.
    method, design : str
        See :data:`SHARDING_METHODS`, :data:`SAMPLING_DESIGNS` and :func:`draw_layer`.
    seed, server_round : int
        The terms of layer ``l`` (its position in ``spectra``) for group ``g`` (groups in
        increasing keep ratio) come from ``default_rng([seed, round, 1, l, g])``.
    scaled : bool
        +Scaled: ω of each client's subset is ``sqrt(Σλ² / Σ_subset λ²)``.
    prism_exponent : float or None
        PriSM's k (``None``: 4 if n/N ≤ 0.2 else 2.5).
    gamma : float
        The spectrum exponent of the annealed methods this round
        (:func:`~fedshard.sampling.anneal.anneal_exponent`); the others ignore it.
    """
    ratios = dict(clients)
    terms: dict[int, dict[str, Terms]] = {c: {} for c, _ in clients}
    groups = sorted(set(ratios.values()))
    metrics: dict[str, float] = {}
    weighted = 0.0
    # layer -> (N,) whether some group can draw the term this round
    reachable = {layer: np.zeros(lam.size, dtype=bool) for layer, lam in spectra.items()}
    for g, ratio in enumerate(groups):
        members = [c for c, r in clients if r == ratio]
        pis = []
        for li, (layer, lam) in enumerate(spectra.items()):
            rng = stream_rng(seed, server_round, Stream.TERMS, li, g)
            subsets, omega, pi = draw_layer(lam, ratio, len(members), method, design, rng,
                                            prism_exponent, gamma)
            pis.append(pi)
            reachable[layer] |= pi > 0
            for client, subset in zip(members, subsets, strict=True):
                if scaled:
                    omega_sub = np.asarray(scaled_multipliers(lam, subset), np.float64)
                else:
                    omega_sub = omega[subset]
                terms[client][layer] = (subset, omega_sub)
        if pis:
            value = float(anme(pis))
            metrics[f"anme-r{ratio:g}"] = value
            weighted += value * len(members)
    if spectra:
        metrics["anme"] = weighted / len(ratios)
        metrics["untrained-energy"] = _untrained_energy(spectra, reachable)
    return RoundPlan(terms, metrics)


def _untrained_energy(spectra: Mapping[str, np.ndarray],
                      reachable: Mapping[str, np.ndarray]) -> float:
    """``Σ_layers Σ_{i unreachable} λᵢ² / Σ_layers Σᵢ λᵢ²`` (0 for an all-zero model)."""
    top = max((float(lam.max()) for lam in spectra.values() if lam.size), default=0.0)
    if top == 0:
        return 0.0
    energy = {k: (lam / top) ** 2 for k, lam in spectra.items()}  # scaled: no overflow
    total = sum(float(e.sum()) for e in energy.values())
    return sum(float(e[~reachable[k]].sum()) for k, e in energy.items()) / total
