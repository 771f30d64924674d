"""A received shard as a ready sub-model, for any training loop (fedshard's or yours).

:func:`receive` turns a ``train`` message into a :class:`Shard`: the user's own model class
with the sharded layers swapped for ``U·diag(ω)·Vᵀ`` (:mod:`fedshard.spectral`), the round's
settings and the checked reply (:meth:`Shard.reply`).

**The paper's client rules travel with the sub-model** (Sec. 3.3): by default the factors
``u``, ``v`` carry gradient hooks (:func:`~fedshard.client.train.optim.attach_client_rules`)
that add Frobenius decay's gradient ``γ ∂‖UΩVᵀ‖²_F`` and scale column i by ClipLR's
``min(1, τ/ω_i)``, so any loop and any torch optimizer applies both with no extra line; with
the server's ``factor_step="dense"`` they also make each step move ``W = UΩVᵀ`` as a dense step
would (:mod:`fedshard.client.train.precondition`), so the dense model's lr works.
``receive(msg, model, client_rules=False)`` leaves them off: then :meth:`Shard.optimizer`
(ClipLR) and :meth:`Shard.penalty` (the decay term) apply them, as fedshard's own loop does.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from torch import nn

from fedshard import protocol as P
from fedshard.client.train.config import TrainConfig
from fedshard.client.train.optim import attach_client_rules, build_optimizer, frobenius_penalty
from fedshard.spectral import LayerFactors, build_submodel

__all__ = ["Shard", "SubmodelCache", "receive", "shard_reply", "submodel_from_record"]

#: A sub-model's shape: ``(layer, u's shape, v's shape)`` of each sharded layer, sorted.
SubmodelShape = tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]


class SubmodelCache:
    """Sub-models of one model kept for the next shard of the same shape, for a process that
    trains many shards one after another (fedshard's in-process engine does).

    Building a sub-model copies the whole model (``copy.deepcopy``: most of the time it takes
    to receive a shard of a small model); a kept sub-model whose sharded layers have the same
    ranks only takes the received values (``load_state_dict``), which gives the same
    sub-model, value for value. :func:`fedshard.client.handlers.handle_train` gives its
    sub-model back once its reply is built, when it trained with the eager step (the fast
    options may change a sub-model's convolutions) and its factors carry no hooks. What a
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
    factors, state = P.decode_shard(record)
    sub, shape = None, _shape(factors)
    if cache is not None:
        if cache.model is not model:
            raise ValueError("submodel_from_record: the cache holds sub-models of another "
                             "model; give the model it was made with. Nothing was built.")
        sub = cache.take(shape)
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


@dataclass
class Shard:
    """A received shard, ready to train with any loop; :func:`receive` builds it.

    Attributes
    ----------
    model : nn.Module
        A copy of your model with each sharded layer replaced by its ``U·diag(ω)·Vᵀ`` layer
        (trainable ``u``, ``v``; frozen buffer ``omega``), on ``device``.
    settings : fedshard.protocol.TrainSettings
        The server's settings for this round: the recipe
        (:class:`~fedshard.settings.LocalTraining`: ``lr`` already scheduled, ``local_epochs``,
        ``batch_size``, ``momentum``, ``frobenius_decay`` γ, ``clip_lr_tau`` τ, ...) and the
        round, keep ratio, training seed and method.
    layers : tuple of str
        Names of the sharded layers.
    message : flwr.app.Message
        The ``train`` message (the reply answers it).
    device : torch.device
        Where ``model`` lives.
    client_rules : bool
        Whether ``model``'s factors carry Frobenius decay and ClipLR as gradient hooks
        (:func:`receive`'s default); :meth:`optimizer`, :meth:`penalty` and
        :meth:`train_config` then leave both out, so nothing is applied twice.
    """

    model: nn.Module
    settings: P.TrainSettings
    layers: tuple[str, ...]
    message: Message
    device: torch.device
    client_rules: bool = False

    @classmethod
    def from_message(cls, msg: Message, model: nn.Module, *,
                     device: str | torch.device = "cpu", client_rules: bool = True,
                     cache: SubmodelCache | None = None) -> Shard:
        """Same as :func:`receive`."""
        if not isinstance(client_rules, bool):
            raise TypeError(f"receive(client_rules={client_rules!r}): expected True (the "
                            "factors carry Frobenius decay and ClipLR) or False; nothing was "
                            "received.")
        if client_rules and cache is not None:
            raise ValueError("Shard.from_message(client_rules=True, cache=...): a kept sub-model "
                             "would carry the hooks of every shard it trained; use the cache with "
                             "client_rules=False. Nothing was received.")
        settings = P.TrainSettings.from_record(msg.content.config_records[P.CONFIG])
        sub, layers = submodel_from_record(model, msg.content.array_records[P.ARRAYS], cache)
        dev = torch.device(device)
        sub = sub.to(dev)
        if client_rules:
            attach_client_rules(sub, settings.frobenius_decay, settings.clip_lr_tau,
                                settings.factor_step)
        return cls(sub, settings, tuple(layers), msg, dev, client_rules)

    def train_config(self, **overrides: Any) -> TrainConfig:
        """fedshard's :class:`~fedshard.client.train.TrainConfig` for the received recipe,
        this shard's device and the round's seed; ``overrides`` replace fields (e.g.
        ``compile=True``, ``local_epochs=2``). With :attr:`client_rules` on, its
        ``frobenius_decay`` is 0 and ``clip_lr_tau`` ``None``: the factors' hooks apply them."""
        s = self.settings
        hooked = self.client_rules
        cfg = TrainConfig(local_epochs=s.local_epochs, lr=s.lr, momentum=s.momentum,
                          frobenius_decay=0.0 if hooked else s.frobenius_decay,
                          clip_lr_tau=None if hooked else s.clip_lr_tau,
                          weight_decay=s.weight_decay,
                          factor_step="plain" if hooked else s.factor_step,
                          device=self.device, seed=s.train_seed)
        return replace(cfg, **overrides) if overrides else cfg

    def optimizer(self, **overrides: Any) -> torch.optim.SGD:
        """SGD with the server's lr, momentum and weight decay (none on the factors), with
        :class:`~fedshard.client.train.ClipLR` attached (τ from the settings; off when the
        server sent none, and when the factors' hooks apply it: :attr:`client_rules`);
        ``overrides`` replace :class:`TrainConfig` fields (e.g. ``lr=0.01``). Optional with
        the client rules on: any optimizer then gets ClipLR from the hooks.

        A plain ``torch.optim.SGD``: call ``zero_grad()``, ``loss.backward()``, ``step()`` on
        it as on any optimizer (each ``step()`` scales the factor gradients by
        ``min(1, τ/ω_i)`` first), and use it with learning-rate schedulers and
        ``state_dict()``.
        """
        return build_optimizer(self.model, self.train_config(**overrides))

    def penalty(self) -> torch.Tensor:
        """The Frobenius decay term ``γ Σ_L ‖U Ω Vᵀ‖²_F`` to add to your loss (γ from the
        settings; a differentiable scalar, ``0`` when γ = 0 or nothing is sharded).

        With :attr:`client_rules` on (:func:`receive`'s default) the decay is already in the
        factors' gradients: this returns ``0``, so code that still adds it does not apply it
        twice (``gamma * frobenius_penalty(shard.model)`` is the term's value, to log)."""
        gamma = self.settings.frobenius_decay
        if gamma == 0 or self.client_rules:
            return torch.zeros((), device=self.device)
        return gamma * frobenius_penalty(self.model).to(self.device)

    def reply(self, num_examples: int, metrics: Mapping[str, float] | None = None) -> Message:
        """The reply ``Message``: the trained factors and dense entries, ``num_examples``
        (the aggregation weight, > 0) and your ``metrics`` (any numeric scalars; the server
        averages each over the nodes that report it, weighted by ``num_examples``).

        Raises
        ------
        FloatingPointError
            If training left NaN or inf in the model (nothing is sent; see the message).
        TypeError, ValueError
            For a non-numeric metric or ``num_examples`` ≤ 0.
        """
        state = {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}
        return shard_reply(self.message, state, num_examples, metrics or {}, self.settings.lr)


def shard_reply(msg: Message, state: Mapping[str, np.ndarray], num_examples: Any,
                 metrics: Mapping[str, Any], lr: float) -> Message:
    """The checked train reply: ``num_examples`` > 0, numeric metrics, finite arrays."""
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
           if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all()]
    if bad:
        raise FloatingPointError(
            f"{P.DIVERGED} at lr={lr:g}: {', '.join(sorted(bad)[:4])} hold NaN or inf; "
            "nothing is sent this round. The factorized layers take larger steps than the dense "
            "model at the same lr (the paper's factor step): give the strategy "
            "LocalTraining(factor_step='dense') (run config factor-step = \"dense\"), whose "
            "steps are the dense model's, or about 1/10 of the dense learning rate.")
    return P.train_reply(msg, dict(state), int(num_examples), values)


def receive(msg: Message, model: nn.Module, *, device: str | torch.device = "cpu",
            client_rules: bool = True) -> Shard:
    """The shard of a ``train`` message as a ready sub-model of ``model`` (not modified).

    Parameters
    ----------
    msg : flwr.app.Message
        The ``train`` message from :class:`~fedshard.server.strategy.SpectralSharding`.
    model : nn.Module
        A fresh instance of the model the server was started with.
    device : str or torch.device
        Where the sub-model is put.
    client_rules : bool
        ``True`` (default): the sub-model's factors carry the paper's client rules, Frobenius
        decay and ClipLR with the server's γ and τ, and the server's factor step
        (``factor_step="dense"``: the dense-equivalent step), as gradient hooks: train
        ``shard.model`` with any loop and any optimizer, nothing else to add (one
        ``backward()`` per step).
        ``False``: a plain sub-model; apply them with :meth:`Shard.optimizer` and
        :meth:`Shard.penalty` (or fedshard's loop, as :func:`handle_train` does).

    Returns
    -------
    Shard
        ``shard.model``, ``shard.settings``, ``shard.optimizer()``, ``shard.penalty()`` and
        ``shard.reply(num_examples=..., metrics=...)``.

    Raises
    ------
    ValueError
        If the message's settings or arrays do not fit (the reply becomes an error).
    """
    return Shard.from_message(msg, model, device=device, client_rules=client_rules)
