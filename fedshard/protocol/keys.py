"""Record names and keys of the wire format, each defined once (kebab-case, Flower's style)."""

from __future__ import annotations

__all__ = [
    "ARRAYS", "CAPABILITIES", "CONFIG", "DIVERGED", "EVAL_ACCURACY", "EVAL_LOSS", "KEEP_RATIO",
    "LR", "MEMORY_MB", "METRICS", "NODE_KEY", "NUM_EXAMPLES", "QUERY", "REFERENCE", "SERVER_ROUND",
    "TRAINING_PEAK_MB", "TRAIN_ACCURACY", "TRAIN_LOSS", "factor_key", "is_factor_key", "layer_of",
]

# Record names inside a RecordDict
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
QUERY = "query"
CAPABILITIES = "capabilities"
REFERENCE = "fedavg-reference"  # the dense model a node also trains when fedavg-cosine is on

# Capability / metric keys
KEEP_RATIO = "keep-ratio"
MEMORY_MB = "memory-mb"  # a node's memory budget (MiB), node config and capability reply
TRAINING_PEAK_MB = "training-peak-mb"  # what the node measured its training to hold (MiB)
NODE_KEY = "node-key"
NUM_EXAMPLES = "num-examples"
SERVER_ROUND = "server-round"  # the train config's round, echoed in the train reply
LR = "lr"  # the train config's learning rate (FedAvg users put theirs there too)
TRAIN_LOSS = "train-loss"
TRAIN_ACCURACY = "train-accuracy"
EVAL_LOSS = "eval-loss"
EVAL_ACCURACY = "eval-accuracy"

# How a node's error reply says that its training diverged (the reason starts with it)
DIVERGED = "Training diverged"

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
