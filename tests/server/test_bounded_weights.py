"""The weight a num-examples claim buys (fedshard.server.robust.bounded_weights): FedAvg's
weights while the nodes above the median hold at most one median more, never a jump in any
claim, and no group of colluders weighs more than f + ratio - 1 typical nodes."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from fedshard.server.robust import bounded_weights


def test_fedavg_weights_while_the_excess_fits_and_off_at_ratio_0() -> None:
    assert bounded_weights([100, 100, 120, 60, 150], 2.0) == [100, 100, 120, 60, 150]
    assert bounded_weights([100, 100, 10**12], 0.0) == [100, 100, 10**12]
    assert bounded_weights([], 2.0) == []


def test_one_large_claim_weighs_ratio_medians_however_large() -> None:
    for claim in (201, 9_900, 10_100, 2**53):
        assert bounded_weights([100] * 9 + [claim], 2.0)[-1] == 200.0


@pytest.mark.parametrize("ratio", [1.0, 1.5, 2.0, 4.0])
def test_continuous_in_every_claim(ratio: float) -> None:
    """A change of one example in a claim changes every weight by a few examples at most
    (a sweep through the median, the cap at ratio x and 100 x the median; a threshold would
    jump by about a median, ~100), and a node's weight never falls as its claim grows."""
    rng = np.random.default_rng([7, int(ratio * 10)])
    base = list(rng.integers(50, 150, size=9).astype(float))
    claims = np.concatenate([np.linspace(1, 400, 400), np.linspace(9_000, 11_000, 400)])
    prev = None
    for c in claims:
        w = np.array(bounded_weights([*base, float(c)], ratio))
        if prev is not None:
            step = abs(c - prev[0])
            assert np.max(np.abs(w - prev[1])) <= 5 * step + 1e-9
            assert w[-1] >= prev[1][-1] - 1e-9
        prev = (c, w)


@pytest.mark.parametrize(("honest", "colluders"), [(7, 3), (6, 4), (9, 1), (5, 4)])
def test_colluders_weigh_at_most_f_plus_ratio_minus_1_medians(honest: int,
                                                              colluders: int) -> None:
    """Colluders claiming anything (brute force over a grid of claims) against honest nodes
    of about the median's size: their total stays within f + ratio - 1 medians."""
    rng = np.random.default_rng([honest, colluders])
    sizes = list(rng.integers(90, 110, size=honest).astype(float))
    for claim in (50.0, 150.0, 199.0, 201.0, 9_900.0, 10_100.0, 2.0**53):
        weights = bounded_weights([*sizes, *[claim] * colluders], 2.0)
        median = statistics.median_low([*sizes, *[claim] * colluders])
        assert sum(weights[honest:]) <= (colluders + 1) * median + 1e-9


def test_the_old_per_node_bound_warns_that_it_is_deprecated() -> None:
    from fedshard.server.robust import weight_bound

    with pytest.warns(DeprecationWarning, match="bounded_weights"):
        assert weight_bound(150.0, 100.0, 2.0) == 150.0
