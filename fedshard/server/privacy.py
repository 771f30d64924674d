"""Differential privacy and :class:`~fedshard.server.strategy.SpectralSharding`: what does not work.

Flower's DP wrappers (``DifferentialPrivacyServerSideFixedClipping``,
``DifferentialPrivacyClientSideFixedClipping`` and their adaptive variants) take a strategy and
call its hooks. They assume every node returns the full dense model: the server-side one clips
and noises ``reply − global`` array by array (the factor arrays of a shard have other shapes
than the global weights: a broadcast error), the client-side one needs ``fixedclipping_mod`` on
the ClientApp, which rejects fedshard's capability ``query``; ``LocalDpMod`` requires the reply
to carry the keys that were sent (a shard reply leaves ω out) and errors. They fail only after
some rounds or silently protect nothing, so the wrappers are refused at the first call.

A wrapper is recognized by what it is, not by who called: an object of another strategy class
that holds this one in its ``strategy`` attribute (:func:`wrappers_of`). The strategy checks
this when one of its training hooks is called from outside its own ``start``.
"""

from __future__ import annotations

import gc

from flwr.serverapp.strategy import Strategy

__all__ = ["WRAPPED_MESSAGE", "refuse_wrappers", "wrappers_of"]

WRAPPED_MESSAGE = (
    "SpectralSharding is being driven by another strategy ({wrapper}); Flower's "
    "differential-privacy wrappers (DifferentialPrivacy{{Server,Client}}Side{{Fixed,Adaptive}}"
    "Clipping) and other meta-strategies assume dense replies of the global model's shapes and "
    "cannot clip or noise per-term factor shards. The run is stopped before round 1. fedshard "
    "has no differential privacy for factor shards yet (Flower's LocalDpMod does not fit "
    "either: it requires the reply's arrays to have the keys that were sent, and a shard reply "
    "leaves out omega). Use SpectralSharding without DP, or for a DP baseline wrap Flower's own "
    "FedAvg on the dense model."
)


def wrappers_of(strategy: Strategy) -> list[Strategy]:
    """The other strategies that hold ``strategy`` as the one they drive.

    Flower's DP wrappers (and its other meta-strategies) keep the wrapped strategy in their
    ``strategy`` attribute and call its hooks from their own ``start``; this finds such an
    object by that reference (the objects whose attributes refer to ``strategy``, through
    :func:`gc.get_referrers`), whoever called.
    """
    found: list[Strategy] = []
    for holder in gc.get_referrers(strategy):
        if isinstance(holder, Strategy):  # an object whose attribute values are held inline
            if holder is not strategy and vars(holder).get("strategy") is strategy:
                found.append(holder)
        elif isinstance(holder, dict) and holder.get("strategy") is strategy:  # a __dict__
            found.extend(owner for owner in gc.get_referrers(holder)
                         if isinstance(owner, Strategy) and owner is not strategy
                         and vars(owner) is holder and owner not in found)
    return found


def refuse_wrappers(strategy: Strategy) -> None:
    """Raise ``RuntimeError`` if another :class:`~flwr.serverapp.strategy.Strategy` holds
    ``strategy`` to drive it (:func:`wrappers_of`), as Flower's DP wrappers do.

    Plain use (``strategy.start()``, a test or a user's loop calling the hooks, a subclass
    with its own ``start``) passes.
    """
    wrappers = wrappers_of(strategy)
    if wrappers:
        raise RuntimeError(WRAPPED_MESSAGE.format(wrapper=type(wrappers[0]).__name__))
