"""inclusion_probabilities / scaled_multipliers against the paper's literal algorithms, R and
first principles."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paper_algorithms import (
    algorithm1_unbiased,
    algorithm2_collective,
    collective_objective,
    unbiased_objective,
)

from fedshard.sampling import (
    METHODS,
    default_prism_exponent,
    inclusion_probabilities,
    scaled_multipliers,
    wallenius_mean,
)

REFERENCE = json.loads(
    (Path(__file__).parent.parent / "data" / "r_sampling_reference.json").read_text()
)["cases"]


def general_position_spectra(seed: int, count: int):
    """Random descending spectra without ties or extreme ranges, (lam, n, C)."""
    rng = np.random.default_rng(seed)
    for trial in range(count):
        big_n = int(rng.integers(2, 36))
        n = int(rng.integers(1, big_n))
        c = int(rng.integers(2, 30))
        if trial % 2:
            lam = rng.gamma(float(rng.choice([0.5, 1.0, 3.0])), size=big_n)
        else:
            lam = 10.0 ** rng.uniform(-2, 2, size=big_n)
        yield np.sort(lam)[::-1], n, c


def hard_spectra(seed: int, count: int):
    """Descending spectra with ties and up to 11 orders of magnitude, (lam, n, C)."""
    rng = np.random.default_rng(seed)
    for trial in range(count):
        big_n = int(rng.integers(2, 30))
        n = int(rng.integers(1, big_n))
        c = int(rng.integers(2, 25))
        if trial % 2:
            lam = rng.integers(1, 4, size=big_n).astype(float)  # many ties
        else:
            lam = 10.0 ** rng.uniform(-8, 3, size=big_n)
        yield np.sort(lam)[::-1], n, c


def reduced_collective_objective(lam, pi, c):
    """E‖W - W̄‖² - Σλ² at the optimal ω (Theorem 2), well conditioned for wide spectra."""
    return float(-(lam**2 * c * pi / (1.0 + (c - 1) * pi)).sum())


# --- Theorem 1 / Algorithm 1 ---------------------------------------------------------------


def test_unbiased_equals_algorithm1_on_random_spectra():
    for lam, n, _ in general_position_spectra(seed=1, count=250):
        pi, omega = inclusion_probabilities(lam, n, "unbiased")
        expected = algorithm1_unbiased(lam, n)
        np.testing.assert_allclose(pi, expected, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(omega * pi, 1.0, rtol=1e-14)
        assert unbiased_objective(lam, pi) == pytest.approx(unbiased_objective(lam, expected))


def test_unbiased_never_worse_than_algorithm1_with_ties_and_wide_ranges():
    for lam, n, _ in hard_spectra(seed=2, count=200):
        pi, _ = inclusion_probabilities(lam, n, "unbiased")
        mine, theirs = (
            unbiased_objective(lam, pi),
            unbiased_objective(lam, algorithm1_unbiased(lam, n)),
        )
        assert mine <= theirs * (1 + 1e-12) + 1e-300


def test_unbiased_matches_r_inclusionprobabilities():
    for case in REFERENCE:
        pi, _ = inclusion_probabilities(case["lambda"], case["n"], "unbiased")
        np.testing.assert_allclose(pi, case["pi_unbiased"], rtol=1e-12, atol=1e-15)


# --- Theorem 2 / Algorithm 2 ---------------------------------------------------------------


def test_collective_equals_algorithm2_on_random_spectra():
    for lam, n, c in general_position_spectra(seed=3, count=250):
        pi, omega = inclusion_probabilities(lam, n, "collective", num_clients=c)
        pi_ref, w_ref = algorithm2_collective(lam, n, c)
        np.testing.assert_allclose(pi, pi_ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(omega, w_ref, rtol=1e-10, atol=1e-12)
        scale = float((lam**2).sum())
        gap = collective_objective(lam, pi, omega, c) - collective_objective(lam, pi_ref, w_ref, c)
        assert abs(gap) <= 1e-12 * scale


def test_collective_never_worse_than_algorithm2_with_ties_and_wide_ranges():
    # With ties the literal Algorithm 2 can miss the optimum: its test √β ≤ λ_t/√C is an exact
    # equality for tied terms and fails by rounding (e.g. λ = (3×9, 2×3, 1×12), n = 10, C = 2).
    for lam, n, c in hard_spectra(seed=4, count=200):
        pi, _ = inclusion_probabilities(lam, n, "collective", num_clients=c)
        pi_ref, _ = algorithm2_collective(lam, n, c)
        mine = reduced_collective_objective(lam, pi, c)
        theirs = reduced_collective_objective(lam, pi_ref, c)
        assert mine <= theirs + 1e-12 * abs(theirs)


def test_collective_tied_terms_share_probability():
    lam = np.array([3.0] * 9 + [2.0] * 3 + [1.0] * 12)
    pi, omega = inclusion_probabilities(lam, 10, "collective", num_clients=2)
    np.testing.assert_allclose(pi[9:12], 1.0 / 3.0, rtol=1e-12)
    np.testing.assert_array_equal(pi[:9], 1.0)
    np.testing.assert_array_equal(pi[12:], 0.0)
    np.testing.assert_allclose(omega[9:12], 2.0 / (1.0 + 1.0 / 3.0))


def test_collective_kkt_conditions():
    # Stationarity of Theorem 2: λᵢ / (1 + (C-1)πᵢ) is constant on the fractional terms, at
    # most that constant for π = 0 terms and at least it for π = 1 terms.
    rng = np.random.default_rng(7)
    lam = rng.gamma(0.7, size=60)
    pi, _ = inclusion_probabilities(lam, 9, "collective", num_clients=5)
    ratio = lam / (1.0 + 4.0 * pi)
    frac = (pi > 0) & (pi < 1)
    assert frac.sum() >= 2
    level = ratio[frac].mean()
    np.testing.assert_allclose(ratio[frac], level, rtol=1e-12)
    assert np.all(lam[pi == 0] * np.sqrt(5) <= np.sqrt(5) * level * (1 + 1e-12))
    assert np.all(lam[pi == 1] >= level * (1 - 1e-12))


def test_collective_with_one_client_is_top_n():
    lam = np.array([0.5, 4.0, 1.0, 2.0, 3.0])
    pi, omega = inclusion_probabilities(lam, 2, "collective", num_clients=1)
    np.testing.assert_array_equal(pi, [0, 1, 0, 0, 1])
    np.testing.assert_array_equal(omega, pi)


def test_collective_error_not_above_unbiased_error():
    # Theorem 2 optimises over all (π, ω), the unbiased choice included: for C i.i.d. unbiased
    # clients E‖W - W̄‖² = (1/C) Σ λ² (1/π - 1).
    for lam, n, c in general_position_spectra(seed=5, count=100):
        pi_u, omega_u = inclusion_probabilities(lam, n, "unbiased")
        pi_c, omega_c = inclusion_probabilities(lam, n, "collective", num_clients=c)
        collective = collective_objective(lam, pi_c, omega_c, c)
        unbiased = collective_objective(lam, pi_u, omega_u, c)
        scale = float((lam**2).sum())  # the closed forms cancel down from Σλ²
        assert unbiased == pytest.approx(unbiased_objective(lam, pi_u) / c, abs=1e-12 * scale)
        assert collective <= unbiased + 1e-12 * (lam**2).sum()


# --- other methods ----------------------------------------------------------------------------


def test_top_n_keeps_largest_and_breaks_ties_by_index():
    lam = np.array([1.0, 3.0, 2.0, 3.0, 2.0])
    pi, omega = inclusion_probabilities(lam, 3, "top-n")
    np.testing.assert_array_equal(pi, [0, 1, 1, 1, 0])
    np.testing.assert_array_equal(omega, pi)


@pytest.mark.parametrize(
    ("n", "big_n", "k"), [(1, 10, 4.0), (2, 10, 4.0), (3, 10, 2.5), (5, 5, 2.5)]
)
def test_default_prism_exponent(n, big_n, k):
    assert default_prism_exponent(n, big_n) == k


def test_prism_is_wallenius_mean_of_powered_spectrum():
    lam = np.array([5.0, 0.3, 2.0, 1.0, 0.0, 0.7, 3.0, 1.5, 0.1, 2.5])
    pi, omega = inclusion_probabilities(lam, 2, "prism")  # n/N = 0.2 -> k = 4
    np.testing.assert_allclose(pi, wallenius_mean(lam**4, 2), rtol=1e-12)
    np.testing.assert_array_equal(omega, np.where(pi > 0, 1.0, 0.0))
    assert omega[4] == 0.0 and pi[4] == 0.0
    pi_w, omega_w = inclusion_probabilities(lam, 2, "prism-wallenius", prism_exponent=2.5)
    np.testing.assert_allclose(pi_w, wallenius_mean(lam**2.5, 2), rtol=1e-12)
    np.testing.assert_allclose(omega_w[pi_w > 0] * pi_w[pi_w > 0], 1.0)
    assert omega_w[4] == 0.0


def test_outputs_follow_input_order():
    rng = np.random.default_rng(8)
    lam = rng.gamma(0.8, size=25)
    perm = rng.permutation(25)
    for method in METHODS:
        pi, omega = inclusion_probabilities(lam, 6, method, num_clients=4)
        pi_p, omega_p = inclusion_probabilities(lam[perm], 6, method, num_clients=4)
        np.testing.assert_allclose(pi_p, pi[perm], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(omega_p, omega[perm], rtol=1e-12, atol=1e-15)


# --- edge cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_n_equals_big_n_keeps_everything(method):
    pi, omega = inclusion_probabilities([3.0, 1.0, 0.5, 2.0], 4, method, num_clients=3)
    np.testing.assert_array_equal(pi, 1.0)
    np.testing.assert_allclose(omega, 1.0)


@pytest.mark.parametrize("method", METHODS)
def test_single_term(method):
    pi, omega = inclusion_probabilities([2.0], 1, method, num_clients=3)
    np.testing.assert_array_equal(pi, [1.0])
    np.testing.assert_allclose(omega, [1.0])


def test_n_equals_big_n_minus_one():
    lam = np.array([4.0, 3.0, 2.0, 1.0])
    pi, _ = inclusion_probabilities(lam, 3, "unbiased")
    # Σ λ = 10 and 3λ₁ = 12 > 10, so λ₁ is capped; then 2·3 = 6 = Λ₁ = 6 caps λ₂ exactly.
    np.testing.assert_allclose(pi, [1.0, 1.0, 2.0 / 3.0, 1.0 / 3.0], rtol=1e-15)
    pi_c, _ = inclusion_probabilities(lam, 3, "collective", num_clients=3)
    assert pi_c.sum() == pytest.approx(3.0)
    np.testing.assert_allclose(pi_c, algorithm2_collective(lam, 3, 3)[0], atol=1e-12)


@pytest.mark.parametrize("method", ["unbiased", "collective"])
def test_ties_get_equal_probabilities(method):
    lam = np.array([2.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    pi, omega = inclusion_probabilities(lam, 3, method, num_clients=4)
    np.testing.assert_allclose(pi[1:5], pi[1], rtol=1e-14)
    np.testing.assert_allclose(omega[1:5], omega[1], rtol=1e-14)


@pytest.mark.parametrize("method", METHODS)
def test_zero_singular_values_are_never_drawn_and_have_finite_omega(method):
    lam = np.array([3.0, 0.0, 2.0, 1.0, 0.0, 0.5, 0.25])
    pi, omega = inclusion_probabilities(lam, 3, method, num_clients=5)
    assert np.all(np.isfinite(omega))
    np.testing.assert_array_equal(pi[[1, 4]], 0.0)
    np.testing.assert_array_equal(omega[[1, 4]], 0.0)
    assert pi.sum() == pytest.approx(3.0, abs=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_fewer_nonzero_singular_values_than_n(method):
    # Rank-deficient layer: keep the 2 nonzero terms, spread the 2 missing slots over the 4 zeros.
    lam = np.array([0.0, 5.0, 0.0, 0.0, 1.0, 0.0])
    pi, omega = inclusion_probabilities(lam, 4, method, num_clients=3)
    if method == "top-n":
        np.testing.assert_array_equal(np.sort(pi), [0, 0, 1, 1, 1, 1])
        assert pi[1] == pi[4] == 1.0
    else:
        np.testing.assert_allclose(pi, [0.5, 1.0, 0.5, 0.5, 1.0, 0.5])
    assert np.all(np.isfinite(omega))


@pytest.mark.parametrize("method", METHODS)
def test_all_zero_spectrum(method):
    pi, omega = inclusion_probabilities(np.zeros(5), 2, method, num_clients=3)
    assert pi.sum() == pytest.approx(2.0)
    assert np.all(np.isfinite(omega))


@pytest.mark.parametrize("method", METHODS)
def test_thirty_orders_of_magnitude(method):
    lam = np.logspace(3, -30, 120)
    pi, omega = inclusion_probabilities(lam, 12, method, num_clients=10)
    assert pi.sum() == pytest.approx(12.0, abs=1e-10)
    assert np.all((pi >= 0) & (pi <= 1)) and np.all(np.isfinite(omega))
    assert np.all(np.diff(pi) <= 1e-15)  # λ is descending
    if method in ("unbiased", "prism-wallenius"):
        np.testing.assert_allclose((omega * pi)[pi > 0], 1.0, rtol=1e-12)
    if method == "unbiased":
        # Far in the tail π ∝ λ exactly: relative accuracy survives 30 orders of magnitude.
        np.testing.assert_allclose(pi[-10:] / lam[-10:], pi[-11] / lam[-11], rtol=1e-12)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lam", "n", "kwargs", "match"),
    [
        ([1.0, np.nan, 0.5], 1, {}, r"singular_values\[1\] = nan"),
        ([1.0, np.inf], 1, {}, r"singular_values\[1\] = inf"),
        ([1.0, -0.5], 1, {}, r"finite and >= 0.*-0.5"),
        ([[1.0, 2.0]], 1, {}, r"1-D array, got shape \(1, 2\)"),
        ([], 1, {}, r"non-empty 1-D"),
        ([1.0, 2.0], 0, {}, r"n must be >= 1, got 0"),
        ([1.0, 2.0], -1, {}, r"n must be >= 1, got -1"),
        ([1.0, 2.0], 3, {}, r"at most the number of terms N = 2, got n = 3"),
        ([1.0, 2.0], 1.5, {}, r"n must be an integer, got 1.5"),
    ],
)
def test_bad_spectrum_or_n(lam, n, kwargs, match):
    with pytest.raises(ValueError, match=match):
        inclusion_probabilities(lam, n, "unbiased", **kwargs)


def test_n_of_wrong_type():
    with pytest.raises(TypeError, match="n must be an integer, got '2'"):
        inclusion_probabilities([1.0, 2.0], "2", "unbiased")
    with pytest.raises(TypeError, match="n must be an integer, got True"):
        inclusion_probabilities([1.0, 2.0], True, "unbiased")


def test_integral_float_n_is_accepted():
    pi, _ = inclusion_probabilities([1.0, 2.0, 3.0], 2.0, "unbiased")
    assert pi.sum() == pytest.approx(2.0)


def test_bad_method_and_parameters():
    with pytest.raises(ValueError, match=r"method must be one of .*got 'fedavg'"):
        inclusion_probabilities([1.0, 2.0], 1, "fedavg")
    with pytest.raises(ValueError, match=r"needs num_clients .* got None"):
        inclusion_probabilities([1.0, 2.0], 1, "collective")
    with pytest.raises(ValueError, match=r"num_clients must be >= 1, got 0"):
        inclusion_probabilities([1.0, 2.0], 1, "collective", num_clients=0)
    with pytest.raises(ValueError, match=r"num_clients must be an integer, got 2.5"):
        inclusion_probabilities([1.0, 2.0], 1, "collective", num_clients=2.5)
    with pytest.raises(ValueError, match=r"prism_exponent must be a finite number > 0, got 0"):
        inclusion_probabilities([1.0, 2.0], 1, "prism", prism_exponent=0)
    with pytest.raises(ValueError, match=r"prism_exponent must be a finite number > 0, got -2"):
        inclusion_probabilities([1.0, 2.0], 1, "prism-wallenius", prism_exponent=-2.0)
    with pytest.raises(ValueError, match=r"prism_exponent must be a positive number, got 'x'"):
        inclusion_probabilities([1.0, 2.0], 1, "prism", prism_exponent="x")


# --- +Scaled ------------------------------------------------------------------------------


def test_scaled_multipliers_keep_frobenius_norm_of_a_random_matrix():
    rng = np.random.default_rng(9)
    w = rng.normal(size=(9, 7))
    u, lam, vt = np.linalg.svd(w, full_matrices=False)
    subsets = np.array([[0, 3, 5], [1, 2, 6], [4, 5, 6]])
    omega = scaled_multipliers(lam, subsets)
    assert omega.shape == subsets.shape
    for subset, om in zip(subsets, omega, strict=True):
        w_hat = (u[:, subset] * (om * lam[subset])) @ vt[subset]
        assert np.linalg.norm(w_hat) == pytest.approx(np.linalg.norm(w), rel=1e-12)
        assert np.all(om == om[0])
    np.testing.assert_allclose(scaled_multipliers(lam, subsets[0]), omega[0])


def test_scaled_multipliers_when_kept_terms_are_zero():
    # Ŵ = 0 whatever ω is: no division by zero, multiplier 1.
    np.testing.assert_array_equal(scaled_multipliers([2.0, 0.0, 0.0], [1, 2]), [1.0, 1.0])
    np.testing.assert_array_equal(scaled_multipliers([0.0, 0.0], [[0], [1]]), [[1.0], [1.0]])


def test_scaled_multipliers_bad_input():
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 3\), got min 0 and max 3"):
        scaled_multipliers([1.0, 2.0, 3.0], [0, 3])
    with pytest.raises(ValueError, match=r"integer array of term indices, got dtype float64"):
        scaled_multipliers([1.0, 2.0, 3.0], [0.5, 1.0])
    with pytest.raises(ValueError, match=r"singular_values\[0\] = nan"):
        scaled_multipliers([np.nan, 2.0], [0])


# --- properties -----------------------------------------------------------------------------

spectra = st.lists(
    st.one_of(
        st.just(0.0),
        st.floats(min_value=1e-30, max_value=1e3, allow_nan=False, allow_infinity=False),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(lam=spectra, data=st.data(), method=st.sampled_from(METHODS), c=st.integers(1, 50))
def test_probability_properties(lam, data, method, c):
    lam = np.asarray(lam)
    n = data.draw(st.integers(1, lam.size), label="n")
    pi, omega = inclusion_probabilities(lam, n, method, num_clients=c)
    assert pi.shape == omega.shape == lam.shape
    assert math.isclose(pi.sum(), n, abs_tol=1e-9)
    assert np.all((pi >= 0) & (pi <= 1))
    assert np.all(np.isfinite(omega)) and np.all(omega >= 0)
    assert np.all(omega[pi == 0] == 0)
    # Monotone: a larger singular value never gets a smaller probability.
    larger = lam[:, None] > lam[None, :]  # (N, N)
    assert np.all((pi[:, None] >= pi[None, :] - 1e-12)[larger])
    if method == "unbiased":
        np.testing.assert_allclose((omega * pi)[pi > 0], 1.0, rtol=1e-12)
