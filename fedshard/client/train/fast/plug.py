"""Where the fast path plugs into :func:`fedshard.client.train.train`: :func:`enabled` says
whether a :class:`~fedshard.client.train.TrainConfig` asks for it, :func:`open_step` hands
the loop a step. The loop uses nothing else from this package.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from fedshard.client.train.config import TrainConfig
from fedshard.client.train.fast.pool import StepPool
from fedshard.client.train.fast.step import TrainStep, configure_convolutions

__all__ = ["STEP_POOL", "enabled", "open_step"]

#: The process's pooled steps (``TrainConfig.reuse_step``); ``STEP_POOL.clear()`` frees them.
STEP_POOL = StepPool(size=4)


def enabled(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` asks for any fast option: ``compile``, ``cuda_graph``, ``merge_terms``,
    ``reuse_step=True`` or a ``pad_terms`` other than 1 (``None`` counts only under
    ``cuda_graph``). Otherwise :func:`~fedshard.client.train.train` runs its eager step."""
    return (cfg.compile or cfg.cuda_graph or cfg.merge_terms or cfg.reuse_step is True
            or cfg.pad_terms not in (None, 1))


@contextmanager
def open_step(model: nn.Module, cfg: TrainConfig) -> Iterator[TrainStep]:
    """The fast step that trains ``model`` (on its training device) with ``cfg``.

    First :func:`~fedshard.client.train.fast.configure_convolutions` sets ``model``'s sharded
    convolutions to the form ``cfg`` asks for (padded or merged; left so afterwards). Then a
    pooled step (:data:`STEP_POOL`, under ``cfg.reuse_step``, by default with
    ``cuda_graph``), or a fresh :class:`TrainStep`. On exit the trained state is in
    ``model`` and a fresh step's CUDA graphs are released.
    """
    configure_convolutions(model, cfg)
    reuse = cfg.cuda_graph if cfg.reuse_step is None else cfg.reuse_step
    if reuse:
        with STEP_POOL.lease(model, cfg) as step:
            yield step
    else:
        with TrainStep(model, cfg) as step:
            yield step
