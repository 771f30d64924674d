"""Bounded replies: what a node returns may change what it was sent only
so much; num-examples is a whole number in range; a non-finite aggregate is never applied."""

from __future__ import annotations

import numpy as np
import pytest
from fault_setup import grid, initial, one_round, scale_arrays, set_metric, strategy

from fedshard import ReplyPolicy
from fedshard.protocol import read_count
from fedshard.protocol.bounds import all_finite, bound_dense, bound_terms


def _honest_max() -> float:
    new, _ = one_round(strategy(), grid())
    assert new is not None
    return float(np.abs(new["hidden.weight"].numpy()).max())


def test_reference_bound_of_factor_columns() -> None:
    rng = np.random.default_rng(0)
    sent = rng.normal(size=(7, 4)).astype(np.float32)
    sent[:, 2] *= 1e-4  # a tiny term: the layer's RMS column norm is its floor
    got = sent + rng.normal(size=(7, 4)).astype(np.float32) * np.array([0.1, 50, 1, 0.0],
                                                                       dtype=np.float32)
    out, hits, _ = bound_terms(sent, got, 10.0)
    floor = np.sqrt((sent.astype(np.float64) ** 2).sum() / 4)
    want_hits = 0
    for j in range(4):  # brute force, column by column
        ref = max(np.linalg.norm(sent[:, j].astype(np.float64)), floor)
        d = got[:, j].astype(np.float64) - sent[:, j]
        want_hits += bool(np.linalg.norm(d) > 10 * ref)
        want = sent[:, j] + d * min(1.0, 10 * ref / np.linalg.norm(d)) if d.any() else sent[:, j]
        np.testing.assert_allclose(out[:, j], want, rtol=1e-5, atol=1e-6)
    assert hits == want_hits >= 1
    zero = np.zeros(16, dtype=np.float32)
    moved, hit, ratio = bound_dense(zero, np.full(16, 100.0, np.float32), 10.0)
    assert hit == 1 and ratio == pytest.approx(100 * 4 / (0.1 * 4))
    assert np.linalg.norm(moved) == pytest.approx(10 * 0.1 * 4, rel=1e-6)


def test_a_reply_scaled_1e3_is_clipped_and_counted() -> None:
    honest = _honest_max()
    g = grid()
    g.tamper[1000] = scale_arrays(1e3)
    new, metrics = one_round(strategy(), g)
    assert new is not None and metrics["clipped-update-norm"] == 1.0
    assert metrics["replies-used"] == 3.0 and metrics["update-ratio-max"] > 100
    # each factor column moves by ≤ 10x its sent norm, so a term u'v'ᵀ grows by ≤ (1+10)²
    # (unbounded, the ×1e3 reply made it ~1e6 times larger)
    assert float(np.abs(new["hidden.weight"].numpy()).max()) < 121 * honest


def test_drop_policy_drops_the_reply_with_its_reason() -> None:
    g = grid()
    g.tamper[1001] = scale_arrays(1e3)
    new, metrics = one_round(strategy(update_policy="drop"), g)
    assert new is not None and metrics["dropped-update-norm"] == 1.0
    assert metrics["replies-used"] == 2.0


def test_1e30_factors_every_round_keep_the_model_finite() -> None:
    s, g = strategy(), grid()
    g.tamper[1002] = scale_arrays(1e30)
    arrays = initial()
    for r in (1, 2, 3):  # round 3 used to fail in decompose() on an inf weight
        new, metrics = one_round(s, g, r, arrays)
        assert new is not None and metrics["clipped-update-norm"] == 1.0
        arrays = new
        assert all(np.isfinite(a.numpy()).all() for a in arrays.values())


@pytest.mark.parametrize("value", [1e308, 2.5, 0, -3, float("nan"), [1, 2], 2.0**60])
def test_bad_num_examples_are_dropped(value: object) -> None:
    g = grid()
    g.tamper[1000] = set_metric("num-examples", value)
    new, metrics = one_round(strategy(), g)
    assert new is not None and all(np.isfinite(a.numpy()).all() for a in new.values())
    assert metrics["dropped-bad-num-examples"] == 1.0 and metrics["num-examples"] == 48.0


def test_num_examples_cap_refuses_1e9_with_zeroed_arrays() -> None:
    g = grid()
    g.tamper[1000] = lambda m: scale_arrays(0.0)(set_metric("num-examples", 10**9)(m))
    new, metrics = one_round(strategy(max_num_examples=1000), g)
    assert metrics["dropped-bad-num-examples"] == 1.0
    assert new is not None and np.abs(new["head.weight"].numpy()).max() > 0.1


def test_read_count_reasons() -> None:
    assert read_count(24) == 24.0 and read_count(24.0) == 24.0
    with pytest.raises(ValueError, match="max_num_examples=0: expected an integer"):
        ReplyPolicy(max_num_examples=0)
    with pytest.raises(ValueError, match=r"update_policy='zero': expected one of \('clip'"):
        ReplyPolicy(update_policy="zero")
    assert "outside [1, 10]" in str(read_count(11, 10))


def test_a_non_finite_aggregate_is_not_applied() -> None:
    # bound off: the factors (×1e30, finite in float32) rebuild W = UVᵀ ≈ 1e60 -> inf
    g = grid()
    for node in g.contexts:
        g.tamper[node] = scale_arrays(1e30, lambda k: k == "hidden.u" or k == "hidden.v")
    new, metrics = one_round(strategy(max_update_ratio=0.0), g)
    assert new is None and metrics["aggregate-non-finite"] == 1.0
    assert metrics["rounds-trained"] == 0.0


def test_one_dense_entry_is_scaled_as_numpy_scales_an_array_of_them() -> None:
    """A dense array's bound works on Python floats; numpy's arrays of one (``_scale``) give
    the same scale and ratio bit for bit, at 0, tiny, huge, inf and nan norms and a zero
    reference."""
    import math

    from fedshard.protocol.bounds import _scale, _scale_one

    rng = np.random.default_rng([56, 3])
    norms = [0.0, 1e-300, 1.0, 9.999, 10.0, 10.001, 1e300, math.inf, math.nan,
             *rng.lognormal(0, 3, size=200)]
    refs = [0.0, 1e-300, 0.1, 1.0, 3.7, 1e300, *rng.lognormal(0, 3, size=20)]
    for ratio in (0.5, 10.0, 1e6):
        for norm in norms:
            for ref in refs:
                with np.errstate(over="ignore"):
                    scales, want_ratio = _scale(np.array([norm]), np.array([ref]), ratio)
                scale, seen = _scale_one(float(norm), float(ref), ratio)
                assert scale == float(scales[0]) or (math.isnan(scale) and
                                                     math.isnan(float(scales[0])))
                assert seen == want_ratio or (math.isnan(seen) and math.isnan(want_ratio)), \
                    (norm, ref, ratio)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_all_finite_tells_nan_and_inf_from_large_finite_values(dtype: type) -> None:
    """NaN and ±inf anywhere are found; values whose squares overflow the dtype (1e30 in
    float32, 6e4 in float16) are finite, as numpy's isfinite says entry by entry."""
    big = float(np.finfo(dtype).max) / 2
    for values, want in (([1.0, 2.0, 3.0], True), ([1.0, big, -big], True),
                         ([1.0, np.nan, 3.0], False), ([np.inf, 1.0, 2.0], False),
                         ([1.0, 2.0, -np.inf], False), ([big, np.nan, big], False)):
        x = np.array(values, dtype=dtype).reshape(3, 1)
        assert all_finite(x) is want == bool(np.isfinite(x).all()), (values, dtype)
