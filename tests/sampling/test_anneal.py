"""Annealed methods (Theorem 1/2 on λ^γ): schedule, marginals, unbiasedness, limits, and the
plan's ``untrained-energy``; oracles are the paper's Algorithms 1 and 2 (literal
transcriptions), brute-force sums and Monte Carlo."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from paper_algorithms import algorithm1_unbiased, algorithm2_collective

from fedshard import Sharding, SpectralSharding
from fedshard.sampling import (
    anneal_exponent,
    annealed_probabilities,
    draw_layer,
    plan_round,
)


def test_schedule_starts_at_gamma0_reaches_one_after_t_rounds_and_never_rises():
    gammas = [anneal_exponent(t, 8.0, 30) for t in range(1, 60)]
    assert gammas[0] == 8.0
    assert all(g == 1.0 for g in gammas[30:])  # rounds T + 1 = 31 and later
    assert gammas[29] > 1.0
    assert all(a >= b for a, b in itertools.pairwise(gammas))
    assert anneal_exponent(16, 8.0, 30) == pytest.approx(4.5)  # halfway: (1 + 8) / 2
    assert anneal_exponent(5, 1.0, 10) == 1.0


@pytest.mark.parametrize("bad", [(0, 8.0, 30), (1, 0.5, 30), (1, 8.0, 0), (1, math.nan, 3)])
def test_schedule_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match="expected t >= 1"):
        anneal_exponent(*bad)


SPECTRUM = np.array([3.1, 2.4, 2.0, 1.7, 1.3, 1.1, 0.8, 0.5, 0.3, 0.2])


@pytest.mark.parametrize("gamma", [1.0, 2.0, 5.0])
def test_anneal_unbiased_is_algorithm1_on_the_powered_spectrum(gamma):
    pi, omega = annealed_probabilities(SPECTRUM, 3, "anneal-unbiased", gamma, 10)
    want = algorithm1_unbiased(SPECTRUM**gamma, 3)
    np.testing.assert_allclose(pi, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(omega * pi, 1.0, rtol=1e-12)
    assert pi.sum() == pytest.approx(3.0)


@pytest.mark.parametrize("gamma", [1.0, 2.0, 5.0])
def test_anneal_collective_is_algorithm2_on_the_powered_spectrum(gamma):
    pi, omega = annealed_probabilities(SPECTRUM, 3, "anneal-collective", gamma, 4)
    want_pi, want_omega = algorithm2_collective(SPECTRUM**gamma, 3, 4)
    np.testing.assert_allclose(pi, want_pi, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(omega, want_omega, rtol=1e-9, atol=1e-12)
    assert omega.max() <= 4.0


def test_large_gamma_is_nearly_top_n_and_gamma_one_is_the_theorem():
    for method in ("anneal-unbiased", "anneal-collective"):
        pi, _ = annealed_probabilities(SPECTRUM, 3, method, 40.0, 10)
        assert pi[:3] == pytest.approx(1.0, abs=2e-3)
        assert pi[3:].sum() < 3e-3
    # the exploration measure falls as γ grows (monotone path from Theorem 2 to Top-n)
    spread = [annealed_probabilities(SPECTRUM, 3, "anneal-collective", g, 10)[0][3:].sum()
              for g in (1.0, 2.0, 4.0, 8.0)]
    assert all(a > b for a, b in itertools.pairwise(spread))


def test_monte_carlo_marginals_and_unbiasedness_of_anneal_unbiased():
    """E[z_i] = π_i for the drawn subsets, and E[Σ z_i ω_i λ_i u_i v_iᵀ] = W (Monte Carlo
    over 4,000 draws of 10 clients; CPS design)."""
    rng = np.random.default_rng(7)
    u, _ = np.linalg.qr(rng.normal(size=(12, 10)))
    v, _ = np.linalg.qr(rng.normal(size=(10, 10)))
    w = (u * SPECTRUM) @ v.T
    gamma = 3.0
    counts = np.zeros(10)
    mean_w = np.zeros_like(w)
    draws = 0
    for k in range(400):
        subsets, omega, pi = draw_layer(SPECTRUM, 0.3, 10, "anneal-unbiased", "cps",
                                        np.random.default_rng([1, k]), gamma=gamma)
        for s in subsets:
            counts[s] += 1
            mean_w += (u[:, s] * (omega[s] * SPECTRUM[s])) @ v[:, s].T
            draws += 1
    freq = counts / draws
    se = np.sqrt(pi * (1 - pi) / draws) + 1e-12
    assert np.all(np.abs(freq - pi) <= 5 * se + 1e-9), (freq, pi)
    mean_w /= draws
    # per-entry tolerance from the spread of single draws: loose but far below ‖W‖
    assert np.abs(mean_w - w).max() < 0.08 * np.abs(w).max()
    # a biased design (Top-n) fails the same check: the test can fail
    top, _, _ = draw_layer(SPECTRUM, 0.3, 1, "top-n", "cps", np.random.default_rng(0))
    biased = (u[:, top[0]] * SPECTRUM[top[0]]) @ v[:, top[0]].T
    assert np.abs(biased - w).max() > 0.08 * np.abs(w).max()


def test_monte_carlo_marginals_of_anneal_collective_brewer():
    counts = np.zeros(10)
    draws = 0
    for k in range(400):
        subsets, _omega, pi = draw_layer(SPECTRUM, 0.3, 10, "anneal-collective", "brewer",
                                        np.random.default_rng([2, k]), gamma=2.0)
        for s in subsets:
            counts[s] += 1
            draws += 1
    se = np.sqrt(pi * (1 - pi) / draws) + 1e-12
    assert np.all(np.abs(counts / draws - pi) <= 5 * se + 1e-9)


def test_untrained_energy_is_the_tail_for_top_n_and_zero_when_all_terms_can_be_drawn():
    rng = np.random.default_rng(0)
    spectra = {"a": np.sort(rng.uniform(0.1, 2, 20))[::-1],
               "b": np.sort(rng.uniform(0, 1, 8))[::-1]}
    clients = [(i, 0.25) for i in range(5)]
    plan = plan_round(spectra, clients, "top-n", "cps", seed=0, server_round=1)
    tail = sum(float((lam[math.ceil(0.25 * lam.size):] ** 2).sum()) for lam in spectra.values())
    total = sum(float((lam**2).sum()) for lam in spectra.values())
    assert plan.anme["untrained-energy"] == pytest.approx(tail / total)
    assert plan_round(spectra, clients, "unbiased", "cps", seed=0,
                      server_round=1).anme["untrained-energy"] == 0.0
    # two keep-ratio groups: a term counts as reachable when either group can draw it
    mixed = plan_round(spectra, [(0, 0.25), (1, 0.5)], "top-n", "cps", seed=0, server_round=1)
    tail = sum(float((lam[math.ceil(0.5 * lam.size):] ** 2).sum()) for lam in spectra.values())
    assert mixed.anme["untrained-energy"] == pytest.approx(tail / total)


def test_with_a_rank_n_spectrum_collective_and_annealing_draw_what_top_n_draws():
    """The low-rank start's consequence: when W has rank ⌈rN⌉ (the tail is float32 round-off),
    Theorem 2 gives the tail π = 0, so Collective and its annealed version send exactly
    Top-n's terms with ω = 1 (the suite runs one row for all three)."""
    rng = np.random.default_rng(3)
    spectra = {"a": np.concatenate([np.sort(rng.uniform(1, 2, 4))[::-1],
                                    rng.uniform(0, 1e-7, 36)]),
               "b": np.concatenate([np.sort(rng.uniform(1, 2, 2))[::-1],
                                    rng.uniform(0, 1e-7, 14)])}
    clients = [(i, 0.1) for i in range(10)]
    plans = [plan_round(spectra, clients, m, "cps", seed=0, server_round=1, gamma=g)
             for m, g in (("top-n", 1.0), ("collective", 1.0), ("anneal-collective", 8.0))]
    for plan in plans[1:]:
        for c in range(10):
            for layer in spectra:
                np.testing.assert_array_equal(plan.terms[c][layer][0], plans[0].terms[c][layer][0])
                np.testing.assert_array_equal(plan.terms[c][layer][1], 1.0)
    # Unbiased does explore the noise tail (π ∝ λ > 0): the equivalence is Theorem 2's
    unbiased = plan_round(spectra, clients, "unbiased", "cps", seed=0, server_round=1)
    assert unbiased.anme["untrained-energy"] == 0.0


def test_method_names_and_strategy_parameters_are_checked():
    assert Sharding(method="anneal-collective", design="cps").problems() == []
    with pytest.raises(ValueError, match=r"scaled=True with method='anneal-collective': "
                                         r"\+Scaled replaces"):  # +Scaled: not with it
        Sharding(method="anneal-collective", scaled=True)
    with pytest.raises(ValueError, match=r"anneal_exponent=0\.5: expected γ₀ ≥ 1"):
        Sharding(method="anneal-unbiased", anneal_exponent=0.5)
    with pytest.raises(ValueError, match=r"anneal_rounds=0: expected T ≥ 1"):
        SpectralSharding(sharded_layers=["a"],
                         sharding=Sharding(method="anneal-unbiased", anneal_rounds=0))
