"""Per-term aggregation and the rebuild of W, against a dense numpy reference.

The reference takes numpy's SVD of W, replaces each held term i by the weighted mean of its
holders' trained columns (Σ_k D_k u_{k,i} / Σ_k D_k, the same for v), keeps every other term,
and multiplies out W = Σ u'_i v'_iᵀ densely.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedshard.spectral.aggregate import (
    TermUpdate,
    aggregate_state,
    dense_mean,
    rebuild_weight,
    term_means,
)
from fedshard.spectral.decompose import layer_spectrum


def _reference(w: np.ndarray, updates: list[TermUpdate]) -> np.ndarray:
    left, lam, right_h = np.linalg.svd(w.reshape(w.shape[0], -1).astype(np.float64),
                                       full_matrices=False)
    u = left * np.sqrt(lam)            # (c_out, N): columns u'_i
    v = right_h.T * np.sqrt(lam)       # (fan_in, N): columns v'_i
    for i in range(lam.size):
        holders = [(up, list(up.indices).index(i)) for up in updates if i in up.indices]
        if holders:
            mass = sum(up.weight for up, _ in holders)
            u[:, i] = sum(up.weight * up.u[:, j] for up, j in holders) / mass
            v[:, i] = sum(up.weight * up.v[:, j] for up, j in holders) / mass
    return (u @ v.T).reshape(w.shape)


def _update(rng: np.random.Generator, w: np.ndarray, indices: list[int], weight: float,
            dtype: type = np.float64) -> TermUpdate:
    fan_in = int(np.prod(w.shape[1:]))
    return TermUpdate(weight, np.array(indices, dtype=np.int64),
                      rng.standard_normal((w.shape[0], len(indices))).astype(dtype),
                      rng.standard_normal((fan_in, len(indices))).astype(dtype))


@pytest.mark.parametrize("held", [[[0, 3], [3, 5]], [[0, 1, 2, 3], [2, 3, 4, 5]]],
                         ids=["rank-2h-update", "full-sum"])
@pytest.mark.parametrize("shape", [(6, 9), (6, 2, 3, 3)], ids=["linear", "conv"])
def test_rebuild_equals_dense_reference(held: list[list[int]], shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape)
    updates = [_update(rng, w, idx, d) for idx, d in zip(held, (3.0, 1.0), strict=True)]
    spec = layer_spectrum(w)
    new = rebuild_weight(spec, *term_means(spec, updates))
    # indices refer to decompose()'s order (descending λ, as numpy's)
    np.testing.assert_allclose(new, _reference(w, updates), rtol=0, atol=1e-10)
    assert new.shape == w.shape and new.dtype == w.dtype


def test_untouched_round_trip_is_identity_and_float32_stays_float32() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    spec = layer_spectrum(w)
    same = TermUpdate(2.0, np.array([1, 4]), spec.ut[[1, 4]].T.copy(), spec.vt[[1, 4]].T.copy())
    new = rebuild_weight(spec, *term_means(spec, [same]))
    assert new.dtype == np.float32
    np.testing.assert_allclose(new, w, rtol=0, atol=2e-6)


def test_term_means_weights_by_data_size_and_lists_held_terms() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 4))
    a = _update(rng, w, [0, 2], 1.0)
    b = _update(rng, w, [2], 3.0)
    held, u_mean, v_mean = term_means(layer_spectrum(w), [a, b])
    assert held.tolist() == [0, 2]
    np.testing.assert_allclose(u_mean[0], a.u[:, 0])
    np.testing.assert_allclose(u_mean[1], (1.0 * a.u[:, 1] + 3.0 * b.u[:, 0]) / 4.0)
    np.testing.assert_allclose(v_mean[1], (1.0 * a.v[:, 1] + 3.0 * b.v[:, 0]) / 4.0)


def test_aggregate_state_averages_dense_keeps_integer_buffers() -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((5, 6)).astype(np.float32)
    current = {"fc.weight": w, "fc.bias": np.zeros(5, np.float32),
               "steps": np.array([7], dtype=np.int64)}
    spec = layer_spectrum(w)
    ups = [_update(rng, w, [0, 1], 1.0, np.float32), _update(rng, w, [1, 4], 3.0, np.float32)]
    dense = [{"fc.bias": np.ones(5, np.float32)}, {"fc.bias": np.full(5, 5.0, np.float32)}]
    out = aggregate_state(current, {"fc": spec}, [1.0, 3.0], dense,
                          [{"fc": ups[0]}, {"fc": ups[1]}])
    np.testing.assert_allclose(out["fc.bias"], 4.0)
    assert out["steps"] is current["steps"]
    np.testing.assert_allclose(out["fc.weight"], _reference(w, ups), rtol=0, atol=2e-5)
    np.testing.assert_allclose(dense_mean([np.ones(2), np.zeros(2)], [1.0, 1.0]), 0.5)
