"""The client side: declare a keep ratio, receive a shard, train it (with your loop or
fedshard's), reply.

- :mod:`~fedshard.client.handlers` - :func:`handle_query`, :func:`handle_train`,
  :func:`handle_evaluate`, :func:`keep_ratio_of` (fedshard's own ClientApp uses them).
- :mod:`~fedshard.client.shard` - :class:`Shard` / :func:`receive`: the received sub-model for
  your own training loop, and its reply.
- :mod:`~fedshard.client.keep_ratios` - :class:`KeepRatioMixture`, :func:`node_keep_ratio`:
  which keep ratio a node declares (its own, or its share of a simulated mix).
- :mod:`~fedshard.client.app` - :class:`ShardingClientApp` and :func:`sharding_mod`: Flower
  glue for an existing project.
- :mod:`~fedshard.client.clipping` - :func:`clip_update_mod`: a node's update clipped before
  it is sent, for a server running central differential privacy.
- :mod:`~fedshard.client.width` - :func:`handle_width_train`: a node of width slicing
  (HeteroFL's scaler, ordered dropout's step).
- :mod:`~fedshard.client.node` - :func:`handle_node_train`: whichever of the two a ``train``
  message asks for (:func:`train_kind`), the dispatch fedshard's ClientApp and engines share.
- :mod:`~fedshard.client.train` - local training: the plain loop and the client rules (SGD-m,
  Frobenius decay, ClipLR) for any optimizer.
"""

from fedshard.client.app import ShardingClientApp, sharding_mod
from fedshard.client.clipping import clip_update_mod
from fedshard.client.handlers import (
    handle_evaluate,
    handle_query,
    handle_train,
    keep_ratio_of,
    node_key_of,
)
from fedshard.client.keep_ratios import KeepRatioMixture, node_keep_ratio
from fedshard.client.node import handle_node_train, train_kind
from fedshard.client.shard import (
    Shard,
    SubmodelCache,
    receive,
    shard_reply,
    submodel_from_record,
)
from fedshard.client.train import (
    ClientRules,
    EvalResult,
    TensorBatches,
    TrainConfig,
    TrainResult,
    frobenius_penalty,
)
from fedshard.client.width import OrderedDropout, handle_width_train

__all__ = [
    "ClientRules",
    "EvalResult",
    "KeepRatioMixture",
    "OrderedDropout",
    "Shard",
    "ShardingClientApp",
    "SubmodelCache",
    "TensorBatches",
    "TrainConfig",
    "TrainResult",
    "clip_update_mod",
    "frobenius_penalty",
    "handle_evaluate",
    "handle_node_train",
    "handle_query",
    "handle_train",
    "handle_width_train",
    "keep_ratio_of",
    "node_keep_ratio",
    "node_key_of",
    "receive",
    "shard_reply",
    "sharding_mod",
    "submodel_from_record",
    "train_kind",
]
