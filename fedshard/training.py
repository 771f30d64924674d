"""Local training of a (sub-)model: SGD with momentum, Frobenius decay and ClipLR (Sec. 3.3).

Torch only. The spectral layers are found by ``isinstance(m, SpectralLayer)``; their ``u`` and
``v`` are trained with Frobenius decay only, every other parameter with ordinary weight decay.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from fedshard.spectral.layers import SpectralLayer

__all__ = [
    "ClipLR",
    "EvalResult",
    "TrainConfig",
    "TrainResult",
    "build_optimizer",
    "evaluate",
    "frobenius_penalty",
    "train",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Local-training settings of one client round.

    Attributes
    ----------
    epochs : int
        Passes over the loader, ``>= 1``.
    lr : float
        SGD learning rate, ``>= 0`` (0: nothing changes, a pipeline diagnostic).
    momentum : float
        SGD momentum in ``[0, 1)``; the paper uses 0.9.
    frobenius_decay : float
        ``γ >= 0``; adds ``γ ‖U Ω V^T‖_F^2`` per spectral layer to the loss (paper: 1e-4).
    clip_tau : float or None
        ClipLR threshold ``τ > 0`` (paper: 10, and ``τ >= 1`` is advised); ``None`` disables.
    weight_decay : float
        Ordinary (L2) weight decay ``>= 0`` of the non-spectral parameters (dense weights,
        biases, norms). Never applied to ``u``/``v`` (paper: Frobenius decay only).
    device : str or torch.device
        Where to train, e.g. ``"cpu"`` or ``"cuda:0"``.
    seed : int
        Seeds a forked torch RNG for the whole call (dropout, DataLoader shuffling without its
        own generator); the caller's global RNG state is left untouched.
    log_every_epoch : bool
        Log loss/accuracy at INFO after each epoch.
    channels_last : bool
        Train in channels-last memory format (the model's 4-D parameters and 4-D input
        batches are converted); often faster for convolutions on CPU, numerically the same.

    Raises
    ------
    ValueError
        On any out-of-range value.
    """

    epochs: int = 1
    lr: float = 0.05
    momentum: float = 0.9
    frobenius_decay: float = 1e-4
    clip_tau: float | None = 10.0
    weight_decay: float = 0.0
    device: str | torch.device = "cpu"
    seed: int = 0
    log_every_epoch: bool = True
    channels_last: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, value: object, expected: str) -> ValueError:
            return ValueError(
                f"TrainConfig.{field}={value!r}: expected {expected}; no training was started."
            )

        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise bad("epochs", self.epochs, "an int >= 1")
        if not _finite(self.lr) or self.lr < 0:
            # lr = 0 is allowed: a round that changes nothing (a diagnostic of the pipeline)
            raise bad("lr", self.lr, "a finite number >= 0")
        if not _finite(self.momentum) or not 0 <= self.momentum < 1:
            raise bad("momentum", self.momentum, "a number in [0, 1)")
        if not _finite(self.frobenius_decay) or self.frobenius_decay < 0:
            raise bad("frobenius_decay", self.frobenius_decay, "a finite number >= 0")
        if self.clip_tau is not None and (not _finite(self.clip_tau) or self.clip_tau <= 0):
            raise bad("clip_tau", self.clip_tau, "a finite number > 0 (or None to disable ClipLR)")
        if not _finite(self.weight_decay) or self.weight_decay < 0:
            raise bad("weight_decay", self.weight_decay, "a finite number >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an int")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as err:
            raise bad("device", self.device, "a torch device such as 'cpu' or 'cuda:0'") from err


@dataclass(frozen=True)
class TrainResult:
    """Outcome of :func:`train`.

    Attributes
    ----------
    loss : float
        Mean cross-entropy (without the Frobenius term) over all targets seen in all epochs.
    accuracy : float
        Fraction of those targets predicted correctly (per token for sequence outputs).
    num_examples : int
        Size of the local data set, ``len(loader.dataset)`` (the aggregation weight ``D``).
    """

    loss: float
    accuracy: float
    num_examples: int


@dataclass(frozen=True)
class EvalResult:
    """Outcome of :func:`evaluate`: mean loss, accuracy and number of examples."""

    loss: float
    accuracy: float
    num_examples: int


class ClipLR:
    """Optimizer wrapper scaling the gradient of factor column ``i`` by ``min(1, τ/ω_i)``.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The wrapped optimizer (e.g. SGD with momentum); it owns the state.
    model : nn.Module
        Its :class:`~fedshard.spectral.SpectralLayer` modules provide ``(u, v, ω)``.
    tau : float or None
        Threshold ``τ > 0``; ``None`` makes the wrapper a pass-through.

    Notes
    -----
    Paper, Sec. 3.3 ("Effective learning rate"): since ``∂L/∂U = (∂L/∂Ŵ) V Ω`` the multiplier
    ``ω_i`` scales the effective learning rate of ``u'_i`` and ``v'_i``;
    ``∂L/∂u'_i <- ∂L/∂u'_i · min(1, τ/ω_i)`` (and the same for ``v'_i``) bounds it by ``τ``
    times the nominal rate. The scaling acts on the full gradient (data loss plus Frobenius
    decay) right before the step, so momentum accumulates the clipped gradients. The rule is
    the one method :meth:`column_scale` (override it for another rule), in the spirit of
    Opacus' ``DPOptimizer``.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, tau: float | None
    ) -> None:
        if tau is not None and (not _finite(tau) or tau <= 0):
            raise ValueError(f"ClipLR tau={tau!r}: expected a finite number > 0 or None.")
        self.optimizer = optimizer
        self.tau = tau
        self.layers = [m for m in model.modules() if isinstance(m, SpectralLayer)]

    def column_scale(self, omega: torch.Tensor) -> torch.Tensor:
        """Per-column gradient factor ``min(1, τ/ω)``, shape ``(n,)``."""
        assert self.tau is not None
        return torch.clamp(self.tau / omega, max=1.0)

    @torch.no_grad()
    def clip_gradients(self) -> None:
        """Scale ``u.grad`` and ``v.grad`` of every spectral layer in place, column by column."""
        if self.tau is None:
            return
        for layer in self.layers:
            scale = self.column_scale(layer.omega)  # (n,), broadcast over rows
            for factor in (layer.u, layer.v):
                if factor.grad is not None:
                    factor.grad.mul_(scale)  # (rows, n) * (n,)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Clip the factor gradients, then step the wrapped optimizer."""
        self.clip_gradients()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forward to the wrapped optimizer."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (momentum buffers)."""
        return self.optimizer.state


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> ClipLR:
    """SGD with momentum for ``model``, wrapped in :class:`ClipLR`.

    Parameters
    ----------
    model : nn.Module
        The (sub-)model to train.
    cfg : TrainConfig
        Provides ``lr``, ``momentum``, ``weight_decay`` and ``clip_tau``.

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
    return ClipLR(sgd, model, cfg.clip_tau)


def frobenius_penalty(model: nn.Module) -> torch.Tensor:
    """``Σ_layers ‖U Ω V^T‖_F^2`` over the spectral layers of ``model`` (differentiable).

    Parameters
    ----------
    model : nn.Module
        The sub-model.

    Returns
    -------
    torch.Tensor
        Scalar; ``0.`` if there are no spectral layers.

    Notes
    -----
    Frobenius decay (paper, Sec. 3.3, after Khodak et al. 2022); each term comes from
    ``n x n`` Gram matrices, see :meth:`SpectralLayer.frobenius_norm_sq`.
    """
    terms = [m.frobenius_norm_sq() for m in model.modules() if isinstance(m, SpectralLayer)]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()


def train(model: nn.Module, loader: DataLoader[Any], cfg: TrainConfig) -> TrainResult:
    """Train ``model`` in place for ``cfg.epochs`` epochs with cross-entropy.

    Parameters
    ----------
    model : nn.Module
        Moved to ``cfg.device`` and left there, in train mode. Outputs ``(B, C)`` logits with
        ``(B,)`` targets, or ``(B, T, C)`` with ``(B, T)`` targets (next-token prediction);
        targets equal to ``-100`` are ignored.
    loader : DataLoader
        Yields ``(inputs, targets)`` batches.
    cfg : TrainConfig
        Settings.

    Returns
    -------
    TrainResult
        Mean loss and accuracy over every target seen, and ``len(loader.dataset)``.

    Raises
    ------
    ValueError
        If the loader yields no batch or a batch of the wrong form.
    FloatingPointError
        If the loss becomes NaN or inf (training stops; lower ``lr`` or enable ClipLR).

    Notes
    -----
    Loss per step: ``CE + γ Σ ‖U Ω V^T‖_F^2``; gradients of ``u``, ``v`` clipped by ClipLR;
    plain SGD with momentum (paper, Sec. 3.3). Deterministic given ``cfg.seed`` on CPU: all
    torch randomness drawn from the global generator during the call comes from a forked RNG
    seeded with it (the caller's RNG state is restored afterwards). A DataLoader with its own
    ``generator`` keeps using that.
    """
    device = torch.device(cfg.device)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    model.train()
    optimizer = build_optimizer(model, cfg)
    gamma = cfg.frobenius_decay
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    total_correct = torch.zeros((), dtype=torch.int64, device=device)
    total_targets = 0
    examples_per_epoch = 0
    with _forked_rng(cfg.seed, device):
        for epoch in range(cfg.epochs):
            epoch_loss = torch.zeros((), dtype=torch.float64, device=device)
            epoch_correct = torch.zeros((), dtype=torch.int64, device=device)
            epoch_targets = 0
            examples_per_epoch = 0
            for batch in loader:
                inputs, targets = _unpack(batch, device)
                if cfg.channels_last and inputs.ndim == 4:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                optimizer.zero_grad(set_to_none=True)
                loss_sum, correct, count = _cross_entropy(model(inputs), targets)
                loss = loss_sum / max(count, 1)
                if gamma > 0:
                    loss = loss + gamma * frobenius_penalty(model)
                if not bool(torch.isfinite(loss)):
                    raise FloatingPointError(
                        f"training loss became {loss.item()} in epoch {epoch + 1}; training "
                        "stopped. Lower the learning rate or enable ClipLR (clip_tau)."
                    )
                loss.backward()
                optimizer.step()
                epoch_loss += loss_sum.detach()
                epoch_correct += correct
                epoch_targets += count
                examples_per_epoch += int(inputs.shape[0])
            if examples_per_epoch == 0:
                raise ValueError("the DataLoader yielded no batches; nothing was trained.")
            total_loss += epoch_loss
            total_correct += epoch_correct
            total_targets += epoch_targets
            if cfg.log_every_epoch:
                logger.info(
                    "epoch %d/%d: loss %.4f, accuracy %.4f over %d targets",
                    epoch + 1,
                    cfg.epochs,
                    epoch_loss.item() / max(epoch_targets, 1),
                    epoch_correct.item() / max(epoch_targets, 1),
                    epoch_targets,
                )
    return TrainResult(
        loss=total_loss.item() / max(total_targets, 1),
        accuracy=total_correct.item() / max(total_targets, 1),
        num_examples=_dataset_size(loader, examples_per_epoch),
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader[Any], device: str | torch.device = "cpu"
) -> EvalResult:
    """Mean cross-entropy and accuracy of ``model`` on ``loader`` (eval mode, no gradients).

    Parameters
    ----------
    model : nn.Module
        Moved to ``device``; its train/eval mode is restored afterwards.
    loader : DataLoader
        Yields ``(inputs, targets)`` batches, shapes as in :func:`train`.
    device : str or torch.device
        Where to evaluate.

    Returns
    -------
    EvalResult
        Loss and accuracy per target; ``num_examples = len(loader.dataset)``.

    Raises
    ------
    ValueError
        If the loader yields no batch or a batch of the wrong form.
    """
    dev = torch.device(device)
    was_training = model.training
    model.to(dev)
    model.eval()
    total_loss = torch.zeros((), dtype=torch.float64, device=dev)
    total_correct = torch.zeros((), dtype=torch.int64, device=dev)
    total_targets = 0
    examples = 0
    try:
        for batch in loader:
            inputs, targets = _unpack(batch, dev)
            loss_sum, correct, count = _cross_entropy(model(inputs), targets)
            total_loss += loss_sum
            total_correct += correct
            total_targets += count
            examples += int(inputs.shape[0])
    finally:
        model.train(was_training)
    if examples == 0:
        raise ValueError("the DataLoader yielded no batches; nothing was evaluated.")
    return EvalResult(
        loss=total_loss.item() / max(total_targets, 1),
        accuracy=total_correct.item() / max(total_targets, 1),
        num_examples=_dataset_size(loader, examples),
    )


def _cross_entropy(
    logits: Any, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Summed cross-entropy, number of correct predictions and of counted targets.

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
    return loss_sum, correct, int(valid.sum())


def _unpack(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(
            f"expected the DataLoader to yield (inputs, targets) pairs, got "
            f"{type(batch).__name__}; nothing more was processed."
        )
    inputs, targets = batch
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True).long()


def _dataset_size(loader: DataLoader[Any], fallback: int) -> int:
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:  # an IterableDataset without __len__: examples in one epoch
        return fallback


@contextmanager
def _forked_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed the CPU (and the training CUDA device's) generator; restore both on exit."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        for index in devices:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
