"""Each node's agreement record across rounds, and the stage a round calls: trust in a
node's updates over time.

* :class:`TrustRecord`: each node's cosines over its last rounds (with the server's trusted
  reference, :mod:`fedshard.server.trusted`, or, without one, with the round's other
  accepted nodes' aggregate), so that a node whose updates keep pointing elsewhere is named,
  and, with ``exclude-distrusted``, no longer used.
* :class:`TrustStage` joins the record and the reference and is what a round calls, once,
  after the reply bounds (:meth:`TrustStage.weigh`).

Notes
-----
Without trusted data each node is compared with the other accepted nodes' aggregate in its
own coordinates (leave-one-out; see :func:`_aggregate_cosines`): a term has few holders and a
mean that counted the node itself would make any update look aligned with it.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.common.logger import log

from fedshard import protocol as P
from fedshard.server.trusted import (
    TrustedReference,
    cosine,
    fltrust_weights,
    update_of,
)
from fedshard.settings import ReplyPolicy

__all__ = ["RECORD_MAX_NODES", "RECORD_MIN_ROUNDS", "RECORD_WINDOW", "TrustRecord",
           "TrustStage"]

#: Rounds of a node's record kept (its last ones) and the fewest before it can be named:
#: over 5 rounds, the noisy last rounds of a cosine lr schedule named honest nodes on data
#: unlike the trusted set's (docs/robustness.md).
RECORD_WINDOW = 10
RECORD_MIN_ROUNDS = 3
#: Nodes a record keeps (the least recently seen goes first): a bound on the server's memory
#: and on a checkpoint's size, whatever the federation's churn.
RECORD_MAX_NODES = 10_000



class TrustRecord:
    """Each node's cosines over its last rounds: bounded (:data:`RECORD_WINDOW` rounds per
    node, :data:`RECORD_MAX_NODES` nodes) and checkpointed (:meth:`state` /
    :meth:`restore`)."""

    def __init__(self) -> None:
        self.cosines: OrderedDict[int, deque[float]] = OrderedDict()

    def add(self, node: int, value: float) -> None:
        """Record one round's cosine of ``node``."""
        row = self.cosines.pop(node, None) or deque(maxlen=RECORD_WINDOW)
        row.append(float(value))
        self.cosines[node] = row
        while len(self.cosines) > RECORD_MAX_NODES:
            self.cosines.popitem(last=False)

    def level(self, node: int) -> float | None:
        """The median of ``node``'s recorded cosines (``None``: fewer than
        :data:`RECORD_MIN_ROUNDS`): one odd round (an honest node's update in a round of
        tiny lr is mostly noise) does not move it."""
        row = self.cosines.get(node)
        return float(np.median(row)) if row and len(row) >= RECORD_MIN_ROUNDS else None

    def distrusts(self, node: int, below: float) -> bool:
        """Whether ``node``'s record names it under ``below`` (``distrust-below`` against a
        trusted reference, ``distrust-below-aggregate`` against the other nodes' aggregate):
        the median of its last :data:`RECORD_WINDOW` cosines (at least
        :data:`RECORD_MIN_ROUNDS`) is below it.

        Notes
        -----
        Against a trusted reference, a dishonest node's cosines (negated, IPM, noise, zero,
        label flip) stay below it from its first rounds on, so it is named by its third
        round. An honest node's cosines scatter
        in the last rounds of a cosine lr schedule (its tiny steps are mostly noise), widely
        for a node whose data is unlike the trusted set's: over 5 rounds their median fell
        below 0.02 for 3 of 30 honest nodes of clean whole runs, over 10 for none (measured
        in docs/robustness.md). The price: a node that turns dishonest after many honest
        rounds is named once more than half of its last 10 are below.
        """
        level = self.level(node)
        return level is not None and level < below

    def state(self) -> dict[int, list[float]]:
        """The record as plain data (node -> cosines, oldest first), for a checkpoint."""
        return {n: list(r) for n, r in self.cosines.items()}

    def restore(self, state: Mapping[int, Sequence[float]]) -> None:
        """The record of :meth:`state` (a checkpoint's).

        Raises
        ------
        ValueError
            If it is not node ids mapped to finite cosines in [-1, 1]; nothing is changed.
        """
        bad = [n for n, r in state.items()
               if isinstance(n, bool) or not isinstance(n, int) or isinstance(r, (str, bytes))
               or not all(isinstance(c, (int, float)) and math.isfinite(c) and -1 <= c <= 1
                          for c in r)]
        if bad or not isinstance(state, Mapping):
            raise ValueError(f"trust record {bad[:5]!r}: expected node ids mapped to lists of "
                             "cosines in [-1, 1]; the record is not restored")
        self.cosines = OrderedDict((int(n), deque((float(c) for c in r),
                                                  maxlen=RECORD_WINDOW))
                                   for n, r in state.items())


class TrustStage:
    """What a round does with trust, after the reply bounds: exclude distrusted nodes (with
    ``exclude_distrusted``), weigh by the reference (with one), record, name.

    Parameters
    ----------
    reference : fedshard.server.trusted.TrustedReference, optional
        The server's clean training; ``None``: the record uses each node's cosine with the
        round's other accepted nodes' aggregate, and nothing is reweighted.
    policy : fedshard.settings.ReplyPolicy
        ``distrust_below`` (the median cosine under which a node is named, with a reference),
        ``distrust_below_aggregate`` (without one) and ``exclude_distrusted``.
    """

    def __init__(self, reference: TrustedReference | None, policy: ReplyPolicy) -> None:
        self.reference, self.policy = reference, policy
        self.record = TrustRecord()
        # with exclude_distrusted: node -> the round it was named in and left out from
        self.excluded: dict[int, int] = {}

    @property
    def below(self) -> float:
        """The median cosine under which a node is named: ``distrust_below`` against a
        trusted reference, ``distrust_below_aggregate`` against the other nodes' aggregate."""
        return (self.policy.distrust_below if self.reference is not None
                else self.policy.distrust_below_aggregate)

    @property
    def threshold_key(self) -> str:
        """The run-config key of :attr:`below`."""
        return "distrust-below" if self.reference is not None else "distrust-below-aggregate"

    def left_out(self) -> dict[int, str]:
        """The nodes a round leaves out of its training sample (with ``exclude_distrusted``),
        each with why: node -> reason."""
        return {n: f"named distrusted in round {r} (median cosine under {self.threshold_key}="
                   f"{self.below:g}) and exclude-distrusted is on"
                for n, r in self.excluded.items()}

    def restore(self, record: Mapping[int, Sequence[float]] | None,
                excluded: Mapping[int, int] | None = None) -> None:
        """The record and the left-out nodes of a checkpoint (:meth:`TrustRecord.state`,
        :attr:`excluded`; ``None``: none kept).

        Raises
        ------
        ValueError
            If either is malformed (the left-out nodes: node ids mapped to the round ≥ 1 each
            was named in); nothing is changed.
        """
        if excluded is not None and (not isinstance(excluded, Mapping) or not all(
                isinstance(n, int) and not isinstance(n, bool) and isinstance(r, int)
                and not isinstance(r, bool) and r >= 1 for n, r in excluded.items())):
            raise ValueError(f"left-out nodes {excluded!r}: expected node ids mapped to the "
                             "round (≥ 1) each was named in; the record is not restored")
        if record is not None:
            self.record.restore(record)
        if excluded is not None:
            self.excluded = {int(n): int(r) for n, r in excluded.items()}

    def weigh(self, server_round: int, accepted: Sequence[P.TrainReply],
              sent: Mapping[int, P.SentShard], messages: Sequence[Message],
              metrics: dict[str, float]) -> list[P.TrainReply]:
        """``accepted`` without the excluded nodes and, with a reference, FLTrust-weighted
        (:func:`fltrust_weights`; a node of trust 0 left out); each node's cosine recorded and
        a node whose record stays below :attr:`below` named in a WARNING (counted in
        ``distrusted-nodes``; ``trust-zero`` counts the replies left out by the reference,
        ``trust-mean`` is the round's mean trust score).

        Raises
        ------
        ValueError
            If the reference's reply does not match what a node was sent
            (:meth:`~fedshard.server.trusted.TrustedReference.update`): the round is not aggregated.
        """
        out = [r for r in accepted if r.node not in self.excluded]
        if len(out) < len(accepted):
            metrics["distrusted-excluded"] = float(len(accepted) - len(out))
        if not out:
            return out
        if self.reference is not None:
            deltas = [update_of(r.values, sent[r.node].values) for r in out]
            by_node = {m.metadata.dst_node_id: m for m in messages}
            epochs = self.reference.epochs_for(float(np.median([r.weight for r in out])))
            refs = [self.reference.update(by_node[r.node], sent[r.node], epochs) for r in out]
            if not any(np.any(v) for g0 in refs for v in g0.values()):
                log(INFO, "Round %d: the trusted reference did not move (lr 0?); the replies "
                    "are not reweighted.", server_round)
                cosines = [cosine(g, g0) for g, g0 in zip(deltas, refs, strict=True)]
            else:
                weights, scales, cosines = fltrust_weights(deltas, refs, [r.weight for r in out])
                out = self._rescaled(out, sent, weights, scales, metrics)
                metrics["trust-mean"] = float(np.mean([max(0.0, c) for c in cosines]))
            source = "the server's trusted reference update"
        else:
            cosines = _aggregate_cosines(out, sent)
            source = "the aggregate of the round's other accepted nodes"
        for r, c in zip(out, cosines, strict=True):
            self.record.add(r.node, c)
        self._name(server_round, [r.node for r in out], source, metrics)
        if self.reference is not None:
            out = [r for r in out if r.weight > 0]
        return out

    def _rescaled(self, out: list[P.TrainReply], sent: Mapping[int, P.SentShard],
                  weights: list[float], scales: list[float], metrics: dict[str, float],
                  ) -> list[P.TrainReply]:
        new = []
        for r, w, s in zip(out, weights, scales, strict=True):
            if w <= 0:
                metrics["trust-zero"] = metrics.get("trust-zero", 0.0) + 1.0
                new.append(replace(r, weight=0.0))
                continue
            values = dict(r.values)
            for k, before in sent[r.node].values.items():
                if np.issubdtype(np.asarray(before).dtype, np.floating):
                    b = np.asarray(before, np.float64)
                    values[k] = (b + s * (np.asarray(r.values[k], np.float64) - b)).astype(
                        r.values[k].dtype)
            new.append(replace(r, values=values, weight=w))
        return new

    def _name(self, server_round: int, nodes: Sequence[int], source: str,
              metrics: dict[str, float]) -> None:
        named = 0
        for node in nodes:
            if not self.record.distrusts(node, self.below):
                continue
            named += 1
            row, below = self.record.cosines[node], self.below
            action = ("; exclude-distrusted: it is not sampled for training, nor its "
                      "replies used, from now on" if self.policy.exclude_distrusted else
                      "; exclude-distrusted = true would leave it out of later rounds")
            log(WARNING, "Round %d: node %d is distrusted: its updates' cosine with %s was "
                "below %s=%g in %d of its last %d rounds (%s; median %.3f)%s.",
                server_round, node, source, self.threshold_key, below,
                sum(c < below for c in row), len(row), ", ".join(f"{c:+.2f}" for c in row),
                self.record.level(node), action)
            if self.policy.exclude_distrusted:
                self.excluded.setdefault(node, server_round)
        if named:
            metrics["distrusted-nodes"] = float(named)


#: Relative weight under which a term or entry counts as held by no other node.
_OTHERS = 1e-9
#: ``d·d`` from ``S·S − 2w x·S + w² x·x`` is kept when at least this share of
#: ``S·S + w² x·x`` (it then carries at most ~1e-13 relative error from the cancellation in
#: float64, ~1e-5 in float32); below it ``d = S − w x`` is formed (:func:`_aggregate_cosines`).
_GRAM_CANCELS = {8: 1e-3, 4: 1e-1}


@np.errstate(over="ignore", invalid="ignore")  # (float32 products that overflow: redone)
def _aggregate_cosines(out: Sequence[P.TrainReply], sent: Mapping[int, P.SentShard],
                       at_least: type[np.floating[Any]] = np.float32) -> list[float]:
    """Each node's cosine with the weighted mean update of the round's *other* accepted nodes,
    in its own coordinates (:func:`update_of`): per factor column the mean over the other nodes
    holding that term (the same sent column), per dense entry or slice over the other nodes
    sent the same shape (zero where no other node holds it).

    Taken in the replies' own precision, at least float32 (:func:`_work_dtype`): a float32
    model's cosines agree with float64's to about 1e-6 (tested), far inside what a record
    read against ``distrust-below-aggregate`` over several rounds can tell apart, in about
    half the time of a float64 pass (a cast and twice the bytes per update); a float64
    model's are taken in float64, and so is a round whose products overflow float32
    (``at_least``: the least precision taken).

    Notes
    -----
    Leave-one-out: a term has few holders (about ``r`` of the cohort) and averaging shrinks
    the honest updates' mean, so a mean that counted the node itself would give any update
    (noise, a negated one) a positive cosine with it; measured in docs/robustness.md.

    Two passes over the replies, each node's update taken afresh in one scratch array per
    shape rather than kept (keeping every node's copy costs the memory of the round's replies
    again, and its page faults, every round). The first sums the weighted updates over their
    holders: ``S`` and total weight ``T`` per dense key, per term for a factor key, and takes
    each node's ``x·x`` per key. The second takes, for each node of weight ``w`` and update
    ``x``, the others' sum ``d = S − w x``, their mean ``d / (T − w)``, and accumulates
    ``x·d`` and ``d·d`` (per column for a factor key, whose ``T`` is per term). For a dense
    key both come from ``x·S`` alone: ``x·d = x·S − w x·x`` and
    ``d·d = S·S − 2w x·S + w² x·x`` (one product per node instead of forming ``d``), unless
    ``d·d`` comes out below :data:`_GRAM_CANCELS` (of the precision) times
    ``S·S + w² x·x`` (the node's own update is nearly all of ``S``: the difference would
    cancel most of its digits); then ``d`` is formed and both products taken from it.
    """
    scratch: dict[tuple[Any, ...], np.ndarray] = {}  # arrays reused across nodes

    def update(entry: _Entry) -> np.ndarray:
        # the node's update of one key, in a scratch array (valid until the next call)
        _, got, before, _ = entry
        buf = _buffer(scratch, got, 0, _work_dtype(got, before, at_least))
        return np.subtract(got, before, out=buf, dtype=buf.dtype)

    # per node, once: each floating key's reply, what was sent and, for a factor key, the
    # term index of each of its columns (None: a dense entry)
    entries = [_entries(r, sent[r.node]) for r in out]
    # per factor key: (N, rows) sums of the weighted columns over their term's holders and
    # (N,) total weights; per dense key and shape: the weighted sum and total weight. Each
    # column and entry adds its nodes in the order of ``out``, as one sum per slot would.
    width: dict[tuple[str, int], tuple[int, np.dtype[Any]]] = {}
    for node_entries in entries:
        for k, got, before, idx in node_entries:
            if idx is not None and idx.size:
                n, dtype = width.get((k, got.shape[0]), (0, np.dtype(np.float32)))
                width[(k, got.shape[0])] = (max(n, int(idx.max()) + 1),
                                            np.promote_types(dtype, _work_dtype(got, before,
                                                                                at_least)))
    col_sums = {slot: np.zeros((n, slot[1]), dtype) for slot, (n, dtype) in width.items()}
    col_totals = {slot: np.zeros(n) for slot, (n, _) in width.items()}
    sums: dict[tuple[str, Any], np.ndarray] = {}
    totals: dict[tuple[str, Any], float] = {}
    squares = []  # each node's x·x, per key
    for r, node_entries in zip(out, entries, strict=True):
        xx: dict[str, float] = {}
        weight = float(r.weight)  # (a numpy weight would widen a float32 sum)
        for entry in node_entries:
            k, idx = entry[0], entry[3]
            x = update(entry)
            xx[k] = float(np.vdot(x, x))
            if idx is None:
                if (k, x.shape) in sums:
                    sums[(k, x.shape)] += np.multiply(x, weight, out=x)
                    totals[(k, x.shape)] += weight
                else:
                    sums[(k, x.shape)] = weight * x
                    totals[(k, x.shape)] = weight
            elif idx.size:
                columns, totals_of = col_sums[(k, x.shape[0])], col_totals[(k, x.shape[0])]
                if idx.size == 1 or bool(np.all(idx[1:] > idx[:-1])):
                    # a node's terms, each once (the plan's sorted indices): one addition per
                    # slot, as np.add.at makes it, without its slow unbuffered loop
                    columns[idx] += (weight * x[:, :idx.size]).T
                    totals_of[idx] += weight
                else:
                    np.add.at(columns, idx, (weight * x[:, :idx.size]).T)
                    np.add.at(totals_of, idx, weight)
        squares.append(xx)
    sum_squares = {slot: float(np.vdot(s, s)) for slot, s in sums.items()}  # S·S per dense key
    overflow = not all(math.isfinite(v) for xx in squares for v in xx.values()) \
        or not all(math.isfinite(v) for v in sum_squares.values())
    cosines = []
    for r, node_entries, xx in zip(out, entries, squares, strict=True):
        w = float(r.weight)
        xd = dd = 0.0  # x·mean and mean·mean over the node's keys
        for entry in node_entries:
            k, idx = entry[0], entry[3]
            x = update(entry)
            # the others' weight; under a rounding's width of the total: no other holder
            if idx is None:
                total = totals[(k, x.shape)]
                t = total - w
                if t > _OTHERS * total:
                    s = sums[(k, x.shape)]
                    xs, ss, wxx = float(np.vdot(x, s)), sum_squares[(k, x.shape)], w * w * xx[k]
                    x_d, d_d = xs - w * xx[k], ss - 2.0 * w * xs + wxx
                    if not d_d >= _GRAM_CANCELS[min(s.dtype.itemsize, 8)] * (ss + wxx):  # (NaN too)
                        # form d itself, in the sum's precision
                        d = np.multiply(x, -w, out=_buffer(scratch, x, 1, s.dtype))
                        d += s  # the others' weighted sum, S − w x
                        x_d, d_d = float(np.vdot(x, d)), float(np.vdot(d, d))
                    xd += x_d / t
                    dd += d_d / (t * t)
            elif idx.size:
                total_col = col_totals[(k, x.shape[0])][idx]
                t_col = total_col - w
                held = t_col > _OTHERS * total_col
                if held.any():
                    xc = x[:, :idx.size] if held.all() else x[:, held.nonzero()[0]]
                    th = t_col[held]
                    d = col_sums[(k, x.shape[0])][idx[held]].T - w * xc  # (rows, held)
                    xd += float(np.sum(np.einsum("ij,ij->j", xc, d) / th))
                    dd += float(np.sum(np.einsum("ij,ij->j", d, d) / (th * th)))
        norm = math.sqrt(sum(xx.values())) * math.sqrt(dd)
        overflow = overflow or not math.isfinite(norm) or not math.isfinite(xd)
        cosines.append(float(np.clip(xd / norm, -1.0, 1.0))
                       if norm > 0 and math.isfinite(norm) else 0.0)
    if overflow and np.dtype(at_least).itemsize < 8:
        return _aggregate_cosines(out, sent, np.float64)  # products beyond float32
    return cosines


#: One floating key of a node's reply: (key, the reply's array, the array sent, the term
#: index of each column of a factor key or None).
_Entry = tuple[str, np.ndarray, np.ndarray, np.ndarray | None]


def _entries(r: P.TrainReply, shard: P.SentShard) -> list[_Entry]:
    """The floating keys of what ``shard`` sent, in its order, as :data:`_Entry` rows of
    ``r``'s reply (a factor key: ``.u`` / ``.v`` of a layer with term indices, 2-D)."""
    rows: list[_Entry] = []
    for k, before in shard.values.items():
        if not np.issubdtype(np.asarray(before).dtype, np.floating):
            continue
        got = r.values[k]
        idx = shard.indices.get(k.rsplit(".", 1)[0])
        terms = (np.asarray(idx, dtype=np.intp).reshape(-1)
                 if k.endswith((".u", ".v")) and idx is not None and got.ndim == 2 else None)
        rows.append((k, got, before, terms))
    return rows


def _work_dtype(got: np.ndarray, before: np.ndarray,
                at_least: type[np.floating[Any]]) -> np.dtype[Any]:
    """The precision an update is taken in: the arrays' own, at least ``at_least`` (float32:
    a float16 model's updates are taken in float32; numpy's float16 arithmetic is slow and
    coarse)."""
    return np.result_type(got.dtype, before.dtype, at_least)


def _buffer(scratch: dict[tuple[Any, ...], np.ndarray], like: np.ndarray, slot: int,
            dtype: np.dtype[Any]) -> np.ndarray:
    """Scratch array number ``slot`` of ``like``'s shape and ``dtype``, reused across
    nodes."""
    key = (slot, dtype, *like.shape)
    buf = scratch.get(key)
    if buf is None:
        buf = scratch[key] = np.empty(like.shape, dtype)
    return buf
