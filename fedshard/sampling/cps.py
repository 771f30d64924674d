"""Conditional Poisson sampling (CPS), the maximum-entropy design with given marginals.

CPS draws a fixed-size sample ``s`` with ``p(s) ∝ Π_{i∈s} wᵢ``: Poisson sampling with working
probabilities ``w/(1+w)`` conditioned on the sample size.  Among all designs of size ``n`` with
marginals ``π`` it has the largest entropy (Tillé 2006, Ch. 5), which is why the paper uses it
(paper Sec. 3.2.3).  The marginals of CPS are not the working probabilities, so the odds ``w``
are fitted to the target ``π`` first.

Everything runs in log space on elementary symmetric polynomials
``eₖ(w_j, ..., w_{M-1})``, so spectra spanning dozens of orders of magnitude neither overflow
nor lose the small terms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from fedshard.sampling.validation import as_count, as_inclusion_probabilities

__all__ = ["ConditionalPoisson"]

logger = logging.getLogger(__name__)

# Elements of the (M, k) work array of one chunk of _marginals: bounds the temporary memory.
_CHUNK_ELEMENTS = 1 << 21


class ConditionalPoisson:
    """Conditional Poisson sampling with marginal inclusion probabilities exactly ``pi``.

    The setup (fitting the working odds and tabulating the sequential-draw probabilities) runs
    once in ``O(I · M k)`` for ``M`` fractional units, ``k = min(n', M - n')`` and ``I`` fitting
    iterations (typically < 10); each draw then costs ``O(k log M)`` plus ``O(N)`` to write it.

    Parameters
    ----------
    pi : array_like, shape (N,)
        Target inclusion probabilities in ``[0, 1]`` summing to an integer ``n``.  Units with
        ``πᵢ = 1`` are in every sample, units with ``πᵢ = 0`` in none.
    tol : float, optional
        Largest allowed ``|π_CPS - π|`` of the fitted design (default ``1e-12``; an error is
        raised if even ``max(tol, 1e-10)`` cannot be reached).
    max_iter : int, optional
        Maximum number of fitting iterations.

    Attributes
    ----------
    inclusion_probabilities : np.ndarray, shape (N,)
        The target marginals (read-only copy).
    sample_size : int
        ``n``.
    log_odds : np.ndarray, shape (N,)
        Fitted ``log wᵢ`` (``+inf`` where ``πᵢ = 1``, ``-inf`` where ``πᵢ = 0``): the design is
        ``p(s) ∝ exp(Σ_{i∈s} log wᵢ)`` over samples of size ``n``.  Defined up to an additive
        constant.
    fit_error : float
        Achieved ``max |π_CPS - π|``.

    Raises
    ------
    ValueError
        If ``pi`` is not a valid inclusion-probability vector.
    RuntimeError
        If the fit does not reach ``1e-10`` within ``max_iter`` iterations.

    Notes
    -----
    *Fit.*  The marginals are ``πᵢ(w) = wᵢ e_{n-1}(w₋ᵢ) / eₙ(w)``.  CPS is an exponential
    family in ``θ = log w`` with ``∂π/∂θ = Cov(z)``, whose diagonal ``π(1-π)`` (Hájek's
    approximation) makes ``θ ← θ + logit(π) - logit(π(θ))`` a Newton-like step; from
    ``θ = logit(π)`` it gains two or three digits per iteration on layer-sized designs, and a
    line search on the convex dual keeps it convergent on tiny or very skewed ones (see
    :func:`_fit`).  ``log πᵢ(θ)`` and ``log(1 - πᵢ(θ))`` are both computed as log-sum-exps,
    so the logits stay accurate for ``πᵢ`` near 0 and near 1.

    *Draws.*  With ``L[z, j] = log e_z(w_j, ..., w_{M-1})``, the first selected unit at or
    after ``i`` when ``z`` units are still needed is ``j`` with probability
    ``exp(L[z, j] - L[z, i]) - exp(L[z, j+1] - L[z, i])``: an inverse-CDF draw by binary
    search on the monotone row ``L[z, :]``, vectorised over the samples.  If more than half of
    the fractional units are selected, the complement (itself CPS with odds ``1/w``) is fitted
    and drawn instead, so ``k <= M/2``.
    """

    def __init__(self, pi: Any, *, tol: float = 1e-12, max_iter: int = 100) -> None:
        target, n = as_inclusion_probabilities(pi)
        max_iter = as_count(max_iter, "max_iter", minimum=1)
        self.inclusion_probabilities = target
        self.inclusion_probabilities.setflags(write=False)
        self.sample_size = n
        size = target.size
        self._certain = target == 1.0
        self._fractional = (target > 0.0) & (target < 1.0)
        frac = target[self._fractional]  # (M,)
        m = frac.size
        k = n - int(self._certain.sum())
        if not 0 <= k <= m:
            raise ValueError(
                f"pi has {int(self._certain.sum())} entries equal to 1 and {m} in (0, 1), which "
                f"cannot make a sample of size n = {n}; nothing was sampled."
            )
        # Draw the complement when it is the smaller side: the table has k + 1 rows.
        self._complement = k > m - k
        if self._complement:
            frac, k = 1.0 - frac, m - k
            # A unit with π < 1.1e-16 has 1 - π == 1.0: it is treated as never drawn (π = 0).
            lost = frac == 1.0
            if lost.any():
                self._fractional[np.flatnonzero(self._fractional)[lost]] = False
                frac, k, m = frac[~lost], k - int(lost.sum()), m - int(lost.sum())
        self._k = k
        self._m = m
        log_odds = np.full(size, -np.inf)
        log_odds[self._certain] = np.inf
        if k == 0:  # nothing random left: the fractional units sum to 0 (up to rounding)
            theta = np.full(m, -np.inf)  # never drawn (never left out, on the complement side)
            self._neg_table = np.zeros((1, m + 1))
            self.fit_error = float(np.abs(frac).max()) if m else 0.0
        else:
            theta, table, self.fit_error = _fit(frac, k, tol, max_iter)
            # Row z is -L[z, :], nondecreasing along the units: ready for np.searchsorted.
            self._neg_table = np.negative(table, out=table)  # (k+1, M+1)
        log_odds[self._fractional] = -theta if self._complement else theta
        self.log_odds = log_odds
        self.log_odds.setflags(write=False)

    def sample(self, num_samples: Any, rng: Any = None) -> np.ndarray:
        """Draw independent samples.

        Parameters
        ----------
        num_samples : int
            Number of samples ``S >= 0``.
        rng : None, int, sequence of int or np.random.Generator
            Normalised with ``np.random.default_rng``.

        Returns
        -------
        subsets : np.ndarray of int64, shape (S, n)
            Selected unit indices, each row sorted increasingly.
        """
        num_samples = as_count(num_samples, "num_samples")
        rng = np.random.default_rng(rng)
        mask = np.zeros((num_samples, self.inclusion_probabilities.size), dtype=bool)
        mask[:, self._certain] = True
        if self._m:
            mask[:, self._fractional] = self._sample_fractional(num_samples, rng)
        return np.nonzero(mask)[1].reshape(num_samples, self.sample_size).astype(np.int64)

    def _sample_fractional(self, num_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Boolean (S, M) selection among the fractional units."""
        k, m = self._k, self._m
        chosen = np.zeros((num_samples, m), dtype=bool)
        if k:
            rows = np.arange(num_samples)
            start = np.zeros(num_samples, dtype=np.int64)  # next unit that may be selected, (S,)
            # -log(v) for v uniform on (0, 1]: an Exp(1) variate.  (S, k)
            neg_log_v = rng.standard_exponential((num_samples, k))
            for step in range(k):
                column = self._neg_table[k - step]  # -L[z, :] for z = k - step, (M+1,)
                threshold = column[start] + neg_log_v[:, step]
                pick = np.searchsorted(column, threshold, side="right") - 1  # (S,)
                chosen[rows, pick] = True
                start = pick + 1
        return ~chosen if self._complement else chosen


def _suffix_table(theta: np.ndarray, k: int) -> np.ndarray:
    """``L[z, j] = log e_z(exp(θ_j), ..., exp(θ_{M-1}))`` for ``z = 0..k``; shape (k+1, M+1)."""
    m = theta.size
    table = np.full((k + 1, m + 1), -np.inf)
    table[0] = 0.0
    for z in range(1, k + 1):
        # e_z(S_j) = Σ_{i >= j} w_i e_{z-1}(S_{i+1}): a reversed cumulative log-sum-exp.
        terms = theta + table[z - 1, 1:]  # (M,)
        table[z, :m] = np.logaddexp.accumulate(terms[::-1])[::-1]
    return table


def _prefix_table(theta: np.ndarray, k: int) -> np.ndarray:
    """``P[a, j] = log e_a(exp(θ_0), ..., exp(θ_{j-1}))`` for ``a = 0..k``; shape (k+1, M+1)."""
    m = theta.size
    table = np.full((k + 1, m + 1), -np.inf)
    table[0] = 0.0
    for a in range(1, k + 1):
        table[a, 1:] = np.logaddexp.accumulate(theta + table[a - 1, :m])
    return table


def _log_sum_exp_rows(terms: np.ndarray) -> np.ndarray:
    """``log Σ_a exp(terms[a, i])`` over axis 0 (each column has a finite entry); overwrites."""
    peak = terms.max(axis=0)
    terms -= peak
    np.exp(terms, out=terms)
    return peak + np.log(terms.sum(axis=0))


def _marginals(theta: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Log inclusion and log exclusion probabilities of CPS with log-odds ``θ`` (M,), size ``k``.

    ``πᵢ = wᵢ Σ_a e_a(w_{<i}) e_{k-1-a}(w_{>i}) / e_k(w)`` and
    ``1 - πᵢ = Σ_a e_a(w_{<i}) e_{k-a}(w_{>i}) / e_k(w)``, each a log-sum-exp over ``a``
    (in chunks of units).  Computing ``log(1 - πᵢ)`` directly keeps ``logit πᵢ`` accurate for
    ``πᵢ`` near 1, where ``1 - exp(log πᵢ)`` would cancel.  Also returns the suffix table.
    """
    m = theta.size
    suffix = _suffix_table(theta, k)  # (k+1, M+1)
    prefix = _prefix_table(theta, k)  # (k+1, M+1)
    log_total = suffix[k, 0]
    log_in = np.empty(m)
    log_out = np.empty(m)
    width = max(1, _CHUNK_ELEMENTS // (k + 1))
    for lo in range(0, m, width):
        hi = min(m, lo + width)
        # [a, i] = log e_a(w_{<i}) + log e_{k-1-a}(w_{>i}), a = 0..k-1  (k, width)
        terms = prefix[:k, lo:hi] + suffix[k - 1 :: -1, lo + 1 : hi + 1]
        log_in[lo:hi] = theta[lo:hi] + _log_sum_exp_rows(terms) - log_total
        # [a, i] = log e_a(w_{<i}) + log e_{k-a}(w_{>i}), a = 0..k  (k+1, width)
        terms = prefix[:, lo:hi] + suffix[k::-1, lo + 1 : hi + 1]
        log_out[lo:hi] = _log_sum_exp_rows(terms) - log_total
    return log_in, log_out, suffix


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def _fit(
    target: np.ndarray, k: int, tol: float, max_iter: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Fit log-odds ``θ`` so that the CPS marginals equal ``target`` (all in (0, 1)).

    Minimises the convex dual ``F(θ) = log e_k(exp θ) - θ·π`` (gradient ``π(θ) - π``) along
    ``d = logit(π) - logit(π(θ))``, a descent direction because logit is increasing (it is
    the Newton direction under Hájek's diagonal approximation of ``Cov(z)``).  The full step is
    taken when it halves the error or does not overshoot the minimum of ``F`` along ``d`` (the
    usual case: each step gains two or three digits).  Otherwise the minimum along ``d`` is
    located by Illinois regula falsi on the increasing derivative ``(π(θ + s d) - π)·d``, which
    keeps small or very skewed designs convergent (e.g. ``k = 1`` with a dominant unit, where
    the full step overshoots by a factor 2 and would oscillate).
    """
    goal = _logit(target)
    # k = 1 is the multinomial design, πᵢ = wᵢ / Σw: the answer is known in closed form.
    theta = np.log(target) if k == 1 else goal.copy()
    log_in, log_out, table = _marginals(theta, k)
    error = float(np.abs(np.exp(log_in) - target).max())
    # The marginals always sum to k; a target that sums to k ± δ can only be met up to ~δ.
    floor = abs(float(target.sum()) - k)
    best = (error, theta, table)
    previous = np.inf
    # Below 1e-10 a line search is only worth it where an evaluation is cheap; on large designs
    # the error there is rounding noise.
    search_below = 1e-10 if target.size * k > 100_000 else 0.0
    for iteration in range(max_iter):
        # Stop at the tolerance, or once the error stalls at the rounding floor of the
        # log-space sums (~1e-12 for thousands of units) below the guaranteed 1e-10.
        if error <= tol + floor or (error > 0.9 * previous and error <= 1e-10 + floor):
            logger.debug("CPS fit: max error %.2e after %d iterations", error, iteration)
            break
        previous = error
        direction = goal - (log_in - log_out)  # (M,)
        slope0 = float((np.exp(log_in) - target) @ direction)  # φ'(0) <= 0

        evaluate = partial(_evaluate, theta, direction, k, target)
        point = evaluate(1.0)
        if point.error > 0.5 * error and point.slope > 0 and error > search_below + floor:
            point = _line_search(evaluate, slope0, point, error)
        if point.error >= error and error <= 1e-10 + floor:
            break  # no further progress below the guaranteed accuracy
        trial, log_in, log_out, table, error = point[:5]
        # p(s) is invariant to a shift of θ; keep the numbers small (L[z] moves by z·shift).
        shift = float(trial.max())
        theta = trial - shift
        table[1:, :] -= shift * np.arange(1, k + 1)[:, None]
        if error < best[0]:
            best = (error, theta, table)
    error, theta, table = best
    if error > max(tol, 1e-10) + floor:
        raise RuntimeError(
            f"Conditional Poisson fit stopped at max |π_CPS - π| = {error:.3e} (max_iter = "
            f"{max_iter}, wanted {max(tol, 1e-10):.0e}); no sampler was built."
        )
    return theta, table, error


class _Point(NamedTuple):
    """The fit evaluated at ``θ + s d``."""

    theta: np.ndarray  # (M,)
    log_in: np.ndarray  # (M,) log π(θ)
    log_out: np.ndarray  # (M,) log(1 - π(θ))
    table: np.ndarray  # (k+1, M+1) suffix table L
    error: float  # max |π(θ) - π|
    slope: float  # φ'(s) = (π(θ) - π)·d


def _evaluate(
    theta: np.ndarray, direction: np.ndarray, k: int, target: np.ndarray, step: float
) -> _Point:
    trial = theta + step * direction
    log_in, log_out, table = _marginals(trial, k)
    pi = np.exp(log_in)
    gap = pi - target
    return _Point(trial, log_in, log_out, table, float(np.abs(gap).max()), float(gap @ direction))


def _line_search(
    evaluate: Callable[[float], _Point], slope0: float, at_one: _Point, error: float
) -> _Point:
    """Minimise ``F`` along the direction on ``[0, 1]``, where ``φ'(0) < 0 < φ'(1)``.

    Illinois regula falsi on ``φ'``; stops once the error halves or ``|φ'|`` drops below a
    tenth of ``|φ'(0)|`` (a strong-Wolfe-type condition), after at most 40 evaluations.
    """
    lo, f_lo = 0.0, slope0
    hi, f_hi = 1.0, at_one.slope
    best: _Point | None = None
    side = 0
    for _ in range(40):
        step = lo - f_lo * (hi - lo) / (f_hi - f_lo)
        if not lo + 0.01 * (hi - lo) < step < hi - 0.01 * (hi - lo):
            step = 0.5 * (lo + hi)
        point = evaluate(step)
        if point.error <= 0.5 * error or abs(point.slope) <= 0.1 * abs(slope0):
            return point
        if point.slope < 0:
            lo, f_lo, best = step, point.slope, point
            if side == -1:
                f_hi *= 0.5  # Illinois: halve the stale end
            side = -1
        else:
            hi, f_hi = step, point.slope
            if side == 1:
                f_lo *= 0.5
            side = 1
    return best if best is not None else point
