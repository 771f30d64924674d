"""Differential privacy and :class:`~fedshard.server.strategy.SpectralSharding`: what does not work.

Flower's DP wrappers (``DifferentialPrivacyServerSideFixedClipping``,
``DifferentialPrivacyClientSideFixedClipping`` and their adaptive variants) take a strategy and
call its hooks. They assume every node returns the full dense model: the server-side one clips
and noises ``reply − global`` array by array (the factor arrays of a shard have other shapes
than the global weights: a broadcast error), the client-side one needs ``fixedclipping_mod`` on
the ClientApp, which rejects fedshard's capability ``query``; ``LocalDpMod`` requires the reply
to carry the keys that were sent (a shard reply leaves ω out) and errors. They fail only after
some rounds or silently protect nothing, so the wrappers are refused at the first call.
"""

from __future__ import annotations

from types import FrameType
from typing import Any

from flwr.serverapp.strategy import Strategy

__all__ = ["WRAPPED_MESSAGE", "refuse_wrappers"]

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


def refuse_wrappers(strategy: Strategy, caller: FrameType | None) -> None:
    """Raise ``RuntimeError`` if ``caller`` (the frame that called one of ``strategy``'s
    hooks) is a method of another :class:`~flwr.serverapp.strategy.Strategy`, as with Flower's
    DP wrappers, which call the wrapped strategy's ``configure_train``.

    Plain calls (``strategy.start()``, a test calling the hook) pass.
    """
    other: Any = caller.f_locals.get("self") if caller is not None else None
    if isinstance(other, Strategy) and other is not strategy:
        raise RuntimeError(WRAPPED_MESSAGE.format(wrapper=type(other).__name__))
