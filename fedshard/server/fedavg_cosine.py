"""The paper's post-gradient analysis: how well the strategy's update agrees with FedAvg's.

With ``fedavg-cosine`` on, every sampled node also trains a dense copy of the global model θ_t
(same settings and data order; :data:`fedshard.protocol.REFERENCE`). From the same θ_t and the
same sampled nodes, FedAvg with full models would have moved to ``θ_FedAvg = Σ_k D_k θ_k / Σ_k
D_k``; the strategy moved to ``θ_{t+1}``. The round's metric is

    fedavg-cosine = cos(θ_{t+1} − θ_t, θ_FedAvg − θ_t)

over every floating array of the model (``fedavg-cosine-sharded``: the sharded layers' weights
only). The model follows the strategy's path (paper Sec. 4.4, "Post-client updates").

Numpy only; the reply check follows :mod:`fedshard.protocol`'s rules (a bad reference is left
out of the metric with a logged reason, never of the aggregation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import Message

from fedshard.protocol import REFERENCE, decode_array

__all__ = ["check_reference", "fedavg_cosines", "update_cosine"]


def check_reference(msg: Message, current: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | str:
    """The trained dense copy of a ``train`` reply, or why it cannot be used.

    ``current`` is the global state the node was sent: the reply must hold exactly its keys,
    with the same shapes and dtypes, and finite values.
    """
    record = msg.content.array_records.get(REFERENCE)
    if record is None:
        return f"no {REFERENCE!r} record in the reply (the node does not train a dense copy)"
    if set(record.keys()) != set(current):
        missing, extra = set(current) - set(record.keys()), set(record.keys()) - set(current)
        return f"{REFERENCE}: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}"
    out = {}
    for key, before in current.items():
        try:
            x = decode_array(record[key])
        except Exception as err:  # a corrupt payload must not crash the server
            return f"{REFERENCE}: {key} cannot be decoded ({err})"
        if x.shape != before.shape or x.dtype != before.dtype:
            return (f"{REFERENCE}: {key} is {x.dtype}{list(x.shape)}, expected "
                    f"{before.dtype}{list(before.shape)}")
        if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
            return f"{REFERENCE}: {key} holds NaN or inf"
        out[key] = x
    return out


def update_cosine(old: Mapping[str, np.ndarray], a: Mapping[str, np.ndarray],
                  b: Mapping[str, np.ndarray], keys: Sequence[str]) -> float:
    """``cos(a − old, b − old)`` over the arrays ``keys`` flattened into one vector (float64);
    NaN when either update is zero or a norm overflows (a node's finite but huge copy)."""
    dot = na = nb = 0.0
    for key in keys:
        base = old[key].astype(np.float64)
        da, db = a[key].astype(np.float64) - base, b[key].astype(np.float64) - base
        dot += float(np.vdot(da, db))
        na += float(np.vdot(da, da))
        nb += float(np.vdot(db, db))
    with np.errstate(over="ignore", invalid="ignore"):
        value = dot / (np.sqrt(na) * np.sqrt(nb)) if na > 0 and nb > 0 else float("nan")
    return float(value) if np.isfinite(value) else float("nan")


def fedavg_cosines(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray],
                   references: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float],
                   sharded_layers: Sequence[str]) -> dict[str, float]:
    """``fedavg-cosine`` and ``fedavg-cosine-sharded`` of one round (see the module).

    Parameters
    ----------
    old, new : mapping
        The global state before and after the round (the strategy's update).
    references, weights :
        The nodes' trained dense copies and their ``num-examples`` D_k.
    sharded_layers :
        Module names of the sharded layers.
    """
    floating = [k for k, v in old.items() if np.issubdtype(v.dtype, np.floating)]
    total = float(sum(weights))
    fedavg: dict[str, np.ndarray] = {}
    for key in floating:
        acc = np.zeros(old[key].shape, dtype=np.float64)
        for w, ref in zip(weights, references, strict=True):
            acc += w * ref[key].astype(np.float64)
        fedavg[key] = acc / total
    sharded = [f"{layer}.weight" for layer in sharded_layers if f"{layer}.weight" in old]
    out = {"fedavg-cosine": update_cosine(old, new, fedavg, floating)}
    if sharded:
        out["fedavg-cosine-sharded"] = update_cosine(old, new, fedavg, sharded)
    # NaN (no update, or an overflow from a huge copy) is left out: history and checkpoint
    # hold finite metrics only.
    return {k: v for k, v in out.items() if np.isfinite(v)}
