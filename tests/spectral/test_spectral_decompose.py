"""decompose / compose / num_terms / take_terms against numpy's SVD and brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedshard.spectral import compose, decompose, num_terms, take_terms

SHAPES = [(7, 5), (5, 7), (6, 6), (8, 3, 3, 3), (4, 6, 1, 1), (3, 2, 3, 5), (1, 9)]


def _weight(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_compose_of_decompose_is_identity_in_float64(shape: tuple[int, ...]) -> None:
    w = _weight(shape, 0)
    u, v, lam = decompose(w)
    n_terms = min(shape[0], math.prod(shape[1:]))
    assert u.shape == (shape[0], n_terms)
    assert v.shape == (math.prod(shape[1:]), n_terms)
    assert lam.shape == (n_terms,)
    assert u.dtype == v.dtype == lam.dtype == torch.float64
    torch.testing.assert_close(compose(u, v, shape), w, rtol=0, atol=1e-12)
    torch.testing.assert_close(u @ v.T, w.reshape(shape[0], -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_singular_values_match_numpy_and_are_absorbed_as_square_roots(
    shape: tuple[int, ...],
) -> None:
    w = _weight(shape, 1)
    u, v, lam = decompose(w)
    ref = np.linalg.svd(w.reshape(shape[0], -1).numpy(), compute_uv=False)
    np.testing.assert_allclose(lam.numpy(), ref, rtol=1e-12, atol=1e-12)
    assert bool((lam[:-1] >= lam[1:]).all())
    # u'_i = sqrt(λ_i) u_i with unit u_i  =>  ‖u'_i‖² = ‖v'_i‖² = λ_i, and the u_i are orthogonal.
    np.testing.assert_allclose((u**2).sum(0).numpy(), ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose((v**2).sum(0).numpy(), ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose((u.T @ u).numpy(), np.diag(ref), atol=1e-10)


def test_float32_weight_is_decomposed_in_float64() -> None:
    w = _weight((16, 8, 3, 3), 2, torch.float32)
    u, v, _ = decompose(w)
    assert u.dtype == torch.float64
    # The float32 input is represented exactly in float64, so the round trip is at float64 level.
    torch.testing.assert_close(compose(u, v, w.shape), w.double(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("indices", [[0], [2, 0], [1, 3, 4], [4, 3, 2, 1, 0]])
def test_subset_of_terms_equals_truncated_numpy_sum(indices: list[int]) -> None:
    w = _weight((6, 5), 3)
    u, v, _ = decompose(w)
    u_sel, v_sel = take_terms(u, v, indices)
    left, lam, right_h = np.linalg.svd(w.numpy(), full_matrices=False)
    expected = sum(lam[i] * np.outer(left[:, i], right_h[i]) for i in indices)
    np.testing.assert_allclose(compose(u_sel, v_sel, (6, 5)).numpy(), expected, atol=1e-12)
    # Column j of the selection is term indices[j].
    torch.testing.assert_close(u_sel[:, 0], u[:, indices[0]])


def test_rank_deficient_weight_has_zero_tail() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 2, generator=g, dtype=torch.float64) @ torch.randn(
        2, 5, generator=g, dtype=torch.float64
    )
    u, v, lam = decompose(w)
    assert lam[2:].abs().max() < 1e-12
    torch.testing.assert_close(compose(u, v, w.shape), w, rtol=0, atol=1e-12)


def test_num_terms_guards_float_error() -> None:
    assert 0.07 * 100 > 7  # the float error being guarded against (7.000000000000001)
    assert num_terms(100, 0.07) == 7
    assert num_terms(30, 0.1) == 3
    assert num_terms(64, 0.1) == 7
    assert num_terms(10, 1.0) == 10
    assert num_terms(1000, 1e-6) == 1


@given(st.integers(1, 5000), st.floats(1e-4, 1.0))
def test_num_terms_is_smallest_n_with_ratio_at_least_r(total: int, r: float) -> None:
    n = num_terms(total, r)
    assert 1 <= n <= total
    assert n / total >= r - 1e-9
    assert n == 1 or (n - 1) / total < r


def test_errors_name_the_offending_value() -> None:
    with pytest.raises(ValueError, match=r"at least 2 dimensions.*got shape \(5,\)"):
        decompose(torch.ones(5))
    with pytest.raises(ValueError, match="NaN or inf"):
        decompose(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"floating-point weight, got dtype torch\.int64"):
        decompose(torch.ones(2, 2, dtype=torch.long))
    u, v, _ = decompose(_weight((4, 3), 5))
    with pytest.raises(ValueError, match=r"cannot build a weight of shape \(4, 4\)"):
        compose(u, v, (4, 4))
    with pytest.raises(ValueError, match=r"\[3, 7\] are outside \[0, 3\)"):
        take_terms(u, v, [0, 3, 7])
    with pytest.raises(ValueError, match=r"duplicates \[1\]"):
        take_terms(u, v, [1, 0, 1])
    with pytest.raises(ValueError, match="empty"):
        take_terms(u, v, [])
    with pytest.raises(ValueError, match=r"keep ratio r in \(0, 1\], got 1.5"):
        num_terms(10, 1.5)
    with pytest.raises(ValueError, match="N >= 1, got 0"):
        num_terms(0, 0.5)
