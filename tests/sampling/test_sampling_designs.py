"""Sampling designs against brute-force enumeration, exact arithmetic and R's `sampling`."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard.sampling import (
    DESIGNS,
    Brewer,
    ConditionalPoisson,
    MinimumSupport,
    draw_subsets,
    inclusion_probabilities,
    successive_sample,
)

REFERENCE = json.loads(
    (Path(__file__).parent.parent / "data" / "r_sampling_reference.json").read_text()
)["cases"]

# Monte Carlo tolerances: a frequency f of an event with probability p over S independent draws
# has standard error se = sqrt(p (1 - p) / S).  We require |f - p| <= Z_MAX * se + 2 / S for
# every event checked.  For common events this is a 5.5-sigma band: a correct sampler fails one
# check with probability ~ 2 Φ(-5.5) = 4e-8, so even a few thousand checked events give a false
# alarm below 1e-4 (and the seeds are fixed), while a design error of 1% of p is flagged at the
# sample sizes used here.  The 2 / S term covers rare events (S p << 1), whose counts are
# Poisson rather than normal: 3 or more hits of an event with S p = 0.02 have probability 1e-6.
Z_MAX = 5.5


def max_z(freq: np.ndarray, p: np.ndarray, draws: int) -> float:
    """Largest (|freq - p| - 2/S) in standard errors; events of probability 0 or 1 are exact."""
    p = np.clip(p, 0.0, 1.0)  # exact probabilities may exceed 1 by rounding
    se = np.sqrt(p * (1 - p) / draws)
    off = np.abs(freq - p)
    excess = np.maximum(off - 2.0 / draws, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(se > 0, excess / se, np.where(off > 1e-12, np.inf, 0.0))
    return float(z.max())


def all_subsets(big_n: int, n: int) -> np.ndarray:
    """Indicator rows (K, N) of every size-n subset, in lexicographic order."""
    combos = list(itertools.combinations(range(big_n), n))
    rows = np.zeros((len(combos), big_n), dtype=bool)
    for r, combo in enumerate(combos):
        rows[r, list(combo)] = True
    return rows


def cps_design(sampler: ConditionalPoisson) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: p(s) ∝ Π_{i∈s} wᵢ over all size-n subsets (w from the fitted log-odds)."""
    log_odds = np.asarray(sampler.log_odds)
    rows = all_subsets(log_odds.size, sampler.sample_size)
    certain, never = np.isposinf(log_odds), np.isneginf(log_odds)
    rows = rows[rows[:, certain].all(axis=1) & ~rows[:, never].any(axis=1)]
    finite = np.where(np.isfinite(log_odds), log_odds, 0.0)
    score = rows @ finite  # (K,)
    p = np.exp(score - score.max())
    return rows, p / p.sum()


def brewer_design(pi: np.ndarray) -> dict[tuple[int, ...], float]:
    """Exact Brewer design by enumerating every branch of the draw-by-draw procedure."""
    fixed = tuple(int(i) for i in np.flatnonzero(pi == 1))
    units = np.flatnonzero((pi > 0) & (pi < 1))
    p = pi[units]
    k = round(pi.sum()) - len(fixed)
    design: dict[tuple[int, ...], float] = {}

    def walk(chosen: list[int], prob: float) -> None:
        r = len(chosen) + 1
        if r > k:
            key = tuple(sorted(fixed + tuple(int(units[j]) for j in chosen)))
            design[key] = design.get(key, 0.0) + prob
            return
        a = p[chosen].sum()
        score = p * (k - a - p) / (k - a - p * (k - r + 1))
        score[chosen] = 0.0
        for j in np.flatnonzero(score > 0):
            walk([*chosen, int(j)], prob * score[j] / score.sum())

    walk([], 1.0)
    return design


def design_arrays(design: dict[tuple[int, ...], float], big_n: int):
    rows = np.zeros((len(design), big_n), dtype=bool)
    for r, key in enumerate(design):
        rows[r, list(key)] = True
    return rows, np.array(list(design.values()))


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def subset_frequencies(subsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Frequency of each indicator row of `rows` among the drawn index rows."""
    keys = {tuple(np.flatnonzero(r)): i for i, r in enumerate(rows)}
    counts = np.zeros(len(rows))
    for s in subsets:
        counts[keys[tuple(s)]] += 1  # KeyError = a subset outside the design's support
    return counts / len(subsets)


def small_pis():
    """π vectors for N <= 9 with certain, impossible, tied and complement-side cases."""
    rng = np.random.default_rng(11)
    out = []
    for trial in range(14):
        big_n = int(rng.integers(3, 10))
        n = int(rng.integers(1, big_n))
        lam = rng.gamma(0.6, size=big_n)
        if trial % 3 == 0:
            pi, _ = inclusion_probabilities(
                lam, n, "collective", num_clients=int(rng.integers(2, 6))
            )
        else:
            pi, _ = inclusion_probabilities(lam, n, "unbiased")
        out.append(pi)
    out.append(np.array([0.5, 0.5, 0.5, 0.5]))
    out.append(np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.5]))  # n = 4 of 6: drawn via the complement
    out.append(np.array([1.0, 0.0, 0.25, 0.75, 0.6, 0.4]))
    return out


# --- conditional Poisson -------------------------------------------------------------------


@pytest.mark.parametrize("pi", small_pis(), ids=lambda p: f"N{p.size}n{round(p.sum())}")
def test_cps_exact_design_has_the_target_marginals_and_maximum_entropy(pi):
    cps = ConditionalPoisson(pi)
    rows, p = cps_design(cps)
    np.testing.assert_allclose(p @ rows, pi, atol=1e-10)
    assert cps.fit_error <= 1e-10
    b_rows, b_p = design_arrays(brewer_design(pi), pi.size)
    np.testing.assert_allclose(b_p @ b_rows, pi, atol=1e-12)  # Brewer is exact too
    ms = MinimumSupport(pi)
    np.testing.assert_allclose(ms.probabilities @ ms.support, pi, atol=1e-12)
    # Where the marginals leave no freedom (e.g. n = 1) all designs coincide: equal entropies.
    assert entropy(p) >= entropy(b_p) - 1e-9
    assert entropy(p) >= entropy(ms.probabilities) - 1e-9


def test_cps_is_a_local_entropy_maximum_under_fixed_marginals():
    # Move the exact CPS design along random directions that keep Σp = 1 and every marginal:
    # the entropy must drop on both sides (it is concave, so this is the global maximum).
    pi = np.array([0.9, 0.7, 0.5, 0.4, 0.3, 0.2])
    rows, p = cps_design(ConditionalPoisson(pi))
    constraints = np.vstack([rows.T.astype(float), np.ones(len(p))])  # (N+1, K)
    _, sing, vt = np.linalg.svd(constraints)
    null = vt[(sing > 1e-10).sum() :]  # basis of directions that keep the marginals
    rng = np.random.default_rng(3)
    base = entropy(p)
    for _ in range(20):
        d = rng.normal(size=null.shape[0]) @ null
        eps = 0.2 * p.min() / np.abs(d).max()
        assert entropy(p + eps * d) < base and entropy(p - eps * d) < base


def test_cps_draws_follow_the_exact_design():
    pi = np.array([0.9, 0.15, 0.55, 0.4, 0.0, 0.3, 0.7, 1.0])  # n = 4 with π = 0 and π = 1
    cps = ConditionalPoisson(pi)
    rows, p = cps_design(cps)
    draws = 40_000
    subsets = cps.sample(draws, rng=np.random.default_rng(5))
    assert max_z(subset_frequencies(subsets, rows), p, draws) <= Z_MAX


def coinclusion(subsets: np.ndarray, big_n: int) -> np.ndarray:
    """Empirical joint inclusion frequencies (N, N) of index rows (S, n)."""
    ind = np.zeros((len(subsets), big_n))
    np.put_along_axis(ind, subsets, 1.0, axis=1)
    return ind.T @ ind / len(subsets)


def test_cps_coinclusion_matches_r_upmaxentropypi2_and_min_support_does_not():
    draws = 20_000
    other_z = []
    for index, case in enumerate(REFERENCE):
        pi, pi2 = np.array(case["pi_unbiased"]), np.array(case["pi2_cps"])
        if case["n"] == 1:
            continue  # every design of fixed size 1 has the same (diagonal) joint probabilities
        x = ConditionalPoisson(pi).sample(draws, rng=[7, index])
        assert max_z(coinclusion(x, pi.size), pi2, draws) <= Z_MAX, f"case {index}"
        y = MinimumSupport(pi).sample(draws, rng=[8, index])
        other_z.append(max_z(coinclusion(y, pi.size), pi2, draws))
    # Same marginals, another joint law: far outside the CPS band in every case.
    assert min(other_z) > 4 * Z_MAX


def test_exact_joint_probabilities_cps_matches_r_and_brewer_does_not():
    # R fits the working probabilities to 1e-6 (UPMEpiktildefrompik's eps), hence atol 1e-5 for
    # CPS; Brewer's design shares the marginals but its π_ij are off by ~1e-3, 100x that.
    brewer_gap = []
    for case in REFERENCE:
        if len(case["lambda"]) > 10:
            continue
        pi, pi2 = np.array(case["pi_unbiased"]), np.array(case["pi2_cps"])
        rows, p = cps_design(ConditionalPoisson(pi))
        np.testing.assert_allclose((rows.T * p) @ rows, pi2, atol=1e-5)
        b_rows, b_p = design_arrays(brewer_design(pi), pi.size)
        brewer_gap.append(np.abs((b_rows.T * b_p) @ b_rows - pi2).max())
    assert max(brewer_gap) > 5e-4
    # A Monte Carlo run of the library's Brewer follows its own joint law, not R's CPS one.
    case = next(c for c in REFERENCE if len(c["lambda"]) == 10 and c["n"] == 5)
    pi = np.array(case["pi_unbiased"])
    b_rows, b_p = design_arrays(brewer_design(pi), pi.size)
    draws = 40_000
    y = Brewer(pi).sample(draws, rng=9)
    assert max_z(coinclusion(y, pi.size), (b_rows.T * b_p) @ b_rows, draws) <= Z_MAX


def exact_marginals(log_odds: np.ndarray, k: int) -> list[Fraction]:
    """CPS marginals in exact rational arithmetic: πᵢ = wᵢ e_{k-1}(w₋ᵢ) / e_k(w)."""
    w = [Fraction(float(np.exp(x))) for x in log_odds]

    def elementary(values: list[Fraction], order: int) -> Fraction:
        e = [Fraction(1)] + [Fraction(0)] * order
        for v in values:
            for z in range(order, 0, -1):
                e[z] += v * e[z - 1]
        return e[order]

    total = elementary(w, k)
    return [w[i] * elementary(w[:i] + w[i + 1 :], k - 1) / total for i in range(len(w))]


def test_cps_fit_over_thirty_orders_of_magnitude_in_exact_arithmetic():
    lam = np.logspace(3, -30, 40)
    pi, _ = inclusion_probabilities(lam, 5, "unbiased")
    cps = ConditionalPoisson(pi)
    frac = (pi > 0) & (pi < 1)
    k = 5 - int((pi == 1).sum())
    exact = np.array([float(x) for x in exact_marginals(np.asarray(cps.log_odds)[frac], k)])
    np.testing.assert_allclose(exact, pi[frac], atol=1e-10)
    # Relative accuracy holds far into the tail (π ~ 1e-33), where atol says nothing.
    np.testing.assert_allclose(exact, pi[frac], rtol=1e-6)
    subsets = cps.sample(2000, rng=0)
    assert np.all(np.isin(np.flatnonzero(pi == 1), subsets))


def test_cps_setup_is_reusable():
    pi, _ = inclusion_probabilities(np.arange(1.0, 21.0), 6, "unbiased")
    cps = ConditionalPoisson(pi)
    a, b = cps.sample(50, rng=1), cps.sample(50, rng=2)
    np.testing.assert_array_equal(a, cps.sample(50, rng=1))
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, draw_subsets(pi, 50, design="cps", rng=1))
    with pytest.raises(ValueError, match="assignment destination is read-only"):
        cps.inclusion_probabilities[0] = 0.5


# --- Brewer and minimum support --------------------------------------------------------------


def test_brewer_draws_follow_the_enumerated_procedure():
    pi = np.array([0.8, 0.6, 0.5, 0.1, 1.0, 0.0, 0.35, 0.65])  # n = 4
    rows, p = design_arrays(brewer_design(pi), pi.size)
    draws = 40_000
    subsets = Brewer(pi).sample(draws, rng=np.random.default_rng(6))
    assert max_z(subset_frequencies(subsets, rows), p, draws) <= Z_MAX


def test_minimum_support_design_and_draws():
    pi = np.array([0.8, 0.6, 0.5, 0.1, 1.0, 0.0, 0.35, 0.65])
    ms = MinimumSupport(pi)
    fractional = int(((pi > 0) & (pi < 1)).sum())
    assert ms.support.shape[0] <= fractional + 1
    assert len({tuple(r) for r in ms.support}) == ms.support.shape[0]
    assert np.all(ms.support.sum(axis=1) == 4)
    assert ms.probabilities.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(ms.probabilities @ ms.support, pi, atol=1e-12)
    draws = 40_000
    subsets = ms.sample(draws, rng=np.random.default_rng(7))
    assert max_z(subset_frequencies(subsets, ms.support), ms.probabilities, draws) <= Z_MAX


@pytest.mark.parametrize("design", ["cps", "brewer", "min-support"])
def test_marginals_by_monte_carlo_on_a_larger_layer(design):
    rng = np.random.default_rng(12)
    pi, _ = inclusion_probabilities(rng.gamma(0.5, size=80), 16, "unbiased")
    draws = 10_000
    subsets = draw_subsets(pi, draws, design=design, rng=13)
    freq = np.bincount(subsets.ravel(), minlength=pi.size) / draws
    assert max_z(freq, pi, draws) <= Z_MAX


# --- successive (PriSM) ----------------------------------------------------------------------


def successive_exact(w: np.ndarray, n: int) -> dict[tuple[int, ...], float]:
    """Exact set distribution of successive sampling by enumerating every ordered draw."""
    design: dict[tuple[int, ...], float] = {}
    for order in itertools.permutations(range(w.size), n):
        prob, left = 1.0, w.sum()
        for i in order:
            prob *= w[i] / left
            left -= w[i]
        key = tuple(sorted(order))
        design[key] = design.get(key, 0.0) + prob
    return design


def test_successive_matches_enumeration_and_numpy_choice():
    w = np.array([5.0, 3.0, 2.0, 1.0, 0.5, 0.25])
    n = 3
    rows, p = design_arrays(successive_exact(w, n), w.size)
    draws = 30_000
    mine = successive_sample(w, n, draws, rng=1)
    assert max_z(subset_frequencies(mine, rows), p, draws) <= Z_MAX
    gen = np.random.default_rng(2)
    theirs = np.sort([gen.choice(w.size, n, replace=False, p=w / w.sum()) for _ in range(draws)])
    assert max_z(subset_frequencies(theirs, rows), p, draws) <= Z_MAX
    via_api = draw_subsets(np.full(6, 0.5), 5, design="successive", weights=w, rng=1)
    np.testing.assert_array_equal(via_api, successive_sample(w, 3, 5, rng=1))


def test_successive_with_zero_weights():
    w = np.array([0.0, 2.0, 0.0, 1.0, 0.0])
    s = successive_sample(w, 2, 200, rng=0)
    assert np.all(s == [1, 3])  # zero weights are never drawn while positive ones remain
    s = successive_sample(w, 4, 3000, rng=0)
    assert np.all(np.isin([1, 3], s))
    freq = np.bincount(s.ravel(), minlength=5) / 3000
    assert max_z(freq[[0, 2, 4]], np.full(3, 2 / 3), 3000) <= Z_MAX


# --- top-n and common behaviour --------------------------------------------------------------


def test_top_n_design():
    s = draw_subsets([0.2, 1.0, 0.9, 0.9, 0.0], 3, design="top-n", rng=0)
    np.testing.assert_array_equal(s, [[1, 2, 3]] * 3)
    s = draw_subsets([0.5, 0.5, 0.5, 0.5], 2, design="top-n")
    np.testing.assert_array_equal(s, [[0, 1], [0, 1]])


@pytest.mark.parametrize("design", ["cps", "brewer", "min-support", "top-n"])
def test_edge_cases(design):
    np.testing.assert_array_equal(draw_subsets(np.ones(4), 2, design=design), [[0, 1, 2, 3]] * 2)
    np.testing.assert_array_equal(draw_subsets([1.0], 3, design=design), [[0]] * 3)
    assert draw_subsets(np.zeros(3), 2, design=design).shape == (2, 0)
    assert draw_subsets([0.5, 0.5], 0, design=design).shape == (0, 1)
    s = draw_subsets([0.5, 0.5, 1.0, 0.0], 1000, design=design, rng=0)
    assert np.all(s[:, -1] == 2) and not np.any(s == 3)


@settings(max_examples=40, deadline=None)
@given(
    lam=st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=1, max_size=30),
    data=st.data(),
    design=st.sampled_from(DESIGNS),
    seed=st.integers(0, 2**32 - 1),
)
def test_draw_properties(lam, data, design, seed):
    lam = np.asarray(lam)
    n = data.draw(st.integers(1, lam.size), label="n")
    pi, _ = inclusion_probabilities(lam, n, "unbiased")
    weights = lam + 1e-3 if design == "successive" else None
    a = draw_subsets(pi, 6, design=design, rng=seed, weights=weights)
    b = draw_subsets(pi, 6, design=design, rng=np.random.default_rng(seed), weights=weights)
    np.testing.assert_array_equal(a, b)  # same seed, same draws
    assert a.shape == (6, n) and a.dtype == np.int64
    assert np.all(np.diff(a, axis=1) > 0)  # sorted, no repeats
    if design != "successive":
        assert np.all(np.isin(np.flatnonzero(pi == 1), a))
        assert not np.any(np.isin(a, np.flatnonzero(pi == 0)))


@pytest.mark.parametrize("design", ["cps", "brewer", "min-support", "successive"])
def test_different_seeds_give_different_draws(design):
    pi, _ = inclusion_probabilities(np.arange(1.0, 31.0), 8, "unbiased")
    weights = np.arange(1.0, 31.0) if design == "successive" else None
    a = draw_subsets(pi, 10, design=design, rng=[1, 2, 3], weights=weights)
    b = draw_subsets(pi, 10, design=design, rng=[1, 2, 4], weights=weights)
    assert not np.array_equal(a, b)


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pi", "kwargs", "error", "match"),
    [
        ([0.5, 1.5], {}, ValueError, r"pi must lie in \[0, 1\], but pi\[1\] = 1.5"),
        ([0.5, -0.5, 1.0], {}, ValueError, r"pi\[1\] = -0.5"),
        ([0.5, np.nan], {}, ValueError, r"pi\[1\] = nan"),
        ([0.5, 0.7], {}, ValueError, r"sum to an integer .* sum\(pi\) = 1.2"),
        ([0.5, 0.5], {"design": "poisson"}, ValueError, r"design must be one of .*'poisson'"),
        ([0.5, 0.5], {"design": "successive"}, ValueError, r"successive.*weights is None"),
        ([0.5, 0.5], {"weights": [1.0, 2.0]}, ValueError, r"only used by design='successive'"),
        (
            [0.5, 0.5],
            {"design": "successive", "weights": [1.0]},
            ValueError,
            r"weights must have the length of pi \(2\), got 1",
        ),
        (
            [0.5, 0.5],
            {"design": "successive", "weights": [1.0, -1.0]},
            ValueError,
            r"weights\[1\] = -1.0",
        ),
    ],
)
def test_bad_input(pi, kwargs, error, match):
    with pytest.raises(error, match=match):
        draw_subsets(pi, 2, **kwargs)


def test_bad_num_samples():
    with pytest.raises(ValueError, match="num_samples must be >= 0, got -1"):
        draw_subsets([0.5, 0.5], -1)
    with pytest.raises(TypeError, match="num_samples must be an integer, got '2'"):
        draw_subsets([0.5, 0.5], "2")
    with pytest.raises(ValueError, match="at most the number of items 2, got 3"):
        successive_sample([1.0, 1.0], 3, 1)
