"""The clients of a round trained together as one vectorized model: :class:`BatchedTrainer`.

In a simulation the clients whose sub-models have the same shapes (the same keep ratio) differ
only in their numbers: factors, ω, data. Their parameters are stacked along a new leading
client axis and one step trains all of them: ten small, latency-bound steps become one step
with ten times the work per kernel (what is meant to pay on a GPU; on a CPU the clients one
after another are faster). The step folds the clients into one model's channels where the
model allows (:mod:`fedshard_lab.engine.folded`: about one client's kernels for all of them;
fedshard's ``mlp``, ``resnet18`` and ``lenet``), else it is :func:`torch.func.vmap` over
:func:`torch.func.functional_call` (about 3.6 times one client's kernels for ten clients:
GroupNorm's backward has no batching rule and every convolution runs grouped;
``benchmarks/bench_batched_kernels.py``).

Each client keeps everything that makes it a client (paper, Sec. 3.3, as
:class:`fedshard.client.train.step.EagerStep`): its own batches in its own order (its
:class:`~fedshard.client.train.TensorBatches` with the round's seed), its own momentum, ω,
ClipLR scales ``min(1, τ/ω_i)`` and Frobenius decay ``γ‖UΩVᵀ‖²_F``: the stacked parameters
are stepped by torch's own SGD with the same client rules
(:class:`~fedshard.client.train.rules.ClientRules`) as every other trainer. A client whose
epoch has run out of batches while others go on keeps its parameters and momentum. A last
batch shorter than the others is padded with examples of weight 0.

Covered: models whose forward has no randomness and no running statistics (no dropout with
``p > 0``, no batch norm), such as fedshard's ``mlp`` and ``resnet18`` (GroupNorm). A model
outside that, a message carrying the dense FedAvg reference (``fedavg-cosine``), a recipe with a
factor step other than the paper's plain SGD (``factor-step``), or data that cannot be held
as tensors are trained one after another
(:class:`~fedshard_lab.engine.grid.SequentialTrainer`). The per-client speed options
(``compile``, ``cuda-graph``, ``merge-terms``) do not apply here.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import Message
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import Dataset

from fedshard import protocol as P
from fedshard.app.config import RunConfig
from fedshard.client.node import train_kind
from fedshard.client.shard import Shard
from fedshard.client.train.batches import TensorBatches, batches_for
from fedshard.client.train.config import TrainConfig
from fedshard.client.train.rules import ClientRules, RulesReport
from fedshard.spectral.layers import SpectralLayer
from fedshard.spectral.selection import BATCH_NORMS
from fedshard_lab.engine.folded import fold, foldable, folded_step
from fedshard_lab.engine.grid import SequentialTrainer, TrainJob

__all__ = ["BatchedTrainer", "step_route", "train_together", "vectorizable"]

logger = logging.getLogger(__name__)


#: torch's dropout layers, by their public classes.
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
             nn.FeatureAlphaDropout)


def vectorizable(model: nn.Module) -> list[str]:
    """Why ``model`` cannot be trained vectorized (empty: it can): its modules with
    train-time randomness (dropout ``p > 0``) or running statistics (batch norm)."""
    reasons = []
    for name, module in model.named_modules():
        if isinstance(module, _DROPOUTS) and module.p > 0:
            reasons.append(f"{name or 'model'}: {type(module).__name__}(p={module.p})")
        elif isinstance(module, BATCH_NORMS):
            reasons.append(f"{name or 'model'}: {type(module).__name__} (running statistics)")
    return reasons


class BatchedTrainer:
    """Trains a round's clients grouped by sub-model shapes and recipe, each group as one
    vectorized model (:func:`train_together`); what it does not cover goes to a
    :class:`~fedshard_lab.engine.grid.SequentialTrainer` (see the module docstring).

    Parameters
    ----------
    model : nn.Module
        The run's model (only read).
    cfg : RunConfig
        The run.
    device : str
        Where to train.
    """

    def __init__(self, model: nn.Module, cfg: RunConfig, device: str) -> None:
        self.model, self.device = model, device
        self.sequential = SequentialTrainer(model, cfg, device)
        self.refused = vectorizable(model)
        if self.refused:
            logger.warning("engine=batched: the model has %s; its clients are trained one "
                           "after another", ", ".join(self.refused[:3]))

    def __call__(self, jobs: Sequence[TrainJob]) -> list[Message | Exception]:
        out: list[Message | Exception | None] = [None] * len(jobs)
        groups: dict[tuple[Any, ...], list[tuple[int, Shard, TensorBatches]]] = defaultdict(list)
        for i, (msg, data) in enumerate(jobs):
            try:
                member = self._member(msg, data)
            except Exception as err:  # that node's error reply, as its ClientApp's
                out[i] = err
                continue
            if member is None:
                out[i] = self.sequential([(msg, data)])[0]
                continue
            shard, loader = member
            s = shard.settings
            key = (tuple((k, tuple(v.shape), v.dtype) for k, v in shard.model.state_dict().items()),
                   s.lr, s.local_epochs, s.batch_size, s.momentum, s.frobenius_decay,
                   s.clip_lr_tau, s.weight_decay)
            groups[key].append((i, shard, loader))
        for members in groups.values():
            try:
                replies = train_together([m[1] for m in members], [m[2] for m in members])
            except Exception as err:  # the group's step failed: every member's reply is it
                replies = [err] * len(members)
            for (i, _, _), reply in zip(members, replies, strict=True):
                out[i] = reply
        assert all(o is not None for o in out)
        return [o for o in out if o is not None]

    def _member(self, msg: Message, data: Dataset[Any]) -> tuple[Shard, TensorBatches] | None:
        """The received shard and its batches, or ``None`` for the sequential path."""
        if (self.refused or P.REFERENCE in msg.content.array_records
                or train_kind(msg) != "shard"):
            return None  # (a narrow model of width slicing is trained alone)
        shard = Shard.from_message(msg, self.model, device=self.device)
        if _uncovered(shard.train_config()):
            return None
        s = shard.settings
        loader = batches_for(data, s.batch_size, seed=s.train_seed, device=shard.device)
        if not isinstance(loader, TensorBatches):
            return None
        return shard, loader


def _uncovered(cfg: TrainConfig) -> list[str]:
    """The recipe's settings :func:`train_together` does not implement (then the client is
    trained by :class:`~fedshard_lab.engine.grid.SequentialTrainer`): a global gradient-norm
    clip, a factor step other than the paper's plain SGD, a cap on the steps."""
    out = []
    if cfg.max_grad_norm is not None:
        out.append(f"max_grad_norm={cfg.max_grad_norm}")
    factor_step = cfg.recipe.factor_step
    if factor_step != "plain":
        out.append(f"factor_step={factor_step!r}")
    if cfg.recipe.max_steps:
        out.append(f"max_steps={cfg.recipe.max_steps}")
    return out


@dataclass
class _StackedLayer:
    """A sharded layer's factors and multipliers with a leading client axis: what the client
    rules (:class:`~fedshard.client.train.rules.ClientRules`) read."""

    u: torch.Tensor  # (C, rows, n)
    v: torch.Tensor  # (C, rows', n)
    omega: torch.Tensor  # (C, n)


def step_route(model: nn.Module) -> str:
    """The step :func:`train_together` takes for ``model``: ``"folded"`` (the clients in one
    model's channels, :func:`~fedshard_lab.engine.folded.folded_step`), else ``"vmap: "`` and
    the reasons :func:`~fedshard_lab.engine.folded.foldable` gives."""
    why = foldable(model)
    return "folded" if not why else "vmap: " + "; ".join(why)


def train_together(shards: Sequence[Shard], loaders: Sequence[TensorBatches]
                   ) -> list[Message | Exception]:
    """Train ``shards`` (sub-models of equal shapes, the same recipe) as one vectorized model,
    each on its own batches; return each one's reply (or the exception that replaces it).

    Parameters
    ----------
    shards : sequence of Shard
        Received (:meth:`Shard.from_message`; their own rules are not attached: the stacked
        factors get one set); their models are trained in place.
    loaders : sequence of TensorBatches
        Client c's batches, in its own order (the round's seed).

    Returns
    -------
    list
        Client c's :meth:`Shard.reply` with ``train-loss`` and ``train-accuracy`` (as
        :func:`fedshard.client.handlers.handle_train` sends), or a ``FloatingPointError`` when
        its loss or parameters are not finite.

    Notes
    -----
    Per step and client, as :class:`~fedshard.client.train.step.EagerStep`: the gradient of
    the mean cross-entropy of its batch (:func:`~fedshard_lab.engine.folded.folded_step`
    where the model folds, else ``torch.func.vmap`` of ``grad``), then torch's own
    SGD with momentum over the stacked parameters (weight decay on the non-factor parameters
    only) with the same client rules (:class:`~fedshard.client.train.rules.ClientRules` on the
    stacked factors: Frobenius decay before the step, ClipLR after it, per client through
    its own ω). A client without a batch in a step keeps its parameters and momentum.
    Paper, Sec. 3.3.
    """
    first = shards[0]
    s = first.settings
    model = first.model
    model.train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    own = [dict(sh.model.named_parameters()) for sh in shards]
    own_buffers = [dict(sh.model.named_buffers()) for sh in shards]
    # (C, ...) per name: client c's tensor at index c (leaf tensors: torch's SGD steps them)
    params = {n: torch.stack([o[n].detach() for o in own]) for n in names}
    buffers = {n: torch.stack([b[n] for b in own_buffers]) for n in own_buffers[0]}
    buffers.update({n: torch.stack([o[n].detach() for o in own]) for n in frozen})
    spectral = [(f"{name}." if name else "") for name, m in model.named_modules()
                if isinstance(m, SpectralLayer)]
    factors = {p + f for p in spectral for f in ("u", "v")}
    groups = [{"params": [params[n] for n in names if n in factors], "weight_decay": 0.0},
              {"params": [params[n] for n in names if n not in factors],
               "weight_decay": s.weight_decay}]
    sgd = torch.optim.SGD([g for g in groups if g["params"]], lr=s.base_lr, momentum=s.momentum)
    rules = ClientRules([_StackedLayer(params[p + "u"], params[p + "v"], buffers[p + "omega"])
                         for p in spectral if p + "u" in params and p + "v" in params],
                        frobenius_decay=s.frobenius_decay, clip_lr_tau=s.clip_lr_tau)
    rules.attach(sgd)
    # the clients folded into one model's channels where the model allows (about one client's
    # kernels for all of them), else vmap over the stacked clients: the same numbers
    step = (folded_step(fold(model)) if step_route(model) == "folded"
            else vmap(grad(_client_loss(model), has_aux=True)))
    count = len(shards)
    device = params[names[0]].device
    total = {k: torch.zeros(count, dtype=torch.float64, device=device)
             for k in ("loss", "correct", "targets")}
    for _ in range(s.local_epochs):
        epoch = {k: torch.zeros(count, dtype=torch.float64, device=device) for k in total}
        batches = [iter(loader) for loader in loaders]
        while True:
            got = [next(it, None) for it in batches]
            if all(b is None for b in got):
                break
            inputs, targets, weights, active = _stacked(got, params[names[0]].dtype)
            grads, (loss_sum, correct, seen) = step(params, buffers, inputs, targets, weights)
            for n in names:
                params[n].grad = grads[n]
            kept = None if all(b is not None for b in got) else _state(sgd, params, names)
            sgd.step()
            if kept is not None:  # a client without a batch this step does not move
                _keep_inactive(sgd, params, names, kept, active)
            with torch.no_grad():
                epoch["loss"] += loss_sum.to(torch.float64)
                epoch["correct"] += correct.to(torch.float64)
                epoch["targets"] += seen.to(torch.float64)
        for k in total:
            total[k] += epoch[k]
    report = rules.report()
    replies: list[Message | Exception] = []
    for c, (shard, loader) in enumerate(zip(shards, loaders, strict=True)):
        with torch.no_grad():
            for n, p in own[c].items():
                if n in params:
                    p.copy_(params[n][c])
        seen_c = max(int(total["targets"][c].item()), 1)
        loss = total["loss"][c].item() / seen_c
        if not torch.isfinite(total["loss"][c]):
            replies.append(FloatingPointError(
                f"{P.DIVERGED}: the training loss became {loss} (trained with the clients of "
                "the same sub-model shapes); the model's parameters are not usable. Lower the "
                "learning rate (lr), set factor-step = \"dense\" or enable ClipLR (clip-lr)."))
            continue
        metrics = {P.TRAIN_LOSS: loss, P.TRAIN_ACCURACY: total["correct"][c].item() / seen_c}
        try:
            replies.append(shard.reply(loader.num_examples, metrics,
                                       rules=_client_report(report, shard)))
        except Exception as err:
            replies.append(err)
    logger.info("batched: %d clients of equal sub-model shapes, %d epoch(s), mean loss %.4f",
                count, s.local_epochs,
                float((total["loss"] / total["targets"].clamp_min(1)).mean()))
    return replies


def _state(sgd: torch.optim.SGD, params: dict[str, torch.Tensor], names: list[str]
           ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each parameter's value and momentum buffer before a step (copies)."""
    out = []
    for n in names:
        buf = sgd.state.get(params[n], {}).get("momentum_buffer")
        out.append((params[n].detach().clone(), None if buf is None else buf.clone()))
    return out


@torch.no_grad()
def _keep_inactive(sgd: torch.optim.SGD, params: dict[str, torch.Tensor], names: list[str],
                   kept: list[tuple[torch.Tensor, torch.Tensor | None]],
                   active: torch.Tensor) -> None:
    """Put back the parameters and momentum of the clients that had no batch (``active``
    false) as they were before the step."""
    for n, (value, buf) in zip(names, kept, strict=True):
        p = params[n]
        keep = active.view(-1, *([1] * (p.ndim - 1)))  # (C, 1, ...)
        p.copy_(torch.where(keep, p, value))
        now = sgd.state[p].get("momentum_buffer")
        if now is not None:
            now.copy_(torch.where(keep, now, buf if buf is not None else torch.zeros_like(now)))


def _client_report(report: RulesReport, shard: Shard) -> RulesReport:
    """The stacked rules' report for one client: its own terms above τ."""
    own = shard.rules.report()
    return replace(report, scaled_columns=own.scaled_columns, columns=own.columns)


def _client_loss(model: nn.Module) -> Any:
    """One client's mean cross-entropy on its (padded) batch and its sums, as a function of
    its parameters (for :func:`torch.func.grad`)."""

    def loss(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
             inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        logits = functional_call(model, (params, buffers), (inputs,))  # (B, C) or (B, T, C)
        flat = logits.reshape(-1, logits.shape[-1])
        flat_targets = targets.reshape(-1)
        # an example's weight for each of its targets; -100 targets are not counted
        w = weights.reshape(weights.shape + (1,) * (targets.ndim - 1)).expand_as(targets)
        w = w.reshape(-1) * (flat_targets != -100).to(w.dtype)
        per_target = F.cross_entropy(flat, flat_targets, reduction="none")  # (B·T,)
        loss_sum = (per_target * w).sum()
        seen = w.sum()
        correct = ((flat.argmax(dim=-1) == flat_targets).to(w.dtype) * w).sum()
        return loss_sum / seen.clamp_min(1), (loss_sum.detach(), correct, seen)

    return loss


def _stacked(got: list[tuple[torch.Tensor, torch.Tensor] | None], dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(C, B, ...)`` inputs and targets, ``(C, B)`` example weights (0: padding) and the
    ``(C,)`` mask of clients that have a batch this step."""
    present = [b for b in got if b is not None]
    size = max(int(b[0].shape[0]) for b in present)
    x0, y0 = present[0]
    active = torch.tensor([b is not None for b in got], device=x0.device)
    if all(b is not None and b[0].shape[0] == size for b in got):
        inputs = torch.stack([b[0] for b in present])
        targets = torch.stack([b[1] for b in present]).long()
        return inputs, targets, torch.ones(len(got), size, dtype=dtype, device=x0.device), active
    inputs = x0.new_zeros((len(got), size, *x0.shape[1:]))
    targets = torch.zeros((len(got), size, *y0.shape[1:]), dtype=torch.long, device=x0.device)
    weights = torch.zeros(len(got), size, dtype=dtype, device=x0.device)
    for c, b in enumerate(got):
        if b is not None:
            n = int(b[0].shape[0])
            inputs[c, :n], targets[c, :n], weights[c, :n] = b[0], b[1], 1
    return inputs, targets, weights, active
