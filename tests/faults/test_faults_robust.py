"""Robust per-term aggregation: median and trimmed mean over each term's
holders, against a brute-force reference; the default mean is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from fault_setup import grid, one_round, scale_arrays, strategy

from fedshard.spectral.aggregate import TermUpdate, dense_mean, term_means
from fedshard.spectral.decompose import layer_spectrum


def _trimmed(values: list[float], frac: float) -> float:
    k = int(np.floor(frac * len(values)))
    kept = sorted(values)[k: len(values) - k]
    return sum(kept) / len(kept)


def _median(values: list[float]) -> float:
    s, m = sorted(values), len(values)
    return s[m // 2] if m % 2 else (s[m // 2 - 1] + s[m // 2]) / 2


def _updates(rng: np.random.Generator, n_terms: int, c_out: int, c_in: int) -> list[TermUpdate]:
    ups = []
    for k in range(7):
        idx = np.sort(rng.choice(n_terms, size=rng.integers(1, n_terms + 1), replace=False))
        u, v = rng.normal(size=(c_out, idx.size)), rng.normal(size=(c_in, idx.size))
        ups.append(TermUpdate(float(k + 1), idx.astype(np.int64), u, v))
    return ups


@pytest.mark.parametrize(("rule", "ref"), [
    ("median", _median), ("trimmed-mean", lambda v: _trimmed(v, 0.2))])
def test_robust_terms_match_a_per_term_brute_force(rule: str, ref) -> None:
    rng = np.random.default_rng(1)
    spec = layer_spectrum(rng.normal(size=(5, 6)).astype(np.float32))
    ups = _updates(rng, 5, 5, 6)
    held, u, v = term_means(spec, ups, rule, 0.2)
    assert list(held) == sorted({int(i) for up in ups for i in up.indices})
    for row, term in enumerate(held):
        holders = [(up, int(np.flatnonzero(up.indices == term)[0])) for up in ups
                   if term in up.indices]
        for c in range(5):
            assert u[row, c] == pytest.approx(ref([float(up.u[c, j]) for up, j in holders]))
        for c in range(6):
            assert v[row, c] == pytest.approx(ref([float(up.v[c, j]) for up, j in holders]))


def test_robust_dense_entries_and_default_mean() -> None:
    rng = np.random.default_rng(2)
    xs = [rng.normal(size=(3, 4)).astype(np.float32) for _ in range(6)]
    w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    med = dense_mean(xs, w, "median")
    trim = dense_mean(xs, w, "trimmed-mean", 0.2)
    mean = dense_mean(xs, w)
    for i in range(3):
        for j in range(4):
            col = [float(x[i, j]) for x in xs]
            assert med[i, j] == pytest.approx(_median(col), rel=1e-6)
            assert trim[i, j] == pytest.approx(_trimmed(col, 0.2), rel=1e-6)
            assert mean[i, j] == pytest.approx(np.dot(w, col) / sum(w), rel=1e-6)


def test_median_ignores_one_scaled_reply_of_three() -> None:
    honest, _ = one_round(strategy(aggregation="median", max_update_ratio=0.0), grid())
    g = grid()
    g.tamper[1000] = scale_arrays(1e3)
    new, metrics = one_round(strategy(aggregation="median", max_update_ratio=0.0), g)
    assert new is not None and honest is not None and metrics["replies-used"] == 3.0
    h, a = np.abs(honest["head.weight"].numpy()).max(), np.abs(new["head.weight"].numpy()).max()
    assert a < 3 * h


def test_bad_aggregation_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"aggregation='bulyan': expected one of \('mean'"):
        strategy(aggregation="bulyan")
    with pytest.raises(ValueError, match=r"trim_fraction=0.5: expected in \[0, 0.5\)"):
        strategy(aggregation="trimmed-mean", trim_fraction=0.5)
