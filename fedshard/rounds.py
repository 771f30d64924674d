"""One training round on the server: shard the model for the sampled nodes, then check the
replies against what each node was sent and aggregate the valid ones.

The strategy's two training hooks delegate here; this module holds the round's state (the
arrays it started from, the decompositions, what each node was sent) between them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from logging import DEBUG, INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.common.logger import log

from fedshard import protocol as P
from fedshard.sampling import plan_round
from fedshard.spectral.aggregate import aggregate_state
from fedshard.spectral.decompose import LayerSpectrum, layer_spectrum
from fedshard.telemetry import one_line, reply_metrics, send_metrics

__all__ = ["MetricsAggrFn", "RoundState", "evaluate_round", "shard_round"]

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

    def collect(self, replies: Iterable[Message]) -> tuple[list[P.TrainReply], Counter[str], int]:
        """The valid replies, the dropped ones counted by reason (each logged), and the
        number of nodes sent a message that did not answer."""
        accepted, dropped, seen = [], Counter[str](), set[int]()
        for msg in replies:
            node = msg.metadata.src_node_id
            reply = P.check_train_reply(msg, self.sent.get(node), seen)
            seen.add(node)
            if isinstance(reply, str):
                dropped[reply.split(":", 1)[0]] += 1
                log(WARNING, "Round %d: dropping the reply of node %d (%s); it does not touch "
                    "the global model.", self.server_round, node, one_line(reply))
                log(DEBUG, "Round %d, node %d, the full reason: %s", self.server_round, node,
                    reply)
            else:
                accepted.append(reply)
        return accepted, dropped, len(set(self.sent) - seen)

    def finish(self, replies: Iterable[Message], aggr_fn: MetricsAggrFn, weight_key: str,
               ) -> tuple[ArrayRecord | None, MetricRecord | None, dict[str, float]]:
        """Check, aggregate and report the replies: the new global arrays (``None`` if no
        reply is valid), the client-side metrics (``aggr_fn`` over the valid replies) and the
        round's full metrics (the server's statistics and the client-side ones; logged)."""
        t0 = time.perf_counter()
        accepted, dropped, missing = self.collect(replies)
        metrics = reply_metrics(self.metrics, accepted, dropped, missing)
        new_arrays = self.aggregate(accepted) if accepted else None
        if new_arrays is None:
            log(WARNING, "Round %d: no valid reply (%d dropped, %d missing); the global model is "
                "kept unchanged.", self.server_round, sum(dropped.values()), missing)
        metrics["aggregate-s"] = time.perf_counter() - t0
        client = aggr_fn([RecordDict({P.METRICS: r.metrics}) for r in accepted],
                         weight_key) if accepted else None
        metrics.update(_floats(client, weight_key))
        log(INFO, "Round %d server metrics: %s", self.server_round,
            ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        return new_arrays, client, metrics

    def aggregate(self, accepted: Sequence[P.TrainReply]) -> ArrayRecord:
        """The new global model from the valid replies (:func:`aggregate_state`)."""
        new = aggregate_state({k: a.numpy() for k, a in self.arrays.items()}, self.spectra,
                              [r.weight for r in accepted], [r.values for r in accepted],
                              [r.terms() for r in accepted])
        return ArrayRecord({k: Array(v) for k, v in new.items()})


def shard_round(
    server_round: int,
    arrays: ArrayRecord,
    sharded_layers: Sequence[str],
    nodes: dict[int, P.Capabilities],
    settings: Callable[[P.Capabilities], P.TrainSettings],
    config: ConfigRecord,
    *,
    lr: float,
    method: str,
    design: str,
    seed: int,
    scaled: bool = False,
    prism_exponent: float | None = None,
) -> tuple[list[Message], RoundState]:
    """One ``train`` message per node (``nodes`` in canonical order) and the round's state.

    Takes the SVD of every sharded layer, plans the terms (:func:`plan_round`), encodes each
    node's shard and its settings (``settings(node)`` on top of the caller's ``config``);
    ``lr`` is the round's learning rate, for the metrics.
    """
    t0 = time.perf_counter()
    spectra = {layer: layer_spectrum(_weight(arrays, layer)) for layer in sharded_layers}
    t1 = time.perf_counter()
    plan = plan_round({k: s.lam for k, s in spectra.items()},
                      [(n, c.keep_ratio) for n, c in nodes.items()], method, design, seed=seed,
                      server_round=server_round, scaled=scaled, prism_exponent=prism_exponent)
    t2 = time.perf_counter()
    messages, sent = [], {}
    for node, terms in plan.terms.items():
        record, sent[node] = P.encode_shard(arrays, spectra, terms, nodes[node].keep_ratio)
        cfg = settings(nodes[node]).to_record(config)
        messages.append(Message(RecordDict({P.ARRAYS: record, P.CONFIG: cfg}), dst_node_id=node,
                                message_type=MessageType.TRAIN, group_id=str(server_round)))
    metrics = send_metrics(arrays, sent, lr, (t0, t1, t2, time.perf_counter()))
    return messages, RoundState(server_round, arrays, spectra, sent, {**metrics, **plan.anme})


def _weight(arrays: ArrayRecord, layer: str) -> np.ndarray:
    key = f"{layer}.weight"
    if key not in arrays:
        raise KeyError(f"Sharded layer {layer!r} has no {key!r} in the global arrays; expected "
                       "the state_dict of the model whose layer names were given as "
                       "sharded_layers.")
    return arrays[key].numpy()


def evaluate_round(server_round: int, replies: Iterable[Message], aggr_fn: MetricsAggrFn,
                   weight_key: str) -> tuple[MetricRecord | None, dict[str, float]]:
    """``aggr_fn`` over the valid evaluation replies (each invalid one logged in one line and
    dropped) and the round's evaluation metrics for the history (with ``eval-nodes``)."""
    records: list[RecordDict] = []
    for msg in replies:
        row = P.check_eval_reply(msg)
        if isinstance(row, str):
            log(WARNING, "Round %d: dropping the evaluation reply of node %d (%s).",
                server_round, msg.metadata.src_node_id, one_line(row))
            log(DEBUG, "Round %d, the full reason: %s", server_round, row)
        else:
            records.append(RecordDict({P.METRICS: row[1]}))
    if not records:
        return None, {}
    out = aggr_fn(records, weight_key)
    return out, {**_floats(out, weight_key), "eval-nodes": float(len(records))}


def _floats(record: MetricRecord | None, weight_key: str) -> dict[str, float]:
    """The scalar entries of ``record`` as floats, ``weight_key`` left out."""
    if record is None:
        return {}
    return {k: float(v) for k, v in record.items()
            if k != weight_key and isinstance(v, (int, float)) and not isinstance(v, bool)}
