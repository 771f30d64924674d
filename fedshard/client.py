"""Client-side message handlers: answer the capability query, train a shard, evaluate.

These are what a ``ClientApp`` calls; they work with any torch model whose dense
``state_dict`` the strategy was started with. See :mod:`fedshard.protocol` for the contract.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedshard import protocol as P
from fedshard.spectral import LayerFactors, build_submodel
from fedshard.training import TrainConfig, evaluate, train

__all__ = ["handle_evaluate", "handle_query", "handle_train", "submodel_from_record"]

logger = logging.getLogger(__name__)


def _number(cfg: ConfigRecord, key: str) -> float:
    """A numeric train-config entry; a missing or non-numeric one is an error reply."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"train config {key}={value!r}: expected a number; the server and this node speak "
            "different versions of the fedshard protocol, so this round is not trained"
        )
    return float(value)


def handle_query(msg: Message, keep_ratio: float, node_key: str | int | None = None) -> Message:
    """Answer a capability query with this node's keep ratio ``0 < r ≤ 1``.

    ``node_key`` is an optional stable identity (e.g. the partition id) that makes the
    server's sampling reproducible across launches; Flower's node ids are random.
    """
    if isinstance(keep_ratio, bool) or not (
        isinstance(keep_ratio, (int, float)) and math.isfinite(keep_ratio) and 0 < keep_ratio <= 1
    ):
        raise ValueError(
            f"keep-ratio={keep_ratio!r}: expected a number in (0, 1]; this node cannot take part "
            "until it declares one (e.g. --node-config \"keep-ratio=0.2\")"
        )
    caps = ConfigRecord({P.KEEP_RATIO: float(keep_ratio)})
    if node_key is not None:
        caps[P.NODE_KEY] = str(node_key)
    return Message(RecordDict({P.CAPABILITIES: caps}), reply_to=msg)


def submodel_from_record(model: nn.Module, record: ArrayRecord) -> tuple[nn.Module, list[str]]:
    """Build the sub-model described by a train ``record`` on a copy of ``model``.

    Returns the sub-model with every received entry loaded (strictly: a missing or extra key
    raises) and the names of its sharded layers. ``model`` itself is not modified.
    """
    layers = sorted(P.layer_of(k) for k in record if k.endswith(".indices"))
    dtype = next(iter(model.parameters())).dtype
    factors = {}
    for layer in layers:
        parts = {p: record[P.factor_key(layer, p)].numpy() for p in ("u", "v", "omega")}
        factors[layer] = LayerFactors(
            u=torch.as_tensor(parts["u"], dtype=dtype),
            v=torch.as_tensor(parts["v"], dtype=dtype),
            omega=torch.as_tensor(parts["omega"], dtype=dtype),
        )
    sub = build_submodel(model, factors)
    state = {
        k: torch.as_tensor(np.array(a.numpy()))
        for k, a in record.items()
        if not k.endswith(".indices")
    }
    missing, unexpected = sub.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"The received arrays do not fit this node's model: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}. Server and node must use the same model "
            "(model, model-width, dataset); this round's reply will be an error."
        )
    return sub, layers


def handle_train(
    msg: Message,
    model: nn.Module,
    dataset: Dataset[Any],
    *,
    device: str = "cpu",
) -> Message:
    """Train the received shard of ``model`` on ``dataset``; reply with the trained factors."""
    record = msg.content.array_records[P.ARRAYS]
    cfg = msg.content.config_records[P.CONFIG]
    sub, layers = submodel_from_record(model, record)
    tau = _number(cfg, "clip-lr-tau")
    seed = int(_number(cfg, "train-seed"))
    train_cfg = TrainConfig(
        epochs=int(_number(cfg, "local-epochs")),
        lr=_number(cfg, "lr"),
        momentum=_number(cfg, "momentum"),
        frobenius_decay=_number(cfg, "frobenius-decay"),
        clip_tau=tau if tau > 0 else None,
        weight_decay=_number(cfg, "weight-decay"),
        device=device,
        seed=seed,
    )
    loader = DataLoader(
        dataset,
        batch_size=int(_number(cfg, "batch-size")),
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    result = train(sub, loader, train_cfg)
    sub = sub.to("cpu")

    # The sub-model's state_dict already names the trained factors "<layer>.u" / "<layer>.v"
    # (the wire keys); ω is frozen and not sent back, the indices are echoed.
    omega_keys = {P.factor_key(layer, "omega") for layer in layers}
    out: dict[str, Array] = {
        key: Array(value.detach().cpu().numpy())
        for key, value in sub.state_dict().items()
        if key not in omega_keys
    }
    for layer in layers:
        out[P.factor_key(layer, "indices")] = record[P.factor_key(layer, "indices")]
    metrics = MetricRecord({
        P.NUM_EXAMPLES: int(result.num_examples),
        P.TRAIN_LOSS: float(result.loss),
        P.TRAIN_ACCURACY: float(result.accuracy),
    })
    return Message(RecordDict({P.ARRAYS: ArrayRecord(out), P.METRICS: metrics}), reply_to=msg)


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
