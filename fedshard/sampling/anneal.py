"""Exploration schedules: from Top-n's exploitation to the optimum of Theorem 1 or 2.

Top-n trains the leading terms from the first round (fast start) but never the others;
Unbiased and Collective explore (a better end, a slower start; paper Sec. 5 names the slow start
as future work). Any inclusion probabilities π with ``Σ π = n`` and ``ω = 1/π`` give an unbiased
sub-model, so there is a path between the two. These schedules walk it with a *temperature on
the spectrum*: in round t the method of Theorem 1 or 2 is applied to ``λ^γ_t`` instead of ``λ``,

    γ_t = 1 + (γ₀ − 1) · ½ (1 + cos(π · min(t − 1, T) / T)),

so γ_1 = γ₀ (large γ: π concentrates on the leading terms, nearly Top-n) and γ_t = 1 from round
T + 1 on (exactly Theorem 1 / Theorem 2).

Numpy only.
"""

from __future__ import annotations

import math

import numpy as np

from fedshard.sampling.probabilities import inclusion_probabilities

__all__ = ["ANNEALED_METHODS", "anneal_exponent", "annealed_probabilities", "base_method"]

#: Annealed methods and the theorem each anneals toward.
ANNEALED_METHODS = ("anneal-unbiased", "anneal-collective")


def base_method(method: str) -> str:
    """``"unbiased"`` / ``"collective"`` for an annealed method, the method itself otherwise."""
    return method.removeprefix("anneal-") if method in ANNEALED_METHODS else method


def anneal_exponent(server_round: int, exponent: float, rounds: int) -> float:
    """The spectrum exponent γ_t of round ``server_round`` (1-based).

    Parameters
    ----------
    server_round : int
        ``t >= 1``.
    exponent : float
        ``γ₀ >= 1``, the exponent of round 1.
    rounds : int
        ``T >= 1``: γ reaches 1 at round ``T + 1`` and stays there.

    Notes
    -----
    ``γ_t = 1 + (γ₀ − 1) · ½ (1 + cos(π · min(t − 1, T) / T))`` (a cosine ramp, like the lr).
    """
    if server_round < 1 or rounds < 1 or not (math.isfinite(exponent) and exponent >= 1):
        raise ValueError(f"anneal_exponent(server_round={server_round}, exponent={exponent}, "
                         f"rounds={rounds}): expected t >= 1, γ₀ >= 1 and T >= 1.")
    progress = min(server_round - 1, rounds) / rounds
    return 1.0 + (exponent - 1.0) * 0.5 * (1.0 + math.cos(math.pi * progress))


def annealed_probabilities(lam: np.ndarray, n: int, method: str, gamma: float,
                           num_clients: int) -> tuple[np.ndarray, np.ndarray]:
    """π and ω of an annealed method at spectrum exponent ``gamma``.

    Notes
    -----
    ``anneal-unbiased``: Theorem 1's π applied to ``λ^γ``, i.e. ``πᵢ = min(1, c λᵢ^γ)`` with c
    fixed by ``Σ π = n``, and ``ω = 1/π``: ``E[Σ zᵢ ωᵢ λᵢ uᵢ vᵢᵀ] = W`` for every γ (each
    term's expectation is ``πᵢ · λᵢ/πᵢ``). ``anneal-collective``: Theorem 2's π on ``λ^γ``
    with ``C = num_clients`` and ``ω = C / (1 + π (C − 1))`` (bounded by C; not unbiased,
    like Collective itself). At ``γ = 1`` both are exactly Theorem 1 / Theorem 2.
    """
    lam = np.asarray(lam, dtype=np.float64)
    top = lam.max() if lam.size else 0.0
    # λ scaled by max λ so λ^γ cannot overflow; π is invariant to the scale of the spectrum.
    powered = (lam / top) ** gamma if top > 0 else lam
    return inclusion_probabilities(powered, n, base_method(method), num_clients=num_clients)
