"""fedshard speaks Flower's Message API only: :class:`LegacyApiError` and the migration guide.

Every node receives its own shard (its terms, ω, their indices) in a :class:`flwr.app.Message`
and answers with a ``Message``; the strategy builds one message per node. Flower's legacy API
(``NumPyClient``/``Client`` behind ``ClientApp(client_fn=...)``, ``Strategy`` with
``initialize_parameters``/``configure_fit``/``aggregate_fit`` behind
``ServerApp(server_fn=...)`` or ``ServerApp(strategy=..., config=...)``) sends every client the
same ``Parameters`` and has no place for any of it, so fedshard refuses it at once, naming
Flower's migration guide (:data:`MESSAGE_API_GUIDE`), rather than fail later with an
``AttributeError``.
"""

from __future__ import annotations

__all__ = ["MESSAGE_API_GUIDE", "LegacyApiError", "legacy_api_error"]

#: Flower's guide to moving a ``NumPyClient``/``Strategy`` app to the Message API.
MESSAGE_API_GUIDE = "https://flower.ai/docs/framework/how-to-upgrade-to-message-api.html"


class LegacyApiError(TypeError):
    """fedshard was given a piece of Flower's legacy API (``client_fn``, a legacy server
    calling ``initialize_parameters``); the message says what to move and links
    :data:`MESSAGE_API_GUIDE`."""


def legacy_api_error(found: str, instead: str, then: str) -> LegacyApiError:
    """The error for ``found`` (what was used), with what to write ``instead`` and what
    happens ``then`` (e.g. "No app was built")."""
    return LegacyApiError(
        f"{found}: fedshard needs Flower's Message API (a ServerApp with @app.main() that "
        "calls strategy.start(grid=...), a ClientApp whose @app.train() handler receives a "
        "Message), because every node receives a shard of its own (its terms, their "
        "multipliers ω and indices), which the legacy API (NumPyClient/Client and client_fn, "
        "Strategy with initialize_parameters/configure_fit/aggregate_fit, server_fn) has no "
        f"place for. {then} Move the app to the Message API ({instead}); Flower's migration "
        f"guide: {MESSAGE_API_GUIDE}, then docs/integration.md for fedshard's part.")
