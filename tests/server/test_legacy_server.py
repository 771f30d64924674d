"""A legacy ``ServerApp`` (``server_fn`` / ``strategy=..., config=...``) with SpectralSharding
stops at once, before round 1, with an error that names the Message API and Flower's migration
guide (it used to stop with ``'SpectralSharding' object has no attribute
'initialize_parameters'``)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
from flower_grid import InProcessGrid
from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.server import Server, ServerAppComponents, ServerConfig, SimpleClientManager
from flwr.serverapp import ServerApp

from fedshard import SpectralSharding
from fedshard.protocol import MESSAGE_API_GUIDE, LegacyApiError
from fedshard.server.legacy import LEGACY_HOOKS

MESSAGE = (r"SpectralSharding\.initialize_parameters\(\) was called by Flower's legacy server "
           r".*SpectralSharding is a strategy of the Message API \(flwr\.serverapp\.strategy\)"
           r": fedshard needs Flower's Message API .*The run stops here, before round 1\. Move "
           r"the app to the Message API \(app = ServerApp\(\); @app\.main\(\)")


class LegacyGrid(InProcessGrid):
    """The in-process grid with the run a legacy server reads (``grid.run.run_id``)."""

    @property
    def run(self) -> Any:
        return SimpleNamespace(run_id=1)


def strategy() -> SpectralSharding:
    return SpectralSharding(sharded_layers=["fc"], num_rounds=3)


def run_legacy(app: ServerApp) -> LegacyGrid:
    grid = LegacyGrid(ClientApp(), [{}, {}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Flower's own deprecation notices
        app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                          run_config={}))
    return grid


def test_a_server_fn_app_stops_before_round_1_naming_the_message_api() -> None:
    def server_fn(context: Context) -> ServerAppComponents:
        return ServerAppComponents(strategy=strategy(), config=ServerConfig(num_rounds=3))

    with pytest.raises(LegacyApiError, match=MESSAGE) as err:
        run_legacy(ServerApp(server_fn=server_fn))
    assert MESSAGE_API_GUIDE in str(err.value)


def test_a_strategy_given_to_the_server_app_stops_before_round_1() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        app = ServerApp(config=ServerConfig(num_rounds=3), strategy=strategy())
    grid = None
    with pytest.raises(LegacyApiError, match=MESSAGE):
        grid = run_legacy(app)
    assert grid is None  # nothing ran


def test_flowers_legacy_server_fit_stops_at_its_first_hook() -> None:
    server = Server(client_manager=SimpleClientManager(), strategy=strategy())  # type: ignore
    with pytest.raises(LegacyApiError, match=MESSAGE):
        server.fit(num_rounds=1, timeout=None)


@pytest.mark.parametrize("hook", LEGACY_HOOKS)
def test_every_legacy_hook_refuses_and_the_message_api_hooks_are_untouched(hook: str) -> None:
    s = strategy()
    with pytest.raises(LegacyApiError, match=rf"SpectralSharding\.{hook}\(\) was called"):
        getattr(s, hook)(1, None)
    for own in ("configure_train", "aggregate_train", "configure_evaluate",
                "aggregate_evaluate", "start", "summary"):
        # the Message API's hooks are the strategy's own or Flower's, none a refusing one
        assert getattr(SpectralSharding, own).__qualname__.split(".")[0] in {
            "SpectralSharding", "KeepRatioStrategy", "FedAvg", "Strategy"}, own


def test_width_slicing_refuses_too() -> None:
    from fedshard import WidthSlicing

    with pytest.raises(LegacyApiError, match=r"WidthSlicing\.configure_fit\(\) was called"):
        WidthSlicing.configure_fit(object.__new__(WidthSlicing), 1, None, None)
