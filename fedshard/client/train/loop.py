"""Local training of a (sub-)model, the plain loop: :func:`train` and :func:`evaluate`.

Torch only. Each batch goes through one :class:`~fedshard.client.train.step.EagerStep`
(SGD with momentum 0.9, Frobenius decay ``γ‖UΩVᵀ‖²`` on the spectral factors, ClipLR
``min(1, τ/ω_i)`` per factor column, weight decay only on the other parameters; paper,
Sec. 3.3). Only when the :class:`TrainConfig` carries fast options
(:class:`fedshard.client.train.fast.FastOptions`) does the loop take its step from them
instead (this module does not import the fast path), or, with a ``step`` of its own (ordered
dropout's), from that.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from fedshard.client.train.batches import TensorBatches, dataset_size, unpack_batch
from fedshard.client.train.config import EvalResult, Step, TrainConfig, TrainResult
from fedshard.client.train.step import EagerStep, cross_entropy_sums

__all__ = ["evaluate", "on_device", "train"]

logger = logging.getLogger(__name__)


def train(model: nn.Module, loader: DataLoader[Any] | TensorBatches,
          cfg: TrainConfig) -> TrainResult:
    """Train ``model`` in place for ``cfg.recipe.local_epochs`` epochs with cross-entropy.

    Parameters
    ----------
    model : nn.Module
        Moved to ``cfg.device`` and left there, in train mode. Outputs ``(B, C)`` logits with
        ``(B,)`` targets, or ``(B, T, C)`` with ``(B, T)`` targets (next-token prediction);
        targets equal to ``-100`` are ignored. With ``pad_terms`` or ``merge_terms`` fast options
        its sharded convolutions are left in that form (the same function; see
        :func:`fedshard.client.train.fast.configure_convolutions`).
    loader : DataLoader or TensorBatches
        Yields ``(inputs, targets)`` pairs or dicts (see :attr:`TrainConfig.input_key`).
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
        If the loss becomes NaN or inf. It is checked every ``_CHECK_EVERY`` steps and at the
        end of each epoch (not every step: that would wait for the device each time), so a few
        more steps may have run; the model's parameters are then not usable.

    Notes
    -----
    Loss per step: ``CE + γ Σ ‖U Ω V^T‖_F^2``; gradients of ``u``, ``v`` clipped by ClipLR;
    plain SGD with momentum (paper, Sec. 3.3); see :class:`EagerStep`. Deterministic given
    ``cfg.torch_seed`` on CPU: all torch randomness drawn from the global generator during the call
    comes from a forked RNG seeded with it (the caller's RNG state is restored afterwards). A
    DataLoader with its own ``generator`` keeps using that.
    """
    device = torch.device(cfg.device)
    on_device(model, device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    model.train()
    if cfg.fast is not None and cfg.fast.enabled():
        with cfg.fast.open_step(model, cfg) as step:
            return _epochs(step, loader, cfg, device)
    if cfg.step is not None:
        return _epochs(cfg.step(model, cfg), loader, cfg, device)
    return _epochs(EagerStep(model, cfg, every_target_counts=_every_target_counts(loader)),
                   loader, cfg, device)


def _every_target_counts(loader: DataLoader[Any] | TensorBatches) -> bool:
    """Whether no batch of ``loader`` can hold an ignored target (-100): a
    :class:`TensorBatches` whose targets hold none (read once per call; a ``DataLoader`` is
    not read ahead)."""
    return isinstance(loader, TensorBatches) and not bool((loader.targets == -100).any())


def _epochs(step: Step, loader: DataLoader[Any] | TensorBatches, cfg: TrainConfig,
            device: torch.device) -> TrainResult:
    # Device-side sums (_Sums): the only reads back to the host are the periodic finiteness
    # checks and the per-epoch log line. CE >= 0, so a sum is finite iff every summand is.
    total = _Sums(device)
    examples_per_epoch = 0
    cap, taken = cfg.recipe.max_steps, 0  # max_steps: at most that many steps (0: no cap)
    with _forked_rng(cfg.torch_seed, device):
        for epoch in range(cfg.recipe.local_epochs):
            if cap and taken >= cap:
                break
            sums = _Sums(device)
            examples_per_epoch = 0
            steps = 0
            for batch in loader:
                inputs, targets = unpack_batch(batch, device, cfg.input_key, cfg.target_key)
                if cfg.channels_last and inputs.ndim == 4:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                sums.add(*step(inputs, targets))
                examples_per_epoch += int(inputs.shape[0])
                steps += 1
                taken += 1
                if steps % _CHECK_EVERY == 0:
                    _check_finite(sums.loss(), epoch, steps, cfg)
                if cap and taken >= cap:
                    break
            if examples_per_epoch == 0:
                raise ValueError("the DataLoader yielded no batches; nothing was trained.")
            _check_finite(sums.loss(), epoch, steps, cfg)
            total.include(sums)
            if cfg.log_every_epoch:
                seen = max(sums.targets(), 1)
                logger.info(
                    "epoch %d/%d: loss %.4f, accuracy %.4f over %d targets",
                    epoch + 1,
                    cfg.recipe.local_epochs,
                    sums.loss().item() / seen,
                    sums.correct().item() / seen,
                    sums.targets(),
                )
    seen = max(total.targets(), 1)
    rules = getattr(step, "rules", None)
    return TrainResult(
        loss=total.loss().item() / seen,
        accuracy=total.correct().item() / seen,
        num_examples=dataset_size(loader, examples_per_epoch),
        rules=rules.report() if rules is not None else None,
    )


class _Sums:
    """The summed cross-entropy (float64), correct predictions and counted targets of the
    steps so far, on the training device.

    The steps' values are kept as they come (:meth:`add`: no device operation per step) and
    added up when read, in one operation per quantity; a count the step gives as an int is
    added on the host."""

    def __init__(self, device: torch.device) -> None:
        self._loss = torch.zeros((), dtype=torch.float64, device=device)
        self._correct = torch.zeros((), dtype=torch.int64, device=device)
        self._targets = torch.zeros((), dtype=torch.int64, device=device)
        self._host_targets = 0
        self._pending: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = \
            ([], [], [])

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor,
            count: torch.Tensor | int) -> None:
        """One step's summed loss, correct predictions and counted targets."""
        losses, corrects, counts = self._pending
        losses.append(loss_sum)
        corrects.append(correct)
        if isinstance(count, int):
            self._host_targets += count
        else:
            counts.append(count)

    def include(self, other: _Sums) -> None:
        """Add ``other``'s sums (an epoch's) to these."""
        self._loss += other.loss()
        self._correct += other.correct()
        self._targets += other._counted()
        self._host_targets += other._host_targets

    def loss(self) -> torch.Tensor:
        """The summed cross-entropy, a float64 device scalar."""
        return _fold(self._loss, self._pending[0])

    def correct(self) -> torch.Tensor:
        """The number of correct predictions, an int64 device scalar."""
        return _fold(self._correct, self._pending[1])

    def _counted(self) -> torch.Tensor:
        return _fold(self._targets, self._pending[2])

    def targets(self) -> int:
        """The number of counted targets (reads the device when a step counted there)."""
        return int(self._counted().item()) + self._host_targets


def _fold(total: torch.Tensor, pending: list[torch.Tensor]) -> torch.Tensor:
    """``total`` (changed in place) plus the sum of ``pending`` (then emptied), in
    ``total``'s dtype."""
    if pending:
        total += torch.stack(pending).sum(dtype=total.dtype)
        pending.clear()
    return total


#: Steps between two checks that the loss is finite (each check waits for the device).
_CHECK_EVERY = 32


def _check_finite(loss_sum: torch.Tensor, epoch: int, steps: int, cfg: TrainConfig) -> None:
    if bool(torch.isfinite(loss_sum)):
        return
    remedies = ["lower the learning rate (lr)", "add normalization layers to the model"]
    if cfg.recipe.factor_step == "plain":
        remedies.append("take the dense model's steps on the factors (factor_step='dense')")
    if cfg.max_grad_norm is None:
        remedies.append("set TrainConfig.max_grad_norm to clip the gradient norm")
    else:
        remedies.append(f"lower max_grad_norm (now {cfg.max_grad_norm})")
    if cfg.recipe.clip_lr_tau is None:
        remedies.append("enable ClipLR (clip_lr_tau)")
    # "Training diverged" is how the server recognises the cause (fedshard.protocol.DIVERGED)
    raise FloatingPointError(
        f"Training diverged: the training loss became {loss_sum.item()} in epoch {epoch + 1} "
        f"(found after step {steps}; checked every {_CHECK_EVERY} steps); training stopped "
        f"and the model's parameters are not usable. To fix: {', '.join(remedies[:-1])} or "
        f"{remedies[-1]}."
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader[Any] | TensorBatches,
    device: str | torch.device = "cpu",
    *,
    input_key: str | None = None,
    target_key: str | None = None,
) -> EvalResult:
    """Mean cross-entropy and accuracy of ``model`` on ``loader`` (eval mode, no gradients).

    Parameters
    ----------
    model : nn.Module
        Moved to ``device``; its train/eval mode is restored afterwards.
    loader : DataLoader or TensorBatches
        Yields ``(inputs, targets)`` pairs or dicts, shapes as in :func:`train`.
    device : str or torch.device
        Where to evaluate.
    input_key, target_key : str, optional
        Keys of dict batches, as :attr:`TrainConfig.input_key` / ``target_key``.

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
    on_device(model, dev)
    model.eval()
    total_loss = torch.zeros((), dtype=torch.float64, device=dev)
    total_correct = torch.zeros((), dtype=torch.int64, device=dev)
    total_targets = torch.zeros((), dtype=torch.int64, device=dev)
    examples = 0
    try:
        for batch in loader:
            inputs, targets = unpack_batch(batch, dev, input_key, target_key)
            loss_sum, correct, count = cross_entropy_sums(model(inputs), targets)
            total_loss += loss_sum
            total_correct += correct
            total_targets += count
            examples += int(inputs.shape[0])
    finally:
        model.train(was_training)
    if examples == 0:
        raise ValueError("the DataLoader yielded no batches; nothing was evaluated.")
    seen = max(int(total_targets.item()), 1)
    return EvalResult(
        loss=total_loss.item() / seen,
        accuracy=total_correct.item() / seen,
        num_examples=dataset_size(loader, examples),
    )


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)``, skipped when every parameter and buffer is already there.

    ``Module.to`` visits every submodule and tensor even when nothing moves (per client and
    round of a simulation, as much time as a few training steps' bookkeeping); the check is
    one pass over the tensors. ``device`` without an index (``cuda``) matches no tensor, so
    the move is left to ``to``."""
    if all(t.device == device for t in model.parameters()) and \
            all(t.device == device for t in model.buffers()):
        return model
    return model.to(device)


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
