"""Flower's legacy server API refused at once: :func:`message_api_only`.

A legacy ``ServerApp`` (``ServerApp(server_fn=...)`` returning ``ServerAppComponents``, or
``ServerApp(strategy=..., config=...)``) runs Flower's ``Server.fit``, which calls the legacy
``Strategy`` hooks: ``initialize_parameters`` first, then ``configure_fit``/``aggregate_fit``
and ``evaluate`` every round. :class:`~fedshard.server.strategy.SpectralSharding` is a strategy
of the Message API (``flwr.serverapp.strategy``) and has none of them, so the legacy server used
to stop with ``'SpectralSharding' object has no attribute 'initialize_parameters'``. With
:func:`message_api_only` the strategy has these hooks, and each raises
:class:`~fedshard.protocol.LegacyApiError` saying that fedshard needs the Message API and
linking Flower's migration guide: the run stops before round 1, as it did, with a message that
says what to change.

The Message API's hooks of the same names (``configure_evaluate``, ``aggregate_evaluate``) are
not touched: only the names that exist in the legacy API alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from fedshard import protocol as P

__all__ = ["LEGACY_HOOKS", "message_api_only"]

#: The hooks of Flower's legacy ``flwr.server.strategy.Strategy`` that its Message API
#: counterpart does not have (``initialize_parameters`` is the first a legacy server calls).
LEGACY_HOOKS = ("initialize_parameters", "configure_fit", "aggregate_fit", "evaluate")

_Strategy = TypeVar("_Strategy", bound=type)

#: What a legacy ServerApp becomes under the Message API.
_INSTEAD = ("app = ServerApp(); @app.main() def main(grid, context): "
            "strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), "
            "num_rounds=...)")


def _refusing(hook: str) -> Callable[..., NoReturn]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        name = type(self).__name__
        raise P.legacy_api_error(
            f"{name}.{hook}() was called by Flower's legacy server (a ServerApp built with "
            f"server_fn=... or strategy=..., config=...; or start_server/start_simulation), "
            f"which drives the legacy Strategy hooks; {name} is a strategy of the Message API "
            "(flwr.serverapp.strategy)",
            _INSTEAD, "The run stops here, before round 1.")

    refuse.__name__ = refuse.__qualname__ = hook
    refuse.__doc__ = (f"Flower's legacy ``Strategy.{hook}``: raises "
                      ":class:`~fedshard.protocol.LegacyApiError` (fedshard needs the Message "
                      "API; see :mod:`fedshard.server.legacy`).")
    return refuse


def message_api_only(cls: _Strategy) -> _Strategy:
    """Give the Message-API strategy class ``cls`` each of :data:`LEGACY_HOOKS` that it does
    not define, as a method that raises :class:`~fedshard.protocol.LegacyApiError`; returns
    ``cls`` (a class decorator; applying it again changes nothing).

    Parameters
    ----------
    cls : type
        A subclass of ``flwr.serverapp.strategy.Strategy``.

    Returns
    -------
    type
        ``cls`` itself.
    """
    for hook in LEGACY_HOOKS:
        if not hasattr(cls, hook):
            setattr(cls, hook, _refusing(hook))
    return cls
