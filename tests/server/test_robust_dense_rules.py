"""The dense robust rules (coordinate-wise median, trimmed mean, Krum) against a brute-force
reference written here, and against Flower's legacy functions (``flwr.server.strategy
.aggregate``, while they exist) to the last bit, in float64 and float32."""

from __future__ import annotations

import itertools
import math

import flwr
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedshard import protocol as P
from fedshard.server.robust import (
    coordinatewise_median,
    coordinatewise_trimmed_mean,
    dense_rule,
    krum,
)
from fedshard.settings import ReplyPolicy
from fedshard.spectral.aggregate import TermUpdate, dense_equivalents
from fedshard.spectral.decompose import layer_spectrum

DTYPES = [np.float64, np.float32]
SHAPES = [(), (1,), (3, 4), (2, 1, 3)]


def _flower():
    """Flower's legacy aggregation functions, or a skip once they are gone."""
    try:
        from flwr.server.strategy import aggregate
    except ImportError:
        pytest.skip(f"flwr {flwr.__version__} has no flwr.server.strategy.aggregate to compare "
                    "with (the brute-force references still run)")
    return aggregate


def _models(rng: np.random.Generator, m: int, shapes: list[tuple[int, ...]], dtype,
            levels: int = 0) -> list[list[np.ndarray]]:
    """m models of the given entry shapes; with ``levels`` the values are drawn from that many
    integers (ties and duplicate coordinates)."""
    def one(shape):
        x = rng.integers(levels, size=shape) if levels else rng.normal(size=shape) * 3
        return np.asarray(x, dtype=dtype)
    return [[one(s) for s in shapes] for _ in range(m)]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --------------------------------------------------------------- brute-force references
def _coords(models: list[list[np.ndarray]], j: int):
    """Entry j's coordinates, each as the list of its m values (Python floats)."""
    for idx in np.ndindex(models[0][j].shape):
        yield idx, [float(model[j][idx]) for model in models]


def _median_ref(values: list[float]) -> float:
    s, m = sorted(values), len(values)
    return s[m // 2] if m % 2 else (s[m // 2 - 1] + s[m // 2]) / 2


def _trimmed_ref(values: list[float], beta: float) -> float:
    k = math.floor(beta * len(values))
    kept = sorted(values)[k: len(values) - k]
    return math.fsum(kept) / len(kept)


def _krum_ref(models: list[list[np.ndarray]], f: int) -> int:
    """Krum by its definition: each model's score is the sum of its squared distances to its
    m - f - 2 (at least 1) nearest others; the first of the smallest scores wins."""
    flat = [[float(x) for entry in model for x in np.asarray(entry).ravel()] for model in models]
    m = len(flat)
    dist = {(i, j): math.fsum((a - b) ** 2 for a, b in zip(flat[i], flat[j], strict=True))
            for i, j in itertools.permutations(range(m), 2)}
    nearest = max(1, m - f - 2)
    scores = [math.fsum(sorted(dist[i, j] for j in range(m) if j != i)[:nearest])
              for i in range(m)]
    return scores.index(min(scores))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 10])
def test_median_matches_a_brute_force_reference(dtype, m: int) -> None:
    models = _models(np.random.default_rng([1, m]), m, SHAPES, dtype)
    got = coordinatewise_median(models)
    rel = 1e-15 if dtype == np.float64 else 1e-6
    for j, out in enumerate(got):
        assert out.shape == SHAPES[j] and out.dtype == dtype
        for idx, values in _coords(models, j):
            assert float(out[idx]) == pytest.approx(_median_ref(values), rel=rel, abs=1e-30)
            if m % 2:  # the middle value itself
                assert float(out[idx]) == _median_ref(values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "beta"), [(1, 0.2), (3, 0.0), (4, 0.25), (5, 0.2), (7, 0.3),
                                         (10, 0.1), (10, 0.49), (12, 0.25)])
def test_trimmed_mean_matches_a_brute_force_reference(dtype, m: int, beta: float) -> None:
    models = _models(np.random.default_rng([2, m]), m, SHAPES, dtype)
    got = coordinatewise_trimmed_mean(models, beta)
    rel = 1e-14 if dtype == np.float64 else 1e-5
    for j, out in enumerate(got):
        assert out.shape == SHAPES[j] and out.dtype == dtype
        for idx, values in _coords(models, j):
            assert float(out[idx]) == pytest.approx(_trimmed_ref(values, beta), rel=rel,
                                                    abs=1e-6 if dtype == np.float32 else 1e-14)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "f"), [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (7, 2), (9, 3)])
def test_krum_matches_a_brute_force_reference(dtype, m: int, f: int) -> None:
    models = _models(np.random.default_rng([3, m, f]), m, SHAPES, dtype)
    assert krum(models, f) == _krum_ref(models, f)


@pytest.mark.parametrize("dtype", DTYPES)
def test_krum_selects_an_honest_model_beside_far_ones(dtype) -> None:
    rng = np.random.default_rng(4)
    honest = _models(rng, 7, SHAPES, dtype)
    far = [[(x + 100 * (k + 1)).astype(dtype) for x in model]
           for k, model in enumerate(_models(rng, 2, SHAPES, dtype))]
    models = honest[:3] + far[:1] + honest[3:] + far[1:]
    chosen = krum(models, 2)
    assert chosen == _krum_ref(models, 2) and chosen not in (3, 8)


def test_trimmed_mean_without_trimming_is_the_mean_and_one_model_is_itself() -> None:
    models = _models(np.random.default_rng(5), 6, SHAPES, np.float64)
    for out, stack in zip(coordinatewise_trimmed_mean(models, 0.0),
                          (np.stack(e) for e in zip(*models, strict=True)), strict=True):
        np.testing.assert_allclose(out, stack.mean(axis=0), rtol=1e-15, atol=1e-15)
    one = models[:1]
    for rule in (coordinatewise_median, lambda ms: coordinatewise_trimmed_mean(ms, 0.4)):
        assert all(_same_bits(a, b) for a, b in zip(rule(one), one[0], strict=True))
    assert krum(one, 0) == 0


# ------------------------------------------------------- Flower's functions, to the last bit
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("levels", [0, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 12])
def test_the_rules_are_flowers_to_the_last_bit(dtype, levels: int, m: int) -> None:
    agg = _flower()
    models = _models(np.random.default_rng([6, m, levels]), m, SHAPES, dtype, levels)
    results = [(model, k + 1) for k, model in enumerate(models)]
    for got, want in zip(coordinatewise_median(models), agg.aggregate_median(results),
                         strict=True):
        assert _same_bits(got, want)
    for beta in (0.0, 0.1, 0.2, 0.25, 0.34, 0.49):
        for got, want in zip(coordinatewise_trimmed_mean(models, beta),
                             agg.aggregate_trimmed_avg(results, beta), strict=True):
            assert _same_bits(got, want), beta
    for f in range(m):
        assert agg.aggregate_krum(results, f, 0) is models[krum(models, f)], f


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 12), dtype=st.sampled_from(DTYPES), levels=st.sampled_from([0, 2, 5]),
       shapes=st.lists(st.sampled_from([(), (1,), (2,), (9,), (3, 4), (2, 1, 3)]),
                       min_size=1, max_size=4),
       beta=st.floats(0.0, 0.499), f=st.integers(0, 12), seed=st.integers(0, 2**32 - 1),
       duplicate=st.booleans())
def test_the_rules_are_flowers_on_any_models(m, dtype, levels, shapes, beta, f, seed,
                                             duplicate) -> None:
    agg = _flower()
    models = _models(np.random.default_rng(seed), m, shapes, dtype, levels)
    if duplicate and m > 1:  # two equal models: Krum's zero distance between them
        models[-1] = [x.copy() for x in models[0]]
    results = [(model, 1) for model in models]
    for got, want in zip(coordinatewise_median(models), agg.aggregate_median(results),
                         strict=True):
        assert _same_bits(got, want)
    for got, want in zip(coordinatewise_trimmed_mean(models, beta),
                         agg.aggregate_trimmed_avg(results, beta), strict=True):
        assert _same_bits(got, want)
    assert agg.aggregate_krum(results, f, 0) is models[krum(models, f)]


def _flowers_dense_rule(current, spectra, accepted, policy) -> dict[str, np.ndarray]:
    """dense_rule as it was written on Flower's legacy functions."""
    agg = _flower()
    states = dense_equivalents(current, spectra, [r.values for r in accepted],
                               [r.terms() for r in accepted])
    keys = list(states[0])
    results = [([st[k] for k in keys], int(r.weight))
               for st, r in zip(states, accepted, strict=True)]
    rule, frac = policy.aggregation, policy.trim_fraction
    if rule == "dense-median":
        arrays = agg.aggregate_median(results)
    elif rule == "dense-trimmed-mean":
        arrays = agg.aggregate_trimmed_avg(results, frac)
    else:
        arrays = agg.aggregate_krum(results, int(np.floor(frac * len(results))), 0)
    new = dict(current)
    new.update({k: np.asarray(a).astype(current[k].dtype)
                for k, a in zip(keys, arrays, strict=True)})
    return new


@pytest.mark.parametrize("rule", ["dense-median", "dense-trimmed-mean", "krum"])
@pytest.mark.parametrize("m", [3, 4, 7])
def test_dense_rule_gives_the_state_flowers_functions_gave(rule: str, m: int) -> None:
    rng = np.random.default_rng([7, m])
    current = {"fc.weight": rng.normal(size=(5, 6)).astype(np.float32),
               "fc.bias": rng.normal(size=5).astype(np.float32),
               "bn.num_batches_tracked": np.asarray(12, dtype=np.int64),
               "bn.running_mean": rng.normal(size=5)}
    spectra = {"fc": layer_spectrum(current["fc.weight"])}
    accepted = []
    for node in range(m):
        idx = np.sort(rng.choice(5, size=int(rng.integers(1, 6)), replace=False)).astype(np.int64)
        up = TermUpdate(float(node + 1), idx, rng.normal(size=(5, idx.size)).astype(np.float32),
                        rng.normal(size=(6, idx.size)).astype(np.float32))
        values = {P.factor_key("fc", "indices"): up.indices, P.factor_key("fc", "u"): up.u,
                  P.factor_key("fc", "v"): up.v,
                  "fc.bias": (current["fc.bias"] + rng.normal(size=5)).astype(np.float32),
                  "bn.running_mean": current["bn.running_mean"] + rng.normal(size=5)}
        accepted.append(P.TrainReply(node=1000 + node, weight=up.weight, values=values,
                                     metrics={}, nbytes=0, layers=("fc",)))
    policy = ReplyPolicy(aggregation=rule, trim_fraction=0.25)
    got, want = dense_rule(current, spectra, accepted, policy), _flowers_dense_rule(
        current, spectra, accepted, policy)
    assert list(got) == list(want)
    for key in want:
        assert _same_bits(got[key], want[key]), key
    assert got["bn.num_batches_tracked"] is current["bn.num_batches_tracked"]


# ------------------------------------------------------------------------------- errors
def test_bad_inputs_are_refused_saying_what_was_expected() -> None:
    models = _models(np.random.default_rng(8), 3, SHAPES, np.float64)
    with pytest.raises(ValueError, match=r"trim_fraction=0\.5: expected in \[0, 0\.5\) \(the "
                                         r"share dropped at each end\); nothing is aggregated"):
        coordinatewise_trimmed_mean(models, 0.5)
    with pytest.raises(ValueError, match=r"trim_fraction=-0\.1: expected in \[0, 0\.5\)"):
        coordinatewise_trimmed_mean(models, -0.1)
    with pytest.raises(ValueError, match=r"coordinate-wise median: expected at least one "
                                         r"model, got none; nothing to aggregate"):
        coordinatewise_median([])
    with pytest.raises(ValueError, match=r"coordinate-wise trimmed mean: expected every model "
                                         r"to have the same entries, got models of \[4, 5\] "
                                         r"entries; nothing is aggregated"):
        coordinatewise_trimmed_mean([*models[:2], [*models[2], models[2][0]]], 0.1)
    with pytest.raises(ValueError, match=r"krum: expected at least one model, got none; no "
                                         r"model is selected"):
        krum([], 0)
    with pytest.raises(ValueError, match=r"num_malicious=-1: expected >= 0; no model is "
                                         r"selected"):
        krum(models, -1)
