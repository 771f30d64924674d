"""Differential privacy (issue 15, item 6): Flower's DP wrappers cannot clip or noise factor
shards; wrapping SpectralSharding is refused at the first call, with what to use instead."""

from __future__ import annotations

import pytest
from fault_setup import grid, initial, strategy
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
)


@pytest.mark.parametrize("wrapper", [DifferentialPrivacyServerSideFixedClipping,
                                     DifferentialPrivacyClientSideFixedClipping])
def test_dp_wrappers_are_refused_before_round_1(wrapper: type) -> None:
    dp = wrapper(strategy(), noise_multiplier=0.1, clipping_norm=1.0, num_sampled_clients=3)
    g = grid()
    with pytest.raises(RuntimeError, match=rf"driven by another strategy \({wrapper.__name__}\)"
                       r".*LocalDpMod"):
        dp.start(grid=g, initial_arrays=initial(), num_rounds=1, timeout=5)
    assert not [m for m in g.sent if m.metadata.message_type == "train"]


def test_direct_use_is_not_refused() -> None:
    assert len(list(strategy().configure_train(1, initial(), ConfigRecord(), grid()))) == 3
