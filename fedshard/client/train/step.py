"""One local-training step on one batch (paper, Sec. 3.3): :class:`EagerStep`, and the
summed cross-entropy it reports (:func:`cross_entropy_sums`).

This is the reference step that :func:`~fedshard.client.train.train` runs. The fast path
(:class:`fedshard.client.train.fast.TrainStep`: ``torch.compile``, CUDA graphs) subclasses it
and computes the same numbers.
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import torch
import torch.nn.functional as F
from flwr.common.logger import log
from torch import nn

from fedshard.client.train.config import TrainConfig
from fedshard.client.train.optim import build_optimizer
from fedshard.client.train.rules import ClientRules
from fedshard.spectral.layers import SpectralLayer
from fedshard.spectral.recompute import Block, blocks_of, low_memory

__all__ = ["EagerStep", "cross_entropy_sums"]


class EagerStep:
    """One training step: zero the gradients, forward and cross-entropy, backward, optionally
    clip the global gradient norm, then the optimizer's step with the client rules around it
    (Frobenius decay before it, ClipLR after it).

    Nothing is read back to the host: the step never waits for the device.

    Parameters
    ----------
    model : nn.Module
        On its training device, in train mode; trained in place.
    cfg : TrainConfig
        Its recipe (lr, momentum, weight decay, the rules' γ, τ and factor step) and
        ``max_grad_norm``.

    Attributes
    ----------
    optimizer : torch.optim.SGD
        From :func:`~fedshard.client.train.build_optimizer`.
    rules : ClientRules
        The client rules attached to it (:meth:`ClientRules.report`: what they did).

    Notes
    -----
    Loss per step: ``CE + γ Σ ‖U Ω V^T‖_F^2`` (paper, Sec. 3.3). The CE part goes through
    autograd; the penalty's gradient is added analytically by the rules, which gives the same
    gradient as differentiating :func:`~fedshard.client.train.frobenius_penalty` up to
    rounding.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, *,
                 every_target_counts: bool = False) -> None:
        self.model = model
        self.rules = ClientRules.of(model, cfg.recipe)
        self.optimizer = build_optimizer(model, cfg, self.rules)
        self.max_grad_norm = cfg.max_grad_norm
        self.params: list[torch.Tensor] = [
            p for g in self.optimizer.param_groups for p in g["params"]]
        #: the batches hold no ignored target (-100): each step's count is its number of
        #: targets, known on the host (the same loss and gradient, in fewer operations)
        self.every_target_counts = every_target_counts
        #: low-memory mode's blocks (TrainConfig.low_memory), found once; None when off
        self.blocks = _low_memory_blocks(model) if cfg.low_memory else None

    def __call__(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Train on one batch.

        Returns
        -------
        tuple
            Device scalars: summed cross-entropy (detached), number of correct predictions;
            and the number of counted targets (a device scalar, or with
            ``every_target_counts`` an int).
        """
        if type(self.optimizer) is torch.optim.SGD:  # zero_grad(set_to_none=True), without
            for p in self.params:                    # its profiler record per step
                p.grad = None
        else:
            self.optimizer.zero_grad(set_to_none=True)
        loss, loss_sum, correct, count = self.loss(inputs, targets)
        loss.backward()
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        self.optimizer.step()  # the rules' hooks: decay before, ClipLR after
        return loss_sum.detach(), correct, count

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[Any, ...]:
        """Mean cross-entropy (to differentiate), and the summed cross-entropy (the mean
        times the count: the same number with or without ``every_target_counts``), correct
        predictions and counted targets of :func:`cross_entropy_sums` (with
        ``every_target_counts``: the count an int, every target of the batch)."""
        if self.blocks is not None:
            with low_memory(self.model, self.blocks):
                return self._plain_loss(inputs, targets)
        return self._plain_loss(inputs, targets)

    def _plain_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[Any, ...]:
        if self.every_target_counts:
            logits = self.model(inputs)
            # cross-entropy's own mean: the sum over the count, bit for bit, and its gradient
            loss = F.cross_entropy(_flat(logits, targets),
                                   targets if targets.ndim == 1 else targets.reshape(-1))
            targets_seen = targets.numel()
            correct = (logits.argmax(dim=-1) == targets).sum()
            return loss, loss.detach() * targets_seen, correct, targets_seen
        loss_sum, correct, count = cross_entropy_sums(self.model(inputs), targets)
        loss = loss_sum / count.clamp_min(1)
        # the reported sum as the mean times the count, the same number both ways
        return loss, loss.detach() * count, correct, count


def _low_memory_blocks(model: nn.Module) -> list[Block]:
    """The blocks low-memory mode recomputes in ``model``; a WARNING when it finds none (the
    step then holds what the plain step holds)."""
    blocks = blocks_of(model)
    if not blocks and not any(isinstance(m, SpectralLayer) for m in model.modules()):
        log(WARNING, "low-memory training: %s has no sharded layer (a dense model, as FedAvg "
            "or width slicing sends): it trains with the plain step's memory.",
            type(model).__name__)
    elif not blocks:
        log(WARNING, "low-memory training found no block to recompute in %s (no sharded layer "
            "inside an nn.Sequential or nn.ModuleList with other layers): it trains with the "
            "plain step's memory. Group the layers between two sharded layers in an "
            "nn.Sequential, or turn low-memory mode off.", type(model).__name__)
    return blocks


def cross_entropy_sums(
    logits: Any, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross-entropy, number of correct predictions and of counted targets (tensors).

    ``logits`` ``(B, C)`` with ``targets`` ``(B,)``, or ``(B, T, C)`` with ``(B, T)``;
    targets ``-100`` (PyTorch's ``ignore_index``) are not counted.
    """
    flat_logits = _flat(logits, targets)  # (B*T, C)
    flat_targets = targets.reshape(-1)  # (B*T,)
    valid = flat_targets != -100
    loss_sum = F.cross_entropy(flat_logits, flat_targets, reduction="sum")
    correct = (flat_logits.argmax(dim=-1) == flat_targets).sum()  # argmax ≥ 0: never -100
    return loss_sum, correct, valid.sum()


def _flat(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    """``logits`` as ``(B*T, C)`` after checking it is a tensor of ``targets``' shape plus
    classes."""
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
    return logits if logits.ndim == 2 else logits.reshape(-1, logits.shape[-1])
