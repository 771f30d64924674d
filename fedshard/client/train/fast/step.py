"""One local-training step: the optimizer (SGD-m in ClipLR), Frobenius decay, the loss, and
the step replayed from a CUDA graph (Sec. 3.3).

:class:`TrainStep` is what :func:`fedshard.client.train.loop.train` runs per batch and what
``benchmarks/bench_client.py`` times; nothing here reads data or waits for the device.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.client.train.config import TrainConfig
from fedshard.client.train.optim import ClipLR, FrobeniusDecay
from fedshard.spectral.conv import SpectralConv2d
from fedshard.spectral.layers import SpectralLayer

__all__ = ["TrainStep", "build_optimizer", "cross_entropy_sums"]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> ClipLR:
    """SGD with momentum for ``model``, wrapped in :class:`ClipLR`.

    Parameters
    ----------
    model : nn.Module
        The (sub-)model to train.
    cfg : TrainConfig
        Provides ``lr``, ``momentum``, ``weight_decay`` and ``clip_lr_tau``.

    Returns
    -------
    ClipLR
        Two parameter groups: the spectral factors ``u``, ``v`` with ``weight_decay=0`` (they
        get Frobenius decay instead, see :func:`frobenius_penalty`), and all other trainable
        parameters with ``cfg.weight_decay``. Empty groups are left out.

    Raises
    ------
    ValueError
        If ``model`` has no trainable parameter.
    """
    factors: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, SpectralLayer):
            factors += [p for p in (m.u, m.v) if p.requires_grad]
    factor_ids = {id(p) for p in factors}
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in factor_ids]
    groups: list[dict[str, Any]] = []
    if factors:
        groups.append({"params": factors, "weight_decay": 0.0})
    if dense:
        groups.append({"params": dense, "weight_decay": cfg.weight_decay})
    if not groups:
        raise ValueError("the model has no trainable parameters; there is nothing to train.")
    sgd = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return ClipLR(sgd, model, cfg.clip_lr_tau)


class TrainStep:
    """One local-training step; :func:`train` and ``benchmarks/bench_client.py`` both use it.

    Built once per :func:`train` call (after the model is on its device): zero the gradients,
    forward and cross-entropy, backward, add the Frobenius-decay gradient
    (:class:`FrobeniusDecay`), optionally clip the global gradient norm, then ClipLR + SGD
    (:class:`ClipLR`). No step waits for the device: nothing is read back to the host.

    Parameters
    ----------
    model : nn.Module
        On its training device, in train mode.
    cfg : TrainConfig
        Settings; ``cfg.compile`` compiles the forward/backward with ``torch.compile``
        (Inductor's fused kernels; with ``cfg.cuda_graph`` inside the whole-step graph).

    Attributes
    ----------
    optimizer : ClipLR
        From :func:`build_optimizer`.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.optimizer = build_optimizer(model, cfg)
        self.decay = FrobeniusDecay(model, cfg.frobenius_decay)
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._loss: Callable[..., tuple[torch.Tensor, ...]] = self._loss_eager
        self._update: Callable[[], None] = self._update_eager
        self._graphs: _StepGraphs | None = None
        pad = cfg.pad_terms
        if pad is None:
            on_cuda = any(p.is_cuda for p in self._params)
            pad = 8 if cfg.cuda_graph and on_cuda and not cfg.compile else 1
        for m in model.modules():
            if isinstance(m, SpectralConv2d):
                m.pad_terms_to = pad
                m.merge_terms = cfg.merge_terms
        if cfg.cuda_graph:
            if not all(p.is_cuda for p in self._params):
                raise ValueError(
                    f"TrainConfig.cuda_graph=True needs the model on a CUDA device, got "
                    f"device={cfg.device!r}; set cuda_graph=False (or train on a GPU). No step "
                    "was run.")
            self._graphs = _StepGraphs(self._eager_step)
        if cfg.compile:
            # Forward and backward only (AOTAutograd): compiled code is shared by every later
            # TrainStep of a model with the same structure (a client's next round, the next
            # client in the same process); the update stays eager, few fused kernels already.
            # (Compiling the optimizer step crashed Dynamo on the second TrainStep of a
            # process, torch 2.14: SpeculationLogDivergence in SGD's state creation.)
            # Inductor's default mode, no CUDA-graph trees: with cuda_graph the whole step is
            # captured by _StepGraphs (faster on an H100 than "reduce-overhead": 4.81 against
            # 5.78 ms at r = 0.1; 2.34 against 2.81 dense).
            self._loss = torch.compile(self._loss_eager)

    def release_graphs(self) -> None:
        """Free the captured CUDA graphs and their memory pools now (a later call captures
        again). A dropped step is freed only by Python's garbage collector, at a time of its
        choosing (its bound methods form reference cycles), with up to ``_MAX_GRAPHS`` graphs'
        memory each; so whoever drops a graphed step releases them, and ``with TrainStep(...)``
        does it on exit."""
        if self._graphs is not None:
            self._graphs.clear()

    def __enter__(self) -> TrainStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_graphs()

    def __call__(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Train on one batch.

        Returns
        -------
        tuple of torch.Tensor
            Device scalars: summed cross-entropy (detached), number of correct predictions,
            number of counted targets.
        """
        if self._graphs is not None:
            return self._graphs(inputs, targets)
        return self._eager_step(inputs, targets)

    def _eager_step(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        loss, loss_sum, correct, count = self._loss(inputs, targets)
        loss.backward()
        self._update()
        return loss_sum.detach(), correct, count

    def _loss_eager(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss_sum, correct, count = cross_entropy_sums(self.model(inputs), targets)
        return loss_sum / count.clamp_min(1), loss_sum, correct, count

    def _update_eager(self) -> None:
        self.decay.add_gradient_()
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.cfg.max_grad_norm, foreach=True)
        self.optimizer.step()


#: Held while a thread captures a CUDA graph and while graphs are released: destroying a graph
#: while another thread's stream captures would invalidate that capture (CUDA's default,
#: global capture mode), and captures in two threads at once would interleave their
#: gc.disable()/enable().
_CAPTURE_LOCK = threading.Lock()


class _StepGraphs:
    """A training step replayed from CUDA graphs, one per batch shape (PyTorch's whole-network
    capture recipe): ``_WARMUP`` eager steps of a shape on a side stream (they are real
    steps: they create the momentum buffers and the ClipLR scales), then the next step of
    that shape is captured and replayed; every later one copies its batch into the graph's
    static inputs and replays. The outputs are the graph's static tensors: read them before
    the next step (``train`` adds them to its sums at once).

    At most ``_MAX_GRAPHS`` graphs are kept, the least recently replayed dropped first: each
    holds a step's activations in its own memory pool, and a pooled step
    (:mod:`fedshard.client.train.fast.pool`) sees every client's last, short batch."""

    _WARMUP = 1  # H100, CIFAR-10 round of 10 clients: 4.8 s with 1, 5.7 s with 3
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
            # an unreachable CUDA graph (a dropped TrainStep and its _StepGraphs form a
            # reference cycle, freed only by the collector), and destroying a graph is not
            # permitted while a stream captures: it invalidates this capture
            # (cudaErrorStreamCaptureInvalidated: seen once on an H100, then reproduced there by
            # collecting a dead captured step inside a capture). PyTorch no longer collects
            # before a capture (torch.compiler.config.force_cudagraph_gc); garbage made in
            # the meantime is collected after it. The lock keeps other threads' captures and
            # graph releases (clear) out, and with them a second gc.disable/enable.
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


def cross_entropy_sums(
    logits: Any, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross-entropy, number of correct predictions and of counted targets (tensors).

    ``logits`` ``(B, C)`` with ``targets`` ``(B,)``, or ``(B, T, C)`` with ``(B, T)``;
    targets ``-100`` (PyTorch's ``ignore_index``) are not counted.
    """
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"the model returned {type(logits).__name__}; expected a logits tensor of shape "
            "(B, C) or (B, T, C)."
        )
    if logits.ndim != targets.ndim + 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match targets of shape "
            f"{tuple(targets.shape)}; expected (B, C) with (B,) or (B, T, C) with (B, T)."
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (B*T, C)
    flat_targets = targets.reshape(-1)  # (B*T,)
    valid = flat_targets != -100
    loss_sum = F.cross_entropy(flat_logits, flat_targets, reduction="sum")
    correct = ((flat_logits.argmax(dim=-1) == flat_targets) & valid).sum()
    return loss_sum, correct, valid.sum()
