"""The server's own reference update on a small clean set (FLTrust, Cao et al., NDSS 2021):
each round the server trains what each node was sent and weighs each node by how far its
update points the same way.

A round's replies alone cannot tell three dishonest nodes in ten with honest-sized updates
from honest nodes on other data (Dirichlet α = 1). Two things can: :class:`TrustedReference`
(opt-in) here, and each node's agreement record across rounds
(:mod:`fedshard.server.trust_record`, whose :class:`~fedshard.server.trust_record.TrustStage`
is what a round calls, with the reference when there is one).

* :class:`TrustedReference`: the server trains, each round, what each node was sent on its
  own clean examples with the nodes' recipe and client rules (the same ``train`` message,
  :func:`fedshard.client.handle_node_train`), and :func:`fltrust_weights` weighs each node by
  its update's cosine with the reference's (:func:`update_of`, :func:`cosine`).

Notes
-----
**Where the comparison happens.** A factor-shard node returns ``u``, ``v`` of its own terms
only; a width-slicing node its narrow slice. The reference is trained on the very message the
node got (its sub-model, its terms and ω, its lr, seed and client rules), so the reference's
update lives in the node's own coordinates, and the cosine is taken over exactly the arrays
the node returns (each factor column and dense entry, minus what it was sent). We chose this
over a dense reference compared with the node's rebuilt ``ΔW = Δ(U diag(ω) Vᵀ)`` because a
node at keep ratio 0.2 moves only its terms: its ``ΔW`` is confined to a subspace the dense
reference's ``ΔW`` mostly leaves, so their cosine would be small for honest and dishonest nodes
alike, and a node's factor moves are what the per-term averages use. The price is one
local training per sampled node per round on the server, as long as a node's: the reference
trains ``local-epochs`` × round(median ``num-examples`` / trusted-set size) epochs over the
trusted set (:meth:`TrustedReference.epochs_for`), so that its update has a node's length (a
single pass over a few hundred examples is a fraction of a typical node's steps, and
rescaling every update to that length would shrink every round's step as much).

**The weights** (FLTrust's Eq. 4–6 per node): with ``g_i`` the node's update and ``g_0,i``
the reference's on the same message, ``t_i = max(0, cos(g_i, g_0,i))``; the node's update is
rescaled to the reference's norm, ``g_i ← (‖g_0,i‖ / ‖g_i‖) g_i``, and its weight becomes
``t_i · w_i`` (``w_i`` its ``num-examples`` after the weight cap, so that nodes agreeing
equally keep FedAvg's relative weights). A node with ``t_i = 0`` (a negated, anti-aligned,
zero or orthogonal update) is left out of the round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from fedshard import protocol as P

__all__ = ["TrainFn", "TrustedReference", "cosine", "fltrust_weights", "update_of"]

#: The server's training function: a ``train`` message as a node would get it -> the reply
#: a node would send (fedshard's ``train_reply`` layout: the trained arrays under ``arrays``).
TrainFn = Callable[[Message], Message]

#: The ``train`` config key of the local epochs.
_EPOCHS = "local-epochs"


def update_of(values: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray]
              ) -> dict[str, np.ndarray]:
    """``values − sent`` in float64 for every floating key of ``sent`` (a node's update in its
    own coordinates: its factor columns and dense entries, or its narrow slice)."""
    return {k: np.subtract(values[k], s, dtype=np.float64)
            for k, s in sent.items() if np.issubdtype(np.asarray(s).dtype, np.floating)}


def _norm(update: Mapping[str, np.ndarray]) -> float:
    """The Euclidean norm of an update over all its keys."""
    return math.sqrt(sum(float(np.vdot(x, x)) for x in update.values()))


def cosine(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """The cosine of two updates over the keys of ``a`` (0 where either is zero)."""
    xy = sum(float(np.vdot(a[k], b[k])) for k in a)
    nx, ny = _norm(a), _norm({k: b[k] for k in a})
    if not (nx > 0 and ny > 0 and math.isfinite(nx * ny)):
        return 0.0
    return float(np.clip(xy / (nx * ny), -1.0, 1.0))


def fltrust_weights(updates: Sequence[Mapping[str, np.ndarray]],
                    references: Sequence[Mapping[str, np.ndarray]],
                    weights: Sequence[float]) -> tuple[list[float], list[float], list[float]]:
    """FLTrust's trust scores per node: ``(t_i · w_i, s_i, cos_i)`` with ``t_i = ReLU(cos_i)``
    the node's cosine with its reference update and ``s_i = ‖g_0,i‖ / ‖g_i‖`` the factor
    that rescales its update to the reference's norm (0 where ``t_i = 0``).

    Notes
    -----
    Cao et al. (NDSS 2021), Eq. (4)–(6), with one reference per node (see the module's
    Notes) and the trust score multiplying the node's (capped) ``num-examples`` weight.
    """
    out_w, out_s, out_c = [], [], []
    for g, g0, w in zip(updates, references, weights, strict=True):
        c = cosine(g, g0)
        t = max(0.0, c)
        ng, n0 = _norm(g), _norm(g0)
        out_w.append(t * float(w))
        out_s.append(n0 / ng if t > 0 and ng > 0 else 0.0)
        out_c.append(c)
    return out_w, out_s, out_c


class TrustedReference:
    """The server's own update on a clean set, for each node's message (FLTrust's root data
    set): ``train_fn(message) -> reply``, trained as a node trains it.

    Parameters
    ----------
    train_fn : callable
        A ``train`` message as a node gets it -> the reply a node would send (its arrays
        under ``"arrays"``, the keys and shapes the node returns). Build one from a model and
        a data set with :meth:`from_data`.
    size : int, optional
        Examples in the trusted set: the reference then trains ``local-epochs`` times
        :meth:`epochs_for` the round's median ``num-examples`` (a node's number of steps);
        ``None``: the node's ``local-epochs`` as sent.

    Raises
    ------
    TypeError
        If ``train_fn`` is not callable.
    ValueError
        If ``size`` is not a positive integer.
    """

    def __init__(self, train_fn: TrainFn, size: int | None = None) -> None:
        if not callable(train_fn):
            raise TypeError(f"train_fn={train_fn!r}: expected a callable taking a train "
                            "Message and returning the reply a node would send (or use "
                            "TrustedReference.from_data(data, model=...)); no reference")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                 or size < 1):
            raise ValueError(f"size={size!r}: expected the trusted set's number of examples "
                             "(≥ 1), or None; no reference")
        self.train_fn, self.size = train_fn, size

    @classmethod
    def from_data(cls, data: Any, *, model: Any = None, family: Any = None,
                  device: str = "cpu", **options: Any) -> TrustedReference:
        """The reference trained by fedshard's own node loop
        (:func:`fedshard.client.handle_node_train`) on ``data``: ``model`` for spectral
        sharding and FedAvg, ``family`` for width slicing (either, or a factory of it);
        ``options`` (``fast``, ...) as the nodes' loop takes them.

        Raises
        ------
        ValueError
            If ``data`` holds no examples, or neither ``model`` nor ``family`` is given.
        """
        size = len(data) if hasattr(data, "__len__") else None
        if size == 0:
            raise ValueError("trusted data set is empty: expected a few hundred clean "
                             "examples (FLTrust uses 100-500); no reference is built")
        if model is None and family is None:
            raise ValueError("TrustedReference.from_data: expected model= (spectral sharding, "
                             "FedAvg) or family= (width slicing); no reference is built")
        from fedshard.client.node import handle_node_train  # the nodes' own loop

        def train(msg: Message) -> Message:
            return handle_node_train(msg, data, model=model, family=family, device=device,
                                     **options)

        return cls(train, size)

    def epochs_for(self, examples: float) -> int:
        """How many times the node's ``local-epochs`` the reference trains, so that it takes
        about the steps of a node holding ``examples`` (the round's median ``num-examples``):
        ``max(1, round(examples / size))``; 1 where the trusted set's size is unknown. Its
        update then has a node's length, the length FLTrust rescales every update to."""
        if not self.size or not math.isfinite(examples):
            return 1
        return max(1, min(1000, round(examples / self.size)))

    def update(self, msg: Message, sent: P.SentShard, epochs: int = 1
               ) -> dict[str, np.ndarray]:
        """The reference's update on ``msg`` (its ``local-epochs`` times ``epochs``), in the
        node's coordinates (:func:`update_of`).

        Raises
        ------
        ValueError
            If the reply is no ``Message``, an error reply, has no ``arrays`` record, or lacks
            a key the node was sent or has another shape for it.
        """
        reply = self.train_fn(_longer(msg, epochs) if epochs > 1 else msg)
        if not isinstance(reply, Message):
            raise ValueError(f"the trusted train_fn returned a {type(reply).__name__}; "
                             "expected the reply Message a node would send")
        if reply.has_error():
            raise ValueError(f"the trusted train_fn returned an error reply "
                             f"({reply.error.reason}); expected trained arrays")
        record = reply.content.array_records.get(P.ARRAYS)
        if record is None:
            raise ValueError(f"the trusted train_fn's reply has no {P.ARRAYS!r} ArrayRecord; "
                             "expected the arrays a node returns")
        values, wrong = {}, []
        for k, s in sent.values.items():
            if k not in record:
                wrong.append(f"{k} missing")
                continue
            values[k] = P.decode_array(record[k])
            if values[k].shape != np.shape(s):
                wrong.append(f"{k} {values[k].shape}, expected {np.shape(s)}")
        if wrong:
            raise ValueError("the trusted train_fn's reply does not match what the node was "
                             f"sent: {'; '.join(wrong[:5])}; expected the same keys and shapes")
        return update_of(values, sent.values)


def _longer(msg: Message, epochs: int) -> Message:
    """A copy of ``msg`` whose ``local-epochs`` is ``epochs`` times the node's (the arrays
    shared, read-only)."""
    config = ConfigRecord(dict(msg.content.config_records[P.CONFIG]))
    sent = config.get(_EPOCHS, 1)
    config[_EPOCHS] = (sent if isinstance(sent, int) else 1) * epochs
    out = Message(RecordDict({P.ARRAYS: msg.content[P.ARRAYS], P.CONFIG: config}),
                  dst_node_id=msg.metadata.dst_node_id,
                  message_type=msg.metadata.message_type, group_id=msg.metadata.group_id)
    return out
