"""Robust aggregation of a round's checked replies: sign- and scale-aware rules for factor
terms, and Flower's own robust rules over the dense-equivalent models.

A returned term ``(u'_i, v'_i)`` stands for the product ``u'_i v'_iᵀ``, which every pair
``(c·u'_i, v'_i/c)`` shares; the server averages ``u`` and ``v`` separately, so a node that
returns its terms sign-flipped (``c = −1``, update ratio 2) or re-balanced (``c = 10``) keeps its
own ``UVᵀ`` and still shrinks or inflates the averaged terms. The rules here run after the
reply checks (:mod:`fedshard.protocol`) and before the per-term averages
(:mod:`fedshard.spectral.aggregate`), each as the operator's
:class:`~fedshard.settings.ReplyPolicy` says; every change is logged with the node and
counted in the round's metrics:

* :func:`align_replies` (``align_factors``, on by default): each term in the sign and balance of
  the term sent (``re-signed-terms``, ``rebalanced-terms``); a no-op for honest nodes;
* :func:`spread_replies` (``max_update_spread`` = κ, 5 by default): a node's change of a layer
  or dense entry beyond κ times the round's median is shrunk to it (``clipped-update-spread``,
  ``update-spread-max``);
* :func:`dense_rule` (``aggregation`` = ``dense-median`` / ``dense-trimmed-mean`` / ``krum``):
  Flower's ``FedMedian`` / ``FedTrimmedAvg`` / ``Krum`` over each reply's whole model.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from logging import WARNING

import numpy as np
from flwr.common.logger import log
from flwr.server.strategy.aggregate import aggregate_krum, aggregate_median, aggregate_trimmed_avg

from fedshard import protocol as P
from fedshard.server.metrics import one_line
from fedshard.settings import ReplyPolicy
from fedshard.spectral.aggregate import (
    align_factors,
    dense_equivalents,
    relative_change,
    shrink_change,
    spread_scales,
    squared_norm,
)
from fedshard.spectral.decompose import LayerSpectrum

__all__ = ["align_replies", "dense_rule", "spread_replies"]


def _count(metrics: dict[str, float], name: str, k: float) -> None:
    metrics[name] = metrics.get(name, 0.0) + k


def align_replies(server_round: int, accepted: Sequence[P.TrainReply],
                  sent: Mapping[int, P.SentShard], policy: ReplyPolicy,
                  metrics: dict[str, float]) -> list[P.TrainReply]:
    """``accepted`` with every returned term re-signed (and re-balanced) to the gauge of the
    term sent (:func:`~fedshard.spectral.aggregate.align_factors`); unchanged when
    ``policy.align_factors`` is off. Each node whose terms changed is logged once;
    ``re-signed-terms`` / ``rebalanced-terms`` in ``metrics`` count the terms. Honest replies
    come back as the same objects."""
    if not policy.align_factors:
        return list(accepted)
    out = []
    for r in accepted:
        before, values, notes = sent[r.node].values, dict(r.values), []
        for layer in r.layers:
            ku, kv = P.factor_key(layer, "u"), P.factor_key(layer, "v")
            a = align_factors(before[ku], before[kv], values[ku], values[kv])
            if a.flipped or a.rebalanced:
                values[ku], values[kv] = a.u, a.v
                notes.append(f"{layer}: {a.flipped} re-signed, {a.rebalanced} re-balanced of "
                             f"{a.u.shape[1]}")
                _count(metrics, "re-signed-terms", a.flipped)
                _count(metrics, "rebalanced-terms", a.rebalanced)
        if notes:
            log(WARNING, "Round %d: node %d returned terms in another sign or balance than it "
                "was sent (%s); they are averaged in the sent terms' sign and balance, which "
                "keeps each of its products u v^T.", server_round, r.node,
                one_line("; ".join(notes[:5]), 600))
            r = replace(r, values=values)
        out.append(r)
    return out


def _groups(reply: P.TrainReply, spectra: Mapping[str, LayerSpectrum]
            ) -> dict[str, tuple[str, ...]]:
    """What the spread rule compares: each sharded layer's ``u`` and ``v`` together, and
    each dense floating entry alone."""
    groups: dict[str, tuple[str, ...]] = {
        layer: (P.factor_key(layer, "u"), P.factor_key(layer, "v")) for layer in spectra}
    factors = {k for keys in groups.values() for k in keys}
    for key, x in reply.values.items():
        if (key not in factors and not key.endswith(".indices")
                and np.issubdtype(x.dtype, np.floating)):
            groups[key] = (key,)
    return groups


def spread_replies(server_round: int, accepted: Sequence[P.TrainReply],
                   sent: Mapping[int, P.SentShard], spectra: Mapping[str, LayerSpectrum],
                   policy: ReplyPolicy, metrics: dict[str, float]) -> list[P.TrainReply]:
    """``accepted`` with each node's change of a sharded layer (``u`` and ``v`` together)
    or of a dense floating entry, relative to what it was sent, shrunk to
    ``policy.max_update_spread`` (κ) times the round's median change of it
    (:func:`~fedshard.spectral.aggregate.spread_scales`; off below 3 replies or with κ = 0).

    Each node is logged once with what was shrunk and by how much, and its weight against the
    round's median weight; one weighted at least twice the median is told apart (honest
    training on much more data than most moves further, and may pass κ). In ``metrics``,
    ``clipped-update-spread`` counts the (node, layer or entry) pairs and
    ``update-spread-max`` is the largest change over its median, before shrinking.

    Notes
    -----
    One step of centred clipping (Karimireddy, He & Jaggi, ICML 2021, Alg. 2) with the sent
    model as the centre and a radius taken from the round's own median, so that no tuning is
    needed: a minority of nodes cannot move the median, and a node's pull on each average is
    at most κ times a typical node's.
    """
    kappa = policy.max_update_spread
    if not kappa or len(accepted) < 3:
        return list(accepted)
    values = [dict(r.values) for r in accepted]
    notes: dict[int, list[str]] = {}
    for name, keys in _groups(accepted[0], spectra).items():
        before = [[sent[r.node].values[k] for k in keys] for r in accepted]
        # a dense entry was sent to every node as the same array: its norm is taken once
        norms: dict[tuple[int, ...], float] = {}
        for arrays in before:
            norms.setdefault(tuple(map(id, arrays)), squared_norm(arrays))
        changes = [relative_change(arrays, [v[k] for k in keys], dense=name not in spectra,
                                   sent_sq=norms[tuple(map(id, arrays))])
                   for arrays, v in zip(before, values, strict=True)]
        median = float(np.median(changes))
        if median > 0:
            metrics["update-spread-max"] = max(metrics.get("update-spread-max", 0.0),
                                               max(changes) / median)
        for i, scale in enumerate(spread_scales(changes, kappa)):
            if scale < 1.0:
                for k, b in zip(keys, before[i], strict=True):
                    values[i][k] = shrink_change(b, values[i][k], float(scale))
                notes.setdefault(accepted[i].node, []).append(
                    f"{name} {changes[i] / median:.3g}x")
                _count(metrics, "clipped-update-spread", 1.0)
    weights = {r.node: r.weight for r in accepted}
    typical = statistics.median_low(weights.values())  # as max-weight-ratio's median
    for node, what in notes.items():
        # with the same local epochs, a node holding more data takes more steps and moves
        # further: an honest data-rich node can pass the bound, and the operator must see it
        hint = (" A node holding much more data than most moves further with honest training: "
                "if this node is honest, raise max-update-spread (0 turns the bound off)."
                if weights[node] >= 2 * typical else "")
        log(WARNING, "Round %d: node %d changed more than max-update-spread=%g times the "
            "round's median change (%s); its change is shrunk to that bound. It is weighted "
            "as %g examples, the round's median %g.%s", server_round, node, kappa,
            one_line(", ".join(what[:8]), 600), weights[node], typical, hint)
    return [replace(r, values=v) if r.node in notes else r
            for r, v in zip(accepted, values, strict=True)]


def dense_rule(current: Mapping[str, np.ndarray], spectra: Mapping[str, LayerSpectrum],
               accepted: Sequence[P.TrainReply], policy: ReplyPolicy) -> dict[str, np.ndarray]:
    """The new state by Flower's own robust rule over the replies' dense-equivalent models
    (:func:`~fedshard.spectral.aggregate.dense_equivalents`): ``dense-median``
    (``FedMedian``), ``dense-trimmed-mean`` (``FedTrimmedAvg``, cutting
    ``policy.trim_fraction`` at each end) or ``krum`` (``Krum``, assuming
    ``⌊trim_fraction·m⌋`` of the m replies dishonest). Integer buffers are kept."""
    states = dense_equivalents(current, spectra, [r.values for r in accepted],
                               [r.terms() for r in accepted])
    keys = list(states[0])
    results = [([st[k] for k in keys], int(r.weight))
               for st, r in zip(states, accepted, strict=True)]
    rule, frac = policy.aggregation, policy.trim_fraction
    if rule == "dense-median":
        arrays = aggregate_median(results)
    elif rule == "dense-trimmed-mean":
        arrays = aggregate_trimmed_avg(results, frac)
    else:
        arrays = aggregate_krum(results, int(np.floor(frac * len(results))), 0)
    new = dict(current)
    new.update({k: np.asarray(a).astype(current[k].dtype)
                for k, a in zip(keys, arrays, strict=True)})
    return new
