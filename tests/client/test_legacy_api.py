"""The client refuses Flower's legacy API and the mods that assume dense replies, when the app is
built: a ``client_fn``, ``LocalDpMod``, the central-DP clipping mods, the secure-aggregation
mods (in ``ShardingClientApp(mods=...)`` and in a handler's ``@app.train(mods=...)``)."""

from __future__ import annotations

from typing import Any

import pytest
from flwr.app import Context, Message
from flwr.clientapp.mod import (
    LocalDpMod,
    adaptiveclipping_mod,
    arrays_size_mod,
    fixedclipping_mod,
    message_size_mod,
)

from fedshard import ShardingClientApp
from fedshard.client.app import refused_mod
from fedshard.protocol import MESSAGE_API_GUIDE, LegacyApiError


def client_fn(context: Context) -> Any:  # a legacy project's: returns a NumPyClient
    raise AssertionError("never called")


def test_a_client_fn_is_refused_with_the_migration_guide() -> None:
    with pytest.raises(LegacyApiError, match=r"ShardingClientApp\(client_fn=\.\.\.\) got a "
                                             r"client_fn.*fedshard needs Flower's Message API"
                                             r".*No app was built\. Move the app to the "
                                             r"Message API \(app = ShardingClientApp\(\); "
                                             r"@app\.train\(\)") as err:
        ShardingClientApp(client_fn=client_fn)
    assert MESSAGE_API_GUIDE in str(err.value) and isinstance(err.value, TypeError)
    assert MESSAGE_API_GUIDE == \
        "https://flower.ai/docs/framework/how-to-upgrade-to-message-api.html"
    with pytest.raises(LegacyApiError, match=r"got a client_fn"):
        ShardingClientApp(client_fn)  # type: ignore[arg-type]  # positionally, as ClientApp's


def test_local_dp_mod_is_refused_before_round_1() -> None:
    with pytest.raises(ValueError, match=r"ShardingClientApp\(mods=\[\.\.\.\]\) got Flower's "
                                         r"LocalDpMod, which cannot wrap a node of spectral "
                                         r"model sharding: LocalDpMod: it clips and noises "
                                         r"each reply array .*train the received sub-model "
                                         r"with DP-SGD .*No app was built"):
        ShardingClientApp(mods=[LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=1.0,
                                           delta=1e-5)])


def test_every_refused_mod_is_named_at_once() -> None:
    with pytest.raises(ValueError, match=r"got Flower's fixedclipping_mod, "
                                         r"adaptiveclipping_mod, which cannot .*"
                                         r"DifferentialPrivacyClientSide\*Clipping"):
        ShardingClientApp(mods=[message_size_mod, fixedclipping_mod, adaptiveclipping_mod])


def test_secure_aggregation_is_refused_and_says_why() -> None:
    from flwr.client.mod import secagg_mod, secaggplus_mod  # the legacy package holds them

    with pytest.raises(ValueError, match=r"secaggplus_mod: SecAgg\+ masks .* needs every node "
                                         r"to send a vector of the same length in the same "
                                         r"order; fedshard's nodes send different terms, of "
                                         r"different shapes .*Secure aggregation is not "
                                         r"supported"):
        ShardingClientApp(mods=[secaggplus_mod])
    assert refused_mod(secagg_mod) is not None


def test_a_refused_mod_on_a_handler_is_refused_when_registered() -> None:
    app = ShardingClientApp()
    with pytest.raises(ValueError, match=r"@app\.train\(mods=\[\.\.\.\]\) got Flower's "
                                         r"LocalDpMod"):
        @app.train(mods=[LocalDpMod(1.0, 1.0, 1.0, 1e-5)])
        def _train(msg: Message, context: Context) -> Message:
            return msg


def test_other_mods_pass() -> None:
    def my_mod(msg: Message, context: Context, call_next: Any) -> Message:
        return call_next(msg, context)

    class LocalDpModOfMine:  # a project's own mod, whatever its name
        def __call__(self, msg: Message, context: Context, call_next: Any) -> Message:
            return call_next(msg, context)

    for mod in (my_mod, arrays_size_mod, message_size_mod, LocalDpModOfMine()):
        assert refused_mod(mod) is None
    app = ShardingClientApp(mods=[my_mod, arrays_size_mod])

    @app.train(mods=[message_size_mod])
    def _train(msg: Message, context: Context) -> Message:
        return msg
