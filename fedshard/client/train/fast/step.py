"""The fast training step: :class:`TrainStep`, the reference :class:`EagerStep` with its
forward/backward compiled (``torch.compile``) and/or the whole step replayed from CUDA graphs,
and :func:`conv_options`, the sharded convolutions' form the options ask for. Same numbers as
the eager step up to float rounding.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedshard.client.train.config import TrainConfig
from fedshard.client.train.fast.convolutions import conv_form
from fedshard.client.train.fast.options import FastOptions
from fedshard.client.train.step import EagerStep
from fedshard.spectral.conv import SpectralConv2d

__all__ = ["TrainStep", "conv_options"]


def _options(cfg: TrainConfig) -> FastOptions:
    """``cfg``'s fast options (all off when it has none)."""
    return cfg.fast if isinstance(cfg.fast, FastOptions) else FastOptions()


def conv_options(model: nn.Module, cfg: TrainConfig) -> tuple[int, bool]:
    """``(pad_terms_to, merge_terms)`` that ``cfg``'s fast options ask of the sharded
    convolutions of ``model`` (on its training device): ``pad_terms``, or when it is ``None``
    8 under ``cuda_graph`` on CUDA without ``compile`` and 1 otherwise; and ``merge_terms``."""
    opts = _options(cfg)
    pad = opts.pad_terms
    if pad is None:
        on_cuda = any(p.is_cuda for p in model.parameters())
        pad = 8 if opts.cuda_graph and on_cuda and not opts.compile else 1
    return pad, opts.merge_terms


class TrainStep(EagerStep):
    """:class:`~fedshard.client.train.step.EagerStep` made fast: the forward and loss compiled
    (``FastOptions.compile``) and/or the whole step captured as CUDA graphs and replayed
    (``FastOptions.cuda_graph``).

    Parameters
    ----------
    model : nn.Module
        On its training device, in train mode, its sharded convolutions already in the form
        ``cfg`` asks for (:func:`configure_convolutions`); this class does not change them.
    cfg : TrainConfig
        Settings; ``compile`` compiles the forward/backward (Inductor's fused kernels; with
        ``cuda_graph`` inside the whole-step graph).

    Raises
    ------
    ValueError
        If ``cuda_graph`` is set and the model is not on a CUDA device, or if the
        model's convolutions are not in the form ``cfg`` asks for.

    Notes
    -----
    Use it as a context manager (``with TrainStep(model, cfg) as step:``), or call
    :meth:`release_graphs` when done: a dropped step is otherwise freed only by Python's
    garbage collector (its bound methods form reference cycles), with its graphs' memory.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig) -> None:
        wanted = conv_options(model, cfg)
        found = {conv_form(m) for m in model.modules() if isinstance(m, SpectralConv2d)}
        if found - {wanted}:
            raise ValueError(
                f"FastOptions ask for sharded convolutions with (pad_terms_to, merge_terms) = "
                f"{wanted}, the model has {sorted(found)}; call "
                "fedshard.client.train.fast.configure_convolutions(model, cfg) first (it sets "
                "them on the model). No step was built.")
        super().__init__(model, cfg)
        opts = _options(cfg)
        if opts.cuda_graph and not all(p.is_cuda for p in self.params):
            raise ValueError(
                f"FastOptions.cuda_graph=True needs the model on a CUDA device, got "
                f"device={cfg.device!r}; set cuda_graph=False (or train on a GPU). No step "
                "was run.")
        # Forward and loss only (AOTAutograd differentiates them): the compiled code is
        # shared by every later step of a model with the same structure; the update stays
        # eager (few kernels already). benchmarks/README.md: why not the optimizer step,
        # and why not Inductor's own CUDA graphs.
        eager_loss = super().loss
        self._loss: Callable[..., tuple[torch.Tensor, ...]] = (
            torch.compile(eager_loss) if opts.compile else eager_loss)
        self._graphs: _StepGraphs | None = (
            _StepGraphs(super().__call__) if opts.cuda_graph else None)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`EagerStep.loss`, compiled under ``FastOptions.compile``."""
        return self._loss(inputs, targets)

    def __call__(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Train on one batch, as :meth:`EagerStep.__call__`. Under ``FastOptions.cuda_graph`` the
        outputs are the graph's static tensors: read them before the next call."""
        if self._graphs is not None:
            return self._graphs(inputs, targets)
        return super().__call__(inputs, targets)

    @torch.no_grad()
    def load_state(self, model: nn.Module) -> None:
        """Make this step train ``model``'s state next: copy its parameters and buffers (ω
        among them) into the step's own model in place, and restart the optimizer's
        momentum at zero.

        ``model`` must have the step's model's structure and shapes (what
        :class:`~fedshard.client.train.fast.StepPool` checks). The step's tensors keep their
        identity, so its captured CUDA graphs stay valid and train ``model`` on their next
        replay. A zero momentum buffer gives SGD's first step (``0.9 · 0 + g = g``).
        """
        _copy_state(self.model, model)
        momenta = [s["momentum_buffer"] for s in self.optimizer.state.values()
                   if s.get("momentum_buffer") is not None]
        for buf in momenta:
            buf.zero_()
        self.rules.steps = 0  # what the rules report is this model's round

    def store_state(self, model: nn.Module) -> None:
        """Copy the step's model's parameters and buffers into ``model`` in place (the
        counterpart of :meth:`load_state`)."""
        _copy_state(model, self.model)

    def release_graphs(self) -> None:
        """Free the captured CUDA graphs and their memory pools now (a later call captures
        again)."""
        if self._graphs is not None:
            self._graphs.clear()

    def __enter__(self) -> TrainStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_graphs()


@torch.no_grad()
def _copy_state(dst: nn.Module, src: nn.Module) -> None:
    """Copy ``src``'s parameters and buffers into ``dst``'s (same structure), in place.

    Once per client round (not per step), so one copy per tensor through public API."""
    pairs = zip([*dst.parameters(), *dst.buffers()], [*src.parameters(), *src.buffers()],
                strict=True)
    for d, s in pairs:
        d.copy_(s)


#: Held while a thread captures a CUDA graph and while graphs are released: destroying a graph
#: while another thread's stream captures would invalidate that capture (CUDA's default,
#: global capture mode), and captures in two threads at once would interleave their
#: gc.disable()/enable().
_CAPTURE_LOCK = threading.Lock()


class _StepGraphs:
    """A training step replayed from CUDA graphs, one per batch shape (PyTorch's whole-network
    capture recipe): ``_WARMUP`` eager steps of a shape on a side stream (they are real
    steps: they create the momentum buffers), then the next step of that shape is captured
    and replayed; every later one copies its batch into the graph's static inputs and
    replays. The outputs are the graph's static tensors: read them before the next step.

    At most ``_MAX_GRAPHS`` graphs are kept, the least recently replayed dropped first: each
    holds a step's activations in its own memory pool, and a pooled step sees every client's
    last, short batch. Everything the step derives from ω (ClipLR's scales, Frobenius decay's
    ``2γ ωω^T``) is computed inside the step, so a replay follows ω copied into the model."""

    _WARMUP = 1  # eager steps per batch shape before its capture (benchmarks/README.md)
    _MAX_GRAPHS = 3  # the full batch and the two most recent short ones

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
                 ) -> None:
        self.step = step
        self.seen: dict[tuple[Any, ...], int] = {}
        self.graphs: OrderedDict[tuple[Any, ...], tuple[Any, torch.Tensor, torch.Tensor,
                                                        tuple[torch.Tensor, ...]]] = OrderedDict()

    def clear(self) -> None:
        """Drop every graph (each is destroyed with its last reference, here: not while
        another thread captures, see :data:`_CAPTURE_LOCK`)."""
        with _CAPTURE_LOCK:
            self.graphs.clear()
            self.seen.clear()

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (tuple(inputs.shape), inputs.dtype, tuple(targets.shape), targets.dtype)
        if key not in self.graphs:
            self.seen[key] = self.seen.get(key, 0) + 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            if self.seen[key] <= self._WARMUP:
                with torch.cuda.stream(side):
                    out = self.step(inputs, targets)
                torch.cuda.current_stream().wait_stream(side)
                return out[0], out[1], out[2]
            static_in, static_tg = inputs.clone(), targets.clone()
            graph = torch.cuda.CUDAGraph()
            # No automatic garbage collection inside the capture: a collection there can free
            # an unreachable CUDA graph (a dropped step is a reference cycle, freed only by
            # the collector), and destroying a graph while a stream captures invalidates the
            # capture. Garbage made in the meantime is collected after it. The lock keeps
            # other threads' captures and graph releases (clear) out, and with them a second
            # gc.disable/enable.
            with _CAPTURE_LOCK:
                gc_was_enabled = gc.isenabled()
                gc.disable()
                try:
                    with torch.cuda.graph(graph):  # records the step; runs at the replay below
                        static_out = self.step(static_in, static_tg)
                finally:
                    if gc_was_enabled:
                        gc.enable()
                self.graphs[key] = (graph, static_in, static_tg, static_out)
                self.seen.pop(key, None)
                while len(self.graphs) > self._MAX_GRAPHS:
                    self.graphs.popitem(last=False)  # destroyed here, inside the lock
        self.graphs.move_to_end(key)
        graph, static_in, static_tg, static_out = self.graphs[key]
        static_in.copy_(inputs)
        static_tg.copy_(targets)
        graph.replay()
        return static_out[0], static_out[1], static_out[2]
