"""What the strategy reports each round: nodes, lr, stage times, bytes, replies, losses.

Metric names are read by :mod:`fedshard_lab.experiments.report` and written to ``metrics.jsonl``;
change them only together.

Two namespaces: the server's own statistics (``replies-used``, ``train-loss`` as the server
weighs it, ...) and what nodes report, aggregated under :data:`CLIENT_PREFIX`
(``client/train-loss``): no name a node sends can overwrite a server statistic or pose as a
test metric.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from logging import DEBUG, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.common.logger import log

from fedshard import protocol as P
from fedshard.protocol.bounds import printable

__all__ = [
    "CLIENT_PREFIX", "NON_FINITE", "DropLog", "client_namespace", "mean_client_metrics",
    "metric_record", "non_finite", "one_line", "reply_metrics", "send_metrics",
    "weighted_means",
]


#: Prefix of the client-reported metrics in a round's history row and ``metrics.jsonl``.
CLIENT_PREFIX = "client/"


def client_namespace(values: dict[str, float]) -> dict[str, float]:
    """``values`` (aggregated from what nodes reported) under :data:`CLIENT_PREFIX`."""
    return {CLIENT_PREFIX + k: v for k, v in values.items()}


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
                  dropped: Counter[str], missing: int,
                  keep_ratios: dict[int, float] | None = None) -> dict[str, float]:
    """The round's metrics: ``sent_metrics``, replies used/dropped (per reason)/clipped/
    missing, metric values left out, the largest update ratio, the weighted training loss and
    accuracy, and the bytes received (per keep-ratio group too where ``keep_ratios``, node ->
    the ratio it was sent, is given)."""
    metrics = dict(sent_metrics)
    metrics["replies-used"] = float(len(accepted))
    metrics["replies-dropped"] = float(sum(dropped.values()))
    metrics["replies-missing"] = float(missing)
    metrics.update({f"dropped-{c}": float(k) for c, k in dropped.items()})
    clipped = [r for r in accepted if r.clipped]
    if clipped:  # replies whose change exceeded max_update_ratio and was scaled down
        metrics["clipped-update-norm"] = float(len(clipped))
    if any(r.ignored_count for r in accepted):
        metrics["ignored-metrics"] = float(sum(r.ignored_count for r in accepted))
    if accepted:
        metrics["update-ratio-max"] = max(r.update_ratio for r in accepted)
        rows = [(r.weight, r.metrics) for r in accepted]
        metrics.update(weighted_means(rows, (P.TRAIN_LOSS, P.TRAIN_ACCURACY)))
        metrics[P.NUM_EXAMPLES] = float(sum(r.weight for r in accepted))
        received = np.mean([r.nbytes for r in accepted])
        metrics["bytes-received-mean"] = float(received)
        metrics["bytes-received-ratio-mean"] = float(received / metrics["dense-bytes"])
        ratios = keep_ratios or {}
        for r in sorted({ratios[a.node] for a in accepted if a.node in ratios}):
            group = [a.nbytes for a in accepted if ratios.get(a.node) == r]
            metrics[f"bytes-received-ratio-r{r:g}"] = float(np.mean(group) /
                                                            metrics["dense-bytes"])
    return metrics


def weighted_means(rows: Sequence[tuple[float, Any]], keys: Sequence[str]) -> dict[str, float]:
    """Per key, the mean over the rows that have it, weighted by the row's weight.

    Finite values near the float64 limit (a loss of 1.7e308 reported by a node) give a finite
    mean: where the weighted sum overflows, the mean is taken as a convex combination of the
    values scaled by the largest of them (the plain sum, bit for bit, everywhere else)."""
    out = {}
    for key in keys:
        vals = [(w, float(m[key])) for w, m in rows if key in m]
        if vals:
            total = sum(w for w, _ in vals)
            mean = sum(w * x for w, x in vals) / total
            if not math.isfinite(mean) and all(math.isfinite(x) for _, x in vals):
                scale = max(abs(x) for _, x in vals)  # > 0: the sum overflowed
                share = sum((w / total) * (x / scale) for w, x in vals)  # in [-1, 1]
                mean = scale * min(1.0, max(-1.0, share))
            out[key] = mean
    return out


#: The round metric counting the values that were not finite and left out of the row.
NON_FINITE = "non-finite-metrics"


def non_finite(metrics: Mapping[str, Any]) -> list[str]:
    """``"name=value"`` (name escaped, :func:`~fedshard.protocol.bounds.printable`) of every
    float value in ``metrics`` that is NaN or ±inf, sorted by name: none may be written to a
    strict JSON file or averaged on."""
    return [f"{printable(k, 80)}={v!r}" for k, v in sorted(metrics.items())
            if isinstance(v, float) and not math.isfinite(v)]


class DropLog:
    """The replies a round drops, logged as one WARNING per reason (its category, the
    ``"category"`` of ``"category: details"``) with the count, the first
    :attr:`NODES_SHOWN` node ids and the first reply's reason in one line; every reply's full
    reason at DEBUG. A node sending 10,000 duplicate replies gives one WARNING line, not
    10,000. Node-sent text is escaped (:func:`~fedshard.protocol.bounds.printable`).

    Parameters
    ----------
    server_round : int
        The round, named in every line.
    noun, plural : str
        What is dropped (``"reply"``, ``"replies"``).
    consequence : tuple of str
        What dropping one, and several, means, appended to the WARNING (e.g. ``("it does not
        touch the global model", "they do not ...")``; empty for none).
    """

    #: Node ids a WARNING names before "…".
    NODES_SHOWN = 5

    def __init__(self, server_round: int, noun: str = "reply", plural: str = "replies",
                 consequence: tuple[str, str] = ("", "")) -> None:
        self.server_round, self.noun, self.plural = server_round, noun, plural
        self.consequence = consequence
        self.reasons: dict[str, tuple[int, list[int], str]] = {}  # category -> count, nodes, first

    def add(self, node: int, drop: P.Drop) -> None:
        """One dropped reply of ``node`` and why (logged at DEBUG in full)."""
        reason = str(drop)
        log(DEBUG, "Round %d, node %d, the full reason: %s", self.server_round, node,
            printable(reason))
        category = drop.reason.value
        count, nodes, first = self.reasons.get(category, (0, [], reason))
        if node not in nodes and len(nodes) <= self.NODES_SHOWN:
            nodes.append(node)
        self.reasons[category] = (count + 1, nodes, first)

    def flush(self) -> None:
        """Log one WARNING per reason, in the order the reasons first came; then forget them."""
        for category, (count, nodes, first) in self.reasons.items():
            if count == 1:
                log(WARNING, "Round %d: dropping the %s of node %d (%s)%s.", self.server_round,
                    self.noun, nodes[0], one_line(first), self._tail(0))
                continue
            shown = ", ".join(str(n) for n in nodes[: self.NODES_SHOWN])
            more = ", …" if len(nodes) > self.NODES_SHOWN else ""
            log(WARNING, "Round %d: dropping %d %s (%s) of node(s) %s%s: %s%s.",
                self.server_round, count, self.plural, category, shown, more,
                one_line(first), self._tail(1))
        self.reasons.clear()

    def _tail(self, many: int) -> str:
        return f"; {self.consequence[many]}" if self.consequence[many] else ""


def metric_record(values: dict[str, float]) -> MetricRecord:
    """A MetricRecord of floats."""
    data: dict[str, int | float | list[int] | list[float]] = {
        k: float(v) for k, v in values.items()
    }
    return MetricRecord(data)


def mean_client_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """The default ``*_metrics_aggr_fn``: per metric name, the ``weight_key``-weighted mean of
    every numeric scalar over the replies that report it; ``weight_key`` itself is summed.

    Same signature as Flower's ``aggregate_metricrecords`` (``FedAvg``'s default), but the
    replies need not report the same names, and lists and non-finite values are left out.
    """
    rows: list[tuple[float, dict[str, float]]] = []
    for record in records:
        values: dict[str, float] = {}
        for metrics in record.metric_records.values():
            values.update({k: float(v) for k, v in metrics.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)
                           and math.isfinite(v)})
        weight = values.pop(weight_key, 0.0)
        if weight > 0:
            rows.append((weight, values))
    names = sorted({k for _, values in rows for k in values})
    out = weighted_means(rows, names)
    out[weight_key] = sum(w for w, _ in rows)
    return metric_record(out)


def one_line(reason: str, limit: int = 300) -> str:
    """One line of an error reason for a log: the exception's message where ``reason`` holds a
    (Ray) traceback, else its first non-empty line; at most ``limit`` characters, escaped
    (:func:`~fedshard.protocol.bounds.printable`: a node's text cannot start a log line)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    if not lines:
        return ""
    marked = [line.rpartition("Message: ")[2] for line in lines if "Message: " in line]
    if marked:
        line = marked[-1]
    elif lines[0].startswith("Traceback") or any("Traceback (most" in x for x in lines):
        line = lines[-1]
    else:
        line = lines[0]
    return printable(line, limit)
