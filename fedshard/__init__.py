"""fedshard: spectral model sharding for federated learning.

Packages (data flows one way: sampling → spectral → client / server → app):

- :mod:`fedshard.settings` - the settings, one frozen, validated dataclass per concern
  (:class:`Sharding`, :class:`LocalTraining`, :class:`ReplyPolicy`, :class:`NodePolicy`,
  :class:`Cohort`, :class:`Slicing`, :class:`Privacy`),
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
- :mod:`fedshard.server` - the Flower strategy :class:`SpectralSharding` and its sibling
  :class:`WidthSlicing` on their shared base (nodes, reply checks, the run's rounds,
  callbacks), the rounds, lr schedule, metrics, the FedAvg-cosine analysis, central
  differential privacy for shards and slices, and the guard against Flower's DP wrappers.
- :mod:`fedshard.width` - width slicing (HeteroFL, FedRolex, ordered dropout), the
  alternative the paper's method is compared with: model families, slices, their average and
  the width of equal cost; its strategy is :class:`WidthSlicing`.
- :mod:`fedshard.models`, :mod:`fedshard.data` - the paper's models and data sets.
- :mod:`fedshard.app` - fedshard's own Flower app (run config, task, the ServerApp's run and
  its callbacks, checkpoints, result files); the library never imports it.

The lab tooling - experiment suites, their reports and plots, the in-process engines, the
Shakespeare builder - is a separate package, ``fedshard_lab`` (the repository's ``lab/``,
``pip install -e ./lab``), which imports fedshard; fedshard never imports it.

From the paper to the code (the same table, with links, is the docs' "From the paper to the
code" page):

==========================================  ==================================================
Paper                                       Code
==========================================  ==================================================
SVD, √λ absorbed (Sec. 3.1, step 1)         ``fedshard.spectral.decompose``,
                                            ``fedshard.spectral.decompose.layer_spectrum``
n = ⌈rN⌉ terms per client                   ``fedshard.sampling.num_terms``
Theorem 1, Unbiased: ω = 1/π (Sec. 3.2.1)   ``fedshard.sampling.inclusion_probabilities``
                                            (``method="unbiased"``)
Theorem 2, Collective (Sec. 3.2.2)          ``fedshard.sampling.inclusion_probabilities``
                                            (``method="collective"``), ω = C/(1+π(C−1))
PriSM, its Wallenius mean, +Scaled          ``fedshard.sampling.inclusion_probabilities``,
                                            ``fedshard.sampling.wallenius_mean``,
                                            ``fedshard.sampling.scaled_multipliers``
Conditional Poisson sampling (Sec. 3.2.3)   ``fedshard.sampling.ConditionalPoisson`` (also
                                            ``fedshard.sampling.Brewer``,
                                            ``fedshard.sampling.MinimumSupport``)
Method and design per group and layer       ``fedshard.sampling.draw_layer``,
                                            ``fedshard.sampling.plan_round``
Factorized layer U·diag(ω)·Vᵀ               ``fedshard.spectral.SpectralLinear``,
                                            ``fedshard.spectral.SpectralConv2d``,
                                            ``fedshard.spectral.SpectralConvTranspose2d``
Frobenius decay γ‖UΩVᵀ‖²_F (Sec. 3.3)       ``fedshard.client.train.frobenius_penalty``,
                                            ``fedshard.client.train.ClientRules``
ClipLR min(1, τ/ωᵢ) (Sec. 3.3)              ``fedshard.client.train.ClientRules.after_step``
Per-term aggregation (Sec. 3.1, step 3)     ``fedshard.spectral.aggregate.term_means``,
                                            ``fedshard.spectral.aggregate.rebuild_weight``
Cosine lr over rounds (Sec. 4.1)            ``fedshard.server.cosine_lr``
ANME (Sec. 4.2.2)                           ``fedshard.sampling.anme``
Post-client updates vs FedAvg (Sec. 4.4)    ``fedshard.server.fedavg_cosine.fedavg_cosines``
(beyond) Theorem 1 / 2 on λ^γ, annealed     ``fedshard.sampling.annealed_probabilities``,
                                            ``fedshard.sampling.anneal_exponent``
(beyond) the low-rank start                 ``fedshard.spectral.truncation.truncate_``
==========================================  ==================================================
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
from fedshard.client.clipping import clip_update_mod
from fedshard.client.train import evaluate, train
from fedshard.logs import route_to_flower
from fedshard.server import SHARDING_METHODS, SpectralSharding, TrustedReference, WidthSlicing
from fedshard.settings import (
    Cohort,
    LocalTraining,
    NodePolicy,
    Privacy,
    ReplyPolicy,
    SettingsError,
    Sharding,
    Slicing,
    robust_defaults,
)
from fedshard.spectral import low_memory, sharded_layer_names
from fedshard.width import WidthFamily

__version__ = "0.1.0"

route_to_flower()  # fedshard's log lines with Flower's format and level (fedshard.logs)

__all__ = [
    "SHARDING_METHODS",
    "Cohort",
    "LocalTraining",
    "NodePolicy",
    "Privacy",
    "ReplyPolicy",
    "SettingsError",
    "Shard",
    "Sharding",
    "ShardingClientApp",
    "Slicing",
    "SpectralSharding",
    "TrainConfig",
    "TrustedReference",
    "WidthFamily",
    "WidthSlicing",
    "__version__",
    "clip_update_mod",
    "evaluate",
    "handle_evaluate",
    "handle_query",
    "handle_train",
    "keep_ratio_of",
    "low_memory",
    "receive",
    "robust_defaults",
    "sharded_layer_names",
    "sharding_mod",
    "train",
]
