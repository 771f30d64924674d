"""Node-side clipping for central differential privacy: a Flower mod that bounds what one node
can send (:func:`clip_update_mod`).

Flower's ``fixedclipping_mod`` clips ``reply − sent`` array by array for its dense DP
wrappers and breaks on fedshard's messages (it reads a clipping norm from every message's
config, the capability ``query`` too). This mod clips the node's whole update, every factor
column and dense entry (width slicing: its slice) as one vector, against the arrays it was
sent, and passes every other message (fedshard's capability query, ``evaluate``, error
replies) through untouched. With node-side clipping the server still clips (to the same S:
nothing changes for an honest node) and adds the noise (:mod:`fedshard.server.central_dp`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from flwr.app import Array, Context, Message
from flwr.common import MessageType

from fedshard import protocol as P
from fedshard.settings import finite_real

__all__ = ["clip_update_mod"]

Mod = Callable[[Message, Context, Callable[[Message, Context], Message]], Message]


def clip_update_mod(clipping_norm: float) -> Mod:
    """A Flower mod that scales the node's ``train`` update to L2 norm at most
    ``clipping_norm`` (S) before the reply is sent.

    The update is every floating array of the reply minus the array of the same key the node
    was sent, taken as one vector; integer arrays (a shard's term ``indices``) are left as they
    are. Put it first among the app's mods so that it sees the encoded reply:
    ``ClientApp(mods=[clip_update_mod(1.0)])`` around fedshard's handlers, or
    ``ShardingClientApp(clipping_norm=1.0)``, which places it outside its re-encoding mod.

    Parameters
    ----------
    clipping_norm : float
        S > 0, the server's ``Privacy.clipping_norm`` (``dp-clipping-norm``).

    Raises
    ------
    ValueError
        For an S that is not a finite number > 0 (when the mod is made). A ``train`` reply
        holding a floating array that was not sent with the same key and shape (a handler's
        reply not yet encoded as a shard) makes the mod raise, which Flower turns into an
        error reply: the server drops it, its update is not used unclipped.
    """
    if not (finite_real(clipping_norm) and clipping_norm > 0):
        raise ValueError(f"clip_update_mod(clipping_norm={clipping_norm!r}): expected a finite "
                         "number S > 0 (the server's dp-clipping-norm); no mod was made")
    bound = float(clipping_norm)

    def clip_update(msg: Message, context: Context,
                    call_next: Callable[[Message, Context], Message]) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        sent = msg.content.array_records.get(P.ARRAYS)
        got = reply.content.array_records.get(P.ARRAYS)
        if sent is None or got is None:
            return reply
        change: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key in got:
            x = got[key].numpy()
            if not np.issubdtype(x.dtype, np.floating):
                continue
            before = sent[key].numpy() if key in sent else None
            if before is None or before.shape != x.shape:
                raise ValueError(
                    f"clip_update_mod: the reply's array {key!r} {tuple(x.shape)} has no sent "
                    "array of the same key and shape to clip against; expected the encoded "
                    "shard or slice reply (put the mod first among the app's mods, or use "
                    "ShardingClientApp(clipping_norm=...)). The reply is not sent.")
            change[key] = (before.astype(np.float64), x.astype(np.float64) - before)
        norm = math.sqrt(sum(float(np.dot(d.ravel(), d.ravel())) for _, d in change.values()))
        if norm <= bound:
            return reply
        scale = bound / norm
        for key, (before, delta) in change.items():
            got[key] = Array(np.ascontiguousarray(before + scale * delta).astype(
                got[key].numpy().dtype))
        return reply

    return clip_update
