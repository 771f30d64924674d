"""Differential privacy: Flower's DP wrappers cannot clip or noise factor
shards; wrapping SpectralSharding is refused at the first call, with what to use instead."""

from __future__ import annotations

from typing import Any

import pytest
from fault_setup import grid, initial, make_net, strategy
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Result,
    Strategy,
)

from fedshard import SpectralSharding
from fedshard.settings import Slicing


@pytest.mark.parametrize("wrapper", [DifferentialPrivacyServerSideFixedClipping,
                                     DifferentialPrivacyClientSideFixedClipping])
def test_dp_wrappers_are_refused_before_round_1(wrapper: type) -> None:
    dp = wrapper(strategy(), noise_multiplier=0.1, clipping_norm=1.0, num_sampled_clients=3)
    g = grid()
    with pytest.raises(RuntimeError, match=r"driven by another strategy \(.*\).*use fedshard's "
                                           r"own setting instead: SpectralSharding\(privacy="
                                           r"Privacy\(.*dp-target-epsilon.*DP-SGD"):
        dp.start(grid=g, initial_arrays=initial(), num_rounds=1, timeout=5)
    assert not [m for m in g.sent if m.metadata.message_type == "train"]


@pytest.mark.parametrize("wrapper", [DifferentialPrivacyServerSideAdaptiveClipping,
                                     DifferentialPrivacyClientSideAdaptiveClipping])
def test_adaptive_dp_wrappers_are_refused_before_round_1(wrapper: type) -> None:
    dp = wrapper(strategy(), noise_multiplier=0.1, num_sampled_clients=3)
    g = grid()
    with pytest.raises(RuntimeError, match=r"driven by another strategy \("):
        dp.start(grid=g, initial_arrays=initial(), num_rounds=1, timeout=5)
    assert not [m for m in g.sent if m.metadata.message_type == "train"]


def test_a_client_side_wrapper_is_refused_however_its_hooks_are_reached() -> None:
    """A client-side DP wrapper puts its clipping norm in the round config: refused even when
    its configure_train is called directly (no start(), no summary())."""
    dp = DifferentialPrivacyClientSideAdaptiveClipping(strategy(), noise_multiplier=0.1,
                                                       num_sampled_clients=3)
    g = grid()
    with pytest.raises(RuntimeError, match=r"client-side DP wrapper: the round config carries "
                                           r"clipping_norm"):
        dp.configure_train(1, initial(), ConfigRecord(), g)
    assert not g.sent


def test_the_strategys_own_start_after_a_refused_wrapper_runs() -> None:
    """A refused wrapper leaves nothing behind: the strategy then runs under its own
    (Flower's) start()."""
    inner = strategy(num_rounds=1)
    dp = DifferentialPrivacyServerSideFixedClipping(inner, noise_multiplier=0.1,
                                                    clipping_norm=1.0, num_sampled_clients=3)
    with pytest.raises(RuntimeError, match="driven by another strategy"):
        dp.start(grid=grid(), initial_arrays=initial(), num_rounds=1, timeout=5)
    inner.start(grid=grid(), initial_arrays=initial(), num_rounds=1, timeout=5)
    assert inner.rounds_trained == 1


def test_direct_use_is_not_refused() -> None:
    assert len(list(strategy().configure_train(1, initial(), ConfigRecord(), grid()))) == 3


def test_a_subclass_with_its_own_start_is_not_refused() -> None:
    class Logged(SpectralSharding):
        def start(self, *args: Any, **kwargs: Any) -> Result:
            self.started = True
            return super().start(*args, **kwargs)

    class OwnLoop(SpectralSharding):
        def start(self, grid: Any, initial_arrays: Any, *args: Any, **kwargs: Any) -> Result:
            self.summary()  # as Flower's Strategy.start (and Flower's advanced example) do
            msgs = list(self.configure_train(1, initial_arrays, ConfigRecord(), grid))
            arrays, _ = self.aggregate_train(1, grid.send_and_receive(msgs))
            return Result(arrays=arrays or initial_arrays)

    for kind in (Logged, OwnLoop):
        s = strategy(cls=kind, num_rounds=1)
        s.start(grid=grid(), initial_arrays=initial(), num_rounds=1, timeout=5)
        assert s.rounds_trained == 1, kind.__name__


class Ensemble(Strategy):
    """A meta-strategy that reaches the strategy's hooks only through a helper function, so
    that no frame directly above configure_train is a strategy's."""

    def __init__(self, inner: Strategy) -> None:
        self.inner = inner

    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Any:
        return _delegate(self.inner, server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        return self.inner.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: Any, config: Any,
                           grid: Any) -> Any:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Any) -> Any:
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.inner.summary()


def _delegate(inner: Strategy, *args: Any) -> Any:
    return list(inner.configure_train(*args))


def test_a_meta_strategy_behind_a_helper_function_is_refused_before_round_1() -> None:
    """Another strategy anywhere above configure_train is a driver: its start() (Flower's),
    or its hook calling a helper that calls ours."""
    g = grid()
    with pytest.raises(RuntimeError, match=r"SpectralSharding is being driven by another "
                                           r"strategy \(Ensemble called SpectralSharding\."
                                           r"configure_train\)"):
        Ensemble(strategy()).start(grid=g, initial_arrays=initial(), num_rounds=1, timeout=5)
    assert not [m for m in g.sent if m.metadata.message_type == "train"]
    with pytest.raises(RuntimeError, match="driven by another strategy"):
        Ensemble(strategy()).configure_train(1, initial(), ConfigRecord(), g)


def test_width_slicing_is_guarded_as_well() -> None:
    from fedshard import Cohort, WidthSlicing
    from fedshard.width import WidthFamily

    inner = WidthSlicing(family=WidthFamily(lambda width: make_net(), 12),
                         slicing=Slicing(width_match="keep-ratio"),
                         cohort=Cohort(min_available_nodes=1, min_train_nodes=1))
    dp = DifferentialPrivacyServerSideFixedClipping(inner, noise_multiplier=0.1,
                                                    clipping_norm=1.0, num_sampled_clients=3)
    with pytest.raises(RuntimeError, match=r"WidthSlicing is being driven by another strategy "
                                           r"\(DifferentialPrivacyServerSideFixedClipping "
                                           r"called WidthSlicing\.configure_train\)"):
        dp.configure_train(1, initial(), ConfigRecord(), grid())


def test_flowers_local_dp_mod_cannot_wrap_a_shard_reply() -> None:
    """What the refusal message says of LocalDpMod, checked: the mod compares the reply's keys
    with the keys it was sent, and a shard reply leaves ω out, so every reply is an error."""
    from fault_setup import local_data, make_net
    from flower_grid import InProcessGrid
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.clientapp.mod import LocalDpMod

    from fedshard import handle_query, handle_train

    app = ClientApp()
    dp = LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=1.0, delta=1e-5)

    @app.query()
    def _q(msg: Message, context: Context) -> Message:
        return handle_query(msg, 0.5)

    @app.train(mods=[dp])  # on the train handler only: as an app mod it rejects the query
    def _t(msg: Message, context: Context) -> Message:
        return handle_train(msg, make_net(), local_data(0))

    g = InProcessGrid(app, [{} for _ in range(2)])
    s = strategy()
    replies = g.send_and_receive(list(s.configure_train(1, initial(), ConfigRecord(), g)))
    assert len(replies) == 2 and all(r.has_error() for r in replies)
    assert all("LocalDpMod" in r.error.reason for r in replies)


@pytest.mark.parametrize("wrapper", [DifferentialPrivacyServerSideFixedClipping,
                                     DifferentialPrivacyServerSideAdaptiveClipping])
def test_a_server_side_wrapper_driven_through_its_hooks_is_refused_before_round_1(
    wrapper: type,
) -> None:
    """A loop of one's own over the wrapper's hooks (no start(), no summary()): refused at the
    first configure_train, naming the wrapper, never a numpy broadcast error after round 1."""
    kwargs: dict[str, Any] = {"clipping_norm": 1.0} if "Fixed" in wrapper.__name__ else {}
    dp = wrapper(strategy(), noise_multiplier=0.1, num_sampled_clients=3, **kwargs)
    g = grid()
    arrays = initial()
    with pytest.raises(RuntimeError, match=(
            rf"driven by another strategy \({wrapper.__name__} called "
            r"SpectralSharding\.configure_train\).*For central differential privacy use "
            "fedshard's own setting")):
        for server_round in (1, 2):
            messages = list(dp.configure_train(server_round, arrays, ConfigRecord(), g))
            new, _ = dp.aggregate_train(server_round, g.send_and_receive(messages))
            arrays = new or arrays
    assert not g.sent
