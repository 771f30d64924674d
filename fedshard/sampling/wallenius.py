"""Mean of the multivariate Wallenius distribution (Fog's approximation).

PriSM draws the ``n`` terms one by one with probability proportional to ``λᵢᵏ`` among the terms
not drawn yet (``numpy.random.Generator.choice(..., replace=False, p=...)``).  With one ball per
colour this is the urn of the multivariate Wallenius noncentral hypergeometric distribution, and
its mean vector is the vector of inclusion probabilities.  The exact mean needs an integral per
colour (or an enumeration); the paper uses Fog's closed-form approximation instead, as
implemented by BiasedUrn's ``meanMWNCHypergeo(..., precision = 0.1)``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from fedshard.sampling.validation import as_nonnegative_vector, as_sample_size

__all__ = ["wallenius_mean"]

logger = logging.getLogger(__name__)

_MAX_ITER = 200


def wallenius_mean(weights: Any, n: Any) -> np.ndarray:
    """Approximate mean of the multivariate Wallenius distribution with one ball per colour.

    Parameters
    ----------
    weights : array_like, shape (N,)
        Nonnegative odds ``ωᵢ`` (PriSM uses ``λᵢᵏ``); only their ratios matter.
    n : int
        Number of balls drawn, ``1 <= n <= N``.

    Returns
    -------
    mean : np.ndarray, shape (N,)
        ``μᵢ = 1 - exp(-ωᵢ r)`` with the scalar ``r > 0`` solved so that ``sum(μ) = n``.
        Entries follow the input order and lie in ``[0, 1]``.

    Raises
    ------
    ValueError
        If a weight is NaN, infinite or negative, or ``n`` is not an integer in ``[1, N]``.

    Notes
    -----
    Fog (2008), "Calculation methods for Wallenius' noncentral hypergeometric distribution":
    the mean ``μ`` of the multivariate distribution with ``mᵢ`` balls of colour ``i``
    approximately satisfies ``(1 - μᵢ/mᵢ)^(1/ωᵢ) = (1 - μⱼ/mⱼ)^(1/ωⱼ)`` for all colours, i.e.
    ``μᵢ = mᵢ (1 - (1 - θ)^ωᵢ)`` with one ``θ`` fixed by ``Σ μᵢ = n``.  Here ``mᵢ = 1`` and
    ``r = -log(1 - θ)``.  The root is found by a safeguarded Newton iteration on ``log r``
    (``Σ μᵢ`` is increasing in ``r``) to machine precision, so the result matches BiasedUrn's
    ``meanMWNCHypergeo(m = rep(1, N), n, odds, precision = 0.1)`` to ~1e-11; it differs from
    the exact mean by up to a few 1e-2 (the paper's "PriSM + Wallenius", Sec. 4.1).

    Degenerate cases follow the limit of vanishing weights: if fewer than ``n`` weights are
    positive, every positive-weight ball is drawn (``μ = 1``) and the remaining draws are
    spread evenly over the zero-weight balls, which is what successive sampling does when it
    draws zero-weight items only after the others are exhausted.
    """
    w = as_nonnegative_vector(weights, "weights")
    n = as_sample_size(n, w.size)
    positive = w > 0
    num_positive = int(positive.sum())
    if num_positive <= n:
        # Every positive-weight ball is drawn; the rest of the sample is uniform over the others.
        mean = np.where(positive, 1.0, 0.0)
        if num_positive < n:
            mean[~positive] = (n - num_positive) / (w.size - num_positive)
        return mean
    # Only ratios matter: work with log(w / max w) <= 0, which cannot overflow or underflow.
    log_w = np.log(w[positive]) - math.log(float(w.max()))  # (P,)
    log_r = _solve_rate(log_w, n)
    mean = np.zeros_like(w)
    with np.errstate(over="ignore"):
        mean[positive] = -np.expm1(-np.exp(log_w + log_r))
    return mean


def _solve_rate(log_w: np.ndarray, n: int) -> float:
    """Return ``log r`` solving ``Σ (1 - exp(-wᵢ r)) = n`` given ``log w`` (more than ``n``).

    Works on ``s = log r``: ``f(s) = Σ -expm1(-wᵢ eˢ) - n`` is increasing with derivative
    ``Σ xᵢ exp(-xᵢ)``, ``xᵢ = wᵢ eˢ``.  Bracket: ``1 - e⁻ˣ <= x`` gives ``r >= n / Σ w``; the
    ``n + 1`` largest weights each reach ``1 - 1/(n+1)`` at ``r = log(n+1) / w₍ₙ₊₁₎``, so the
    sum is at least ``n`` there.  Everything is evaluated from ``log w + s``, so ``r`` may
    exceed the float range (subnormal weight ratios) without overflow.
    """
    size = log_w.size
    log_next = float(np.partition(log_w, size - n - 1)[size - n - 1])  # (n+1)-th largest
    peak = float(log_w.max())
    lo = math.log(n) - (peak + math.log(float(np.exp(log_w - peak).sum())))
    hi = math.log(math.log(n + 1.0)) - log_next
    s = 0.5 * (lo + hi)
    for _ in range(_MAX_ITER):
        log_x = log_w + s
        with np.errstate(over="ignore"):
            x = np.exp(log_x)  # (P,), inf for terms that are certainly drawn
        f = float(-np.expm1(-x).sum()) - n
        if f == 0.0:
            break
        if f < 0:
            lo = s
        else:
            hi = s
        slope = float(np.exp(log_x - x).sum())  # Σ x e^{-x}, 0 where x = inf
        step = -f / slope if slope > 0 else math.inf
        candidate = s + step
        # Newton step when it stays inside the bracket, bisection otherwise.
        s_new = candidate if lo < candidate < hi else 0.5 * (lo + hi)
        if abs(s_new - s) <= 4 * np.finfo(float).eps * max(1.0, abs(s)):
            s = s_new
            break
        s = s_new
    else:  # pragma: no cover - the bracketed iteration converges in < 60 steps
        logger.warning("wallenius_mean: root of the rate equation not converged (n=%d)", n)
    return s
