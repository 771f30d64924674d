"""What the strategy reports each round: nodes, lr, stage times, bytes, replies, losses.

Metric names are read by :mod:`fedshard.experiments.report` and written to ``metrics.jsonl``;
change them only together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log

from fedshard import protocol as P

__all__ = ["eval_metrics", "metric_record", "reply_metrics", "send_metrics", "weighted_means"]


def send_metrics(arrays: ArrayRecord, sent: dict[int, P.SentShard], lr: float,
                 times: Sequence[float]) -> dict[str, float]:
    """``configure_train``'s report: nodes, lr, stage times (``times`` = the four instants
    around SVD, sampling and packing) and the bytes sent, overall and per keep-ratio group."""
    t0, t1, t2, t3 = times
    dense_bytes = sum(len(a.data) for a in arrays.values())
    per_node = np.array([s.bytes_sent for s in sent.values()], dtype=np.float64)
    metrics: dict[str, float] = {
        "nodes-sampled": float(len(sent)), "nodes-sent": float(len(sent)), "lr": lr,
        "svd-s": t1 - t0, "sampling-s": t2 - t1, "pack-s": t3 - t2,
        "dense-bytes": float(dense_bytes),
        "bytes-sent-mean": float(per_node.mean()),
        "bytes-sent-ratio-mean": float(per_node.mean() / dense_bytes),
    }
    for r in sorted({s.keep_ratio for s in sent.values()}):
        group = [s.bytes_sent for s in sent.values() if s.keep_ratio == r]
        metrics[f"bytes-sent-ratio-r{r:g}"] = float(np.mean(group) / dense_bytes)
    return metrics


def reply_metrics(sent_metrics: dict[str, float], accepted: Sequence[P.TrainReply],
                  dropped: Counter[str], missing: int) -> dict[str, float]:
    """The round's metrics: ``sent_metrics``, replies used/dropped (per reason)/clipped/
    missing, metric values left out, the largest update ratio, the weighted training loss and
    accuracy, and the bytes received."""
    metrics = dict(sent_metrics)
    metrics["replies-used"] = float(len(accepted))
    metrics["replies-dropped"] = float(sum(dropped.values()))
    metrics["replies-missing"] = float(missing)
    metrics.update({f"dropped-{c}": float(k) for c, k in dropped.items()})
    clipped = [r for r in accepted if r.clipped]
    if clipped:  # replies whose change exceeded max_update_ratio and was scaled down
        metrics["clipped-update-norm"] = float(len(clipped))
    if any(r.ignored_metrics for r in accepted):
        metrics["ignored-metrics"] = float(sum(len(r.ignored_metrics) for r in accepted))
    if accepted:
        metrics["update-ratio-max"] = max(r.update_ratio for r in accepted)
        rows = [(r.weight, r.metrics) for r in accepted]
        metrics.update(weighted_means(rows, (P.TRAIN_LOSS, P.TRAIN_ACCURACY)))
        metrics[P.NUM_EXAMPLES] = float(sum(r.weight for r in accepted))
        received = np.mean([r.nbytes for r in accepted])
        metrics["bytes-received-mean"] = float(received)
        metrics["bytes-received-ratio-mean"] = float(received / metrics["dense-bytes"])
    return metrics


def weighted_means(rows: Sequence[tuple[float, Any]], keys: Sequence[str]) -> dict[str, float]:
    """Per key, the mean over the rows that have it, weighted by the row's weight."""
    out = {}
    for key in keys:
        vals = [(w, float(m[key])) for w, m in rows if key in m]
        if vals:
            out[key] = sum(w * x for w, x in vals) / sum(w for w, _ in vals)
    return out


def metric_record(values: dict[str, float]) -> MetricRecord:
    """A MetricRecord of floats."""
    data: dict[str, int | float | list[int] | list[float]] = {
        k: float(v) for k, v in values.items()
    }
    return MetricRecord(data)


def eval_metrics(server_round: int, replies: Iterable[Message]) -> dict[str, float] | None:
    """The weighted means of the valid evaluation replies (invalid ones logged and dropped;
    non-scalar or non-finite metric values are left out), or ``None`` if none is valid."""
    rows: list[tuple[float, Any]] = []
    for msg in replies:
        row = P.check_eval_reply(msg)
        if isinstance(row, str):
            log(WARNING, "Round %d: dropping the evaluation reply of node %d (%s).",
                server_round, msg.metadata.src_node_id, row)
        else:
            rows.append(row)
    if not rows:
        return None
    out = {P.NUM_EXAMPLES: sum(w for w, _ in rows), "eval-nodes": float(len(rows))}
    out.update(weighted_means(rows, (P.EVAL_LOSS, P.EVAL_ACCURACY)))
    return out
