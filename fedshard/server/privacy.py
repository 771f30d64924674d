"""Differential privacy and :class:`~fedshard.server.strategy.SpectralSharding`: what does not work.

Flower's DP wrappers (``DifferentialPrivacyServerSideFixedClipping``,
``DifferentialPrivacyClientSideFixedClipping`` and their adaptive variants) take a strategy and
call its hooks. They assume every node returns the full dense model: the server-side one clips
and noises ``reply − global`` array by array (the factor arrays of a shard have other shapes
than the global weights: a broadcast error), the client-side one needs ``fixedclipping_mod`` on
the ClientApp, which rejects fedshard's capability ``query``; ``LocalDpMod`` requires the reply
to carry the keys that were sent (a shard reply leaves ω out) and errors. They fail only after
some rounds or silently protect nothing, so they are refused before round 1.

How: SpectralSharding runs under its own ``start()`` (or a subclass's) or by direct calls of
its hooks (your own loop, a test). Every Flower strategy's ``start()`` calls the strategy's
``summary()`` before round 1, a wrapper's ``start()`` its wrapped strategy's too;
SpectralSharding's ``summary()`` outside its own ``start()`` marks it as driven by another
strategy, and its training hooks then refuse (:func:`refuse_foreign_driver`). A subclass with a
``start()`` of its own is taken to drive itself (its ``summary()`` marks nothing). However the
hooks are reached (a loop of your own that calls the wrapper's hooks, no ``start()`` at all),
``configure_train`` called from a method of another Flower strategy object is refused too
(:func:`driving_strategy`), and a client-side DP wrapper is also recognized by what it puts in
the round config (``clipping_norm``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from flwr.serverapp.strategy import Strategy

__all__ = ["DP_CONFIG_KEYS", "WRAPPED_MESSAGE", "driving_strategy", "refuse_foreign_driver"]

#: Round-config keys that Flower's client-side DP wrappers add before calling the strategy.
DP_CONFIG_KEYS = ("clipping_norm",)

WRAPPED_MESSAGE = (
    "SpectralSharding is being driven by another strategy ({driver}); Flower's "
    "differential-privacy wrappers (DifferentialPrivacy{{Server,Client}}Side{{Fixed,Adaptive}}"
    "Clipping) and other meta-strategies assume dense replies of the global model's shapes and "
    "cannot clip or noise per-term factor shards. The run is stopped before round 1. fedshard "
    "has no central differential privacy for factor shards yet (Flower's LocalDpMod does not "
    "fit either: it requires the reply's arrays to have the keys that were sent, and a shard "
    "reply leaves out omega). For DP on the nodes, train the received sub-model with DP-SGD "
    "(Opacus: docs/integration.md, \"Differential privacy and secure aggregation\"); for a "
    "central-DP baseline wrap Flower's own FedAvg on the dense model."
)


def driving_strategy(strategy: object) -> Strategy | None:
    """The other Flower strategy whose method called one of ``strategy``'s hooks, if any.

    Walks up the calls from the hook past every frame of ``strategy`` itself (its own
    ``start()``, a subclass's ``super()`` chain) to the first caller; that caller's ``self``,
    where it is a :class:`flwr.serverapp.strategy.Strategy` other than ``strategy``, is the
    driver: a DP wrapper's ``configure_train`` (it then clips ``reply − global`` array by
    array, which factor shards cannot take) or another meta-strategy. Call it from the hook
    itself. Without frame introspection (not CPython) it finds nothing.
    """
    frame, caller = inspect.currentframe(), None
    try:
        caller = frame.f_back.f_back if frame is not None and frame.f_back else None
        while caller is not None and caller.f_locals.get("self") is strategy:
            caller = caller.f_back
        driver = caller.f_locals.get("self") if caller is not None else None
    finally:
        del frame, caller  # frames hold their locals: no reference cycle kept
    return driver if isinstance(driver, Strategy) and driver is not strategy else None


def refuse_foreign_driver(foreign_start: bool, config: Mapping[str, Any],
                          driver: object | None = None) -> None:
    """Raise ``RuntimeError`` (:data:`WRAPPED_MESSAGE`) if another strategy's ``start()``
    drives this one (``foreign_start``: its ``summary()`` was called outside its own
    ``start()``), another strategy's method called the hook (``driver``, from
    :func:`driving_strategy`) or the round config carries a client-side DP wrapper's keys.

    Plain use (``strategy.start()``, a test or a user's loop calling the hooks, a subclass
    with its own ``start``) passes.
    """
    dp_keys = [k for k in DP_CONFIG_KEYS if k in config]
    if dp_keys:
        raise RuntimeError(WRAPPED_MESSAGE.format(
            driver=f"a client-side DP wrapper: the round config carries {', '.join(dp_keys)}"))
    if driver is not None:
        raise RuntimeError(WRAPPED_MESSAGE.format(
            driver=f"{type(driver).__name__} called SpectralSharding.configure_train"))
    if foreign_start:
        raise RuntimeError(WRAPPED_MESSAGE.format(
            driver="its start() called SpectralSharding.summary() from outside "
                   "SpectralSharding.start()"))
