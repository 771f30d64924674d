"""Rank truncation (the low-rank start and the Top-n diagnostics) against Eckart–Young and a
brute-force check of what stays untouched."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedshard.spectral.truncation import truncate_, truncate_state, truncate_weight


@pytest.mark.parametrize("shape", [(12, 20), (16, 8, 3, 3)])
def test_truncation_is_the_best_rank_n_approximation(shape):
    rng = np.random.default_rng(0)
    w = rng.normal(size=shape).astype(np.float32)
    mat = w.reshape(shape[0], -1).astype(np.float64)
    lam = np.linalg.svd(mat, compute_uv=False)
    n = math.ceil(0.25 * lam.size)
    out, share, tail_norm = truncate_weight(w, 0.25)
    assert out.shape == w.shape and out.dtype == w.dtype
    resid = mat - out.reshape(shape[0], -1).astype(np.float64)
    # Eckart–Young: the error of the best rank-n approximation is sqrt(Σ_{i>n} λ²)
    assert np.linalg.norm(resid) == pytest.approx(np.sqrt((lam[n:] ** 2).sum()), rel=1e-5)
    assert tail_norm == pytest.approx(np.sqrt((lam[n:] ** 2).sum()), rel=1e-10)
    assert share == pytest.approx((lam[n:] ** 2).sum() / (lam**2).sum(), rel=1e-10)
    kept = np.linalg.svd(out.reshape(shape[0], -1).astype(np.float64), compute_uv=False)
    assert np.all(kept[n:] < 1e-5 * kept[0])  # rank n up to float32 round-off
    np.testing.assert_allclose(kept[:n], lam[:n], rtol=1e-5)
    # no other rank-n matrix of a random family does better
    for _k in range(20):
        a = rng.normal(size=(mat.shape[0], n)) @ rng.normal(size=(n, mat.shape[1]))
        assert np.linalg.norm(mat - a) > np.linalg.norm(resid)


def test_keep_ratio_one_changes_nothing_and_zero_weight_has_no_tail():
    w = np.random.default_rng(1).normal(size=(6, 9))
    out, share, _ = truncate_weight(w, 1.0)
    np.testing.assert_allclose(out, w, atol=1e-12)
    assert share == pytest.approx(0.0, abs=1e-20)
    assert truncate_weight(np.zeros((4, 4)), 0.5)[1] == 0.0
    with pytest.raises(ValueError, match="expects a floating weight with >= 2 dimensions"):
        truncate_weight(np.zeros(4), 0.5)


def test_truncate_in_place_touches_only_the_named_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
                          nn.Linear(12, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    removed = truncate_(model, ["2"], 0.25)
    after = model.state_dict()
    for key in before:
        if key == "2.weight":
            continue
        assert torch.equal(before[key], after[key]), key
    lam = torch.linalg.svdvals(before["2.weight"].double())
    assert torch.linalg.matrix_rank(after["2.weight"].double(), atol=1e-5).item() == 3
    assert removed == pytest.approx(float((lam[3:] ** 2).sum() / (lam**2).sum()), rel=1e-6)
    with pytest.raises(ValueError, match=r"\['1'\] are not layers with a weight"):
        truncate_(model, ["1"], 0.5)


def test_truncate_state_weights_the_tail_share_by_layer_energy():
    rng = np.random.default_rng(2)
    state = {"a.weight": rng.normal(size=(8, 8)), "b.weight": 10 * rng.normal(size=(4, 6)),
             "b.bias": rng.normal(size=4)}
    out, share = truncate_state(state, ["a", "b"], 0.5)
    tails = [truncate_weight(state[k], 0.5)[2] ** 2 for k in ("a.weight", "b.weight")]
    total = sum(float((state[k] ** 2).sum()) for k in ("a.weight", "b.weight"))
    assert share == pytest.approx(sum(tails) / total, rel=1e-10)
    assert out["b.bias"] is not None and np.array_equal(out["b.bias"], state["b.bias"])
    with pytest.raises(KeyError, match=r"no 'c\.weight' in the state dict"):
        truncate_state(state, ["c"], 0.5)
