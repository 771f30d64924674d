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

from fedshard.batches import INPUT_KEYS, TARGET_KEYS, dataset_size, unpack_batch
from fedshard.optim import ClipLR, FrobeniusDecay, frobenius_penalty
from fedshard.spectral.layers import SpectralConv2d, SpectralLayer

__all__ = [
    "INPUT_KEYS",
    "TARGET_KEYS",
    "ClipLR",
    "EvalResult",
    "FrobeniusDecay",
    "TrainConfig",
    "TrainResult",
    "TrainStep",
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
    compile : bool
        Compile the forward and backward with ``torch.compile`` (Inductor's fused kernels;
        on a GPU combine it with ``cuda_graph``, which captures them in the whole-step
        graph: the fastest step measured). The same numbers as eager up to float
        rounding; the first model of each structure in a process pays the compilation (and
        its first short batch a recompilation for any batch size); later models of that
        structure (a client's next round, other clients in the process) reuse it.
    cuda_graph : bool
        Capture the whole step (forward, backward, Frobenius decay, clipping, ClipLR + SGD)
        as one CUDA graph per batch shape, after an eager warm-up step of that shape, and
        replay it: one launch per step instead of hundreds, which is what bounds a small
        sub-model's step on a GPU. CUDA only (a ``ValueError`` on another device). The same
        kernels as eager, so the same numbers.
    max_grad_norm : float or None
        If set (``> 0``), clip the global 2-norm of all trainable gradients (after Frobenius
        decay, before ClipLR) to it, without waiting for the device; ``None`` disables.
    input_key, target_key : str or None
        Keys of the inputs and targets in dict batches; ``None`` recognises the
        flwr-datasets / Hugging Face names (:data:`INPUT_KEYS`, :data:`TARGET_KEYS`).
        Ignored for ``(inputs, targets)`` pairs.
    pad_terms : int or None
        Pad every :class:`~fedshard.spectral.SpectralConv2d`'s ``n`` intermediate channels
        with zero terms to a multiple of this while training (``pad_terms_to``; exact: see
        there). ``None``: 8 for ``cuda_graph`` on CUDA without ``compile`` (H100, r = 0.1
        ResNet-18 step 4.84 against 5.47 ms: cuDNN's kernels for thin convolutions with
        other channel counts are slow), else 1. Eager CUDA steps are bound by launches, not
        kernels, and the padding's extra launches made them slower (22.0 against 19.4 ms).

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
    compile: bool = False
    cuda_graph: bool = False
    max_grad_norm: float | None = None
    input_key: str | None = None
    target_key: str | None = None
    pad_terms: int | None = None

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
        if self.max_grad_norm is not None and (
            not _finite(self.max_grad_norm) or self.max_grad_norm <= 0
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
        loss_sum, correct, count = _cross_entropy(self.model(inputs), targets)
        return loss_sum / count.clamp_min(1), loss_sum, correct, count

    def _update_eager(self) -> None:
        self.decay.add_gradient_()
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.cfg.max_grad_norm, foreach=True)
        self.optimizer.step()


class _StepGraphs:
    """A training step replayed from CUDA graphs, one per batch shape (PyTorch's whole-network
    capture recipe): ``_WARMUP`` eager steps of a shape on a side stream (they are real
    steps: they create the momentum buffers and the ClipLR scales), then the next step of
    that shape is captured and replayed; every later one copies its batch into the graph's
    static inputs and replays. The outputs are the graph's static tensors: read them before
    the next step (``train`` adds them to its sums at once)."""

    _WARMUP = 1  # H100, CIFAR-10 round of 10 clients: 4.8 s with 1, 5.7 s with 3

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
                 ) -> None:
        self.step = step
        self.seen: dict[tuple[Any, ...], int] = {}
        self.graphs: dict[tuple[Any, ...], tuple[Any, torch.Tensor, torch.Tensor,
                                                 tuple[torch.Tensor, ...]]] = {}

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
            with torch.cuda.graph(graph):  # records the step; it runs at the replay below
                static_out = self.step(static_in, static_tg)
            self.graphs[key] = (graph, static_in, static_tg, static_out)
        graph, static_in, static_tg, static_out = self.graphs[key]
        static_in.copy_(inputs)
        static_tg.copy_(targets)
        graph.replay()
        return static_out[0], static_out[1], static_out[2]


def train(model: nn.Module, loader: DataLoader[Any], cfg: TrainConfig) -> TrainResult:
    """Train ``model`` in place for ``cfg.epochs`` epochs with cross-entropy.

    Parameters
    ----------
    model : nn.Module
        Moved to ``cfg.device`` and left there, in train mode. Outputs ``(B, C)`` logits with
        ``(B,)`` targets, or ``(B, T, C)`` with ``(B, T)`` targets (next-token prediction);
        targets equal to ``-100`` are ignored.
    loader : DataLoader
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
    plain SGD with momentum (paper, Sec. 3.3); see :class:`TrainStep`. Deterministic given
    ``cfg.seed`` on CPU: all torch randomness drawn from the global generator during the call
    comes from a forked RNG seeded with it (the caller's RNG state is restored afterwards). A
    DataLoader with its own ``generator`` keeps using that.
    """
    device = torch.device(cfg.device)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    model.train()
    step = TrainStep(model, cfg)
    # Device-side sums: the only reads back to the host are the periodic finiteness checks
    # and the per-epoch log line. CE >= 0, so a sum is finite iff every summand is.
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    total_correct = torch.zeros((), dtype=torch.int64, device=device)
    total_targets = torch.zeros((), dtype=torch.int64, device=device)
    examples_per_epoch = 0
    with _forked_rng(cfg.seed, device):
        for epoch in range(cfg.epochs):
            epoch_loss = torch.zeros((), dtype=torch.float64, device=device)
            epoch_correct = torch.zeros((), dtype=torch.int64, device=device)
            epoch_targets = torch.zeros((), dtype=torch.int64, device=device)
            examples_per_epoch = 0
            steps = 0
            for batch in loader:
                inputs, targets = unpack_batch(batch, device, cfg.input_key, cfg.target_key)
                if cfg.channels_last and inputs.ndim == 4:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                loss_sum, correct, count = step(inputs, targets)
                epoch_loss += loss_sum
                epoch_correct += correct
                epoch_targets += count
                examples_per_epoch += int(inputs.shape[0])
                steps += 1
                if steps % _CHECK_EVERY == 0:
                    _check_finite(epoch_loss, epoch, steps, cfg)
            if examples_per_epoch == 0:
                raise ValueError("the DataLoader yielded no batches; nothing was trained.")
            _check_finite(epoch_loss, epoch, steps, cfg)
            total_loss += epoch_loss
            total_correct += epoch_correct
            total_targets += epoch_targets
            if cfg.log_every_epoch:
                seen = max(int(epoch_targets.item()), 1)
                logger.info(
                    "epoch %d/%d: loss %.4f, accuracy %.4f over %d targets",
                    epoch + 1,
                    cfg.epochs,
                    epoch_loss.item() / seen,
                    epoch_correct.item() / seen,
                    int(epoch_targets.item()),
                )
    seen = max(int(total_targets.item()), 1)
    return TrainResult(
        loss=total_loss.item() / seen,
        accuracy=total_correct.item() / seen,
        num_examples=dataset_size(loader, examples_per_epoch),
    )


#: Steps between two checks that the loss is finite (each check waits for the device).
_CHECK_EVERY = 32


def _check_finite(loss_sum: torch.Tensor, epoch: int, steps: int, cfg: TrainConfig) -> None:
    if bool(torch.isfinite(loss_sum)):
        return
    remedies = ["lower the learning rate (lr)", "add normalization layers to the model"]
    if cfg.max_grad_norm is None:
        remedies.append("set TrainConfig.max_grad_norm to clip the gradient norm")
    else:
        remedies.append(f"lower max_grad_norm (now {cfg.max_grad_norm})")
    if cfg.clip_tau is None:
        remedies.append("enable ClipLR (clip_tau)")
    raise FloatingPointError(
        f"training loss became {loss_sum.item()} in epoch {epoch + 1} (found after step "
        f"{steps}; checked every {_CHECK_EVERY} steps); training stopped and the model's "
        f"parameters are not usable. To fix: {', '.join(remedies[:-1])} or {remedies[-1]}."
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader[Any],
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
    loader : DataLoader
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
    model.to(dev)
    model.eval()
    total_loss = torch.zeros((), dtype=torch.float64, device=dev)
    total_correct = torch.zeros((), dtype=torch.int64, device=dev)
    total_targets = torch.zeros((), dtype=torch.int64, device=dev)
    examples = 0
    try:
        for batch in loader:
            inputs, targets = unpack_batch(batch, dev, input_key, target_key)
            loss_sum, correct, count = _cross_entropy(model(inputs), targets)
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


def _cross_entropy(
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
