"""The fast path's options, in one object: :class:`FastOptions`.

Give one to :class:`~fedshard.client.train.TrainConfig` (``fast=FastOptions(compile=True)``)
or to :func:`~fedshard.client.handle_train` (``fast=...``); the plain loop then takes its step
from :meth:`FastOptions.open_step` instead of the eager one. Without it (``fast=None``) the
loop runs the eager step (:class:`~fedshard.client.train.step.EagerStep`) and nothing of this
package is imported. Where each option wins, measured: ``benchmarks/README.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from fedshard.settings import BOOL, Settings, rule, setting

if TYPE_CHECKING:
    from fedshard.client.train.config import TrainConfig
    from fedshard.client.train.fast.step import TrainStep

__all__ = ["FastOptions"]


@dataclass(frozen=True)
class FastOptions(Settings):
    """Opt-in speed for local training: the same numbers as the eager step up to float
    rounding.

    Attributes
    ----------
    compile : bool
        Compile the forward and backward with ``torch.compile`` (Inductor's fused kernels;
        on a GPU combine it with ``cuda_graph``, which captures them in the whole-step
        graph). The first model of each structure in a process pays the compilation (and its
        first short batch a recompilation for any batch size); later models of that
        structure (a client's next round, other clients in the process) reuse it.
    cuda_graph : bool
        Capture the whole step (forward, backward, Frobenius decay, clipping, ClipLR + the
        optimizer's step) as one CUDA graph per batch shape, after an eager warm-up step of
        that shape, and replay it: one launch per step instead of hundreds, which is what
        bounds a small sub-model's step on a GPU. CUDA only (a ``ValueError`` on another
        device).
    merge_terms : bool
        Train every :class:`~fedshard.spectral.SpectralConv2d` as one dense convolution
        whose kernel ``U diag(ω) Vᵀ`` is rebuilt each step, instead of a k×k convolution to
        ``n`` channels and a 1×1 one. The same function and gradients up to rounding; fewer
        kernels, the dense model's convolution FLOPs: for steps bound by kernel launches or
        latency (small sub-models on a GPU), slower where FLOPs count (CPU).
    pad_terms : int or None
        Pad every :class:`~fedshard.spectral.SpectralConv2d`'s ``n`` intermediate channels
        with zero terms to a multiple of this (exact: zero terms add nothing and get zero
        gradients). ``None``: 8 for ``cuda_graph`` on CUDA without ``compile`` (cuDNN's
        kernels for thin convolutions with other channel counts are slow), else 1.
    reuse_step : bool or None
        Train on a pooled step (:data:`~fedshard.client.train.fast.STEP_POOL`, one per
        process): a later model of the same shapes and settings (the next client of the same
        keep ratio in a Ray worker or on the in-process grid) is copied into a kept model
        copy whose step, optimizer and CUDA graphs already exist, so it skips the warm-up and
        capture; its trained state is copied back. The same numbers as a fresh step (the
        optimizer's state starts empty). ``None``: on with ``cuda_graph``, off otherwise.
        Turn it off for a model whose forward depends on state the pool cannot see (it
        compares modules, tensor shapes, plain attributes and ``repr``; hooks disable
        pooling).
    """

    compile: bool = setting(False, BOOL)
    cuda_graph: bool = setting(False, BOOL)
    merge_terms: bool = setting(False, BOOL)
    pad_terms: int | None = setting(
        None, rule(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                   "expected an int ≥ 1 (1: no padding) or None (auto)", optional=True),
        run=False)
    reuse_step: bool | None = setting(
        None, rule(lambda v: isinstance(v, bool), "expected True, False or None (auto)",
                   optional=True), run=False)

    def enabled(self) -> bool:
        """Whether any option is on: ``compile``, ``cuda_graph``, ``merge_terms``,
        ``reuse_step=True`` or a ``pad_terms`` other than 1 (``None`` counts only under
        ``cuda_graph``). Otherwise the loop runs its eager step."""
        return (self.compile or self.cuda_graph or self.merge_terms or self.reuse_step is True
                or self.pad_terms not in (None, 1))

    @contextmanager
    def open_step(self, model: nn.Module, cfg: TrainConfig) -> Iterator[TrainStep]:
        """The fast step that trains ``model`` (on its training device) with ``cfg``.

        First :func:`~fedshard.client.train.fast.configure_convolutions` sets ``model``'s
        sharded convolutions to the form these options ask for (padded or merged; left so
        afterwards). Then a pooled step (:data:`~fedshard.client.train.fast.STEP_POOL`, under
        ``reuse_step``, by default with ``cuda_graph``), or a fresh
        :class:`~fedshard.client.train.fast.TrainStep`. On exit the trained state is in
        ``model`` and a fresh step's CUDA graphs are released.
        """
        from fedshard.client.train.fast.convolutions import configure_convolutions
        from fedshard.client.train.fast.plug import STEP_POOL
        from fedshard.client.train.fast.step import TrainStep

        configure_convolutions(model, cfg)
        reuse = self.cuda_graph if self.reuse_step is None else self.reuse_step
        if reuse:
            with STEP_POOL.lease(model, cfg) as step:
                yield step
        else:
            with TrainStep(model, cfg) as step:
                yield step
