"""The server side: the Flower strategy and what it is made of.

- :mod:`~fedshard.server.base` - :class:`KeepRatioStrategy`, the base of the strategies: nodes
  that declare a keep ratio, reply checks, the run's rounds, callbacks.
- :mod:`~fedshard.server.strategy` - :class:`SpectralSharding`, the Flower strategy.
- :mod:`~fedshard.server.width` - :class:`WidthSlicing`, its sibling (HeteroFL, FedRolex,
  ordered dropout).
- :mod:`~fedshard.server.rounds` - one training round: shard per keep-ratio group, check the
  replies, aggregate every term over its holders, rebuild W.
- :mod:`~fedshard.server.robust` - what one dishonest node can do within the bounds, undone:
  terms re-signed and re-balanced, the weight cap, the spread bound (a node out of line held
  to the median), Flower's robust rules on dense replies.
- :mod:`~fedshard.server.trusted` - the server's trusted reference update (FLTrust, opt-in);
  :mod:`~fedshard.server.trust_record` - each node's agreement record across rounds, named
  and optionally left out when it keeps pointing elsewhere.
- :mod:`~fedshard.server.nodes` - waiting for nodes, their declared keep ratios, the rules
  that bound them, seeded node sampling.
- :mod:`~fedshard.server.schedule` - a run's rounds (resumed runs count on) and the
  learning-rate schedule over them (cosine).
- :mod:`~fedshard.server.metrics` - per-round metrics, client-metric aggregation, TensorBoard.
- :mod:`~fedshard.server.fedavg_cosine` - the paper's post-gradient analysis (Sec. 4.4).
- :mod:`~fedshard.server.callbacks` - what a run does around its rounds (:class:`RoundCallback`:
  the strategy's own checks and stops, yours); :mod:`~fedshard.server.advice` - what a run
  says and warns as it goes; :mod:`~fedshard.server.stops` - runs that cannot go on or train
  nothing; :mod:`~fedshard.server.side_jobs` - central
  evaluation and TensorBoard as callbacks; :mod:`~fedshard.server.progress` - is the run
  learning (the slow start of a sharded model, an accuracy that keeps falling).
- :mod:`~fedshard.server.central_dp` - central differential privacy for factor shards and
  width slices (:class:`~fedshard.settings.Privacy`): each node's update clipped, every
  per-term and per-entry sum noised, the spent (ε, δ) accounted (Opacus's RDP accountant).
- :mod:`~fedshard.server.privacy` - Flower's DP wrappers and other strategies driving ours
  refused (they assume dense replies; fedshard's own central DP is the setting above).
- :mod:`~fedshard.server.legacy` - Flower's legacy server refused at once (fedshard needs the
  Message API): the strategies get the legacy ``Strategy`` hooks, each raising
  :class:`~fedshard.protocol.LegacyApiError` with the migration guide.
"""

from fedshard.server.advice import (
    CompoundingMultipliers,
    ConfigPrecedence,
    SettingsSummary,
    ShardingBudgetReport,
    SingleNodeGroups,
    SmallCohort,
    TrainingReceipts,
    UntrainedChannels,
)
from fedshard.server.base import KeepRatioStrategy
from fedshard.server.callbacks import RoundCallback, StopRun, default_callbacks
from fedshard.server.metrics import mean_client_metrics
from fedshard.server.nodes import load_keep_ratio_table
from fedshard.server.progress import FallingAccuracy, SlowStart, SpreadShrinksHonestNodes
from fedshard.server.schedule import cosine_lr
from fedshard.server.side_jobs import CentralEvaluation, TensorBoardLog
from fedshard.server.stops import (
    NO_TRAINING_PATIENCE,
    StopOnDivergence,
    StopWhenEveryReplyFails,
    StopWhenUntrained,
    UnchangingModel,
)
from fedshard.server.strategy import (
    SHARDING_METHODS,
    NoRoundTrainedError,
    SpectralSharding,
    TrainingDivergedError,
)
from fedshard.server.trusted import TrustedReference
from fedshard.server.width import WidthSlicing
from fedshard.settings import LR_SCHEDULES

__all__ = [
    "LR_SCHEDULES",
    "NO_TRAINING_PATIENCE",
    "SHARDING_METHODS",
    "CentralEvaluation",
    "CompoundingMultipliers",
    "ConfigPrecedence",
    "FallingAccuracy",
    "KeepRatioStrategy",
    "NoRoundTrainedError",
    "RoundCallback",
    "SettingsSummary",
    "ShardingBudgetReport",
    "SingleNodeGroups",
    "SlowStart",
    "SmallCohort",
    "SpectralSharding",
    "SpreadShrinksHonestNodes",
    "StopOnDivergence",
    "StopRun",
    "StopWhenEveryReplyFails",
    "StopWhenUntrained",
    "TensorBoardLog",
    "TrainingDivergedError",
    "TrainingReceipts",
    "TrustedReference",
    "UnchangingModel",
    "UntrainedChannels",
    "WidthSlicing",
    "cosine_lr",
    "default_callbacks",
    "load_keep_ratio_table",
    "mean_client_metrics",
]
