"""The client side: declare a keep ratio, receive a shard, train it (yours or ours), reply.

Two ways to train, one implementation:

- **Bring your own loop** (in the spirit of PEFT's ``get_peft_model``)::

      shard = receive(msg, Net(), device="cuda")      # your model, sharded layers swapped
      opt = torch.optim.SGD(shard.model.parameters(), lr=shard.settings.lr, momentum=0.9)
      shard.rules.attach(opt)                         # the paper's client rules, on its steps
      for x, y in my_loader:                          # (or shard.optimizer(): the server's SGD)
          loss = F.cross_entropy(shard.model(x), y)
          opt.zero_grad(); loss.backward(); opt.step()
      return shard.reply(num_examples=len(my_loader.dataset), metrics={"my-loss": ...})

- **Batteries included**: :func:`handle_train` does that with fedshard's loop
  (:func:`fedshard.client.train.loop.train`) on a ``Dataset`` or a ``DataLoader`` you built.

The paper's client rules (Sec. 3.3, :class:`~fedshard.client.train.rules.ClientRules`) come
with the received factors (``shard.rules``) and act on the optimizer they are attached to:
Frobenius decay ``γ Σ_L ‖U Ω Vᵀ‖²_F`` (it replaces weight decay on the factors) is added to
their gradients before each of its steps, and ClipLR scales what the step moved term i by
``min(1, τ/ω_i)``, so a large multiplier ω_i cannot blow up that term's effective learning
rate, whichever optimizer steps.

The wire format is :mod:`fedshard.protocol`'s; the model is any torch model whose dense
``state_dict`` the strategy was started with.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Union

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedshard import protocol as P
from fedshard.client.keep_ratios import (
    KEEP_RATIOS,
    KeepRatioMixture,
    is_simulated_node,
    node_keep_ratio,
)
from fedshard.client.memory import MemoryFit
from fedshard.client.shard import (  # re-exported
    Shard,
    SubmodelCache,
    receive,
    submodel_from_record,
)
from fedshard.client.train.batches import TensorBatches, batches_for
from fedshard.client.train.config import FastPath, StepFactory
from fedshard.client.train.loop import (
    evaluate,
    train,
)
from fedshard.sampling import as_keep_ratio

__all__ = [
    "Shard",
    "SubmodelCache",
    "handle_evaluate",
    "handle_query",
    "handle_train",
    "keep_ratio_of",
    "node_key_of",
    "receive",
    "submodel_from_record",
]

logger = logging.getLogger(__name__)



# ---------------------------------------------------------------------------- capabilities
def keep_ratio_of(context: Context, default: float | None = None) -> float:
    """This node's keep ratio ``0 < r ≤ 1``, the same way in simulation and deployment.

    Looked up in order: the node config's ``keep-ratio`` (a deployed SuperNode's
    ``--node-config "keep-ratio=0.2"``), the run config's ``keep-ratio`` (one number for every
    node, e.g. ``keep-ratio = 0.5`` in ``[tool.flwr.app.config]``), the run config's
    ``keep-ratios`` mix (``"0.25:0.5,0.5:0.5"``; a simulated node's share by partition id, as in
    fedshard's own app: :func:`fedshard.client.keep_ratios.node_keep_ratio`), then ``default``.

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
    if KEEP_RATIOS in context.run_config:
        try:
            mixture = KeepRatioMixture.parse(str(context.run_config[KEEP_RATIOS]))
        except ValueError as err:
            raise ValueError(f"run config {err}; this node cannot take part until it is "
                             "fixed") from None
        return node_keep_ratio(context.node_config, mixture)
    if default is not None:
        return as_keep_ratio(default, "keep_ratio_of(default=...)")
    raise ValueError(
        f"This node declares no keep ratio: expected {P.KEEP_RATIO!r} in its node config "
        f"(deployment: --node-config \"{P.KEEP_RATIO}=0.2\") or in the run config "
        f"({P.KEEP_RATIO} = 0.5, or {KEEP_RATIOS} = \"0.25:0.5,0.5:0.5\" for simulated nodes, "
        "in [tool.flwr.app.config]), or keep_ratio_of(context, default=...); found none, so "
        "this node does not take part.")


def node_key_of(context: Context) -> str | None:
    """This node's stable key (its identity in the server's sampling and random streams, the
    same at every launch), or ``None`` to let the server take the key Flower authenticated the
    node with (or, without authentication, its node id, stable within one launch).

    The node config's ``node-key`` (``--node-config "node-key='device-7'"``) when given; for a
    node of Flower's simulation (:func:`~fedshard.client.keep_ratios.is_simulated_node`), its
    ``partition-id``. Never a deployed device's ``partition-id``: devices that each hold their
    own data would all be ``"0"``.
    """
    config = context.node_config
    if P.NODE_KEY in config:
        return str(config[P.NODE_KEY])
    if is_simulated_node(config):
        return str(config["partition-id"])
    return None


def handle_query(msg: Message, keep_ratio: float | MemoryFit,
                 node_key: str | int | None = None) -> Message:
    """Answer a capability query with this node's keep ratio ``0 < r ≤ 1``, or with the
    ratio its memory allows (a :class:`~fedshard.client.memory.MemoryFit` of
    :func:`~fedshard.client.memory.keep_ratio_for_memory`: the budget and the measured
    training peak go with it, and the server logs them).

    ``node_key`` is an optional stable identity (e.g. the partition id) that makes the
    server's sampling reproducible across launches; Flower's node ids are random.
    """
    if isinstance(keep_ratio, MemoryFit):
        return P.capabilities_reply(msg, keep_ratio.keep_ratio, node_key,
                                    memory_mb=keep_ratio.memory_mb,
                                    training_peak_mb=keep_ratio.peak_mb)
    return P.capabilities_reply(msg, keep_ratio, node_key)


# ---------------------------------------------------------------------------- data
# typing.Union, not `|`: a light docs build mocks torch, and a mocked DataLoader[Any] is no type
Loader = Union[DataLoader[Any], TensorBatches]  # noqa: UP007


def _loader(data: Dataset[Any] | Loader, batch_size: int, seed: int | None,
            device: str | torch.device) -> Loader:
    """``data`` as batches: a given DataLoader or :class:`TensorBatches` as is; a Dataset
    through :func:`~fedshard.client.train.batches.batches_for` (fedshard's own data sets held on
    ``device``, others in a DataLoader; for training shuffled with the round's seed). Dict
    samples stay dicts: the training loop reads them (:mod:`fedshard.client.train.batches`)."""
    if isinstance(data, (DataLoader, TensorBatches)):
        if seed is not None:
            logger.info("handle_train: using the given %s as is (batch size %s); the "
                        "server's batch-size=%d is ignored.", type(data).__name__,
                        data.batch_size, batch_size)
        return data
    return batches_for(data, batch_size, seed=seed, device=device)


def _again(loader: Loader, data: Dataset[Any] | Loader, batch_size: int, seed: int | None,
           device: str | torch.device) -> Loader:
    """The same batches in the same order once more (the FedAvg reference's training)."""
    if isinstance(loader, TensorBatches):  # the same tensors, its generator from the start
        return TensorBatches(loader.inputs, loader.targets, loader.batch_size,
                             seed=loader.seed, device=loader.device)
    return _loader(data, batch_size, seed, device)


def handle_train(
    msg: Message,
    model: nn.Module,
    data: Dataset[Any] | Loader,
    *,
    device: str = "cpu",
    input_key: str | None = None,
    target_key: str | None = None,
    submodels: SubmodelCache | None = None,
    fast: FastPath | None = None,
    step: StepFactory | None = None,
    **options: Any,
) -> Message:
    """Train the received shard of ``model`` with fedshard's loop; reply with the factors.

    Parameters
    ----------
    msg : flwr.app.Message
        The ``train`` message.
    model : nn.Module
        A fresh instance of the server's model (not modified).
    data : Dataset, DataLoader or TensorBatches
        A ``Dataset`` is batched with the server's ``batch-size`` and shuffled with the
        round's seed. One that gives all its examples as tensors
        (:class:`~fedshard.client.train.batches.HasTensors`, as fedshard's data sets do), or a
        ``TensorDataset`` of ``(inputs, targets)``, is held on the device as
        :class:`~fedshard.client.train.TensorBatches`, in the order a DataLoader would give (same
        model, less host work per batch). A ``DataLoader`` or ``TensorBatches`` is used as
        is. Samples may be ``(x, y)`` pairs or dicts (``input_key``/``target_key``;
        ``None``: flwr-datasets' names, e.g. ``"img"``
        and ``"label"``, see :data:`fedshard.client.train.batches.INPUT_KEYS`).
    device : str
        Where to train.
    input_key, target_key : str, optional
        Keys of dict samples.
    submodels : SubmodelCache, optional
        Sub-models of ``model`` kept between calls (:class:`~fedshard.client.shard.SubmodelCache`;
        fedshard's in-process engine passes one): a kept sub-model of the same shape is loaded
        instead of copying ``model`` again, and this one is kept after the reply is built
        (when trained with the eager step). The same numbers either way.
    fast : FastOptions, optional
        This node's fast path (:class:`fedshard.client.train.fast.FastOptions`, e.g.
        ``FastOptions(compile=True, cuda_graph=True)``); ``None``: the eager step.
    step : StepFactory, optional
        A step of another loss in place of the eager one
        (:attr:`~fedshard.client.train.TrainConfig.step`, e.g. ordered dropout's); not with an
        enabled ``fast`` (a ``ValueError`` says so).
    **options
        This node's own :class:`~fedshard.client.train.TrainConfig` fields: how it trains
        (``log_every_epoch``, ``channels_last``, ``max_grad_norm``), not what (the recipe is
        the server's).

    Returns
    -------
    flwr.app.Message
        The reply (:meth:`Shard.reply`) with ``train-loss`` and ``train-accuracy``. When the
        message carries the dense model (:data:`fedshard.protocol.REFERENCE`, the server's
        ``fedavg-cosine``), a dense copy is trained too, with the same settings and data order,
        and sent back under that name (its ``fedavg-train-loss`` in the metrics).
    """
    dense = copy.deepcopy(model) if P.REFERENCE in msg.content.array_records else None
    # train() attaches the client rules to the optimizer of its step
    shard = Shard.from_message(msg, model, device=device, cache=submodels)
    s = shard.settings
    cfg = shard.train_config(input_key=input_key, target_key=target_key, fast=fast, step=step,
                             **options)
    loader = _loader(data, s.batch_size, s.train_seed, shard.device)
    result = train(shard.model, loader, cfg)
    metrics = {P.TRAIN_LOSS: result.loss, P.TRAIN_ACCURACY: result.accuracy}
    if dense is None:
        reply = shard.reply(result.num_examples, metrics, rules=result.rules)
        if submodels is not None and not cfg.fast_enabled() and step is None:  # eager only
            submodels.give(shard.model)
        return reply
    record = msg.content.array_records[P.REFERENCE]
    dense.load_state_dict({k: torch.from_numpy(P.decode_array(a)) for k, a in record.items()},
                          strict=True)
    ref = train(dense.to(shard.device),
                _again(loader, data, s.batch_size, s.train_seed, shard.device), cfg)
    reply = shard.reply(result.num_examples, {**metrics, "fedavg-train-loss": ref.loss},
                        rules=result.rules)
    reply.content[P.REFERENCE] = P.array_record(
        {k: P.encode_array(v.detach().cpu().numpy()) for k, v in dense.state_dict().items()})
    return reply


def handle_evaluate(
    msg: Message, model: nn.Module, data: Dataset[Any] | Loader, *,
    batch_size: int = 256, device: str = "cpu", input_key: str | None = None,
    target_key: str | None = None,
) -> Message:
    """Evaluate the received dense global model on ``data`` (a Dataset or a DataLoader used
    as is; dict samples as in :func:`handle_train`)."""
    record = msg.content.array_records[P.ARRAYS]
    state = {k: torch.from_numpy(P.decode_array(a)) for k, a in record.items()}
    model.load_state_dict(state, strict=True)
    loader = _loader(data, batch_size, None, device)
    result = evaluate(model, loader, device=device, input_key=input_key, target_key=target_key)
    metrics = MetricRecord({
        P.NUM_EXAMPLES: int(result.num_examples),
        P.EVAL_LOSS: float(result.loss),
        P.EVAL_ACCURACY: float(result.accuracy),
    })
    return Message(RecordDict({P.METRICS: metrics}), reply_to=msg)
