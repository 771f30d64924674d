"""The client side of fedshard's app: the run's model, this node's data, its keep ratio.

What the ClientApp needs from a validated :class:`~fedshard.app.config.RunConfig` (and what the
ServerApp shares with it: the model builder). The server's orchestration is in
:mod:`fedshard.app.run`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from fedshard.app.config import RunConfig
from fedshard.client.keep_ratios import (  # re-exported: the library's rule
    SIMULATION_NODE_CONFIG,
    is_simulated_node,
    node_keep_ratio,
)
from fedshard.data import dataset_info, load_partition

__all__ = [
    "SIMULATION_NODE_CONFIG", "build_model", "client_dataset", "declared_keep_ratio",
    "example_input", "is_simulated_node", "node_partition", "resolve_device", "template_model",
]


def template_model(cfg: RunConfig) -> nn.Module:
    """:func:`build_model`'s model, built once per process and shared by every call with the
    same model settings: **never modify it** (pass it where the model is only read, e.g.
    :func:`fedshard.client.handlers.handle_train`, or ``copy.deepcopy`` it first).

    A ClientApp would otherwise build the model for every message only to overwrite its weights
    with the server's; a random initialization costs several times a deep copy, and
    :func:`~fedshard.client.handle_train` copies only what the sub-model keeps (measured by
    ``benchmarks/bench_receive.py``).
    """
    key = (cfg.model, cfg.model_width, cfg.dataset, cfg.seed)  # all that build_model reads
    model = _TEMPLATES.get(key)
    if model is None:
        model = build_model(cfg)
        while len(_TEMPLATES) >= 2:  # a process serves one run at a time
            _TEMPLATES.pop(next(iter(_TEMPLATES)))
        _TEMPLATES[key] = model
    return model


_TEMPLATES: dict[tuple[Any, ...], nn.Module] = {}


def build_model(cfg: RunConfig) -> nn.Module:
    """The run's model, initialized from ``seed`` (inside a forked RNG: no global seeding)."""
    info = dataset_info(cfg.dataset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(np.random.default_rng([cfg.seed, 0xF5]).integers(2**31)))
        if cfg.model == "resnet18":
            from fedshard.models import resnet18

            _need_images(cfg, info)
            return resnet18(num_classes=info.num_classes, in_channels=info.in_channels,
                            width=cfg.model_width)
        if cfg.model == "mlp":
            from fedshard.models import mlp

            _need_images(cfg, info)
            return mlp(info.in_channels * info.image_size**2, info.num_classes,
                       width=cfg.model_width)
        if cfg.model == "cct":
            from fedshard.models import cct_6_3x2

            _need_images(cfg, info)
            return cct_6_3x2(info.num_classes, in_channels=info.in_channels,
                             img_size=info.image_size)
        if cfg.model == "chargpt":
            from fedshard.models import char_transformer

            if info.task != "next-char":
                raise ValueError(f"model='chargpt' needs a next-char data set, not {cfg.dataset!r}")
            return char_transformer(info.num_classes)
    raise ValueError(f"model={cfg.model!r}: no builder")  # RunConfig validation prevents this


def _need_images(cfg: RunConfig, info: Any) -> None:
    if info.task != "image":
        raise ValueError(
            f"model={cfg.model!r} needs an image data set, but dataset={cfg.dataset!r} is "
            f"{info.task!r}; use model='chargpt' for it"
        )


def example_input(cfg: RunConfig) -> torch.Tensor:
    """One input batch of the right shape (determines the forward order of layers)."""
    info = dataset_info(cfg.dataset)
    if info.task == "next-char":
        return torch.zeros(1, 80, dtype=torch.long)
    return torch.zeros(1, info.in_channels, info.image_size, info.image_size)


def client_dataset(cfg: RunConfig, partition_id: int, num_partitions: int) -> Dataset[Any]:
    """This node's training partition (``dirichlet-alpha = 0``: the data set's paper α;
    Shakespeare is split by speaking role and takes no α)."""
    info = dataset_info(cfg.dataset)
    alpha = None if info.task == "next-char" or cfg.dirichlet_alpha == 0 else cfg.dirichlet_alpha
    return load_partition(
        cfg.dataset, partition_id, num_partitions, data_dir=cfg.data_dir or None,
        alpha=alpha, seed=cfg.seed, download=cfg.download,
    )


def node_partition(cfg: RunConfig, node_config: dict[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of this node's data.

    A simulated node's ``num-partitions`` is the federation's ``num-supernodes``; a run config
    whose ``num-partitions`` differs would be recorded in the results as if it had been used,
    so it is an error (the node replies with it, and a run in which no node trains fails).
    A deployed node's own ``num-partitions`` is its business (e.g. ``1``: all of its data).
    """
    pid = int(node_config.get("partition-id", 0))
    num = int(node_config.get("num-partitions", cfg.num_partitions))
    if is_simulated_node(node_config) and num != cfg.num_partitions:
        raise ValueError(
            f"run config num-partitions={cfg.num_partitions}, but this simulation has {num} "
            f"nodes (node config num-partitions={num}); the data would be split {num} ways "
            "while the results record another split. Set num-partitions equal to "
            "num-supernodes; this node does not train until then")
    return pid, num


def declared_keep_ratio(cfg: RunConfig, node_config: dict[str, Any]) -> float:
    """A node's keep ratio: ``keep-ratio`` from its node config (deployment), else, only for
    a simulated node (:func:`is_simulated_node`), derived from ``partition-id`` and the run's
    ``keep-ratios`` mixture. A deployed node without ``keep-ratio`` raises ``ValueError``: the
    mixture describes the simulated federation, not a device's capacity. The rule is the
    library's (:func:`fedshard.client.keep_ratios.node_keep_ratio`), the one any project's
    ``ShardingClientApp(keep_ratios=...)`` applies."""
    return node_keep_ratio(node_config, cfg.mixture)


def resolve_device(setting: str) -> str:
    """A run config's ``client-device``/``server-device`` as a torch device string.

    ``"auto"``: ``"cuda:0"`` when torch sees a GPU, else ``"cpu"``. Under Flower's Ray
    simulation with ``client-resources-num-gpus > 0`` Ray sets ``CUDA_VISIBLE_DEVICES`` for
    each ClientApp, so ``cuda:0`` is the GPU it was given. An explicit ``cuda`` on a machine
    without one is an error (a run must not silently train on the CPU).
    """
    if setting == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {setting!r} was asked for, but torch sees no GPU here "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use 'auto' or 'cpu', or give the "
            "ClientApps GPUs (client-resources-num-gpus in the federation config)")
    return setting
