"""The client side: declare a keep ratio, receive a shard, train it (yours or ours), reply.

Two ways to train, one implementation:

- **Bring your own loop** (in the spirit of PEFT's ``get_peft_model``)::

      shard = receive(msg, Net(), device="cuda")      # your model, sharded layers swapped
      opt = shard.optimizer()                         # SGD-m + ClipLR with the server's settings
      for x, y in my_loader:
          loss = F.cross_entropy(shard.model(x), y) + shard.penalty()   # + Frobenius decay
          opt.zero_grad(); loss.backward(); opt.step()
      return shard.reply(num_examples=len(my_loader.dataset), metrics={"my-loss": ...})

- **Batteries included**: :func:`handle_train` does exactly that with fedshard's loop
  (:func:`fedshard.training.train`) on a ``Dataset`` or a ``DataLoader`` you built.

Frobenius decay: :meth:`Shard.penalty` is ``γ Σ_L ‖U Ω Vᵀ‖²_F`` over the sharded layers (paper
Sec. 3.3); add it to the loss, it replaces weight decay on the factors. ClipLR: the optimizer of
:meth:`Shard.optimizer` scales the gradient of term i by ``min(1, τ/ω_i)`` before each step, so a
large multiplier ω_i cannot blow up that term's effective learning rate.

The wire format is :mod:`fedshard.protocol`'s; the model is any torch model whose dense
``state_dict`` the strategy was started with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedshard import protocol as P
from fedshard.sampling import as_keep_ratio
from fedshard.spectral import LayerFactors, build_submodel
from fedshard.training import (
    ClipLR,
    TrainConfig,
    build_optimizer,
    evaluate,
    frobenius_penalty,
    train,
)

__all__ = [
    "DEFAULT_INPUT_KEYS",
    "DEFAULT_TARGET_KEY",
    "PairBatches",
    "Shard",
    "ShardingClientApp",
    "handle_evaluate",
    "handle_query",
    "handle_train",
    "keep_ratio_of",
    "receive",
    "sharding_mod",
    "submodel_from_record",
]

logger = logging.getLogger(__name__)

#: Input keys tried, in order, on dict samples (flwr-datasets' image data sets use these).
DEFAULT_INPUT_KEYS = ("img", "image")
#: Target key of dict samples (flwr-datasets' default).
DEFAULT_TARGET_KEY = "label"


# ---------------------------------------------------------------------------- capabilities
def keep_ratio_of(context: Context, default: float | None = None) -> float:
    """This node's keep ratio ``0 < r ≤ 1``, the same way in simulation and deployment.

    Looked up in order: the node config's ``keep-ratio`` (a deployed SuperNode's
    ``--node-config "keep-ratio=0.2"``), the run config's ``keep-ratio`` (one number for every
    node, e.g. ``keep-ratio = 0.5`` in ``[tool.flwr.app.config]``), then ``default``.

    Parameters
    ----------
    context : flwr.app.Context
        The ClientApp's context.
    default : float, optional
        The ratio when neither config names one.

    Returns
    -------
    float
        The checked keep ratio.

    Raises
    ------
    ValueError
        If no source names a keep ratio, or the one found is not a number in ``(0, 1]``.
    """
    for source, config in (("node config", context.node_config),
                           ("run config", context.run_config)):
        if P.KEEP_RATIO in config:
            return as_keep_ratio(config[P.KEEP_RATIO], f"{source} {P.KEEP_RATIO}",
                                 "this node cannot take part until it is fixed")
    if default is not None:
        return as_keep_ratio(default, "keep_ratio_of(default=...)")
    raise ValueError(
        f"This node declares no keep ratio: expected {P.KEEP_RATIO!r} in its node config "
        f"(deployment: --node-config \"{P.KEEP_RATIO}=0.2\") or in the run config "
        f"({P.KEEP_RATIO} = 0.5 in [tool.flwr.app.config]), or keep_ratio_of(context, "
        "default=...); found neither, so this node does not take part.")


def handle_query(msg: Message, keep_ratio: float, node_key: str | int | None = None) -> Message:
    """Answer a capability query with this node's keep ratio ``0 < r ≤ 1``.

    ``node_key`` is an optional stable identity (e.g. the partition id) that makes the
    server's sampling reproducible across launches; Flower's node ids are random.
    """
    return P.capabilities_reply(msg, keep_ratio, node_key)


# ---------------------------------------------------------------------------- the shard
def submodel_from_record(model: nn.Module, record: ArrayRecord) -> tuple[nn.Module, list[str]]:
    """Build the sub-model described by a train ``record`` on a copy of ``model``.

    Returns the sub-model with every received entry loaded (strictly: a missing or extra key
    raises) and the names of its sharded layers. ``model`` itself is not modified.
    """
    factors, state = P.decode_shard(record)
    dtype = next(iter(model.parameters())).dtype
    sub = build_submodel(model, {
        layer: LayerFactors(**{p: torch.as_tensor(x, dtype=dtype) for p, x in parts.items()})
        for layer, parts in factors.items()
    })
    missing, unexpected = sub.load_state_dict(
        {k: torch.as_tensor(np.array(x)) for k, x in state.items()}, strict=False)
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
        The server's settings for this round: ``lr`` (already scheduled), ``local_epochs``,
        ``batch_size``, ``momentum``, ``frobenius_decay`` γ, ``clip_lr_tau`` τ, ...
    layers : tuple of str
        Names of the sharded layers.
    message : flwr.app.Message
        The ``train`` message (the reply answers it).
    device : torch.device
        Where ``model`` lives.
    """

    model: nn.Module
    settings: P.TrainSettings
    layers: tuple[str, ...]
    message: Message
    device: torch.device

    @classmethod
    def from_message(cls, msg: Message, model: nn.Module, *,
                     device: str | torch.device = "cpu") -> Shard:
        """Same as :func:`receive`."""
        settings = P.TrainSettings.from_record(msg.content.config_records[P.CONFIG])
        sub, layers = submodel_from_record(model, msg.content.array_records[P.ARRAYS])
        dev = torch.device(device)
        return cls(sub.to(dev), settings, tuple(layers), msg, dev)

    def train_config(self, **overrides: Any) -> TrainConfig:
        """fedshard's :class:`~fedshard.training.TrainConfig` for these settings
        (``overrides`` replace fields, e.g. ``epochs=2``)."""
        s = self.settings
        cfg = TrainConfig(epochs=s.local_epochs, lr=s.lr, momentum=s.momentum,
                          frobenius_decay=s.frobenius_decay, clip_tau=s.clip_lr_tau,
                          weight_decay=s.weight_decay, device=self.device, seed=s.train_seed)
        return replace(cfg, **overrides) if overrides else cfg

    def optimizer(self, **overrides: Any) -> ClipLR:
        """SGD with the server's lr, momentum and weight decay, wrapped in ClipLR (τ from the
        settings); ``overrides`` replace :class:`TrainConfig` fields (e.g. ``lr=0.01``).

        Call ``zero_grad()``, ``loss.backward()``, ``step()`` on it as on any optimizer.
        """
        return build_optimizer(self.model, self.train_config(**overrides))

    def penalty(self) -> torch.Tensor:
        """The Frobenius decay term ``γ Σ_L ‖U Ω Vᵀ‖²_F`` to add to your loss (γ from the
        settings; a differentiable scalar, ``0`` when γ = 0 or nothing is sharded)."""
        gamma = self.settings.frobenius_decay
        if gamma == 0:
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
        return _shard_reply(self.message, state, num_examples, metrics or {}, self.settings.lr)


def _shard_reply(msg: Message, state: Mapping[str, np.ndarray], num_examples: Any,
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
            f"Training diverged at lr={lr:g}: {', '.join(sorted(bad)[:4])} hold NaN or inf; "
            "nothing is sent this round. The factorized layers take larger steps than the dense "
            "model at the same lr: give the strategy about 1/10 of the dense learning rate, clip "
            "the gradient norm, or add a normalization layer.")
    return P.train_reply(msg, dict(state), int(num_examples), values)


def sharding_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """A Flower mod that turns a ``train`` handler written for FedAvg into a fedshard one.

    Your handler loads the sub-model with ``model = receive(msg, Net()).model``, trains it and
    replies as for FedAvg (``ArrayRecord(model.state_dict())`` and a ``MetricRecord`` with
    ``num-examples``); the mod re-encodes that reply in the wire format (ω left out, the term
    indices echoed) with the same checks as :meth:`Shard.reply`. Other replies pass unchanged.
    """
    reply = call_next(msg, context)
    if msg.metadata.message_type != "train" or reply.has_error():
        return reply
    sent = msg.content.array_records.get(P.ARRAYS)
    arrays = reply.content.array_records.get(P.ARRAYS)
    if sent is None or arrays is None or not any(k.endswith(".indices") for k in sent) \
            or any(k.endswith(".indices") for k in arrays):
        return reply  # not a shard, or already encoded (Shard.reply)
    metrics = dict(reply.content.metric_records.get(P.METRICS, {}))
    num_examples = metrics.pop(P.NUM_EXAMPLES, None)
    lr = msg.content.config_records[P.CONFIG].get("lr", float("nan"))
    return _shard_reply(msg, {k: a.numpy() for k, a in arrays.items()}, num_examples, metrics,
                        float(lr))  # type: ignore[arg-type]


class ShardingClientApp(ClientApp):
    """A ``ClientApp`` that takes part in spectral model sharding: it answers the server's
    capability query with :func:`keep_ratio_of` (``default_keep_ratio`` as its default; the
    node's ``partition-id`` as its stable key) and applies :func:`sharding_mod` to its handlers.

    Drop-in for ``ClientApp()``; register ``train``/``evaluate`` as usual.
    """

    def __init__(self, default_keep_ratio: float | None = None,
                 mods: list[Any] | None = None) -> None:
        super().__init__(mods=[sharding_mod, *(mods or [])])
        self.default_keep_ratio = default_keep_ratio

        @self.query()
        def _query(msg: Message, context: Context) -> Message:
            key = context.node_config.get("partition-id")  # stable across launches
            return handle_query(msg, keep_ratio_of(context, self.default_keep_ratio),
                                None if key is None else str(key))


def receive(msg: Message, model: nn.Module, *, device: str | torch.device = "cpu") -> Shard:
    """The shard of a ``train`` message as a ready sub-model of ``model`` (not modified).

    Parameters
    ----------
    msg : flwr.app.Message
        The ``train`` message from :class:`~fedshard.strategy.SpectralSharding`.
    model : nn.Module
        A fresh instance of the model the server was started with.
    device : str or torch.device
        Where the sub-model is put.

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
    return Shard.from_message(msg, model, device=device)


# ---------------------------------------------------------------------------- data
class PairBatches:
    """A loader's batches as ``(inputs, targets)``: dict batches (flwr-datasets samples such
    as ``{"img": ..., "label": ...}``) are turned into pairs, pairs pass unchanged.

    Parameters
    ----------
    loader : DataLoader
        Used as is (workers, sampler, collate function kept).
    input_key : str, optional
        Key of the inputs; ``None`` tries :data:`DEFAULT_INPUT_KEYS` in order.
    target_key : str
        Key of the targets.
    """

    def __init__(self, loader: DataLoader[Any], input_key: str | None = None,
                 target_key: str = DEFAULT_TARGET_KEY) -> None:
        self.loader = loader
        self.input_keys: Sequence[str] = (input_key,) if input_key else DEFAULT_INPUT_KEYS
        self.target_key = target_key

    @property
    def dataset(self) -> Any:
        """The loader's data set (its length is the number of examples)."""
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield self._pair(batch) if isinstance(batch, Mapping) else batch

    def _pair(self, batch: Mapping[str, Any]) -> tuple[Any, Any]:
        key = next((k for k in self.input_keys if k in batch), None)
        if key is None or self.target_key not in batch:
            raise ValueError(
                f"A dict batch with keys {sorted(batch)}: expected an input key among "
                f"{list(self.input_keys)} and the target key {self.target_key!r}; pass "
                "input_key=/target_key= to name yours. Nothing was trained.")
        return batch[key], batch[self.target_key]


def _loader(data: Dataset[Any] | DataLoader[Any], batch_size: int, seed: int | None,
            input_key: str | None, target_key: str) -> DataLoader[Any]:
    if isinstance(data, DataLoader):
        if seed is not None:
            logger.info("handle_train: using the given DataLoader as is (batch size %s); the "
                        "server's batch-size=%d is ignored.", data.batch_size, batch_size)
        loader = data
    elif seed is None:
        loader = DataLoader(data, batch_size=batch_size, shuffle=False)
    else:
        loader = DataLoader(data, batch_size=batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
    # PairBatches has everything train/evaluate use of a DataLoader (iteration, .dataset).
    return cast(DataLoader[Any], PairBatches(loader, input_key, target_key))


def handle_train(
    msg: Message,
    model: nn.Module,
    data: Dataset[Any] | DataLoader[Any],
    *,
    device: str = "cpu",
    input_key: str | None = None,
    target_key: str = DEFAULT_TARGET_KEY,
    train_options: Mapping[str, Any] | None = None,
) -> Message:
    """Train the received shard of ``model`` with fedshard's loop; reply with the factors.

    Parameters
    ----------
    msg : flwr.app.Message
        The ``train`` message.
    model : nn.Module
        A fresh instance of the server's model (not modified).
    data : Dataset or DataLoader
        A ``Dataset`` is batched with the server's ``batch-size`` and shuffled with the
        round's seed; a ``DataLoader`` is used as is. Samples may be ``(x, y)`` pairs or
        dicts (``input_key``/``target_key``, default ``"img"``/``"image"`` and ``"label"``).
    device : str
        Where to train.
    input_key, target_key : str
        Keys of dict samples.
    train_options : mapping, optional
        This node's own :class:`~fedshard.training.TrainConfig` fields, e.g. ``compile``,
        ``cuda_graph``, ``channels_last`` (speed only); they replace the fields they name.

    Returns
    -------
    flwr.app.Message
        The reply (:meth:`Shard.reply`) with ``train-loss`` and ``train-accuracy``.
    """
    shard = receive(msg, model, device=device)
    s = shard.settings
    loader = _loader(data, s.batch_size, s.train_seed, input_key, target_key)
    result = train(shard.model, loader, shard.train_config(**dict(train_options or {})))
    return shard.reply(result.num_examples,
                       {P.TRAIN_LOSS: result.loss, P.TRAIN_ACCURACY: result.accuracy})


def handle_evaluate(
    msg: Message, model: nn.Module, data: Dataset[Any] | DataLoader[Any], *,
    batch_size: int = 256, device: str = "cpu", input_key: str | None = None,
    target_key: str = DEFAULT_TARGET_KEY,
) -> Message:
    """Evaluate the received dense global model on ``data`` (a Dataset or a DataLoader used
    as is; dict samples as in :func:`handle_train`)."""
    record = msg.content.array_records[P.ARRAYS]
    state = {k: torch.as_tensor(np.array(a.numpy())) for k, a in record.items()}
    model.load_state_dict(state, strict=True)
    loader = _loader(data, batch_size, None, input_key, target_key)
    result = evaluate(model, loader, device=device)
    metrics = MetricRecord({
        P.NUM_EXAMPLES: int(result.num_examples),
        P.EVAL_LOSS: float(result.loss),
        P.EVAL_ACCURACY: float(result.accuracy),
    })
    return Message(RecordDict({P.METRICS: metrics}), reply_to=msg)
