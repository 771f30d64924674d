"""Inclusion probabilities π and auxiliary multipliers ω of the sharding strategies.

Each strategy maps the singular values ``λ`` of one layer and the number ``n`` of terms a client
keeps to the marginal inclusion probabilities ``πᵢ = Pr(term i is sent)`` and the multipliers
``ωᵢ`` the client applies to the kept terms (``Ŵ = Σᵢ zᵢ ωᵢ λᵢ uᵢ vᵢᵀ``, paper Eq. 1).

Convention for terms that can never be drawn (``πᵢ = 0``): ``ωᵢ = 0``.  Such a term never
reaches a client, so its multiplier is never used; returning 0 (as the paper's Algorithm 2 does)
instead of ``1/0`` keeps every ω finite.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np

from fedshard.sampling.validation import as_count, as_nonnegative_vector, as_sample_size
from fedshard.sampling.wallenius import wallenius_mean

__all__ = [
    "METHODS",
    "default_prism_exponent",
    "inclusion_probabilities",
    "scaled_multipliers",
]

logger = logging.getLogger(__name__)

Method = Literal["unbiased", "collective", "top-n", "prism", "prism-wallenius"]
METHODS: tuple[str, ...] = ("unbiased", "collective", "top-n", "prism", "prism-wallenius")

# A probability this close to 1 is a rounding artefact of a capped term (the water level sits
# exactly on λᵢ); snapping it keeps the term "always in" for the designs.
_ONE_SNAP = 1e-12
# Probabilities below this are flushed to 0 (never drawn): 1/π would overflow float64 and such a
# term would be drawn once in 1e300 rounds.  Only subnormal-range spectra get here.
_FLUSH = 1e-300


def default_prism_exponent(n: int, num_terms: int) -> float:
    """PriSM's exponent ``k`` of ``πᵢ ∝ λᵢᵏ``: 4 if ``n / N <= 0.2``, else 2.5 (paper Sec. 4.1)."""
    return 4.0 if n / num_terms <= 0.2 else 2.5


def inclusion_probabilities(
    singular_values: Any,
    n: Any,
    method: Method | str,
    *,
    num_clients: Any = None,
    prism_exponent: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Marginal inclusion probabilities π and auxiliary multipliers ω of one layer.

    Parameters
    ----------
    singular_values : array_like, shape (N,)
        Singular values ``λ >= 0`` in any order; the outputs follow the same order.
    n : int
        Number of terms each client keeps, ``1 <= n <= N``.
    method : {"unbiased", "collective", "top-n", "prism", "prism-wallenius"}
        The sharding strategy (see Notes).
    num_clients : int, optional
        Group size ``C >= 1``; required by ``"collective"``.  The other methods ignore it
        (a given value is still checked, so callers may pass it uniformly).
    prism_exponent : float, optional
        Exponent ``k > 0`` of the PriSM weights ``λᵏ``; defaults to
        :func:`default_prism_exponent`.  Ignored (but checked) by the non-PriSM methods.

    Returns
    -------
    pi : np.ndarray, shape (N,)
        Inclusion probabilities in ``[0, 1]`` with ``Σ πᵢ = n``.
    omega : np.ndarray, shape (N,)
        Auxiliary multipliers; ``ωᵢ = 0`` where ``πᵢ = 0``.

    Raises
    ------
    ValueError
        On NaN/inf/negative singular values, ``n`` outside ``[1, N]`` or non-integer, unknown
        ``method``, missing or ``< 1`` ``num_clients`` for ``"collective"``, or
        ``prism_exponent <= 0``.

    Notes
    -----
    - ``"unbiased"`` (Theorem 1): minimises ``E‖W - Ŵ‖²_F = Σ λᵢ² (1/πᵢ - 1)`` subject to
      ``E Ŵ = W``; ``ω = 1/π``.  The optimum is ``πᵢ = min(1, c λᵢ)`` (water filling), found
      exactly after one sort: the number ``t`` of capped terms is the smallest ``t`` with
      ``λ₍ₜ₊₁₎ (n - t) < Σ_{l>t} λ₍ₗ₎`` (Algorithm 1 evaluates all feasible ``t``; the first
      feasible one is the KKT point of this convex problem).
    - ``"collective"`` (Theorem 2): ``ω = C / (1 + π (C - 1))`` and
      ``πᵢ = clip((√C λᵢ / √β - 1) / (C - 1), 0, 1)`` with the scalar level ``√β`` fixed by
      ``Σ πᵢ = n``.  ``Σ πᵢ`` is continuous and nonincreasing in ``√β`` with breakpoints
      ``λᵢ/√C`` and ``√C λᵢ``, and linear in ``1/√β`` between them; a binary search over the
      sorted breakpoints finds the piece (the pair ``(t, u)`` of Algorithm 2) and ``√β`` is
      solved on it in closed form: ``O(N log N)`` instead of Algorithm 2's ``O(n N²)``.
      ``C = 1`` is top-n.
    - ``"top-n"`` (FedHM): ``π = ω = 1`` for the ``n`` largest ``λ`` (ties: lower index first),
      0 elsewhere.
    - ``"prism"``: ``π = wallenius_mean(λᵏ, n)`` (Fog's approximation of the inclusion
      probabilities of PriSM's successive draws), ``ω = 1``.  ``"prism-wallenius"``: same π,
      ``ω = 1/π`` (paper Sec. 4.1, "PriSM + Wallenius").

    If fewer than ``n`` singular values are positive (rank-deficient layer), every nonzero
    term is kept (``π = 1``) and the remaining ``n - nnz`` slots are spread evenly over the
    zero terms (they carry no weight, so every objective is indifferent to them).
    Probabilities below ``1e-300`` (reachable only with subnormal singular-value ratios) are
    set to 0 so that ``1/π`` stays finite.
    """
    lam = as_nonnegative_vector(singular_values, "singular_values")
    n = as_sample_size(n, lam.size)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}; nothing was computed.")
    clients = None if num_clients is None else as_count(num_clients, "num_clients", minimum=1)
    exponent = _check_exponent(prism_exponent)

    if method in ("prism", "prism-wallenius"):
        k = default_prism_exponent(n, lam.size) if exponent is None else exponent
        top = lam.max()
        weights = (lam / top) ** k if top > 0 else np.zeros_like(lam)
        pi = wallenius_mean(weights, n)
        pi[pi < _FLUSH] = 0.0
        omega = np.ones_like(pi) if method == "prism" else _reciprocal(pi)
        return pi, np.where(pi > 0, omega, 0.0)

    if method == "collective" and clients is None:
        raise ValueError(
            "method='collective' needs num_clients (the group size C >= 1), got None; "
            "nothing was computed."
        )
    # Work on the spectrum sorted in non-increasing order; a stable sort breaks ties by index.
    order = np.argsort(-lam, kind="stable")
    lam_sorted = lam[order]
    if method == "top-n" or (method == "collective" and clients == 1):
        pi_sorted = np.zeros_like(lam_sorted)
        pi_sorted[:n] = 1.0
    elif method == "unbiased":
        pi_sorted = _unbiased_sorted(lam_sorted, n)
    else:
        assert clients is not None
        pi_sorted = _collective_sorted(lam_sorted, n, clients)
    pi = np.empty_like(pi_sorted)
    pi[order] = pi_sorted
    pi[pi < _FLUSH] = 0.0

    if method == "top-n" or (method == "collective" and clients == 1):
        omega = pi.copy()
    elif method == "unbiased":
        omega = _reciprocal(pi)
    else:
        assert clients is not None
        omega = np.where(pi > 0, clients / (1.0 + pi * (clients - 1)), 0.0)
    return pi, omega


def scaled_multipliers(singular_values: Any, subset: Any) -> np.ndarray:
    """Multipliers of the "+Scaled" modification: keep ``‖Ŵ‖_F = ‖W‖_F`` (paper Sec. 4.1).

    Parameters
    ----------
    singular_values : array_like, shape (N,)
        Singular values ``λ >= 0``.
    subset : array_like of int, shape (n,) or (S, n)
        Indices of the kept terms (one subset per row).

    Returns
    -------
    omega : np.ndarray, same shape as ``subset``
        ``√(Σₖ λₖ² / Σ_{k∈s} λₖ²)``, the same value for every kept term of a subset.  Where
        every kept term is zero (``Ŵ = 0`` for any ω) the multiplier is 1.

    Raises
    ------
    ValueError
        On bad singular values or indices outside ``[0, N)``.
    """
    lam = as_nonnegative_vector(singular_values, "singular_values")
    idx = np.asarray(subset)
    if idx.ndim not in (1, 2) or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer)):
        raise ValueError(
            f"subset must be a 1-D or 2-D integer array of term indices, got dtype {idx.dtype} "
            f"and shape {idx.shape}; nothing was computed."
        )
    if idx.size and (idx.min() < 0 or idx.max() >= lam.size):
        raise ValueError(
            f"subset indices must lie in [0, {lam.size}), got min {idx.min()} and max "
            f"{idx.max()}; nothing was computed."
        )
    top = lam.max()
    if top == 0:
        return np.ones(idx.shape)
    energy = (lam / top) ** 2  # scaled so that squaring cannot overflow
    kept = energy[idx.astype(np.int64)].sum(axis=-1, keepdims=True)  # (..., 1)
    total = energy.sum()
    ratio = np.divide(total, kept, out=np.ones_like(kept), where=kept > 0)
    return np.broadcast_to(np.sqrt(ratio), idx.shape).copy()


def _check_exponent(prism_exponent: Any) -> float | None:
    if prism_exponent is None:
        return None
    if isinstance(prism_exponent, bool) or not isinstance(prism_exponent, int | float | np.number):
        raise ValueError(
            f"prism_exponent must be a positive number, got {prism_exponent!r}; "
            "nothing was computed."
        )
    k = float(prism_exponent)
    if not np.isfinite(k) or k <= 0:
        raise ValueError(
            f"prism_exponent must be a finite number > 0, got {prism_exponent!r}; "
            "nothing was computed."
        )
    return k


def _reciprocal(pi: np.ndarray) -> np.ndarray:
    """``1/π`` where ``π > 0``, 0 where the term is never drawn."""
    return np.divide(1.0, pi, out=np.zeros_like(pi), where=pi > 0)


def _fill_rank_deficient(lam_sorted: np.ndarray, n: int) -> np.ndarray:
    """π when at most ``n`` terms are nonzero: keep them all, spread the rest evenly."""
    positive = lam_sorted > 0
    num_positive = int(positive.sum())
    logger.debug("rank-deficient layer: %d nonzero singular values, n = %d", num_positive, n)
    pi = np.where(positive, 1.0, 0.0)
    if num_positive < n:
        pi[~positive] = (n - num_positive) / (lam_sorted.size - num_positive)
    return pi


def _unbiased_sorted(lam: np.ndarray, n: int) -> np.ndarray:
    """Theorem 1 for ``lam`` sorted non-increasingly; O(N) after the sort."""
    num_positive = int(np.count_nonzero(lam))
    if num_positive <= n:
        return _fill_rank_deficient(lam, n)
    # tail[t] = Σ_{l >= t} λ_l (0-based), summed from the smallest term for accuracy.  (N,)
    tail = np.cumsum(lam[::-1])[::-1]
    t = np.arange(n)
    # Feasible t: the uncapped level (n - t) / tail[t] keeps λ_t below 1.  Feasibility is
    # monotone in t and t = n - 1 is feasible because more than n terms are positive (in
    # floating point a tail below the rounding of λ_n can hide that, hence the explicit True).
    feasible = lam[:n] * (n - t) < tail[:n]
    feasible[-1] = True
    t0 = int(np.argmax(feasible))
    with np.errstate(over="ignore"):  # only the capped head (l < t0) can overflow: π = 1
        pi = np.minimum(1.0, (lam / tail[t0]) * (n - t0))
    pi[:t0] = 1.0
    pi[pi >= 1.0 - _ONE_SNAP] = 1.0
    return pi


def _collective_sorted(lam: np.ndarray, n: int, clients: int) -> np.ndarray:
    """Theorem 2 for ``lam`` sorted non-increasingly and ``C >= 2``; O(N log N)."""
    num_positive = int(np.count_nonzero(lam))
    if num_positive <= n:
        return _fill_rank_deficient(lam, n)
    root_c = np.sqrt(clients)
    pos = lam[:num_positive]  # (P,), all > 0

    def level_sum(y: float) -> float:
        """Σ πᵢ at the level y = √β; nonincreasing in y."""
        with np.errstate(over="ignore"):  # λ/y = inf for a subnormal level: π = 1, as wanted
            return float(np.clip((root_c * pos / y - 1.0) / (clients - 1), 0.0, 1.0).sum())

    # πᵢ(y) is 1 for y <= λᵢ/√C and 0 for y >= √C λᵢ, linear in 1/y between.  (2P,)
    breaks = np.sort(np.concatenate([pos / root_c, root_c * pos]))
    # Binary search for consecutive breakpoints with Σπ >= n at lo and < n at hi.  At the
    # first one every term has π = 1 (Σ = P > n); at the last one every term has π = 0.
    lo, hi = 0, breaks.size - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if level_sum(float(breaks[mid])) >= n:
            lo = mid
        else:
            hi = mid
    # On the open piece (breaks[lo], breaks[hi]) the sets are fixed: t capped terms, then u
    # active ones.  Read them off at the midpoint (λ is sorted, so both are prefixes).
    y_mid = 0.5 * (breaks[lo] + breaks[hi])
    t = int(np.count_nonzero(pos >= root_c * y_mid))
    t_plus_u = int(np.count_nonzero(root_c * pos > y_mid))
    pi = np.zeros_like(lam)
    pi[:t] = 1.0
    if t_plus_u == t:  # pragma: no cover - Σπ is constant on the piece, which cannot cross n
        return pi
    # Σ π = t + (√C Σ_active λ / y - u) / (C - 1) = n gives Algorithm 2's √β in closed form.
    active = pos[t:t_plus_u]
    y = root_c * float(active.sum()) / ((n - t) * (clients - 1) + t_plus_u - t)
    pi[t:t_plus_u] = np.clip((root_c * active / y - 1.0) / (clients - 1), 0.0, 1.0)
    pi[pi >= 1.0 - _ONE_SNAP] = 1.0
    return pi
