"""Client-side message handlers: answer the capability query, train a shard, evaluate.

These are what a ``ClientApp`` calls; they work with any torch model whose dense
``state_dict`` the strategy was started with. The wire format is :mod:`fedshard.protocol`'s.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedshard import protocol as P
from fedshard.spectral import LayerFactors, build_submodel
from fedshard.training import TrainConfig, evaluate, train

__all__ = ["handle_evaluate", "handle_query", "handle_train", "submodel_from_record"]

logger = logging.getLogger(__name__)


def handle_query(msg: Message, keep_ratio: float, node_key: str | int | None = None) -> Message:
    """Answer a capability query with this node's keep ratio ``0 < r ≤ 1``.

    ``node_key`` is an optional stable identity (e.g. the partition id) that makes the
    server's sampling reproducible across launches; Flower's node ids are random.
    """
    return P.capabilities_reply(msg, keep_ratio, node_key)


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


def handle_train(
    msg: Message,
    model: nn.Module,
    dataset: Dataset[Any],
    *,
    device: str = "cpu",
) -> Message:
    """Train the received shard of ``model`` on ``dataset``; reply with the trained factors."""
    settings = P.TrainSettings.from_record(msg.content.config_records[P.CONFIG])
    sub, _ = submodel_from_record(model, msg.content.array_records[P.ARRAYS])
    train_cfg = TrainConfig(
        epochs=settings.local_epochs,
        lr=settings.lr,
        momentum=settings.momentum,
        frobenius_decay=settings.frobenius_decay,
        clip_tau=settings.clip_lr_tau,
        weight_decay=settings.weight_decay,
        device=device,
        seed=settings.train_seed,
    )
    loader = DataLoader(
        dataset,
        batch_size=settings.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(settings.train_seed),
    )
    result = train(sub, loader, train_cfg)
    # The sub-model's state_dict already names the trained factors "<layer>.u" / "<layer>.v"
    # (the wire keys).
    state = {k: v.detach().cpu().numpy() for k, v in sub.to("cpu").state_dict().items()}
    return P.train_reply(msg, state, result.num_examples,
                         {P.TRAIN_LOSS: result.loss, P.TRAIN_ACCURACY: result.accuracy})


def handle_evaluate(
    msg: Message, model: nn.Module, dataset: Dataset[Any], *, batch_size: int = 256,
    device: str = "cpu",
) -> Message:
    """Evaluate the received dense global model on ``dataset``."""
    record = msg.content.array_records[P.ARRAYS]
    state = {k: torch.as_tensor(np.array(a.numpy())) for k, a in record.items()}
    model.load_state_dict(state, strict=True)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    result = evaluate(model, loader, device=device)
    metrics = MetricRecord({
        P.NUM_EXAMPLES: int(result.num_examples),
        P.EVAL_LOSS: float(result.loss),
        P.EVAL_ACCURACY: float(result.accuracy),
    })
    return Message(RecordDict({P.METRICS: metrics}), reply_to=msg)
