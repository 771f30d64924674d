"""fedshard: spectral model sharding for federated learning.

Packages (data flows one way: sampling → spectral → client / server → app):

- :mod:`fedshard.settings` - the settings, one frozen, validated dataclass per concern
  (:class:`Sharding`, :class:`LocalTraining`, :class:`ReplyPolicy`, :class:`NodePolicy`),
  shared by the run config, the strategy, the wire codec and the node's trainer.
- :mod:`fedshard.sampling` - inclusion probabilities, multipliers, sampling designs, the
  annealed methods, the round's plan and the random streams (numpy only).
- :mod:`fedshard.spectral` - SVD, factorized layers, model surgery, per-term aggregation, rank
  truncation (torch only).
- :mod:`fedshard.protocol` - the wire contract: record keys, train settings, shards, reply checks
  and bounds.
- :mod:`fedshard.client` - the client: message handlers, the received shard for your own loop,
  the ClientApp glue, and :mod:`fedshard.client.train` (the local-training recipe; the fast
  path fenced in :mod:`fedshard.client.train.fast`).
- :mod:`fedshard.server` - the Flower strategy :class:`SpectralSharding`, its rounds, nodes,
  lr schedule, metrics, the FedAvg-cosine analysis and the DP guard.
- :mod:`fedshard.width` - width slicing (HeteroFL, FedRolex, ordered dropout), the
  alternative the paper's method is compared with: model families, slices, their average and
  the width of equal cost; its strategy is :class:`WidthSlicing`.
- :mod:`fedshard.models`, :mod:`fedshard.data` - the paper's models and data sets.
- :mod:`fedshard.app` - fedshard's own Flower app (run config, task, the ServerApp's run and
  its callbacks, checkpoints, result files); the library never imports it.
- :mod:`fedshard.experiments` - suites of runs, their reports and plots (a command line tool).

From the paper to the code:

======================================  ==================================================
Paper                                   Code
======================================  ==================================================
SVD, √λ absorbed (Sec. 3.1 step 1)      ``spectral.decompose.decompose``, ``layer_spectrum``
n = ⌈rN⌉                                ``sampling.plan.num_terms``
Theorem 1 (Unbiased, ω = 1/π)           ``sampling.probabilities._unbiased_sorted``
Theorem 2 (Collective, ω=C/(1+π(C−1)))  ``sampling.probabilities._collective_sorted``
PriSM, Wallenius mean, +Scaled          ``sampling.probabilities``, ``sampling.wallenius``
Conditional Poisson sampling (CPS)      ``sampling.cps.ConditionalPoisson``
Method → design, per group and layer    ``sampling.plan.draw_layer``, ``plan_round``
ANME                                    ``sampling.entropy.anme``
Factorized layer U·diag(ω)·Vᵀ           ``spectral.layers.SpectralLinear``, ``spectral.conv``
Frobenius decay γ‖UΩVᵀ‖²_F (Sec. 3.3)   ``client.train.optim.frobenius_penalty``, ``FrobeniusDecay``
ClipLR min(1, τ/ω_i) (Sec. 3.3)         ``client.train.optim.ClipLR.column_scale``
Per-term aggregation (Sec. 3.1 step 3)  ``spectral.aggregate.term_means``, ``rebuild_weight``
Cosine lr over rounds (Sec. 4.1)        ``server.schedule.cosine_lr``
Post-client updates vs FedAvg (4.4)     ``server.fedavg_cosine.fedavg_cosines``
(beyond) Theorem 1/2 on λ^γ, annealed   ``sampling.anneal.annealed_probabilities``
(beyond) low-rank start, truncation     ``spectral.truncation.truncate_``
======================================  ==================================================
"""

from fedshard.client import (
    Shard,
    ShardingClientApp,
    TrainConfig,
    handle_evaluate,
    handle_query,
    handle_train,
    keep_ratio_of,
    receive,
    sharding_mod,
)
from fedshard.client.train import evaluate, train
from fedshard.logs import route_to_flower
from fedshard.server import SHARDING_METHODS, SpectralSharding, WidthSlicing
from fedshard.settings import (
    LocalTraining,
    NodePolicy,
    ReplyPolicy,
    SettingsError,
    Sharding,
    Slicing,
)
from fedshard.spectral import sharded_layer_names
from fedshard.width import WidthFamily

__version__ = "0.1.0"

route_to_flower()  # fedshard's log lines with Flower's format and level (fedshard.logs)

__all__ = [
    "SHARDING_METHODS",
    "LocalTraining",
    "NodePolicy",
    "ReplyPolicy",
    "SettingsError",
    "Shard",
    "Sharding",
    "ShardingClientApp",
    "Slicing",
    "SpectralSharding",
    "TrainConfig",
    "WidthFamily",
    "WidthSlicing",
    "__version__",
    "evaluate",
    "handle_evaluate",
    "handle_query",
    "handle_train",
    "keep_ratio_of",
    "receive",
    "sharded_layer_names",
    "sharding_mod",
    "train",
]
