"""Local training of a (sub-)model: SGD with momentum, Frobenius decay and ClipLR (paper
Sec. 3.3), on batches held on the training device.

- :mod:`~fedshard.client.train.config` - :class:`TrainConfig`, :class:`TrainResult`,
  :class:`EvalResult`.
- :mod:`~fedshard.client.train.rules` - :class:`ClientRules`: Frobenius decay, the dense
  factor step and ClipLR (per-term lr ``min(1, τ/ω_i)``), once, for any optimizer they are
  attached to (:class:`RulesHandle`).
- :mod:`~fedshard.client.train.optim` - :func:`build_optimizer` (SGD with momentum, the rules
  attached) and :func:`frobenius_penalty`.
- :mod:`~fedshard.client.train.precondition` - the dense factor step's transform: factor
  steps that move ``W = U Ω Vᵀ`` as a dense step would, so the dense model's lr works.
- :mod:`~fedshard.client.train.step` - :class:`EagerStep`, one training step on one batch.
- :mod:`~fedshard.client.train.batches` - :class:`TensorBatches` and batch unpacking.
- :mod:`~fedshard.client.train.loop` - :func:`train` and :func:`evaluate`, the plain loop.
- :mod:`~fedshard.client.train.fast` - opt-in speed
  (:class:`~fedshard.client.train.fast.FastOptions`): compiled and CUDA-graph steps, padded or
  merged convolutions, the step pool; not imported here.
"""

from fedshard.client.train.batches import (
    INPUT_KEYS,
    TARGET_KEYS,
    TensorBatches,
    batches_for,
    dataset_size,
    unpack_batch,
)
from fedshard.client.train.config import (
    EvalResult,
    FastPath,
    Step,
    StepFactory,
    TrainConfig,
    TrainResult,
)
from fedshard.client.train.loop import evaluate, train
from fedshard.client.train.optim import build_optimizer, frobenius_penalty, parameter_groups
from fedshard.client.train.precondition import dense_factor_gradient
from fedshard.client.train.rules import ClientRules, RulesHandle, RulesReport
from fedshard.client.train.step import EagerStep, cross_entropy_sums

__all__ = [
    "INPUT_KEYS",
    "TARGET_KEYS",
    "ClientRules",
    "EagerStep",
    "EvalResult",
    "FastPath",
    "RulesHandle",
    "RulesReport",
    "Step",
    "StepFactory",
    "TensorBatches",
    "TrainConfig",
    "TrainResult",
    "batches_for",
    "build_optimizer",
    "cross_entropy_sums",
    "dataset_size",
    "dense_factor_gradient",
    "evaluate",
    "frobenius_penalty",
    "parameter_groups",
    "train",
    "unpack_batch",
]
