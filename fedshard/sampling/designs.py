"""Sampling designs: draw fixed-size subsets of terms.

:func:`draw_subsets` is the single entry point used by the strategy.  The designs with exact
marginals ``π`` are conditional Poisson (``"cps"``, :class:`ConditionalPoisson`, the paper's
choice), Brewer's method (``"brewer"``) and the minimum-support design (``"min-support"``), the
two alternatives of the paper's ablation (Sec. 4.2.2, "Influence of the joint distribution").
``"successive"`` is PriSM's scheme (draw one by one ∝ weights among the remaining terms) and
``"top-n"`` is FedHM's deterministic choice.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np

from fedshard.sampling.cps import ConditionalPoisson
from fedshard.sampling.validation import (
    as_count,
    as_inclusion_probabilities,
    as_nonnegative_vector,
)

__all__ = ["DESIGNS", "Brewer", "MinimumSupport", "draw_subsets", "successive_sample"]

logger = logging.getLogger(__name__)

Design = Literal["cps", "brewer", "min-support", "successive", "top-n"]
DESIGNS: tuple[str, ...] = ("cps", "brewer", "min-support", "successive", "top-n")

# Splitting leaves values within this distance of 0 or 1 as rounding artefacts of a unit that
# reached its bound; they are set exactly so that the procedure terminates.
_SPLIT_SNAP = 1e-12


def draw_subsets(
    pi: Any,
    num_samples: Any,
    *,
    design: Design | str = "cps",
    rng: Any = None,
    weights: Any = None,
) -> np.ndarray:
    """Draw ``num_samples`` independent subsets of size ``n = Σ πᵢ``.

    Parameters
    ----------
    pi : array_like, shape (N,)
        Inclusion probabilities in ``[0, 1]`` with an integer sum ``n``.
    num_samples : int
        Number of subsets ``S >= 0`` (the strategy passes the group size).
    design : {"cps", "brewer", "min-support", "successive", "top-n"}
        ``"cps"``, ``"brewer"`` and ``"min-support"`` have marginals exactly ``π``;
        ``"successive"`` draws ∝ ``weights`` without replacement (its marginals are only
        approximately ``wallenius_mean(weights, n)``); ``"top-n"`` returns the ``n`` units with
        the largest ``π`` (ties: lower index) in every row.
    rng : None, int, sequence of int or np.random.Generator
        Normalised with ``np.random.default_rng``.
    weights : array_like, shape (N,), optional
        Required by ``"successive"`` (PriSM passes ``λᵏ``); rejected by the other designs.

    Returns
    -------
    subsets : np.ndarray of int64, shape (S, n)
        One subset per row, sorted increasingly.

    Raises
    ------
    ValueError
        On invalid ``pi``, unknown ``design``, missing/unexpected/invalid ``weights`` or a
        negative ``num_samples``.

    Notes
    -----
    Each call sets its design up afresh; to draw repeatedly from the same ``π`` with CPS, keep a
    :class:`ConditionalPoisson` and call its ``sample`` method.
    """
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}; nothing was sampled.")
    target, n = as_inclusion_probabilities(pi)
    num_samples = as_count(num_samples, "num_samples")
    if design == "successive":
        if weights is None:
            raise ValueError(
                "design='successive' draws proportionally to `weights` (PriSM: λᵏ), but "
                "weights is None; nothing was sampled."
            )
        w = as_nonnegative_vector(weights, "weights")
        if w.size != target.size:
            raise ValueError(
                f"weights must have the length of pi ({target.size}), got {w.size}; "
                "nothing was sampled."
            )
        return successive_sample(w, n, num_samples, rng)
    if weights is not None:
        raise ValueError(
            f"weights are only used by design='successive', got design={design!r} with "
            "weights; pass weights=None. Nothing was sampled."
        )
    if design == "top-n":
        top = np.sort(np.argsort(-target, kind="stable")[:n])
        return np.tile(top.astype(np.int64), (num_samples, 1))
    sampler: ConditionalPoisson | Brewer | MinimumSupport
    if design == "cps":
        sampler = ConditionalPoisson(target, tol=1e-10)
    elif design == "brewer":
        sampler = Brewer(target)
    else:
        sampler = MinimumSupport(target)
    return sampler.sample(num_samples, rng)


def successive_sample(weights: Any, n: Any, num_samples: Any, rng: Any = None) -> np.ndarray:
    """Successive sampling: ``n`` draws ∝ ``weights`` among the items not drawn yet.

    This is the set distribution of ``numpy.random.Generator.choice(N, n, replace=False,
    p=w / w.sum())`` that PriSM uses (numpy redraws with replacement and keeps first
    occurrences, which picks each new item ∝ ``w`` among the unseen ones).

    Parameters
    ----------
    weights : array_like, shape (N,)
        Nonnegative weights.
    n : int
        Subset size, ``0 <= n <= N``.
    num_samples : int
        Number of subsets.
    rng : None, int, sequence of int or np.random.Generator
        Normalised with ``np.random.default_rng``.

    Returns
    -------
    subsets : np.ndarray of int64, shape (S, n)
        Sorted rows.

    Notes
    -----
    Implemented with exponential races (Efraimidis & Spirakis 2006): keep the ``n`` smallest
    ``Eᵢ / wᵢ`` with ``Eᵢ ~ Exp(1)``; the order in which the races finish is exactly the
    successive draw order, so the kept set has the successive-sampling distribution.  This
    costs ``O(N)`` per subset instead of ``n`` passes.  Items of weight 0 are drawn only when
    fewer than ``n`` weights are positive, uniformly among themselves (the limit of vanishing
    weights; numpy's ``choice`` raises instead).
    """
    w = as_nonnegative_vector(weights, "weights")
    n = as_count(n, "n")
    if n > w.size:
        raise ValueError(
            f"n must be at most the number of items {w.size}, got {n}; nothing was sampled."
        )
    num_samples = as_count(num_samples, "num_samples")
    rng = np.random.default_rng(rng)
    positive = w > 0
    num_positive = int(positive.sum())
    race = rng.standard_exponential((num_samples, w.size))  # (S, N)
    if num_positive >= n:
        # Finishing times E/w; zero weights never finish.
        with np.errstate(divide="ignore"):
            times = np.where(positive, race / np.where(positive, w, 1.0), np.inf)
    else:
        # All positive items are in; the remaining slots go uniformly to the zero-weight items.
        times = np.where(positive, -1.0, race)
    mask = np.zeros((num_samples, w.size), dtype=bool)
    if n:
        chosen = np.argpartition(times, n - 1, axis=1)[:, :n]  # (S, n)
        np.put_along_axis(mask, chosen, True, axis=1)
    return np.nonzero(mask)[1].reshape(num_samples, n).astype(np.int64)


class _FixedSizeDesign:
    """Shared bookkeeping: units with π = 1 are always in, π = 0 never, the rest are drawn."""

    def __init__(self, pi: Any) -> None:
        target, n = as_inclusion_probabilities(pi)
        self.inclusion_probabilities = target
        self.inclusion_probabilities.setflags(write=False)
        self.sample_size = n
        self._certain = target == 1.0
        self._fractional = (target > 0.0) & (target < 1.0)
        self._frac = target[self._fractional]  # (M,)
        self._k = n - int(self._certain.sum())
        if not 0 <= self._k <= self._frac.size:
            raise ValueError(
                f"pi has {int(self._certain.sum())} entries equal to 1 and {self._frac.size} in "
                f"(0, 1), which cannot make a sample of size n = {n}; nothing was sampled."
            )

    def sample(self, num_samples: Any, rng: Any = None) -> np.ndarray:
        """Draw ``num_samples`` subsets: int64 array (S, n), rows sorted."""
        num_samples = as_count(num_samples, "num_samples")
        rng = np.random.default_rng(rng)
        mask = np.zeros((num_samples, self.inclusion_probabilities.size), dtype=bool)
        mask[:, self._certain] = True
        if self._frac.size:
            mask[:, self._fractional] = self._sample_fractional(num_samples, rng)
        return np.nonzero(mask)[1].reshape(num_samples, self.sample_size).astype(np.int64)

    def _sample_fractional(self, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError


class Brewer(_FixedSizeDesign):
    """Brewer's (1975) draw-by-draw method with marginals exactly ``pi``.

    Parameters
    ----------
    pi : array_like, shape (N,)
        Inclusion probabilities in ``[0, 1]`` with an integer sum.

    Notes
    -----
    Brewer (1975), as in Tillé (2006) and R's ``sampling::UPbrewer``: with ``k``
    units to draw among the fractional ones, at step ``r = 1..k`` (``a`` = sum of the π of the
    units already drawn) unit ``j`` not drawn yet is chosen with probability
    ``∝ πⱼ (k - a - πⱼ) / (k - a - πⱼ (k - r + 1))``.  Both factors are positive: the undrawn
    units carry mass ``k - a > k - r + 1`` because every drawn unit has ``π < 1``.  Each draw
    costs ``O(k M)``.
    """

    def _sample_fractional(self, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        p, k = self._frac, self._k
        chosen = np.zeros((num_samples, p.size), dtype=bool)
        mass = np.zeros((num_samples, 1))  # a: Σ π of the units drawn so far, (S, 1)
        rows = np.arange(num_samples)
        uniforms = rng.random((num_samples, k))
        for step in range(1, k + 1):
            rest = k - mass  # (S, 1)
            score = p * (rest - p) / (rest - p * (k - step + 1))  # (S, M)
            score[chosen] = 0.0
            cdf = np.cumsum(score, axis=1)
            pick = np.argmax(cdf > uniforms[:, step - 1 : step] * cdf[:, -1:], axis=1)  # (S,)
            chosen[rows, pick] = True
            mass[:, 0] += p[pick]
        return chosen


class MinimumSupport(_FixedSizeDesign):
    """Minimum-support design with marginals exactly ``pi`` (Tillé 2006, Ch. 6).

    The design is computed once as an explicit list of at most ``M + 1`` samples (``M``
    fractional units) with their probabilities; a draw picks one of them.

    Parameters
    ----------
    pi : array_like, shape (N,)
        Inclusion probabilities in ``[0, 1]`` with an integer sum.

    Attributes
    ----------
    support : np.ndarray of bool, shape (K, N)
        The samples with positive probability, one indicator row each.
    probabilities : np.ndarray, shape (K,)
        Their probabilities (sum 1).

    Notes
    -----
    Splitting procedure (Deville & Tillé 1998): while some ``πᵢ`` is fractional, let ``s`` be
    the sample made of the units with ``π = 1`` and the ``k`` largest fractional ones (ties:
    lower index), ``α = min(min_{i∈s} πᵢ, 1 - max_{i∉s} πᵢ)`` over fractional units, and write
    ``π = α s + (1 - α) π'`` with ``π' = (π - α s)/(1 - α)``.  Sample ``s`` gets probability
    ``α`` times the mass left, and the procedure continues on ``π'``, in which at least one
    more unit is 0 or 1, so it stops after at most ``M`` splits.  R's
    ``sampling::UPminimalsupport`` picks ``s`` at random among the fractional units instead,
    a mixture of such designs with a larger support.
    """

    def __init__(self, pi: Any) -> None:
        super().__init__(pi)
        rows, probs = _minimum_support(self._frac, self._k)
        self._rows = rows  # (K, M) bool
        self.probabilities = probs
        self.probabilities.setflags(write=False)
        support = np.zeros((probs.size, self.inclusion_probabilities.size), dtype=bool)
        support[:, self._certain] = True
        support[:, self._fractional] = rows
        self.support = support
        self.support.setflags(write=False)
        self._cdf = np.cumsum(probs)

    def _sample_fractional(self, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        which = np.searchsorted(self._cdf, rng.random(num_samples) * self._cdf[-1], side="right")
        return self._rows[np.minimum(which, self._rows.shape[0] - 1)]


def _minimum_support(frac: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples (K, M) and probabilities (K,) of the minimum-support design of ``frac``."""
    current = frac.copy()
    mass = 1.0  # probability of reaching the current split
    rows: list[np.ndarray] = []
    probs: list[float] = []
    for _ in range(frac.size + 1):
        fractional = (current > 0.0) & (current < 1.0)
        ones = current == 1.0
        need = k - int(ones.sum())
        if not fractional.any() or need <= 0 or need >= int(fractional.sum()):
            # Integer vector left (up to rounding): the last sample takes the remaining mass.
            last = ones.copy()
            if need > 0:
                last[fractional] = True
            rows.append(last)
            probs.append(mass)
            break
        idx = np.flatnonzero(fractional)
        top = idx[np.argsort(-current[idx], kind="stable")[:need]]  # the k' largest
        sample = ones.copy()
        sample[top] = True
        inside = current[top].min()
        outside = current[fractional & ~sample].max()
        alpha = min(inside, 1.0 - outside)
        rows.append(sample)
        probs.append(mass * alpha)
        mass *= 1.0 - alpha
        current = (current - alpha * sample) / (1.0 - alpha)
        # The unit(s) that set α hit their bound exactly in exact arithmetic.
        current[sample & fractional & (current <= _SPLIT_SNAP)] = 0.0
        current[~sample & fractional & (current >= 1.0 - _SPLIT_SNAP)] = 1.0
        np.clip(current, 0.0, 1.0, out=current)
    return np.array(rows, dtype=bool).reshape(len(rows), frac.size), np.array(probs)
