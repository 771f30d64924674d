"""Theorems 1 and 2 by Monte Carlo on random matrices, with the library's designs.

Each check compares a sample mean over S independent draws with a closed form and allows 5.5
standard errors (estimated from the same draws): a correct implementation fails a check with
probability ~4e-8 per compared quantity (seeds are fixed anyway), while e.g. a wrong multiplier,
a biased design or a wrong closed form shifts the mean by tens of standard errors at these S.
"""

from __future__ import annotations

import numpy as np
import pytest
from paper_algorithms import collective_objective, unbiased_objective

from fedshard.sampling import draw_subsets, inclusion_probabilities

Z = 5.5


def random_layer(seed: int, shape=(12, 9)):
    """A random dense W with a decaying spectrum and its SVD factors."""
    rng = np.random.default_rng(seed)
    w = (
        rng.normal(size=shape)
        @ np.diag(0.85 ** np.arange(shape[1]))
        @ rng.normal(size=(shape[1],) * 2)
    )
    u, lam, vt = np.linalg.svd(w, full_matrices=False)
    return w, u, lam, vt


def estimates(u, lam, vt, omega, subsets):
    """Ŵ for every subset: Σ_{i∈s} ωᵢ λᵢ uᵢ vᵢᵀ, shape (S, out, in)."""
    coef = np.zeros((len(subsets), lam.size))
    np.put_along_axis(coef, subsets, (omega * lam)[subsets], axis=1)  # (S, N)
    return np.einsum("oi,si,ij->soj", u, coef, vt)


def assert_mean(samples, expected, what):
    samples = np.asarray(samples)
    mean = samples.mean(axis=0)
    se = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    off = np.abs(mean - expected)
    worst = float(np.max(off / (se + 1e-300)))
    # The 1e-12 slack covers quantities that are deterministic (se = 0) up to rounding.
    assert np.all(off - Z * se <= 1e-12 * np.abs(expected).max()), (
        f"{what}: worst |mean - expected| / se = {worst:.1f}"
    )


@pytest.mark.parametrize("design", ["cps", "brewer", "min-support"])
def test_unbiased_estimator_is_unbiased_with_theorem1_error(design):
    w, u, lam, vt = random_layer(seed=1)
    n, draws = 3, 20_000
    pi, omega = inclusion_probabilities(lam, n, "unbiased")
    subsets = draw_subsets(pi, draws, design=design, rng=[2, n])
    w_hat = estimates(u, lam, vt, omega, subsets)  # (S, 12, 9)
    assert_mean(w_hat, w, "E[Ŵ] = W")
    errors = ((w_hat - w) ** 2).sum(axis=(1, 2))  # (S,)
    assert_mean(errors, unbiased_objective(lam, pi), "Theorem 1")


def test_biased_multipliers_are_detected():
    # The same check must fail for ω = 1 (PriSM-like, no compensation): the test can fail.
    w, u, lam, vt = random_layer(seed=1)
    pi, _ = inclusion_probabilities(lam, 3, "unbiased")
    w_hat = estimates(u, lam, vt, np.ones_like(lam), draw_subsets(pi, 20_000, rng=3))
    with pytest.raises(AssertionError, match="E\\[Ŵ\\] = W"):
        assert_mean(w_hat, w, "E[Ŵ] = W")


@pytest.mark.parametrize("clients", [2, 5])
def test_collective_error_matches_theorem2_and_beats_unbiased(clients):
    w, u, lam, vt = random_layer(seed=4)
    n, groups = 3, 8_000
    pi_c, omega_c = inclusion_probabilities(lam, n, "collective", num_clients=clients)
    pi_u, omega_u = inclusion_probabilities(lam, n, "unbiased")
    errors = {}
    for name, pi, omega in (("collective", pi_c, omega_c), ("unbiased", pi_u, omega_u)):
        subsets = draw_subsets(pi, groups * clients, rng=[5, clients])
        w_bar = (
            estimates(u, lam, vt, omega, subsets).reshape(groups, clients, *w.shape).mean(axis=1)
        )
        errors[name] = ((w_bar - w) ** 2).sum(axis=(1, 2))  # (groups,)
    assert_mean(errors["collective"], collective_objective(lam, pi_c, omega_c, clients), "Thm 2")
    # C independent unbiased clients: the average has 1/C of Theorem 1's error.
    assert_mean(errors["unbiased"], unbiased_objective(lam, pi_u) / clients, "Thm 1 / C")
    # Theorem 2's optimum beats the unbiased strategy, by far more than the noise here.
    diff = errors["unbiased"] - errors["collective"]  # paired by group index, independent draws
    assert diff.mean() > Z * diff.std(ddof=1) / np.sqrt(groups)
