"""Local training of a (sub-)model: SGD with momentum, Frobenius decay and ClipLR (paper
Sec. 3.3), on batches held on the training device.

- :mod:`~fedshard.client.train.config` - :class:`TrainConfig`, :class:`TrainResult`,
  :class:`EvalResult`.
- :mod:`~fedshard.client.train.optim` - :func:`build_optimizer`, :class:`ClipLR` (per-term
  lr ``min(1, τ/ω_i)``) and Frobenius decay (:func:`frobenius_penalty`,
  :class:`FrobeniusDecay`).
- :mod:`~fedshard.client.train.precondition` - :class:`DenseFactorStep`: factor steps that
  move ``W = U Ω Vᵀ`` as a dense step would, so the dense model's lr works.
- :mod:`~fedshard.client.train.step` - :class:`EagerStep`, one training step on one batch.
- :mod:`~fedshard.client.train.batches` - :class:`TensorBatches` and batch unpacking.
- :mod:`~fedshard.client.train.loop` - :func:`train` and :func:`evaluate`, the plain loop.
- :mod:`~fedshard.client.train.fast` - opt-in speed: compiled and CUDA-graph steps, padded
  or merged convolutions, the step pool (:data:`STEP_POOL`).
"""

from fedshard.client.train.batches import (
    INPUT_KEYS,
    TARGET_KEYS,
    TensorBatches,
    batches_for,
    dataset_size,
    unpack_batch,
)
from fedshard.client.train.config import EvalResult, TrainConfig, TrainResult
from fedshard.client.train.fast import STEP_POOL
from fedshard.client.train.loop import evaluate, train
from fedshard.client.train.optim import ClipLR, FrobeniusDecay, build_optimizer, frobenius_penalty
from fedshard.client.train.precondition import DenseFactorStep, dense_factor_gradient
from fedshard.client.train.step import EagerStep, cross_entropy_sums

__all__ = [
    "INPUT_KEYS",
    "STEP_POOL",
    "TARGET_KEYS",
    "ClipLR",
    "DenseFactorStep",
    "EagerStep",
    "EvalResult",
    "FrobeniusDecay",
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
    "train",
    "unpack_batch",
]
