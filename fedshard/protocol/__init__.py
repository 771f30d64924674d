"""The wire contract between :class:`~fedshard.server.strategy.SpectralSharding` and its clients.

It is a contract of Flower's Message API: the legacy API (``client_fn``, ``server_fn``, a
``Strategy`` with ``configure_fit``) is refused with :class:`LegacyApiError`
(:mod:`fedshard.protocol.message_api`).

Every record key is defined here once; the strategy, the client handlers and the tests import
them. Keys are kebab-case (Flower's convention), array keys follow ``state_dict`` names.

Messages
--------
``query`` (server → node, :data:`flwr.app.MessageType.QUERY`)
    ``RecordDict({"query": ConfigRecord({"want": ["keep-ratio", "node-key"]})})``. The node
    answers ``RecordDict({"capabilities": ConfigRecord({"keep-ratio": r, "node-key": k})})``
    with ``0 < r ≤ 1`` and an optional stable key ``k`` (a string; the simulation uses the
    partition id). Flower draws new node ids at every launch; the key keeps node sampling,
    term sampling and training seeds reproducible across launches (and across a resume).
``train`` (server → node)
    ``"arrays"`` (:class:`~flwr.app.ArrayRecord`): for each sharded layer ``L`` (a ``Linear`` or
    ``Conv2d`` module name) ``L.u`` (c_out, n), ``L.v`` (c_in·k·k, n), ``L.omega`` (n,) and
    ``L.indices`` (n,) int64 — the columns ``u'_i = √λ_i u_i``, ``v'_i = √λ_i v_i`` of the
    terms ``i ∈ indices`` of ``W = Σ_i u'_i v'_iᵀ`` and their frozen multipliers ω_i; every other
    ``state_dict`` entry (including ``L.bias``) under its own name.
    ``"config"`` (:class:`~flwr.app.ConfigRecord`): the keys in :data:`TRAIN_CONFIG_KEYS`.
``train`` reply (node → server)
    ``"arrays"``: the same keys without ``L.omega``; ``L.u``/``L.v`` trained, ``L.indices``
    echoed unchanged, the dense entries trained. Same shapes and dtypes as sent, finite values.
    ``"metrics"`` (:class:`~flwr.app.MetricRecord`): ``num-examples`` (> 0, the aggregation
    weight D), ``train-loss``, ``train-accuracy`` (at most
    :data:`~fedshard.protocol.bounds.MAX_REPLY_METRICS` values, names of at most
    :data:`~fedshard.protocol.bounds.MAX_METRIC_NAME` characters: the rest is left out and
    counted). The server keeps them apart from its own statistics, as ``client/<name>``.
    ``"config"`` (:class:`~flwr.app.ConfigRecord`, optional): ``server-round`` echoed; a reply
    whose echo (or whose ``reply_to`` message) is of another round is dropped (``stale-reply``).
``train``, optional ``"fedavg-reference"`` (:data:`REFERENCE`, only with ``fedavg-cosine``)
    An :class:`~flwr.app.ArrayRecord` with the dense global ``state_dict``: the node also
    trains a dense copy of it with the same settings and data order (as ``method = "none"``
    trains) and replies with the trained dense ``state_dict`` under the same name (same keys,
    shapes and dtypes, finite). It feeds the ``fedavg-cosine`` metric only; a node that leaves
    it out still has its shard aggregated.
``evaluate`` (server → node, only when client-side evaluation is on)
    ``"arrays"``: the dense global ``state_dict``; ``"config"``: ``server-round``. Reply
    ``"metrics"``: ``num-examples``, ``eval-loss``, ``eval-accuracy``.
"""

from fedshard.protocol.arrays import array_record, array_view, decode_array, encode_array
from fedshard.protocol.bounds import UPDATE_POLICIES, read_count, scalar_metrics
from fedshard.protocol.capabilities import (
    Capabilities,
    capabilities_reply,
    is_capability_query,
    query_message,
    read_capabilities,
)
from fedshard.protocol.drops import Drop, DropReason
from fedshard.protocol.keys import (
    ARRAYS,
    CAPABILITIES,
    CONFIG,
    DIVERGED,
    EVAL_ACCURACY,
    EVAL_LOSS,
    KEEP_RATIO,
    LR,
    MEMORY_MB,
    METRICS,
    NODE_KEY,
    NUM_EXAMPLES,
    QUERY,
    REFERENCE,
    SERVER_ROUND,
    TRAIN_ACCURACY,
    TRAIN_LOSS,
    factor_key,
    is_factor_key,
    layer_of,
)
from fedshard.protocol.message_api import MESSAGE_API_GUIDE, LegacyApiError, legacy_api_error
from fedshard.protocol.receipts import RECEIPT_KEYS, Receipt, read_receipt
from fedshard.protocol.settings import NODE_KEYS, RECIPE_KEYS, TRAIN_CONFIG_KEYS, TrainSettings
from fedshard.protocol.shards import (
    SentShard,
    TrainReply,
    check_eval_reply,
    check_train_reply,
    decode_shard,
    encode_shard,
    train_reply,
)

__all__ = [
    "ARRAYS",
    "CAPABILITIES",
    "CONFIG",
    "DIVERGED",
    "EVAL_ACCURACY",
    "EVAL_LOSS",
    "KEEP_RATIO",
    "LR",
    "MEMORY_MB",
    "MESSAGE_API_GUIDE",
    "METRICS",
    "NODE_KEY",
    "NODE_KEYS",
    "NUM_EXAMPLES",
    "QUERY",
    "RECEIPT_KEYS",
    "RECIPE_KEYS",
    "REFERENCE",
    "SERVER_ROUND",
    "TRAIN_ACCURACY",
    "TRAIN_CONFIG_KEYS",
    "TRAIN_LOSS",
    "UPDATE_POLICIES",
    "Capabilities",
    "Drop",
    "DropReason",
    "LegacyApiError",
    "Receipt",
    "SentShard",
    "TrainReply",
    "TrainSettings",
    "array_record",
    "array_view",
    "capabilities_reply",
    "check_eval_reply",
    "check_train_reply",
    "decode_array",
    "decode_shard",
    "encode_array",
    "encode_shard",
    "factor_key",
    "is_capability_query",
    "is_factor_key",
    "layer_of",
    "legacy_api_error",
    "query_message",
    "read_capabilities",
    "read_count",
    "read_receipt",
    "scalar_metrics",
    "train_reply",
]
