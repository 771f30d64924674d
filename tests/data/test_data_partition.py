"""Dir(α·p) and Pachinko splits: exact bookkeeping, the priors' moments, heterogeneity vs α."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard.data import dirichlet_partition, pachinko_partition, partition_sizes


def _check_exact_split(parts: list[np.ndarray], n: int, k: int) -> None:
    assert len(parts) == k
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == n and sizes.max() - sizes.min() <= 1  # as equal as possible
    everything = np.concatenate(parts)
    assert np.array_equal(np.sort(everything), np.arange(n))  # each example exactly once
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)


def _shares(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    return np.array([np.bincount(labels[p], minlength=num_classes) / len(p) for p in parts])


@settings(max_examples=40, deadline=None)
@given(
    class_counts=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    k_frac=st.floats(0.0, 1.0),
    alpha=st.sampled_from([0.01, 0.3, 1.0, 10.0, 1e4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_dirichlet_split_is_exact(class_counts, k_frac, alpha, seed):
    labels = np.repeat(np.arange(len(class_counts)) * 7, class_counts)  # sparse label values
    np.random.default_rng(seed).shuffle(labels)
    n = labels.size
    k = 1 + int(k_frac * (n - 1))
    _check_exact_split(dirichlet_partition(labels, k, alpha, seed), n, k)


@settings(max_examples=30, deadline=None)
@given(
    fine_counts=st.lists(st.integers(0, 15), min_size=6, max_size=6).filter(lambda c: sum(c) > 0),
    k=st.integers(1, 12),
    alphas=st.sampled_from([(0.05, 0.05), (1.0, 10.0), (100.0, 0.1)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_pachinko_split_is_exact(fine_counts, k, alphas, seed):
    fine = np.repeat(np.arange(6), fine_counts)
    coarse = fine // 3 + 10  # fine 0-2 -> coarse 10, fine 3-5 -> coarse 11
    k = min(k, fine.size)
    _check_exact_split(pachinko_partition(fine, coarse, k, *alphas, rng=seed), fine.size, k)


def test_partition_sizes_front_loads_remainder():
    assert partition_sizes(10, 4).tolist() == [3, 3, 2, 2]
    assert partition_sizes(5, 5).tolist() == [1] * 5


def test_dirichlet_class_shares_have_the_dir_alpha_p_moments():
    # q ~ Dir(α p): E q_j = p_j, Var q_j = p_j (1 - p_j) / (α + 1). A client's share of class j
    # adds multinomial noise: Var s_j = Var q_j + E[q_j (1 - q_j)] / n
    # = p_j (1 - p_j) [1 + α / n] / (α + 1). With α = 100 classes seldom run out, so the
    # without-replacement dealing hardly matters (about 2 % less variance, measured).
    # Under the per-class convention Dir(α, ..., α) the variance would be ~3x smaller.
    p = np.array([0.5, 0.3, 0.2])
    labels = np.repeat(np.arange(3), (p * 10_000).astype(int))
    alpha, k = 100.0, 100
    n = labels.size // k
    shares = np.concatenate(
        [_shares(labels, dirichlet_partition(labels, k, alpha, s), 3) for s in range(30)]
    )
    expected_var = p * (1 - p) * (1 + alpha / n) / (alpha + 1)
    np.testing.assert_allclose(shares.mean(axis=0), p, atol=1e-12)  # every example is used
    np.testing.assert_allclose(shares.var(axis=0), expected_var, rtol=0.08)


def test_dirichlet_heterogeneity_falls_as_alpha_grows():
    labels = np.repeat(np.arange(10), 500)
    rng = np.random.default_rng(3)
    rng.shuffle(labels)
    max_share, entropy = [], []
    for alpha in (0.1, 1.0, 10.0, 1000.0):
        s = _shares(labels, dirichlet_partition(labels, 50, alpha, 0), 10)
        max_share.append(s.max(axis=1).mean())
        with np.errstate(divide="ignore", invalid="ignore"):
            entropy.append(-np.nansum(s * np.log(s), axis=1).mean())
    assert all(np.diff(max_share) < 0), max_share
    assert all(np.diff(entropy) > 0), entropy
    assert max_share[0] > 0.7  # α = 0.1: mostly one class per client (classes run out)
    assert entropy[-1] > 0.95 * np.log(10)  # α = 1000: nearly i.i.d.


def test_pachinko_coarse_and_fine_heterogeneity_follow_their_alphas():
    fine = np.repeat(np.arange(100), 60)
    coarse = fine // 5
    k, n = 50, 120

    def coarse_var(alpha_c, alpha_f):
        s = [
            _shares(coarse, pachinko_partition(fine, coarse, k, alpha_c, alpha_f, r), 20)
            for r in range(10)
        ]
        return np.concatenate(s).var(axis=0).mean()

    # Coarse stage Dir(α_c 1_20): Var q = (1/20)(19/20) / (20 α_c + 1), plus multinomial noise.
    p = 1 / 20
    for alpha_c in (1.0, 10.0):
        var_q = p * (1 - p) / (20 * alpha_c + 1)
        expected = var_q + (p * (1 - p) - var_q) / n
        assert coarse_var(alpha_c, 10.0) == pytest.approx(expected, rel=0.15)

    def fine_max_share(alpha_f):
        # Largest fine share within a (client, coarse) cell holding at least 10 examples.
        values = []
        for r in range(5):
            for part in pachinko_partition(fine, coarse, k, 1.0, alpha_f, r):
                for g in np.unique(coarse[part]):
                    cell = fine[part][coarse[part] == g]
                    if cell.size >= 10:
                        values.append(np.bincount(cell - 5 * g, minlength=5).max() / cell.size)
        return np.mean(values)

    assert fine_max_share(0.1) > fine_max_share(10.0) > fine_max_share(1000.0)


def test_same_seed_same_split_other_seed_other_split():
    labels = np.repeat(np.arange(5), 40)
    a = dirichlet_partition(labels, 8, 1.0, 7)
    b = dirichlet_partition(labels, 8, 1.0, np.random.default_rng(7))
    c = dirichlet_partition(labels, 8, 1.0, 8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    fine = np.repeat(np.arange(10), 20)
    d = pachinko_partition(fine, fine // 5, 8, 1.0, 10.0, 7)
    e = pachinko_partition(fine, fine // 5, 8, 1.0, 10.0, 7)
    assert all(np.array_equal(x, y) for x, y in zip(d, e, strict=True))


def test_one_partition_takes_everything():
    labels = np.array([3, 1, 3, 2])
    (only,) = dirichlet_partition(labels, 1, 0.5, 0)
    assert only.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"alpha": 0.0}, ValueError, r"alpha=0.0: expected a finite value > 0"),
        ({"alpha": float("nan")}, ValueError, r"alpha=nan"),
        ({"alpha": "1"}, TypeError, r"alpha must be a real number"),
        ({"num_partitions": 0}, ValueError, r"num_partitions=0: expected between 1 and .*\(6\)"),
        ({"num_partitions": 7}, ValueError, r"num_partitions=7"),
        ({"num_partitions": 2.0}, TypeError, r"num_partitions must be an int"),
        ({"labels": np.zeros((2, 3), int)}, ValueError, r"non-empty 1-D array, got shape \(2, 3\)"),
        ({"labels": np.array([])}, ValueError, r"non-empty 1-D"),
        ({"labels": np.array([0.5, 1.0])}, TypeError, r"must hold integers, got dtype float64"),
    ],
)
def test_dirichlet_rejects_bad_input(kwargs, error, match):
    args = {"labels": np.arange(6) % 2, "num_partitions": 2, "alpha": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        dirichlet_partition(args["labels"], args["num_partitions"], args["alpha"], 0)


def test_pachinko_rejects_inconsistent_labels():
    fine = np.array([0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"fine labels \[0\] occur with more than one coarse"):
        pachinko_partition(fine, np.array([0, 1, 1, 1]), 2, 1.0, 10.0, 0)
    with pytest.raises(ValueError, match=r"same length, got 4 and 3"):
        pachinko_partition(fine, np.array([0, 0, 1]), 2, 1.0, 10.0, 0)
    with pytest.raises(ValueError, match=r"alpha_fine=-1"):
        pachinko_partition(fine, fine, 2, 1.0, -1, 0)
