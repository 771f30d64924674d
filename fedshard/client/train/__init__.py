"""Local training of a (sub-)model: SGD with momentum, Frobenius decay and ClipLR (paper
Sec. 3.3), on batches held on the training device.

- :mod:`~fedshard.client.train.config` - :class:`TrainConfig`, :class:`TrainResult`,
  :class:`EvalResult`.
- :mod:`~fedshard.client.train.optim` - :class:`ClipLR` (per-term lr ``min(1, τ/ω_i)``) and
  Frobenius decay (:func:`frobenius_penalty`, :class:`FrobeniusDecay`).
- :mod:`~fedshard.client.train.batches` - :class:`TensorBatches` and batch unpacking.
- :mod:`~fedshard.client.train.loop` - :func:`train` and :func:`evaluate`.
- :mod:`~fedshard.client.train.fast` - compiled and CUDA-graph steps, padding, the step pool.
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
from fedshard.client.train.loop import STEP_POOL, build_optimizer, evaluate, train
from fedshard.client.train.optim import ClipLR, FrobeniusDecay, frobenius_penalty

__all__ = [
    "INPUT_KEYS",
    "STEP_POOL",
    "TARGET_KEYS",
    "ClipLR",
    "EvalResult",
    "FrobeniusDecay",
    "TensorBatches",
    "TrainConfig",
    "TrainResult",
    "batches_for",
    "build_optimizer",
    "dataset_size",
    "evaluate",
    "frobenius_penalty",
    "train",
    "unpack_batch",
]
