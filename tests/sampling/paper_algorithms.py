"""Literal transcriptions of the paper's Algorithms 1 and 2 (appendix, "algorithms_listing").

Used only as an independent oracle by the tests and as the baseline of
``benchmarks/bench_sampling.py``; the library solves the same problems by water filling.

Transcription rules: 1-based indices of the pseudo-code become 0-based (``λ_{t+1}`` is
``lam[t]``); the loops over ``t`` and ``u`` are kept as Python loops; the inner "FOR l" loops
that assign a contiguous range and the sums ``Σ`` are written as numpy slice operations (same
work, without Python's per-element overhead, so the benchmark is not inflated by it).
Algorithm 2 reads ``λ_t`` at ``t = 0``, which the pseudo-code leaves undefined; it is taken as
``+∞`` (no term is forced to ``π = 1``).
"""

from __future__ import annotations

import math

import numpy as np


def algorithm1_unbiased(lam: np.ndarray, n: int) -> np.ndarray:
    """Algorithm 1: inclusion probabilities of the Unbiased strategy.

    Requires ``λ₁ >= ... >= λ_N > 0`` and ``0 < n < N``.
    """
    lam = np.asarray(lam, dtype=np.float64)
    big_n = lam.size
    e_star = math.inf  # best criterion value
    pi = np.empty(big_n)
    pi_star = None
    for t in range(0, n):  # t = 0 .. n-1
        cap_lambda = lam[t:].sum()  # Λ_t = Σ_{l=t+1}^{N} λ_l
        if lam[t] < cap_lambda / (n - t):  # λ_{t+1} < Λ_t / (n - t)
            pi[:t] = 1.0  # for l = 1..t
            pi[t:] = (n - t) * lam[t:] / cap_lambda  # for l = t+1..N
            e = (lam**2 * (1.0 / pi - 1.0)).sum()
            if e < e_star:
                e_star = e
                pi_star = pi.copy()
    assert pi_star is not None, "Algorithm 1 found no feasible t (needs λ > 0, 0 < n < N)"
    return pi_star


def algorithm2_collective(lam: np.ndarray, n: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 2: inclusion probabilities and multipliers of the Collective strategy.

    Requires ``λ₁ >= ... >= λ_N > 0``, ``0 < n < N`` and ``C >= 2``.  Returns ``(π*, w*)``;
    like the pseudo-code, ``w = 0`` for terms with ``π = 0``.
    """
    lam = np.asarray(lam, dtype=np.float64)
    big_n = lam.size
    root_c = math.sqrt(c)
    # Consider top-n case first, i.e. t = n, u = 0
    pi = np.zeros(big_n)
    w = np.zeros(big_n)
    pi[:n] = 1.0
    w[:n] = 1.0
    e_star = -(lam[:n] ** 2).sum()
    pi_star, w_star = pi.copy(), w.copy()
    # Other cases
    for t in range(0, n):  # t = 0 .. n-1
        pi[:t] = 1.0
        w[:t] = 1.0
        e_t = -(lam[:t] ** 2).sum()
        lam_t = lam[t - 1] if t >= 1 else math.inf  # λ_t (λ_0 := +∞)
        for u in range(1, big_n - t + 1):  # u = 1 .. N-t
            active = lam[t : t + u]  # λ_{t+1..t+u}
            sqrt_beta = root_c * active.sum() / ((n - t) * (c - 1) + u)
            if (
                lam[t] / root_c < sqrt_beta <= lam_t / root_c
                and sqrt_beta < lam[t + u - 1] * root_c
            ):
                pi[t : t + u] = (active * root_c / sqrt_beta - 1.0) / (c - 1)
                w[t : t + u] = root_c * sqrt_beta / active
                pi[t + u :] = 0.0
                w[t + u :] = 0.0
                e = e_t - c / (c - 1) * (active * (active - sqrt_beta / root_c)).sum()
                if e < e_star:
                    e_star = e
                    pi_star, w_star = pi.copy(), w.copy()
    return pi_star, w_star


def unbiased_objective(lam: np.ndarray, pi: np.ndarray) -> float:
    """Theorem 1: ``E‖W - Ŵ‖²_F = Σ λᵢ² (1/πᵢ - 1)`` (terms with ``λᵢ = 0`` contribute 0)."""
    lam = np.asarray(lam, dtype=np.float64)
    pi = np.asarray(pi, dtype=np.float64)
    keep = lam > 0
    return float((lam[keep] ** 2 * (1.0 / pi[keep] - 1.0)).sum())


def collective_objective(lam: np.ndarray, pi: np.ndarray, omega: np.ndarray, c: int) -> float:
    """Theorem 2: ``E‖W - W̄‖²_F`` for ``C`` i.i.d. clients with multipliers ``ω``."""
    lam = np.asarray(lam, dtype=np.float64)
    pi = np.asarray(pi, dtype=np.float64)
    omega = np.asarray(omega, dtype=np.float64)
    inner = -2.0 + omega / c + omega * pi * (c - 1) / c
    return float((lam**2 * omega * pi * inner).sum() + (lam**2).sum())
