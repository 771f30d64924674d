"""The ``train`` message's arrays and its reply: encoding, decoding and checking a shard."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedshard.protocol.arrays import array_record, array_view, decode_array, encode_array
from fedshard.protocol.bounds import (
    EVAL_RANGES,
    all_finite,
    bound_dense,
    bound_terms,
    bounded_metrics,
    read_count,
    scalar_metrics,
)
from fedshard.protocol.drops import Drop, DropReason
from fedshard.protocol.keys import (
    ARRAYS,
    CONFIG,
    DIVERGED,
    METRICS,
    NUM_EXAMPLES,
    SERVER_ROUND,
    factor_key,
    layer_of,
)
from fedshard.protocol.receipts import Receipt, read_receipt
from fedshard.settings import ReplyPolicy
from fedshard.spectral.aggregate import TermUpdate, squared_difference
from fedshard.spectral.decompose import LayerSpectrum

__all__ = [
    "SentShard", "TrainReply", "check_eval_reply", "check_train_reply", "decode_shard",
    "encode_shard", "train_reply",
]


@dataclass(frozen=True)
class SentShard:
    """What one node was sent this round; its reply is checked against it."""

    keep_ratio: float
    indices: dict[str, np.ndarray]  # layer -> (n,) term indices
    expected: dict[str, tuple[tuple[int, ...], np.dtype[Any]]]  # reply key -> (shape, dtype)
    bytes_sent: int
    # reply key -> what was sent (references to the round's arrays, not copies): the update
    # bound compares the reply with it
    values: Mapping[str, np.ndarray] = field(default_factory=dict, repr=False)


def encode_shard(
    arrays: ArrayRecord,
    spectra: dict[str, LayerSpectrum],
    terms: dict[str, tuple[np.ndarray, np.ndarray]],
    keep_ratio: float,
    current: Mapping[str, np.ndarray] | None = None,
) -> tuple[ArrayRecord, SentShard]:
    """One node's ``train`` arrays (fresh arrays, nothing shared with other nodes' factors):
    the dense entries of ``arrays`` and, per sharded layer, ``u``/``v``/``omega``/``indices``
    of the terms ``terms[layer] = (indices, ω)``. ``current`` is ``arrays`` decoded (shared
    by every node of the round; decoded here if not given)."""
    sharded_weights = {f"{layer}.weight" for layer in spectra}
    out: dict[str, Array] = {}
    expected: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
    values: dict[str, np.ndarray] = {}
    for key, arr in arrays.items():
        if key in sharded_weights:
            continue
        out[key] = arr  # dense entries are read-only on the wire; sharing the Array is safe
        expected[key] = (tuple(arr.shape), np.dtype(arr.dtype))
        values[key] = current[key] if current is not None else decode_array(arr)
    indices = {}
    for layer, spec in spectra.items():
        idx, omega = terms[layer]
        parts = {
            "u": np.ascontiguousarray(spec.ut[idx].T, dtype=spec.dtype),  # (c_out, n)
            "v": np.ascontiguousarray(spec.vt[idx].T, dtype=spec.dtype),  # (c_in·k·k, n)
            "omega": np.ascontiguousarray(omega, dtype=spec.dtype),
            "indices": np.ascontiguousarray(idx, dtype=np.int64),
        }
        for part, value in parts.items():
            key = factor_key(layer, part)
            out[key] = encode_array(value)
            if part != "omega":
                expected[key] = (value.shape, value.dtype)
            if part in ("u", "v"):
                values[key] = value
        indices[layer] = parts["indices"]
    nbytes = sum(len(a.data) for a in out.values())
    return array_record(out), SentShard(keep_ratio, indices, expected, nbytes, values)


def decode_shard(
    record: ArrayRecord, *, views: bool = False,
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """A ``train`` message's arrays as ``(factors, state)``: ``state`` every entry but the
    indices (a state dict of the sub-model, factors included), each decoded once;
    ``factors[layer]`` holds ``state``'s ``u``, ``v``, ``omega`` arrays of that layer.
    ``views``: read-only views of the record's bytes where possible (:func:`array_view`), for
    a reader that copies them at once."""
    layers = sorted(layer_of(k) for k in record if k.endswith(".indices"))
    read = array_view if views else decode_array
    state = {k: read(a) for k, a in record.items() if not k.endswith(".indices")}
    factors = {layer: {p: state[factor_key(layer, p)] for p in ("u", "v", "omega")}
               for layer in layers}
    return factors, state


def train_reply(msg: Message, state: dict[str, np.ndarray], num_examples: int,
                metrics: dict[str, float], receipt: Receipt | None = None) -> Message:
    """The reply to a ``train`` message: the trained ``state`` (the sub-model's state dict;
    ω is left out, the indices are echoed from ``msg``), the metrics and, in a ``"config"``
    record, the round ``msg`` was sent in (``server-round``, echoed: the server drops a reply
    whose content answers another round) and the ``receipt`` (what the node trained with)."""
    record = msg.content.array_records[ARRAYS]
    indices = [k for k in record if k.endswith(".indices")]
    omega = {factor_key(layer_of(k), "omega") for k in indices}
    out = {k: encode_array(v) for k, v in state.items() if k not in omega}
    out.update({k: record[k] for k in indices})
    values: dict[str, int | float | list[int] | list[float]] = {NUM_EXAMPLES: int(num_examples)}
    values.update({k: float(v) for k, v in metrics.items()})
    content = RecordDict({ARRAYS: array_record(out), METRICS: MetricRecord(values)})
    sent_config = msg.content.config_records.get(CONFIG)
    echo: dict[str, Any] = receipt.entries() if receipt is not None else {}
    if sent_config is not None and SERVER_ROUND in sent_config:
        echo[SERVER_ROUND] = sent_config[SERVER_ROUND]
    if echo:
        content[CONFIG] = ConfigRecord(echo)
    return Message(content, reply_to=msg)


@dataclass(frozen=True)
class TrainReply:
    """A checked ``train`` reply: weight, decoded (and bounded) arrays, its finite scalar
    metrics, bytes on the wire, how many columns/arrays were clipped, the largest update
    ratio seen, why metrics were left out and how many were (``ignored_count``).

    The arrays are read-only views of the reply's own bytes where they were not clipped (a
    stage that changes one makes a new array, as the robust stages and the trust reference
    do)."""

    node: int
    weight: float
    values: dict[str, np.ndarray]
    metrics: dict[str, float]
    nbytes: int
    layers: tuple[str, ...]
    clipped: int = 0
    update_ratio: float = 0.0
    ignored_metrics: tuple[str, ...] = ()
    ignored_count: int = 0
    receipt: Receipt | str | None = None  # what the node says it trained with (or why not)
    #: dense key -> (the checked array, its squared change from what was sent), taken by the
    #: update bound (:func:`~fedshard.spectral.aggregate.squared_difference`); valid while
    #: ``values[key]`` is that array (the spread rule reads it instead of taking it again)
    changes: Mapping[str, tuple[np.ndarray, float]] = field(default_factory=dict)

    def terms(self) -> dict[str, TermUpdate]:
        """The trained terms, by layer."""
        return {layer: TermUpdate(self.weight, *(self.values[factor_key(layer, p)]
                                                 for p in ("indices", "u", "v")))
                for layer in self.layers}


def check_eval_reply(msg: Message, limits: ReplyPolicy | None = None,
                     ) -> tuple[float, dict[str, float], list[str], int] | Drop:
    """``(num-examples, finite scalar metrics, why values were left out, how many)`` of an
    ``evaluate`` reply, or why to drop it (a :class:`~fedshard.protocol.drops.Drop`).

    ``num-examples`` must be a whole number in ``[1, limits.max_num_examples]``
    (:class:`~fedshard.settings.ReplyPolicy`; default: its defaults). Non-scalar or
    non-finite metric values and those beyond the cap are left out
    (:func:`fedshard.protocol.bounds.scalar_metrics`), and so are an ``eval-accuracy``
    outside ``[0, 1]`` and a negative ``eval-loss``
    (:data:`~fedshard.protocol.bounds.EVAL_RANGES`); the caller logs the reasons and counts
    them: none reach the averages. The weight is capped against the round's median by the
    caller (``max_weight_ratio``), as for training replies."""
    limits = limits if limits is not None else ReplyPolicy()
    if msg.has_error():
        return Drop(DropReason.ERROR_REPLY, str(msg.error.reason))
    metrics = msg.content.metric_records.get(METRICS)
    if metrics is None:
        return Drop(DropReason.MISSING_RECORD, f"expected a MetricRecord {METRICS!r}")
    weight = read_count(metrics.get(NUM_EXAMPLES), limits.max_num_examples)
    if isinstance(weight, str):
        return Drop(DropReason.BAD_NUM_EXAMPLES, f"{NUM_EXAMPLES} {weight}")
    values, ignored, count = scalar_metrics(metrics, NUM_EXAMPLES)
    values, outside = bounded_metrics(values, EVAL_RANGES)
    return weight, values, ignored + outside, count + len(outside)


def check_train_reply(msg: Message, sent: SentShard | None, seen: set[int],
                      limits: ReplyPolicy | None = None,
                      node: int | None = None, server_round: int | None = None,
                      sent_norms: dict[int, float] | None = None) -> TrainReply | Drop:
    """The checked reply, or why it must be dropped (a :class:`~fedshard.protocol.drops.Drop`:
    its reason and details).

    ``node`` is the node the answered message was sent to (default: the reply's sender);
    ``limits`` bound ``num-examples`` and the change from what was sent
    (:class:`~fedshard.settings.ReplyPolicy`; default: its defaults); ``server_round``, when
    given, is the round the reply must answer (its ``"config"`` echo, where it has one:
    ``stale-reply`` otherwise). ``sent_norms``: a round's memo of the squared norms of the
    dense arrays sent (by ``id``; every node was sent the same array), filled as the replies
    are checked.
    """
    limits = limits if limits is not None else ReplyPolicy()
    node = msg.metadata.src_node_id if node is None else node
    if msg.has_error():
        # a node whose training diverged says so (fedshard.client.shard_reply): counted apart,
        # the strategy stops a run in which most nodes diverge (ReplyPolicy.max_diverged_fraction)
        kind = (DropReason.DIVERGED if DIVERGED in str(msg.error.reason)
                else DropReason.ERROR_REPLY)
        return Drop(kind, f"code {msg.error.code}, {msg.error.reason}")
    if sent is None:
        return Drop(DropReason.UNEXPECTED_SENDER,
                    "this node was not sent a training message this round")
    if node in seen:
        return Drop(DropReason.DUPLICATE, "a second reply from this node in the same round")
    if msg.metadata.src_node_id != node:
        return Drop(DropReason.WRONG_SENDER, f"the reply to node {node}'s message came from "
                    f"node {msg.metadata.src_node_id}")
    content = msg.content
    if ARRAYS not in content.array_records or METRICS not in content.metric_records:
        return Drop(DropReason.MISSING_RECORD, f"expected an ArrayRecord {ARRAYS!r} and a "
                    f"MetricRecord {METRICS!r}, got {sorted(content.keys())}")
    echo = content.config_records.get(CONFIG)
    if server_round is not None and echo is not None and echo.get(SERVER_ROUND) != server_round:
        return Drop(DropReason.STALE_REPLY, f"its content answers round "
                    f"{echo.get(SERVER_ROUND)!r}, not round {server_round}")
    metrics = content.metric_records[METRICS]
    weight = read_count(metrics.get(NUM_EXAMPLES), limits.max_num_examples)
    if isinstance(weight, str):
        return Drop(DropReason.BAD_NUM_EXAMPLES, f"{NUM_EXAMPLES} {weight}")
    record = content.array_records[ARRAYS]
    keys, want = set(record.keys()), set(sent.expected)
    if keys != want:
        return Drop(DropReason.BAD_KEYS, f"missing {sorted(want - keys)[:5]}, unexpected "
                    f"{sorted(keys - want)[:5]}")
    values: dict[str, np.ndarray] = {}
    for key, (shape, dtype) in sent.expected.items():
        try:
            x = array_view(record[key])  # read-only: the reply's own bytes
        except Exception as err:  # a corrupt payload must not crash the server
            return Drop(DropReason.BAD_ARRAY, f"{key} cannot be decoded ({err})")
        if tuple(x.shape) != shape:
            return Drop(DropReason.BAD_SHAPE,
                        f"{key} has shape {tuple(x.shape)}, expected {shape}")
        if x.dtype != dtype:
            return Drop(DropReason.BAD_DTYPE, f"{key} has dtype {x.dtype}, expected {dtype}")
        if np.issubdtype(x.dtype, np.floating) and not all_finite(x):
            return Drop(DropReason.NON_FINITE, f"{key} holds NaN or inf")
        values[key] = x
    for layer, idx in sent.indices.items():
        if not np.array_equal(values[factor_key(layer, "indices")], idx):
            return Drop(DropReason.BAD_INDICES,
                        f"{layer}.indices differ from the terms this node was sent")
    clipped, ratio = 0, 0.0
    changes: dict[str, tuple[np.ndarray, float]] = {}
    if limits.max_update_ratio > 0:
        factors = {factor_key(layer, p) for layer in sent.indices for p in ("u", "v")}
        norms = {} if sent_norms is None else sent_norms
        for key, before in sent.values.items():
            if not np.issubdtype(before.dtype, np.floating):
                continue
            got = values[key]
            if key in factors:
                values[key], hits, seen_ratio = bound_terms(before, got,
                                                            limits.max_update_ratio)
            else:
                if id(before) not in norms:
                    flat = before.ravel()
                    norms[id(before)] = float(np.dot(flat, flat))
                change_sq = squared_difference(got, before)
                values[key], hits, seen_ratio = bound_dense(
                    before, got, limits.max_update_ratio, sent_sq=norms[id(before)],
                    change_sq=change_sq)
                if not hits:
                    changes[key] = (got, change_sq)
            clipped, ratio = clipped + hits, max(ratio, seen_ratio)
        if clipped and limits.update_policy == "drop":
            return Drop(DropReason.UPDATE_NORM,
                        f"{clipped} factor column(s)/array(s) changed by more than "
                        f"max_update_ratio={limits.max_update_ratio:g} times what was sent "
                        f"(largest ratio {ratio:.3g})")
    kept, ignored, ignored_count = scalar_metrics(metrics, NUM_EXAMPLES)
    # bytes on the wire, counted as for the sent records (serialized Array data)
    nbytes = sum(len(a.data) for a in record.values())
    return TrainReply(node, weight, values, kept, nbytes, tuple(sent.indices), clipped, ratio,
                      tuple(ignored), ignored_count, read_receipt(echo), changes)
