"""One training round on the server: shard the model for the sampled nodes, then check the
replies against what each node was sent and aggregate the valid ones.

The strategy's two training hooks delegate here; this module holds the round's state (the
arrays it started from, the decompositions, what each node was sent) between them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from logging import ERROR, INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.common.logger import log

from fedshard import protocol as P
from fedshard.protocol.bounds import printable
from fedshard.sampling import ANNEALED_METHODS, Stream, anneal_exponent, plan_round, stream_rng
from fedshard.server.central_dp import RoundPrivacy
from fedshard.server.fedavg_cosine import check_reference, fedavg_cosines
from fedshard.server.metrics import (
    NON_FINITE,
    DropLog,
    client_namespace,
    non_finite,
    one_line,
    reply_metrics,
    send_metrics,
    weighted_means,
)
from fedshard.server.robust import (
    FAR_WEIGHT,
    align_replies,
    bounded_weights,
    dense_rule,
    spread_replies,
)
from fedshard.server.trust_record import TrustStage
from fedshard.settings import LocalTraining, ReplyPolicy, Sharding
from fedshard.spectral.aggregate import DENSE_AGGREGATIONS, aggregate_state
from fedshard.spectral.decompose import LayerSpectrum, layer_spectrum

__all__ = [
    "NO_ROUND_TRAINED", "MetricsAggrFn", "RoundState", "evaluate_messages", "evaluate_round",
    "shard_round",
]

#: The ERROR a run logs when no round changed the model.
NO_ROUND_TRAINED = (
    "No round trained: no round of this run got a usable training reply, the model is the "
    "initial one. Check the dropped-<reason> metrics and the warnings above (nodes without a "
    "keep ratio, error replies, timeouts).")

#: Flower's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` signature.
MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]


@dataclass
class RoundState:
    """What a training round sent; its replies are checked and aggregated against it."""

    server_round: int
    arrays: ArrayRecord
    spectra: dict[str, LayerSpectrum]
    sent: dict[int, P.SentShard]
    metrics: dict[str, float] = field(default_factory=dict)
    current: dict[str, np.ndarray] = field(default_factory=dict)  # ``arrays`` decoded
    messages: list[Message] = field(default_factory=list)  # ids are set when pushed
    replies: ReplyPolicy = field(default_factory=ReplyPolicy)
    device: str | None = None  # where the SVD and the rebuild run (None: numpy on the host)
    reference: bool = False  # fedavg-cosine: nodes were sent the dense model to train too
    references: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # node -> state
    dropped: list[tuple[int, str]] = field(default_factory=list)  # (node, full reason), in order
    accepted: list[P.TrainReply] = field(default_factory=list)  # the replies used (finish)
    trust: TrustStage | None = None  # the record and trusted reference (after the bounds)
    privacy: RoundPrivacy | None = None  # central DP's mechanism, when it is on

    def collect(self, replies: Iterable[Message]) -> tuple[list[P.TrainReply], Counter[str], int]:
        """The valid replies, the dropped ones counted by reason (each logged), and the
        number of nodes sent a message that did not answer.

        A reply belongs to the node its message was sent to (``reply_to_message_id``; an
        error reply from the SuperLink for a dead node names no useful sender), else to its
        sender. A reply that answers no message of this round (another ``reply_to`` id, group
        or ``server-round`` echo) is ``stale-reply``. A node's second reply (an error reply
        too) is a ``duplicate``: each node's answer counts once. The dropped replies are
        logged as one WARNING per reason (:class:`~fedshard.server.metrics.DropLog`)."""
        to_node = {m.metadata.message_id: m.metadata.dst_node_id for m in self.messages
                   if m.metadata.message_id}
        accepted: list[P.TrainReply] = []
        dropped, seen, stale = Counter[str](), set[int](), set[int]()
        sent_norms: dict[int, float] = {}  # what every node was sent, its norm taken once
        drops = DropLog(self.server_round, consequence=(
            "it does not touch the global model", "they do not touch the global model"))
        for msg in replies:
            node = to_node.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
            reply: P.TrainReply | P.Drop | None = self._stale(msg, to_node)
            if reply is not None:
                stale.add(node)
            elif node in seen:
                reply = P.Drop(P.DropReason.DUPLICATE,
                               "a second reply from this node in the same round")
            else:
                reply = P.check_train_reply(msg, self.sent.get(node), seen, self.replies, node,
                                            self.server_round, sent_norms)
                seen.add(node)
            if isinstance(reply, P.Drop):
                dropped[reply.reason.value] += 1
                self.dropped.append((node, printable(str(reply))))
                drops.add(node, reply)
                continue
            if reply.clipped:
                log(WARNING, "Round %d: node %d changed %d factor column(s)/array(s) by more "
                    "than max_update_ratio=%g times what it was sent (largest ratio %.3g); "
                    "the change is clipped to the bound.", self.server_round, node,
                    reply.clipped, self.replies.max_update_ratio, reply.update_ratio)
            if self.reference:
                self._keep_reference(msg, node)
            if reply.ignored_count:
                log(WARNING, "Round %d: node %d sent metrics that are not averaged (%s); its "
                    "arrays are still used.", self.server_round, node,
                    one_line("; ".join(reply.ignored_metrics[:5]), 600))
            accepted.append(reply)
        drops.flush()
        return accepted, dropped, len(set(self.sent) - seen - stale)

    def _stale(self, msg: Message, to_node: dict[str, int]) -> P.Drop | None:
        """Why ``msg`` answers no message of this round (``None``: it may; its content's
        ``server-round`` echo is checked with the rest of the reply)."""
        if msg.has_error():
            return None
        answered = msg.metadata.reply_to_message_id
        if to_node and answered not in to_node:
            return P.Drop(P.DropReason.STALE_REPLY, f"it answers message {answered[:12]!r}, "
                          f"which is not one of round {self.server_round}'s training messages")
        if msg.metadata.group_id != str(self.server_round):
            return P.Drop(P.DropReason.STALE_REPLY, f"its group {msg.metadata.group_id!r} is "
                          f"not round {self.server_round}'s")
        return None

    def bound_weights(self, accepted: list[P.TrainReply]) -> list[P.TrainReply]:
        """``accepted`` weighted by :func:`~fedshard.server.robust.bounded_weights` under
        ``max_weight_ratio`` (a claim above the round's median weighs at most that multiple
        of it, the nodes above it share one budget of ``max_weight_ratio − 1`` medians), each
        lowered weight logged;
        ``clipped-num-examples`` counts them, ``implausible-num-examples`` the claims beyond
        :data:`~fedshard.server.robust.FAR_WEIGHT` times the median, each named."""
        ratio = self.replies.max_weight_ratio
        if not ratio or not accepted:
            return accepted
        claims = [r.weight for r in accepted]
        bounded = bounded_weights(claims, ratio)
        lowered = [(r.node, r.weight, w) for r, w in zip(accepted, bounded, strict=True)
                   if w < r.weight]
        for name, k in weight_metrics(claims, lowered).items():
            self.metrics[name] = self.metrics.get(name, 0.0) + k
        log_weight_caps(self.server_round, lowered, ratio, statistics.median_low(claims))
        return [replace(r, weight=w) for r, w in zip(accepted, bounded, strict=True)]

    def finish(self, replies: Iterable[Message], aggr_fn: MetricsAggrFn, weight_key: str,
               ) -> tuple[ArrayRecord | None, MetricRecord | None, dict[str, float]]:
        """Check, aggregate and report the replies: the new global arrays (``None``: keep the
        old model, logged), the client-side metrics (``aggr_fn`` over the valid replies) and
        the round's full metrics (the server's statistics and, under ``client/``, the
        client-side ones; logged)."""
        t0 = time.perf_counter()
        accepted, dropped, missing = self.collect(replies)
        claimed = {r.node: r.weight for r in accepted}  # num-examples before the weight cap
        accepted = self.bound_weights(accepted)
        accepted = spread_replies(self.server_round, align_replies(
            self.server_round, accepted, self.sent, self.replies, self.metrics), self.sent,
            self.spectra, self.replies, self.metrics, claimed)
        if self.trust is not None:
            accepted = self.trust.weigh(self.server_round, accepted, self.sent, self.messages,
                                        self.metrics)
        self.accepted = accepted
        new_arrays = self.aggregate(accepted) if accepted else None
        metrics = reply_metrics(self.metrics, accepted, dropped, missing,
                                {n: s.keep_ratio for n, s in self.sent.items()})
        if self.reference and new_arrays is not None:
            metrics.update(self.cosines(accepted, new_arrays))
        if new_arrays is None:
            log(WARNING, "Round %d: no usable aggregate (%d replies used, %d dropped, %d "
                "missing); the global model is kept unchanged.", self.server_round,
                len(accepted), sum(dropped.values()), missing)
        metrics["aggregate-s"] = time.perf_counter() - t0
        client = aggr_fn([_record(r.metrics, r.weight, weight_key) for r in accepted],
                         weight_key) if accepted else None
        metrics.update(client_namespace(_floats(client, weight_key)))
        metrics = _finite(self.server_round, metrics)
        log(INFO, "Round %d server metrics: %s", self.server_round,
            ", ".join(f"{printable(k, 80)}={v:.4g}" for k, v in metrics.items()))
        return new_arrays, client, metrics

    def _keep_reference(self, msg: Message, node: int) -> None:
        current = self.current or {k: P.decode_array(a) for k, a in self.arrays.items()}
        ref = check_reference(msg, current)
        if isinstance(ref, str):
            log(WARNING, "Round %d: node %d's dense reference is not used for fedavg-cosine "
                "(%s); its shard is aggregated as usual.", self.server_round, node,
                one_line(ref))
        else:
            self.references[node] = ref

    def cosines(self, accepted: Sequence[P.TrainReply],
                new_arrays: ArrayRecord) -> dict[str, float]:
        """``fedavg-cosine`` (:mod:`fedshard.server.fedavg_cosine`) over the accepted replies
        that came with a usable dense reference, and ``fedavg-references``: how many did."""
        used = [r for r in accepted if r.node in self.references]
        out = {"fedavg-references": float(len(used))}
        if used:
            current = self.current or {k: P.decode_array(a) for k, a in self.arrays.items()}
            new = {k: P.decode_array(a) for k, a in new_arrays.items()}
            out.update(fedavg_cosines(current, new, [self.references[r.node] for r in used],
                                      [r.weight for r in used], list(self.spectra)))
        self.references.clear()
        return out

    def combine(self, accepted: Sequence[P.TrainReply]) -> dict[str, np.ndarray]:
        """The new global ``state_dict`` from the valid replies: the per-term averages
        (:func:`aggregate_state`) or ``replies``' dense rule."""
        current = self.current or {k: P.decode_array(a) for k, a in self.arrays.items()}
        if self.privacy is not None:  # clipped, unweighted, noised (fedshard.server.central_dp)
            return self.privacy.combine_terms(current, self.spectra, accepted, self.sent,
                                              self.device)
        if self.replies.aggregation in DENSE_AGGREGATIONS:
            return dense_rule(current, self.spectra, accepted, self.replies)
        return aggregate_state(current, self.spectra, [r.weight for r in accepted],
                               [r.values for r in accepted], [r.terms() for r in accepted],
                               self.replies.aggregation, self.replies.trim_fraction,
                               self.device)

    def aggregate(self, accepted: Sequence[P.TrainReply]) -> ArrayRecord | None:
        """The new global model from the valid replies (:meth:`combine`), or ``None`` if it
        holds NaN or inf (then the previous model is kept, and ``aggregate-non-finite`` is
        set in the round's metrics)."""
        new = self.combine(accepted)
        bad = [k for k, v in new.items()
               if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all()]
        if bad:
            self.metrics["aggregate-non-finite"] = 1.0
            log(ERROR, "Round %d: the aggregate of %d replies holds NaN or inf in %s; it is "
                "not applied, the previous global model is kept.", self.server_round,
                len(accepted), ", ".join(bad[:5]))
            return None
        return P.array_record({k: P.encode_array(v) for k, v in new.items()})


def shard_round(
    server_round: int,
    arrays: ArrayRecord,
    sharded_layers: Sequence[str],
    nodes: dict[int, P.Capabilities],
    config: ConfigRecord,
    *,
    sharding: Sharding,
    training: LocalTraining,
    lr: float,
    replies: ReplyPolicy,
    seed: int,
    device: str | None = None,
) -> tuple[list[Message], RoundState]:
    """One ``train`` message per node (``nodes`` in canonical order) and the round's state.

    Takes the SVD of every sharded layer, plans the terms with ``sharding``
    (:func:`plan_round`; the annealed methods at this round's γ), encodes each node's shard and
    its :class:`~fedshard.protocol.TrainSettings` (the ``training`` recipe at the round's
    scheduled rate ``lr``, a per-node training seed from ``seed``) on top of the caller's
    ``config``;
    with ``sharding.fedavg_cosine`` every node also gets the dense model to train. ``replies``
    bounds the replies and sets the averaging rule; ``device`` is where the SVD and the rebuild
    run (``None``: numpy on the host).
    """
    t0 = time.perf_counter()
    spectra = {layer: layer_spectrum(_weight(arrays, layer), device)
               for layer in sharded_layers}
    t1 = time.perf_counter()
    gamma = (anneal_exponent(server_round, float(sharding.anneal_exponent),
                             int(sharding.anneal_rounds))
             if sharding.method in ANNEALED_METHODS else None)
    plan = plan_round({k: s.lam for k, s in spectra.items()},
                      [(n, c.keep_ratio) for n, c in nodes.items()], sharding.method,
                      sharding.design, seed=seed, server_round=server_round,
                      scaled=sharding.scaled, prism_exponent=sharding.prism_exponent,
                      gamma=1.0 if gamma is None else gamma)
    t2 = time.perf_counter()
    reference = sharding.fedavg_cosine
    messages, sent = [], {}
    current = {k: P.decode_array(a) for k, a in arrays.items()}  # decoded once, shared by all nodes
    for node, terms in plan.terms.items():
        caps = nodes[node]
        record, sent[node] = P.encode_shard(arrays, spectra, terms, caps.keep_ratio, current)
        seed_rng = stream_rng(seed, server_round, Stream.TRAIN, caps.stream)
        settings = P.TrainSettings.of(training, lr=lr, server_round=server_round,
                                      keep_ratio=caps.keep_ratio, method=sharding.method,
                                      train_seed=int(seed_rng.integers(2**31 - 1)))
        content = RecordDict({P.ARRAYS: record, P.CONFIG: settings.to_record(config)})
        if reference:  # read-only on the wire: one shared record
            content[P.REFERENCE] = arrays
        messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                                group_id=str(server_round)))
    metrics = send_metrics(arrays, sent, lr, (t0, t1, t2, time.perf_counter()))
    if gamma is not None:
        metrics["anneal-exponent"] = gamma
    state = RoundState(server_round, arrays, spectra, sent, {**metrics, **plan.anme}, current,
                       messages, replies, device, reference)
    log(INFO, "configure_train: round %d, %d nodes (keep ratios %s), lr=%.4g, svd %.2fs, "
        "sampling %.2fs, packing %.2fs", server_round, len(messages),
        dict(Counter(c.keep_ratio for c in nodes.values())), lr, metrics["svd-s"],
        metrics["sampling-s"], metrics["pack-s"])
    return messages, state


def _weight(arrays: ArrayRecord, layer: str) -> np.ndarray:
    key = f"{layer}.weight"
    if key not in arrays:
        raise KeyError(f"Sharded layer {layer!r} has no {key!r} in the global arrays; expected "
                       "the state_dict of the model whose layer names were given as "
                       "sharded_layers.")
    return P.decode_array(arrays[key])


def evaluate_messages(server_round: int, nodes: Sequence[int], arrays: ArrayRecord,
                      config: ConfigRecord) -> list[Message]:
    """One ``evaluate`` message per node: the dense global ``arrays`` and a copy of
    ``config`` with ``server-round`` (the caller's record is not modified)."""
    messages = []
    for node in nodes:
        cfg = ConfigRecord(dict(config))
        cfg["server-round"] = server_round
        messages.append(Message(RecordDict({P.ARRAYS: arrays, P.CONFIG: cfg}),
                                dst_node_id=node, message_type=MessageType.EVALUATE))
    return messages


def evaluate_round(server_round: int, replies: Iterable[Message], aggr_fn: MetricsAggrFn,
                   weight_key: str, limits: ReplyPolicy | None = None,
                   ) -> tuple[MetricRecord | None, dict[str, float]]:
    """``aggr_fn`` over the valid evaluation replies and the round's evaluation metrics for
    the history: ``eval-nodes``, the server's weighted ``eval-loss``/``eval-accuracy``, and
    ``aggr_fn``'s result under ``client/``.

    Each reply is checked as training replies are (:func:`fedshard.protocol.check_eval_reply`
    under ``limits``, default: :class:`~fedshard.settings.ReplyPolicy`'s defaults): an invalid
    one, and a node's reply after its first that is not an error reply, is dropped (one
    WARNING per reason, counted in ``eval-dropped-<reason>``); values left out of a valid one
    (an accuracy outside [0, 1], a negative loss, ...) are logged and counted in
    ``ignored-eval-metrics``; a ``num-examples`` above ``max_weight_ratio`` times the round's
    (lower) median is weighted as that, logged and counted in ``clipped-eval-num-examples``."""
    limits = limits if limits is not None else ReplyPolicy()
    checked: list[tuple[int, float, dict[str, float]]] = []
    dropped, seen = Counter[str](), set[int]()
    drops = DropLog(server_round, "evaluation reply", "evaluation replies")
    ignored = 0
    for msg in replies:
        node = msg.metadata.src_node_id
        reply = (P.Drop(P.DropReason.DUPLICATE,
                        "a second evaluation reply from this node in the same round")
                 if node in seen else P.check_eval_reply(msg, limits))
        if not msg.has_error():  # the SuperLink's error replies for dead nodes share a sender
            seen.add(node)
        if isinstance(reply, P.Drop):
            dropped[reply.reason.value] += 1
            drops.add(node, reply)
            continue
        weight, values, reasons, count = reply
        if count:
            log(WARNING, "Round %d: node %d sent evaluation metrics that are not averaged "
                "(%s).", server_round, node, one_line("; ".join(reasons[:5]), 600))
            ignored += count
        checked.append((node, weight, values))
    drops.flush()
    row = {"ignored-eval-metrics": float(ignored)} if ignored else {}
    row.update({f"eval-dropped-{c}": float(k) for c, k in dropped.items()})
    if not checked:
        return None, row
    ratio = limits.max_weight_ratio
    if ratio:
        claims = [w for _, w, _ in checked]
        bounded = bounded_weights(claims, ratio)
        lowered = [(node, w, b) for (node, w, _), b in zip(checked, bounded, strict=True)
                   if b < w]
        if lowered:
            row["clipped-eval-num-examples"] = float(len(lowered))
            log_weight_caps(server_round, lowered, ratio, statistics.median_low(claims))
        checked = [(node, b, values) for (node, _, values), b in
                   zip(checked, bounded, strict=True)]
    records = [_record(values, weight, weight_key) for _, weight, values in checked]
    out = aggr_fn(records, weight_key)
    return out, _finite(server_round, {
        **row, **client_namespace(_floats(out, weight_key)),
        **weighted_means([(w, v) for _, w, v in checked], (P.EVAL_LOSS, P.EVAL_ACCURACY)),
        "eval-nodes": float(len(records))})


def weight_metrics(claims: Sequence[float], lowered: Sequence[tuple[int, float, float]],
                   ) -> dict[str, float]:
    """The round's counts of :meth:`RoundState.bound_weights`: ``clipped-num-examples`` (the
    ``lowered`` weights) and ``implausible-num-examples`` (claims beyond
    :data:`~fedshard.server.robust.FAR_WEIGHT` × the round's median)."""
    median = statistics.median_low(claims)
    far = sum(1.0 for w in claims if w > FAR_WEIGHT * median)
    return {**({"clipped-num-examples": float(len(lowered))} if lowered else {}),
            **({"implausible-num-examples": far} if far else {})}


def log_weight_caps(server_round: int, lowered: Sequence[tuple[int, float, float]],
                    ratio: float, median: float) -> None:
    """Log the nodes whose weight :func:`~fedshard.server.robust.bounded_weights` lowered
    (``(node, claim, weight)``): each claim beyond
    :data:`~fedshard.server.robust.FAR_WEIGHT` × the median in a WARNING naming it, the
    others (honest nodes holding more data than most get there) in one INFO line."""
    for node, claim, weight in lowered:
        if claim > FAR_WEIGHT * median:
            log(WARNING, "Round %d: node %d reports num-examples=%.0f, more than %g times "
                "the round's median %g, which is implausible; it is weighted as %.4g "
                "(max-weight-ratio=%g: no claim weighs more than %g times the median, and the "
                "nodes above the median share %g median(s) of extra weight).",
                server_round, node, claim, FAR_WEIGHT, median, weight, ratio, ratio, ratio - 1)
    near = sorted((node, claim, weight) for node, claim, weight in lowered
                  if claim <= FAR_WEIGHT * median)
    if near:
        log(INFO, "Round %d: %d node(s) report num-examples above the round's median %g (up "
            "to %.3g times it; nodes %s), weighted as %s: max-weight-ratio=%g lets one node "
            "weigh up to %g times the median, and the nodes above it share %g median(s) of "
            "extra weight. Honest nodes holding more data than most get there; "
            "max-weight-ratio = 0 keeps FedAvg's weights.", server_round, len(near), median,
            max(c for _, c, _ in near) / median, ", ".join(str(n) for n, _, _ in near[:20]),
            ", ".join(f"{w:.4g}" for _, _, w in near[:20]), ratio, ratio, ratio - 1)


def _finite(server_round: int, metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` without its NaN and ±inf values (a weighted mean of huge values, a custom
    aggregation's result), logged in one WARNING and counted in ``non-finite-metrics``: they
    would not be strict JSON in ``metrics.jsonl``."""
    bad = non_finite(metrics)
    if not bad:
        return metrics
    log(WARNING, "Round %d: %s %s not finite; left out of the round's metrics (counted in %s).",
        server_round, ", ".join(bad[:10]), "is" if len(bad) == 1 else "are", NON_FINITE)
    out = {k: v for k, v in metrics.items() if not (isinstance(v, float) and not math.isfinite(v))}
    out[NON_FINITE] = out.get(NON_FINITE, 0.0) + len(bad)
    return out


def _record(metrics: dict[str, float], weight: float, weight_key: str) -> RecordDict:
    """A checked reply's metrics (finite scalars) and weight, as ``aggr_fn`` expects them."""
    return RecordDict({P.METRICS: MetricRecord({**metrics, weight_key: weight})})


def _floats(record: MetricRecord | None, weight_key: str) -> dict[str, float]:
    """The scalar entries of ``record`` as floats, ``weight_key`` left out."""
    if record is None:
        return {}
    return {k: float(v) for k, v in record.items()
            if k != weight_key and isinstance(v, (int, float)) and not isinstance(v, bool)}
