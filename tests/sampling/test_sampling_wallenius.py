"""wallenius_mean against BiasedUrn (R) and the exact law of successive sampling."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard.sampling import successive_sample, wallenius_mean

REFERENCE = json.loads(
    (Path(__file__).parent.parent / "data" / "r_sampling_reference.json").read_text()
)["cases"]
SMALL = [c for c in REFERENCE if c["wallenius_mean_fog"] is not None]


def successive_inclusion(w: np.ndarray, n: int) -> np.ndarray:
    """Exact inclusion probabilities of successive sampling (draw ∝ w among the rest)."""
    pi = np.zeros(w.size)
    for order in itertools.permutations(range(w.size), n):
        prob, left = 1.0, w.sum()
        for i in order:
            prob *= w[i] / left
            left -= w[i]
        pi[list(order)] += prob
    return pi


@pytest.mark.parametrize("case", SMALL, ids=lambda c: f"N{len(c['lambda'])}n{c['n']}")
def test_matches_biasedurn_fog_approximation(case):
    lam, n, k = np.array(case["lambda"]), case["n"], case["prism_k"]
    mean = wallenius_mean(lam**k, n)
    # BiasedUrn solves the same equation iteratively; both agree to its solver accuracy.
    np.testing.assert_allclose(mean, case["wallenius_mean_fog"], atol=1e-9)
    # Fog's approximation is only that: within a few 1e-2 of the exact mean.
    assert np.abs(mean - np.array(case["wallenius_mean"])).max() < 0.08


def test_exact_wallenius_mean_is_the_law_of_successive_sampling():
    # BiasedUrn's exact mean (precision 1e-9) equals the inclusion probabilities of PriSM's
    # draw-one-by-one scheme, enumerated here over all ordered draws.
    checked = 0
    for case in SMALL:
        lam, n, k = np.array(case["lambda"]), case["n"], case["prism_k"]
        if lam.size > 10:
            continue
        exact = successive_inclusion(lam**k, n)
        np.testing.assert_allclose(exact, case["wallenius_mean"], atol=1e-7)
        checked += 1
    assert checked == 4


def test_successive_draws_converge_to_the_exact_mean():
    case = next(c for c in SMALL if len(c["lambda"]) == 16 and c["n"] == 5)
    lam, k = np.array(case["lambda"]), case["prism_k"]
    draws = 40_000
    subsets = successive_sample(lam**k, 5, draws, rng=3)
    freq = np.bincount(subsets.ravel(), minlength=lam.size) / draws
    p = np.array(case["wallenius_mean"])
    se = np.sqrt(p * (1 - p) / draws)
    # 5.5 standard errors plus 2/S for rare events (see test_sampling_designs.Z_MAX).
    assert np.all(np.abs(freq - p) <= 5.5 * se + 2.0 / draws)


def test_n_equals_one_is_not_the_exact_multinomial():
    # Documents the approximation: the exact mean for n = 1 is w / Σw, Fog's is not.
    w = np.array([4.0, 2.0, 1.0, 1.0])
    mean = wallenius_mean(w, 1)
    assert mean.sum() == pytest.approx(1.0)
    assert not np.allclose(mean, w / w.sum(), atol=1e-3)


def test_edge_cases():
    np.testing.assert_array_equal(wallenius_mean([3.0, 1.0, 2.0], 3), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(wallenius_mean([5.0], 1), [1.0])
    # Fewer positive weights than n: positive ones are certain, zeros share the rest.
    np.testing.assert_allclose(wallenius_mean([0.0, 2.0, 0.0, 1.0], 3), [0.5, 1.0, 0.5, 1.0])
    np.testing.assert_allclose(wallenius_mean([0.0, 2.0, 0.0, 1.0], 2), [0.0, 1.0, 0.0, 1.0])
    np.testing.assert_allclose(wallenius_mean(np.zeros(4), 1), np.full(4, 0.25))
    np.testing.assert_allclose(wallenius_mean(np.ones(5), 2), np.full(5, 0.4), rtol=1e-12)


def test_weights_over_120_orders_of_magnitude():
    w = np.logspace(3, -30, 50) ** 4
    mean = wallenius_mean(w, 5)
    assert mean.sum() == pytest.approx(5.0, abs=1e-12)
    assert np.all(np.diff(mean) <= 0) and mean[-1] > 0
    # Deep in the tail μᵢ = 1 - exp(-wᵢ r) ≈ wᵢ r: proportional to the weight.
    np.testing.assert_allclose(mean[-5:] / w[-5:], mean[-6] / w[-6], rtol=1e-9)


@pytest.mark.parametrize(
    ("weights", "n", "error", "match"),
    [
        ([1.0, np.nan], 1, ValueError, r"weights\[1\] = nan"),
        ([1.0, -2.0], 1, ValueError, r"weights\[1\] = -2.0"),
        ([1.0, np.inf], 1, ValueError, r"weights\[1\] = inf"),
        ([1.0, 2.0], 0, ValueError, r"n must be >= 1, got 0"),
        ([1.0, 2.0], 3, ValueError, r"at most the number of terms N = 2, got n = 3"),
        ([1.0, 2.0], 1.5, ValueError, r"n must be an integer, got 1.5"),
    ],
)
def test_bad_input(weights, n, error, match):
    with pytest.raises(error, match=match):
        wallenius_mean(weights, n)


@settings(max_examples=100, deadline=None)
@given(
    w=st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=40),
    data=st.data(),
    scale=st.floats(1e-3, 1e3),
)
def test_properties(w, data, scale):
    w = np.asarray(w)
    n = data.draw(st.integers(1, w.size), label="n")
    mean = wallenius_mean(w, n)
    assert mean.sum() == pytest.approx(n, abs=1e-9)
    assert np.all((mean >= 0) & (mean <= 1))
    larger = w[:, None] > w[None, :]
    assert np.all((mean[:, None] >= mean[None, :] - 1e-12)[larger])
    np.testing.assert_allclose(wallenius_mean(w * scale, n), mean, atol=1e-9)  # odds ratios only
