"""Differential privacy and fedshard's strategies: what does not work, refused before round 1.

Flower's DP wrappers (``DifferentialPrivacyServerSideFixedClipping``,
``DifferentialPrivacyClientSideFixedClipping`` and their adaptive variants) take a strategy and
call its hooks. They assume every node returns the full dense model: the server-side one clips
and noises ``reply − global`` array by array (the factor arrays of a shard have other shapes
than the global weights: a broadcast error), the client-side one needs ``fixedclipping_mod`` on
the ClientApp, which rejects fedshard's capability ``query``; ``LocalDpMod`` requires the reply
to carry the keys that were sent (a shard reply leaves ω out) and errors. They fail only after
some rounds or silently protect nothing, so they are refused before round 1, pointing at
fedshard's own central DP (:class:`~fedshard.settings.Privacy`,
:mod:`fedshard.server.central_dp`), which clips and noises per term and per entry.

How: a :class:`~fedshard.server.base.KeepRatioStrategy` runs under Flower's ``start()`` (its
own, a subclass's) or by direct calls of its hooks (a loop of one's own, a test); no other
strategy drives it. Its ``configure_train`` looks up the call stack
(:func:`driving_strategy`): a frame of a method of another Flower strategy object above it,
whether that strategy's ``configure_train`` called it directly, its ``start()`` drives the
rounds, or a helper function sits between them, is a driver, and the round is refused
(:func:`refuse_foreign_driver`); a client-side DP wrapper is also recognized by what it puts in
the round config (``clipping_norm``). Frames of the strategy itself (its subclass's own
``start()``, a ``super()`` chain) are not drivers.
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
    "{strategy} is being driven by another strategy ({driver}); Flower's "
    "differential-privacy wrappers (DifferentialPrivacy{{Server,Client}}Side{{Fixed,Adaptive}}"
    "Clipping) and other meta-strategies assume dense replies of the global model's shapes and "
    "cannot clip or noise per-term factor shards or width slices. The run is stopped before "
    "round 1. For central differential privacy use fedshard's own setting instead: "
    "{strategy}(privacy=Privacy(target_epsilon=..., clipping_norm=...)) or the run-config keys "
    "dp-target-epsilon and dp-clipping-norm (each node's whole update clipped to S, Gaussian "
    "noise on every per-term and per-entry sum, the spent epsilon logged: docs/privacy.md); "
    "on the nodes, fedshard.clip_update_mod clips an update before it is sent, and DP-SGD "
    "(Opacus) trains the received sub-model (docs/integration.md, \"Differential privacy and "
    "secure aggregation\"). Flower's LocalDpMod does not fit either: it requires the reply's "
    "arrays to have the keys that were sent, and a shard reply leaves out omega."
)


def driving_strategy(strategy: object) -> Strategy | None:
    """The other Flower strategy that drives ``strategy``'s hooks, if any.

    Walks up the call stack from the hook's caller and returns the first ``self`` that is a
    :class:`flwr.serverapp.strategy.Strategy` other than ``strategy``: a DP wrapper's
    ``configure_train`` (it then clips ``reply − global`` array by array, which factor shards
    cannot take), another strategy's ``start()`` driving the rounds, or a meta-strategy that
    reaches the hooks through helper functions. Frames of ``strategy`` itself (its own or a
    subclass's ``start()``, a ``super()`` chain) are passed over. Call it from the hook
    itself. Without frame introspection (not CPython) it finds nothing.
    """
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back else None
    try:
        while caller is not None:
            owner = caller.f_locals.get("self")
            if isinstance(owner, Strategy) and owner is not strategy:
                return owner
            caller = caller.f_back
    finally:
        del frame, caller  # frames hold their locals: no reference cycle kept
    return None


def refuse_foreign_driver(config: Mapping[str, Any], driver: object | None = None,
                          name: str = "SpectralSharding") -> None:
    """Raise ``RuntimeError`` (:data:`WRAPPED_MESSAGE`) if another strategy drives the one
    named ``name`` (``driver``, from :func:`driving_strategy`) or the round config carries a
    client-side DP wrapper's keys.

    Plain use (Flower's ``start()`` of the strategy itself, a subclass's own, a test or a
    user's loop calling the hooks) passes.
    """
    dp_keys = [k for k in DP_CONFIG_KEYS if k in config]
    if dp_keys:
        raise RuntimeError(WRAPPED_MESSAGE.format(
            strategy=name,
            driver=f"a client-side DP wrapper: the round config carries {', '.join(dp_keys)}"))
    if driver is not None:
        raise RuntimeError(WRAPPED_MESSAGE.format(
            strategy=name, driver=f"{type(driver).__name__} called {name}.configure_train"))
