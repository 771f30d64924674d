"""Settings and outcomes of local training: :class:`TrainConfig`, :class:`TrainResult`,
:class:`EvalResult` (one frozen, validated dataclass per concern; torch only for the device)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fedshard.settings import DEFAULT_LR, LocalTraining, finite_real

if TYPE_CHECKING:
    from torch import nn

    from fedshard.client.train.rules import RulesReport

__all__ = ["EvalResult", "FastPath", "Step", "StepFactory", "TrainConfig", "TrainResult"]

#: A training step: one batch ``(inputs, targets)`` in, device sums (loss, correct
#: predictions, counted targets) out (:class:`~fedshard.client.train.step.EagerStep` is the
#: reference one). A step that keeps the client rules it applied has them as ``rules``.
Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

#: What :attr:`TrainConfig.step` takes: ``make(model, cfg)`` -> the :data:`Step` that trains
#: ``model`` under ``cfg`` (ordered dropout's :class:`~fedshard.client.width.OrderedDropout`).
StepFactory = Callable[["nn.Module", "TrainConfig"], Step]


class FastPath(Protocol):
    """What the plain loop asks of its ``fast`` option
    (:class:`fedshard.client.train.fast.FastOptions` is the one fedshard has)."""

    def enabled(self) -> bool:
        """Whether the loop should take its step from :meth:`open_step`."""

    def open_step(self, model: nn.Module, cfg: TrainConfig) -> AbstractContextManager[Any]:
        """A context manager that yields the step (``step(inputs, targets)`` -> device sums
        of the loss, the correct predictions and the counted targets)."""


def _paper_recipe() -> LocalTraining:
    return LocalTraining(lr=DEFAULT_LR)


@dataclass(frozen=True)
class TrainConfig:
    """How one node trains one round: the recipe (what the server decides) and the node's own
    options (where and how it runs).

    Attributes
    ----------
    recipe : fedshard.settings.LocalTraining
        lr, momentum, Frobenius decay γ, ClipLR's τ, weight decay, the factor step and the
        local epochs (the run's recipe; a round's received settings,
        :class:`fedshard.protocol.TrainSettings`, are one, with the round's scheduled lr).
        Default: the paper's recipe at lr 0.05.
    device : str or torch.device
        Where to train, e.g. ``"cpu"`` or ``"cuda:0"``.
    torch_seed : int
        Seeds a forked torch RNG for the whole call (dropout, DataLoader shuffling without its
        own generator); the caller's global RNG state is left untouched.
    log_every_epoch : bool
        Log loss/accuracy at INFO after each epoch.
    channels_last : bool
        Train in channels-last memory format (the model's 4-D parameters and 4-D input
        batches are converted); often faster for convolutions on CPU, numerically the same.
    max_grad_norm : float or None
        If set (``> 0``), clip the global 2-norm of the gradients of the data loss to it
        before the optimizer's step (and the client rules), without waiting for the device;
        ``None`` disables.
    input_key, target_key : str or None
        Keys of the inputs and targets in dict batches; ``None`` recognises the
        flwr-datasets / Hugging Face names (:data:`INPUT_KEYS`, :data:`TARGET_KEYS`).
        Ignored for ``(inputs, targets)`` pairs.
    fast : FastPath or None
        The fast path (:class:`fedshard.client.train.fast.FastOptions`: ``torch.compile``,
        CUDA graphs, padded or merged convolutions, a pooled step); ``None`` (or every option
        off): the eager step.
    step : StepFactory or None
        A step of another loss in place of the eager one (:data:`StepFactory`:
        ``make(model, cfg)`` -> the step; ordered dropout's
        :class:`~fedshard.client.width.OrderedDropout`); ``None``: the eager step. It cannot
        be combined with an enabled ``fast`` (the fast path compiles and captures the eager
        step, not another one).
    low_memory : bool
        Train a sharded model in low-memory mode (:func:`fedshard.spectral.low_memory`): each
        block keeps only its input and its sharded layers' rank-n bottlenecks for the backward
        pass and recomputes its full-width tensors there; the same gradients (float64 equal
        to rounding), less memory, some more time (``benchmarks/bench_memory.py``). Default
        off. It cannot be combined with an enabled ``fast`` or another ``step``.

    Raises
    ------
    ValueError
        On any out-of-range value (the recipe checks its own fields by the rules of
        :mod:`fedshard.settings`, the same as the server's), or for a ``step`` with an
        enabled ``fast``.
    """

    recipe: LocalTraining = field(default_factory=_paper_recipe)
    device: str | torch.device = "cpu"
    torch_seed: int = 0
    log_every_epoch: bool = True
    channels_last: bool = False
    max_grad_norm: float | None = None
    input_key: str | None = None
    target_key: str | None = None
    fast: FastPath | None = None
    step: StepFactory | None = None
    low_memory: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, value: object, expected: str) -> ValueError:
            return ValueError(
                f"TrainConfig.{field}={value!r}: expected {expected}; no training was started."
            )

        if not isinstance(self.recipe, LocalTraining):
            raise bad("recipe", self.recipe, "a fedshard.settings.LocalTraining")
        if self.max_grad_norm is not None and (
            not finite_real(self.max_grad_norm) or self.max_grad_norm <= 0
        ):
            raise bad("max_grad_norm", self.max_grad_norm, "a finite number > 0 (or None)")
        for name in ("input_key", "target_key"):
            key = getattr(self, name)
            if key is not None and not isinstance(key, str):
                raise bad(name, key, "a str (or None to recognise the usual names)")
        if isinstance(self.torch_seed, bool) or not isinstance(self.torch_seed, int):
            raise bad("torch_seed", self.torch_seed, "an int")
        if self.fast is not None and not callable(getattr(self.fast, "open_step", None)):
            raise bad("fast", self.fast, "a fedshard.client.train.fast.FastOptions (or None)")
        if self.step is not None and not callable(self.step):
            raise bad("step", self.step, "a function (model, cfg) -> step (or None)")
        if self.step is not None and self.fast_enabled():
            raise ValueError(
                f"TrainConfig(step={self.step!r}, fast={self.fast!r}): expected one of them; "
                "the fast path compiles and captures fedshard's eager step, and cannot run "
                "another step. Turn the fast options off (fast=None) to train with this "
                "step; no training was started.")
        if not isinstance(self.low_memory, bool):
            raise bad("low_memory", self.low_memory, "True or False")
        if self.low_memory and (self.fast_enabled() or self.step is not None):
            raise ValueError(
                f"TrainConfig(low_memory=True, fast={self.fast!r}, step={self.step!r}): "
                "low-memory training recomputes blocks of fedshard's eager step, which the "
                "fast path's compiled or captured step and another step do not run; expected "
                "low_memory=False with them (or fast=None and step=None). No training was "
                "started.")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as err:
            raise bad("device", self.device, "a torch device such as 'cpu' or 'cuda:0'") from err

    @property
    def lr(self) -> float:
        """The rate this round trains with (the recipe's, :data:`~fedshard.settings.DEFAULT_LR`
        if it has none)."""
        return self.recipe.base_lr

    def fast_enabled(self) -> bool:
        """Whether the fast path is asked for (``fast`` given and one of its options on)."""
        return self.fast is not None and self.fast.enabled()


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
    rules : RulesReport or None
        What the client rules did (:meth:`ClientRules.report`), when the step had them.
    """

    loss: float
    accuracy: float
    num_examples: int
    rules: RulesReport | None = None


@dataclass(frozen=True)
class EvalResult:
    """Outcome of :func:`evaluate`: mean loss, accuracy and number of examples."""

    loss: float
    accuracy: float
    num_examples: int
