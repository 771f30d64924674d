"""Settings and outcomes of local training: :class:`TrainConfig`, :class:`TrainResult`,
:class:`EvalResult` (one frozen, validated dataclass per concern; torch only for the device)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedshard.settings import check

__all__ = ["EvalResult", "TrainConfig", "TrainResult", "finite_real"]


#: TrainConfig's fields of the local-training recipe (:class:`fedshard.settings.LocalTraining`)
#: -> their rule in :data:`fedshard.settings.RULES` (``lr`` is the round's scheduled rate).
RECIPE_RULES = {"local_epochs": "local_epochs", "lr": "round_lr", "momentum": "momentum",
                "frobenius_decay": "frobenius_decay", "clip_lr_tau": "clip_lr_tau",
                "weight_decay": "weight_decay", "factor_step": "factor_step"}


@dataclass(frozen=True)
class TrainConfig:
    """Local-training settings of one client round.

    Attributes
    ----------
    local_epochs : int
        Passes over the loader, ``>= 1``.
    lr : float
        SGD learning rate ``>= 0``: a node trains with its round's scheduled rate, which a
        schedule may take to 0 (then nothing changes: a check of the pipeline).
    momentum : float
        SGD momentum in ``[0, 1)``; the paper uses 0.9.
    frobenius_decay : float
        ``γ >= 0``; adds ``γ ‖U Ω V^T‖_F^2`` per spectral layer to the loss (paper: 1e-4).
    clip_lr_tau : float or None
        ClipLR threshold ``τ >= 1`` (paper: 10); ``None`` disables.
    weight_decay : float
        Ordinary (L2) weight decay ``>= 0`` of the non-spectral parameters (dense weights,
        biases, norms). Never applied to ``u``/``v`` (paper: Frobenius decay only).
    factor_step : str
        ``"plain"`` (the paper's SGD on the factors) or ``"dense"``: the factor gradients are
        transformed before each step so that it moves ``W = U Ω Vᵀ`` as a dense step at the
        same lr (:class:`~fedshard.client.train.precondition.DenseFactorStep`).
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
    compile : bool
        Compile the forward and backward with ``torch.compile`` (Inductor's fused kernels;
        on a GPU combine it with ``cuda_graph``, which captures them in the whole-step
        graph). The same numbers as eager up to float rounding; the first model of each
        structure in a process pays the compilation (and its first short batch a
        recompilation for any batch size); later models of that structure (a client's next
        round, other clients in the process) reuse it. This and the four options below are
        the fast path (:mod:`fedshard.client.train.fast`); where each wins, measured:
        ``benchmarks/README.md``.
    cuda_graph : bool
        Capture the whole step (forward, backward, Frobenius decay, clipping, ClipLR + SGD)
        as one CUDA graph per batch shape, after an eager warm-up step of that shape, and
        replay it: one launch per step instead of hundreds, which is what bounds a small
        sub-model's step on a GPU. CUDA only (a ``ValueError`` on another device). The
        same numbers as eager up to float rounding (the kernels are eager's, except where
        ``pad_terms`` pads thin convolutions).
    max_grad_norm : float or None
        If set (``> 0``), clip the global 2-norm of all trainable gradients (after Frobenius
        decay, before ClipLR) to it, without waiting for the device; ``None`` disables.
    input_key, target_key : str or None
        Keys of the inputs and targets in dict batches; ``None`` recognises the
        flwr-datasets / Hugging Face names (:data:`INPUT_KEYS`, :data:`TARGET_KEYS`).
        Ignored for ``(inputs, targets)`` pairs.
    pad_terms : int or None
        Pad every :class:`~fedshard.spectral.SpectralConv2d`'s ``n`` intermediate channels
        with zero terms to a multiple of this (``pad_terms_to``; exact: see there). Set on
        the model's layers by :func:`~fedshard.client.train.fast.configure_convolutions`
        and left so. ``None``: 8 for ``cuda_graph`` on CUDA without ``compile`` (cuDNN's
        kernels for thin convolutions with other channel counts are slow), else 1 (eager
        CUDA steps are bound by launches, and padding adds some).
    reuse_step : bool or None
        Train on a pooled step (:data:`~fedshard.client.train.fast.STEP_POOL`, one per
        process): a later model of the same shapes and settings (the next client of the
        same keep ratio in a Ray worker or on the in-process grid) is copied into a kept
        model copy whose step, optimizer and CUDA graphs already exist, so it skips the
        warm-up and capture; its trained state is copied back. The same numbers as a fresh
        step (the momentum starts at zero; ClipLR and Frobenius decay read the new ω at
        each step). ``None``:
        on with ``cuda_graph``, off otherwise (an eager step has little to reuse). Turn it
        off for a model whose forward depends on state the pool cannot see (it compares
        modules, tensor shapes, plain attributes and ``repr``; hooks disable pooling).
    merge_terms : bool
        Train every :class:`~fedshard.spectral.SpectralConv2d` as one dense convolution
        whose kernel ``U diag(ω) Vᵀ`` is rebuilt each step (``merge_terms`` there, set on the
        model's layers by :func:`~fedshard.client.train.fast.configure_convolutions` and
        left so), instead of a k×k convolution to ``n`` channels and a 1×1 one. The same
        function and gradients up to rounding; fewer kernels, the dense model's convolution
        FLOPs: for steps bound by kernel launches or latency (small sub-models on a GPU),
        slower where FLOPs count (CPU).

    Raises
    ------
    ValueError
        On any out-of-range value (the recipe's fields by the rules of
        :data:`fedshard.settings.RULES`, the same as the server's).
    """

    local_epochs: int = 1
    lr: float = 0.05
    momentum: float = 0.9
    frobenius_decay: float = 1e-4
    clip_lr_tau: float | None = 10.0
    weight_decay: float = 0.0
    factor_step: str = "plain"
    device: str | torch.device = "cpu"
    seed: int = 0
    log_every_epoch: bool = True
    channels_last: bool = False
    compile: bool = False
    cuda_graph: bool = False
    max_grad_norm: float | None = None
    input_key: str | None = None
    target_key: str | None = None
    pad_terms: int | None = None
    reuse_step: bool | None = None
    merge_terms: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, value: object, expected: str) -> ValueError:
            return ValueError(
                f"TrainConfig.{field}={value!r}: expected {expected}; no training was started."
            )

        for field, rule in RECIPE_RULES.items():  # the rules of fedshard.settings
            value = getattr(self, field)
            expected = check(rule, value)
            if expected is not None:
                raise bad(field, value, expected.removeprefix("expected "))
        if self.max_grad_norm is not None and (
            not finite_real(self.max_grad_norm) or self.max_grad_norm <= 0
        ):
            raise bad("max_grad_norm", self.max_grad_norm, "a finite number > 0 (or None)")
        for field in ("input_key", "target_key"):
            key = getattr(self, field)
            if key is not None and not isinstance(key, str):
                raise bad(field, key, "a str (or None to recognise the usual names)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an int")
        if self.pad_terms is not None and (
            isinstance(self.pad_terms, bool) or not isinstance(self.pad_terms, int)
            or self.pad_terms < 1
        ):
            raise bad("pad_terms", self.pad_terms, "an int >= 1 (1: no padding) or None (auto)")
        if not isinstance(self.merge_terms, bool):
            raise bad("merge_terms", self.merge_terms, "a bool")
        if self.reuse_step is not None and not isinstance(self.reuse_step, bool):
            raise bad("reuse_step", self.reuse_step, "True, False or None (auto)")
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


def finite_real(x: object) -> bool:
    """True for a finite ``int`` or ``float`` (not a ``bool``, NaN or ±inf): a setting that
    arrives from outside (a run config, a message) is checked with this before use."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
