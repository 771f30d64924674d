"""A received shard as a ready sub-model, for any training loop (fedshard's or yours).

:func:`receive` turns a ``train`` message into a :class:`Shard`: the user's own model class
with the sharded layers swapped for ``U·diag(ω)·Vᵀ`` (:mod:`fedshard.spectral`), the round's
settings, the paper's client rules for it and the checked reply (:meth:`Shard.reply`).

**The paper's client rules come with the shard** (Sec. 3.3,
:class:`~fedshard.client.train.rules.ClientRules`, ``shard.rules``): attach them to the
optimizer that trains ``shard.model`` (``shard.rules.attach(optimizer)``; a framework that
builds its own optimizer: ``shard.rules.attaching(build)``), and each of its steps applies
Frobenius decay ``γ ∂‖UΩVᵀ‖²_F`` before the step and ClipLR's per-term lr scale
``min(1, τ/ω_i)`` to what the step moved; with the server's ``factor_step="dense"`` they also
make each step move ``W = UΩVᵀ`` as a dense step would
(:mod:`fedshard.client.train.precondition`), so the dense model's lr works.
:meth:`Shard.optimizer` (the server's SGD) and fedshard's own loop attach them themselves. The
rules act on the optimizers they are attached to and on nothing else in the process. The reply
says how many terms ClipLR scaled (``clip-lr-terms``), and a round in which no optimizer step
applied the rules logs a WARNING.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from torch import nn

from fedshard import protocol as P
from fedshard.client.train.config import TrainConfig
from fedshard.client.train.loop import on_device
from fedshard.client.train.optim import build_optimizer
from fedshard.client.train.rules import ClientRules, RulesReport
from fedshard.protocol.bounds import all_finite
from fedshard.spectral import LayerFactors, build_submodel
from fedshard.spectral.per_sample import register_if_opacus_loaded

__all__ = ["CLIP_LR_TERMS", "Shard", "SubmodelCache", "receipt_of", "receive", "receiving",
           "rules_metrics", "shard_reply", "submodel_from_record"]

logger = logging.getLogger(__name__)

#: The reply metric that says how many of a node's terms ClipLR scaled (ω_i > τ) in the
#: round; 0 when it scaled none, or when no optimizer step applied the rules.
CLIP_LR_TERMS = "clip-lr-terms"

#: The list a :func:`receiving` block collects the shards of :func:`receive` in; ``None``
#: outside such a block. A context variable: each thread (and asyncio task) sees only the block
#: it runs in, and nothing outlives the block.
_RECEIVED: ContextVar[list[Shard] | None] = ContextVar("fedshard_received", default=None)

#: A sub-model's shape: ``(layer, u's shape, v's shape)`` of each sharded layer, sorted.
SubmodelShape = tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]


class SubmodelCache:
    """Sub-models of one model kept for the next shard of the same shape, for a process that
    trains many shards one after another (fedshard's in-process engine does).

    Building a sub-model copies the whole model (``copy.deepcopy``: most of the time it takes
    to receive a shard of a small model); a kept sub-model whose sharded layers have the same
    ranks only takes the received values, which gives the same sub-model, value for value:
    copied straight from the received bytes into its tensors, or through ``load_state_dict``
    where a module loads in its own way or has state-dict hooks.
    :func:`fedshard.client.handlers.handle_train` gives its sub-model back once its reply
    is built, when it trained with the eager step (the fast options may change a
    sub-model's convolutions) and its factors carry no hooks. What a
    sub-model holds beyond its ``state_dict`` (non-persistent buffers, attributes its forward
    pass changes) is carried over to the next shard: use it with models whose forward pass
    changes nothing but their parameters and buffers (fedshard's models are such).

    Parameters
    ----------
    model : nn.Module
        The model the sub-models are built from (only read).
    max_shapes : int
        At most this many shapes are kept (one sub-model each); a shape beyond them is built
        and dropped after use.
    """

    def __init__(self, model: nn.Module, max_shapes: int = 8) -> None:
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"SubmodelCache(max_shapes={max_shapes!r}): expected an int ≥ 1; "
                             "no cache was made.")
        self.model = model
        self.max_shapes = max_shapes
        self._free: dict[SubmodelShape, nn.Module] = {}
        self._lent: weakref.WeakKeyDictionary[nn.Module, SubmodelShape] = \
            weakref.WeakKeyDictionary()

    def take(self, shape: SubmodelShape) -> nn.Module | None:
        """A kept sub-model of ``shape`` (no longer kept), or ``None``."""
        return self._free.pop(shape, None)

    def lend(self, sub: nn.Module, shape: SubmodelShape) -> None:
        """Note that ``sub``, of ``shape``, is in use (:meth:`give` takes it back)."""
        self._lent[sub] = shape

    def give(self, sub: nn.Module) -> None:
        """Keep ``sub`` (from :meth:`lend`; its trainer is done with it) for the next shard of
        its shape; a sub-model this cache did not lend is ignored."""
        shape = self._lent.pop(sub, None)
        if shape is not None and (shape in self._free or len(self._free) < self.max_shapes):
            self._free[shape] = sub

    def __len__(self) -> int:
        """Sub-models kept now."""
        return len(self._free)


def _shape(factors: Mapping[str, Mapping[str, np.ndarray]]) -> SubmodelShape:
    return tuple(sorted((layer, tuple(parts["u"].shape), tuple(parts["v"].shape))
                        for layer, parts in factors.items()))


def submodel_from_record(model: nn.Module, record: ArrayRecord,
                         cache: SubmodelCache | None = None) -> tuple[nn.Module, list[str]]:
    """Build the sub-model described by a train ``record`` on a copy of ``model``.

    Returns the sub-model with every received entry loaded (strictly: a missing or extra key
    raises) and the names of its sharded layers. ``model`` itself is not modified. With a
    ``cache`` (of ``model``), a kept sub-model of the same shape is loaded instead of a new
    copy (:class:`SubmodelCache`).
    """
    sub = None
    if cache is not None:
        if cache.model is not model:
            raise ValueError("submodel_from_record: the cache holds sub-models of another "
                             "model; give the model it was made with. Nothing was built.")
        factors, views = P.decode_shard(record, views=True)
        shape = _shape(factors)
        sub = cache.take(shape)
        if sub is not None and _copy_into(sub, views):
            cache.lend(sub, shape)
            return sub, sorted(factors)
    # a new sub-model, or a kept one that load_state_dict loads (and raises what it raises)
    factors, state = P.decode_shard(record)
    shape = _shape(factors)
    if sub is None:
        dtype = next(iter(model.parameters())).dtype
        sub = build_submodel(model, {
            layer: LayerFactors(**{p: torch.as_tensor(x, dtype=dtype) for p, x in parts.items()})
            for layer, parts in factors.items()
        })
    if cache is not None:
        cache.lend(sub, shape)
    missing, unexpected = sub.load_state_dict(
        {k: torch.as_tensor(x) for k, x in state.items()}, strict=False)  # fresh arrays
    if missing or unexpected:
        raise ValueError(
            f"The received arrays do not fit this node's model: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}. Server and node must use the same model "
            "(model, model-width, dataset); this round's reply will be an error."
        )
    return sub, sorted(factors)


#: torch's per-module tables of the hooks that change what ``state_dict`` and
#: ``load_state_dict`` do (read, never written; pinned by tests/test_torch_internals.py).
STATE_DICT_HOOKS = ("_state_dict_pre_hooks", "_state_dict_hooks",
                    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
# modules whose loading is a plain copy of a complete state dict: nn.Module's own, and the
# batch norms' (it adds a missing ``num_batches_tracked`` of an old state dict, then that)
_PLAIN_LOADS = (nn.Module._load_from_state_dict, nn.BatchNorm2d._load_from_state_dict)


def _copy_into(sub: nn.Module, state: Mapping[str, np.ndarray]) -> bool:
    """Copy ``state`` into ``sub``'s parameters and buffers, as
    ``sub.load_state_dict(state, strict=True)`` would, with one copy from the received
    bytes (``state``: read-only views) and without its per-module machinery; ``False``, with
    nothing changed, where ``load_state_dict`` would do more than copy (a module with its own
    loading or with state-dict hooks) or refuse (other keys or shapes): the caller then
    leaves it to ``load_state_dict``."""
    for m in sub.modules():
        if type(m)._load_from_state_dict not in _PLAIN_LOADS or \
                any(getattr(m, h, None) for h in STATE_DICT_HOOKS):
            return False
    targets = sub.state_dict(keep_vars=True)
    if targets.keys() != state.keys() or any(tuple(targets[k].shape) != x.shape
                                             for k, x in state.items()):
        return False
    with torch.no_grad():
        for k, x in state.items():
            t = targets[k]
            dst = t.detach().numpy() if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES \
                else None
            if dst is not None and dst.dtype == x.dtype:
                np.copyto(dst, x)  # the same bytes as torch's copy_
            else:  # another device or dtype: torch converts
                t.copy_(torch.from_numpy(np.array(x)))
    return True


#: torch dtypes whose CPU tensors ``Tensor.numpy()`` views.
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8,
                           torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                           torch.complex64, torch.complex128})


@dataclass
class Shard:
    """A received shard, ready to train with any loop; :func:`receive` builds it.

    Attributes
    ----------
    model : nn.Module
        A copy of your model with each sharded layer replaced by its ``U·diag(ω)·Vᵀ`` layer
        (trainable ``u``, ``v``; frozen parameter ``omega``), on ``device``.
    settings : fedshard.protocol.TrainSettings
        The server's settings for this round: the recipe
        (:class:`~fedshard.settings.LocalTraining`: ``lr`` already scheduled, ``local_epochs``,
        ``batch_size``, ``momentum``, ``frobenius_decay`` γ, ``clip_lr_tau`` τ, ...) and the
        round, keep ratio and training seed.
    layers : tuple of str
        Names of the sharded layers.
    message : flwr.app.Message
        The ``train`` message (the reply answers it).
    device : torch.device
        Where ``model`` lives.
    rules : ClientRules
        The client rules of the received recipe on ``model``'s factors: attach them to the
        optimizer that trains ``model`` (``shard.rules.attach(optimizer)``); they act on no
        other optimizer.
    """

    model: nn.Module
    settings: P.TrainSettings
    layers: tuple[str, ...]
    message: Message
    device: torch.device
    rules: ClientRules

    @classmethod
    def from_message(cls, msg: Message, model: nn.Module, *,
                     device: str | torch.device = "cpu",
                     cache: SubmodelCache | None = None) -> Shard:
        """Same as :func:`receive` (``cache``: a :class:`SubmodelCache` of ``model``), without
        telling an enclosing :func:`receiving` block."""
        settings = P.TrainSettings.from_record(msg.content.config_records[P.CONFIG])
        sub, layers = submodel_from_record(model, msg.content.array_records[P.ARRAYS], cache)
        register_if_opacus_loaded()  # DP-SGD: Opacus takes the factorized layers' formulas
        dev = torch.device(device)
        sub = on_device(sub, dev)  # (a kept sub-model is already there)
        return cls(sub, settings, tuple(layers), msg, dev, ClientRules.of(sub, settings))

    def train_config(self, **overrides: Any) -> TrainConfig:
        """fedshard's :class:`~fedshard.client.train.TrainConfig` for the received recipe,
        this shard's device and the round's seed; ``overrides`` replace fields (e.g.
        ``log_every_epoch=False``)."""
        cfg = TrainConfig(recipe=self.settings, device=self.device,
                          torch_seed=self.settings.train_seed)
        return replace(cfg, **overrides) if overrides else cfg

    def optimizer(self, **overrides: Any) -> torch.optim.SGD:
        """SGD with the server's lr, momentum and weight decay (none on the factors), the
        client rules attached (:func:`~fedshard.client.train.build_optimizer`);
        ``overrides`` replace :class:`TrainConfig` fields. Optional: an optimizer you build
        over ``shard.model.parameters()`` gets the rules with ``shard.rules.attach(it)``.

        A plain ``torch.optim.SGD``: call ``zero_grad()``, ``loss.backward()``, ``step()`` on
        it as on any optimizer, and use it with learning-rate schedulers and
        ``state_dict()``.
        """
        return build_optimizer(self.model, self.train_config(**overrides), self.rules)

    def reply(self, num_examples: int, metrics: Mapping[str, float] | None = None, *,
              rules: RulesReport | None = None) -> Message:
        """The reply ``Message``: the trained factors and dense entries, ``num_examples``
        (the aggregation weight, > 0), your ``metrics`` (any numeric scalars; the server
        averages each over the nodes that report it, weighted by ``num_examples``) and
        :data:`CLIP_LR_TERMS`.

        ``rules``: what the client rules did, when a trainer other than :attr:`rules` applied
        them (fedshard's loop); by default :attr:`rules`' report (a WARNING if no optimizer
        step applied them).

        Raises
        ------
        FloatingPointError
            If training left NaN or inf in the model (nothing is sent; see the message).
        TypeError, ValueError
            For a non-numeric metric or ``num_examples`` ≤ 0.
        """
        state = {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}
        report = rules if rules is not None else self.rules.report()
        values = {**(metrics or {}), **rules_metrics(report, self.rules.active)}
        return shard_reply(self.message, state, num_examples, values, self.settings.base_lr,
                           receipt_of(report))


@contextmanager
def receiving() -> Iterator[list[Shard]]:
    """Collect the shards :func:`receive` builds inside this block (in this thread or asyncio
    task), in order.

    How :func:`fedshard.client.sharding_mod` learns what the client rules did in a handler
    that replies FedAvg-style (``ArrayRecord(model.state_dict())``) after dropping its
    :class:`Shard`: the mod holds the list for the one message it handles; nothing is kept
    once the block ends. Blocks nest: an inner block collects what is received inside it.
    """
    shards: list[Shard] = []
    token = _RECEIVED.set(shards)
    try:
        yield shards
    finally:
        _RECEIVED.reset(token)


def receipt_of(report: RulesReport) -> P.Receipt:
    """The reply's receipt (:class:`fedshard.protocol.Receipt`): what the node trained with, as
    the client rules saw it."""
    applied = report.steps > 0
    return P.Receipt(report.optimizer, report.lr, report.steps,
                     applied and report.clip_lr_tau is not None,
                     applied and report.frobenius_decay > 0,
                     report.dp_sgd, report.noise_multiplier, report.max_grad_norm)


def rules_metrics(report: RulesReport, active: bool) -> dict[str, float]:
    """The reply's :data:`CLIP_LR_TERMS` from ``report``; a WARNING when the rules had
    something to do (``active``) but no optimizer step applied them."""
    if active and report.steps == 0:
        off = [f"Frobenius decay (γ={report.frobenius_decay:g})"] if report.frobenius_decay else []
        if report.clip_lr_tau is not None:
            off.append(f"ClipLR (τ={report.clip_lr_tau:g}, {report.scaled_columns} of "
                       f"{report.columns} terms above it)")
        if report.factor_step == "dense":
            off.append("the dense factor step")
        logger.warning(
            "The client rules were not applied this round: %s. No step of an optimizer they "
            "were attached to moved the received factors. Attach them to the optimizer that "
            "trains shard.model (shard.rules.attach(optimizer), or shard.optimizer() for the "
            "server's SGD), or call shard.rules.before_step() / after_step() around your own "
            "update.", ", ".join(off))
    return {CLIP_LR_TERMS: float(report.scaled_columns if report.steps else 0)}


def shard_reply(msg: Message, state: Mapping[str, np.ndarray], num_examples: Any,
                 metrics: Mapping[str, Any], lr: float,
                 receipt: P.Receipt | None = None) -> Message:
    """The checked train reply: ``num_examples`` > 0, numeric metrics, finite arrays (and the
    node's ``receipt``)."""
    if isinstance(num_examples, bool) or not isinstance(num_examples, (int, float, np.number)) \
            or not num_examples > 0:
        raise ValueError(f"{P.NUM_EXAMPLES}={num_examples!r}: expected a number > 0 (the "
                         "aggregation weight); no reply was built.")
    values: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"metric {key!r}={value!r}: expected a number (int or float); "
                            "no reply was built.")
        values[key] = float(value)
    bad = [k for k, v in state.items()
           if np.issubdtype(v.dtype, np.floating) and not all_finite(v)]
    if bad:
        raise FloatingPointError(
            f"{P.DIVERGED} at lr={lr:g}: {', '.join(sorted(bad)[:4])} hold NaN or inf; "
            "nothing is sent this round. The factorized layers take larger steps than the dense "
            "model at the same lr (the paper's factor step): give the strategy "
            "LocalTraining(factor_step='dense') (run config factor-step = \"dense\"), whose "
            "steps are the dense model's, or about 1/10 of the dense learning rate.")
    return P.train_reply(msg, dict(state), int(num_examples), values, receipt)


def receive(msg: Message, model: nn.Module, *, device: str | torch.device = "cpu") -> Shard:
    """The shard of a ``train`` message as a ready sub-model of ``model`` (not modified).

    Parameters
    ----------
    msg : flwr.app.Message
        The ``train`` message from :class:`~fedshard.server.strategy.SpectralSharding`.
    model : nn.Module
        A fresh instance of the model the server was started with.
    device : str or torch.device
        Where the sub-model is put.

    Returns
    -------
    Shard
        ``shard.model``, ``shard.settings``, ``shard.rules`` (the paper's client rules with
        the server's γ, τ and factor step: ``shard.rules.attach(optimizer)`` makes every step
        of ``optimizer`` apply them), ``shard.optimizer()`` (the server's SGD, rules attached)
        and ``shard.reply(num_examples=..., metrics=...)``.

    Raises
    ------
    ValueError
        If the message's settings or arrays do not fit (the reply becomes an error).
    """
    shard = Shard.from_message(msg, model, device=device)
    collecting = _RECEIVED.get()
    if collecting is not None:  # a receiving() block (sharding_mod) asks what its handler got
        collecting.append(shard)
    return shard
