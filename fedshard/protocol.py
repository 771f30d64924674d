"""The wire contract between :class:`~fedshard.strategy.SpectralSharding` and its clients.

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
    weight D), ``train-loss``, ``train-accuracy``.
``evaluate`` (server → node, only when client-side evaluation is on)
    ``"arrays"``: the dense global ``state_dict``; ``"config"``: ``server-round``. Reply
    ``"metrics"``: ``num-examples``, ``eval-loss``, ``eval-accuracy``.
"""

from __future__ import annotations

__all__ = [
    "ARRAYS",
    "CAPABILITIES",
    "CONFIG",
    "EVAL_ACCURACY",
    "EVAL_LOSS",
    "KEEP_RATIO",
    "METRICS",
    "NODE_KEY",
    "NUM_EXAMPLES",
    "QUERY",
    "TRAIN_ACCURACY",
    "TRAIN_CONFIG_KEYS",
    "TRAIN_LOSS",
    "factor_key",
    "is_factor_key",
    "layer_of",
]

# Record names inside a RecordDict
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
QUERY = "query"
CAPABILITIES = "capabilities"

# Capability / metric keys
KEEP_RATIO = "keep-ratio"
NODE_KEY = "node-key"
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
TRAIN_ACCURACY = "train-accuracy"
EVAL_LOSS = "eval-loss"
EVAL_ACCURACY = "eval-accuracy"

# What a train ConfigRecord carries (all set by the strategy, per node).
TRAIN_CONFIG_KEYS = (
    "server-round",
    "lr",
    "local-epochs",
    "batch-size",
    "momentum",
    "frobenius-decay",
    "clip-lr-tau",  # 0.0 = ClipLR off
    "weight-decay",
    "keep-ratio",
    "train-seed",
    "method",
)

_FACTOR_PARTS = ("u", "v", "omega", "indices")


def factor_key(layer: str, part: str) -> str:
    """Array key of ``part`` (``"u"``, ``"v"``, ``"omega"``, ``"indices"``) of ``layer``."""
    if part not in _FACTOR_PARTS:
        raise ValueError(f"part={part!r}: expected one of {_FACTOR_PARTS}")
    return f"{layer}.{part}"


def is_factor_key(key: str, layers: frozenset[str] | set[str]) -> bool:
    """Whether ``key`` is a factor entry of one of ``layers``."""
    layer, _, part = key.rpartition(".")
    return part in _FACTOR_PARTS and layer in layers


def layer_of(key: str) -> str:
    """Module name of a ``"<layer>.<part>"`` key."""
    return key.rpartition(".")[0]
