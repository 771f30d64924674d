"""From a validated :class:`~fedshard.config.RunConfig` to model, data, strategy and evaluation.

The two Flower apps are thin: they read ``context.run_config`` once into a ``RunConfig`` and
call the functions here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fedshard.checkpoint import Checkpoint
from fedshard.config import RunConfig
from fedshard.data import dataset_info, load_partition, load_test_set
from fedshard.results import RunRecorder
from fedshard.strategy import SpectralSharding
from fedshard.training import evaluate

__all__ = [
    "build_model",
    "build_strategy",
    "central_evaluate_fn",
    "client_dataset",
    "declared_keep_ratio",
    "example_input",
    "run_server",
]

logger = logging.getLogger(__name__)


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


def build_strategy(cfg: RunConfig, model: nn.Module) -> SpectralSharding:
    """The strategy for ``cfg``, sharding the paper's default layers of ``model``."""
    return SpectralSharding.from_model(
        model,
        example_input=example_input(cfg),
        num_rounds=cfg.num_server_rounds,
        method=cfg.method,
        design=cfg.design,
        scaled=cfg.scaled,
        prism_exponent=cfg.prism_exponent or None,
        lr=cfg.lr,
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        momentum=cfg.momentum,
        frobenius_decay=cfg.frobenius_decay,
        clip_lr_tau=cfg.tau,
        weight_decay=cfg.weight_decay,
        seed=cfg.seed,
        query_timeout=cfg.round_timeout,
        node_wait_timeout=cfg.round_timeout,
        fraction_train=cfg.fraction_train,
        fraction_evaluate=cfg.fraction_evaluate,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=cfg.min_available_nodes,
    )


def client_dataset(cfg: RunConfig, partition_id: int, num_partitions: int) -> Dataset[Any]:
    """This node's training partition (``dirichlet-alpha = 0``: the data set's paper α;
    Shakespeare is split by speaking role and takes no α)."""
    info = dataset_info(cfg.dataset)
    alpha = None if info.task == "next-char" or cfg.dirichlet_alpha == 0 else cfg.dirichlet_alpha
    return load_partition(
        cfg.dataset, partition_id, num_partitions, data_dir=cfg.data_dir or None,
        alpha=alpha, seed=cfg.seed, download=cfg.download,
    )


def declared_keep_ratio(cfg: RunConfig, node_config: dict[str, Any]) -> float:
    """A node's keep ratio: ``keep-ratio`` from its node config (deployment), else derived
    from ``partition-id`` and the run's ``keep-ratios`` mixture (simulation)."""
    if "keep-ratio" in node_config:
        value = node_config["keep-ratio"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 < value <= 1
        ):
            raise ValueError(
                f"node config keep-ratio={value!r}: expected a number in (0, 1]; this node "
                "cannot train until it is fixed"
            )
        return float(value)
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise ValueError(
            "This node declares no keep-ratio and no partition-id/num-partitions; start it with "
            "--node-config \"keep-ratio=0.2 ...\""
        )
    return cfg.mixture.ratio_for(int(node_config["partition-id"]),
                                 int(node_config["num-partitions"]))


def run_server(grid: Grid, cfg: RunConfig, *, device: str = "cpu") -> dict[str, Any]:
    """The ServerApp's whole job: model, strategy, rounds, results, checkpoints, resume.

    With ``resume`` and a checkpoint in the run's results folder, the run continues after the
    checkpoint's round with the checkpoint's model, capability cache and history; the config
    must be the one the checkpoint was written with (``resume`` and ``round-timeout`` aside).
    """
    model = build_model(cfg)
    strategy = build_strategy(cfg, model)
    directory = cfg.results_path
    initial = ArrayRecord(model.state_dict())
    done = 0
    checkpoint = Checkpoint.load(directory) if cfg.resume else None
    if cfg.resume and checkpoint is None:
        logger.warning("resume=true but %s holds no checkpoint: starting from round 1",
                       directory)
    if checkpoint is not None:
        checkpoint.check_config(cfg.as_dict(), ignore=("resume", "round-timeout"))
        done = checkpoint.server_round
        if done >= cfg.num_server_rounds:
            logger.info("Run %s already finished (%d rounds); nothing to do.", directory, done)
            return {"rounds-completed": done}
        model.load_state_dict({k: torch.from_numpy(v) for k, v in checkpoint.arrays.items()})
        initial = ArrayRecord(model.state_dict())
        strategy.resume(done, checkpoint.capabilities, checkpoint.history)
        logger.info("Resuming %s after round %d of %d", directory, done, cfg.num_server_rounds)
    recorder = RunRecorder(directory, cfg.as_dict(), cfg.num_server_rounds,
                           resume_round=done if checkpoint is not None else None)
    config = {k: v for k, v in cfg.as_dict().items() if k != "resume"}
    latest: list[ArrayRecord] = [initial]

    def on_round(server_round: int, arrays: ArrayRecord) -> None:
        latest[0] = arrays
        Checkpoint(server_round, {k: a.numpy() for k, a in arrays.items()}, config,
                   strategy.capability_table(), strategy.history).save(directory)

    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=cfg.num_server_rounds - done,
        timeout=cfg.round_timeout,
        train_config=ConfigRecord(),
        evaluate_fn=central_evaluate_fn(cfg, model, strategy, recorder, device=device,
                                        on_round=on_round),
    )
    # Flower's Result holds no arrays when no round produced an update: use the latest model.
    final = result.arrays if len(result.arrays) > 0 else latest[0]
    return recorder.finish(final.to_torch_state_dict())


def central_evaluate_fn(
    cfg: RunConfig,
    model: nn.Module,
    strategy: SpectralSharding,
    recorder: RunRecorder,
    *,
    device: str = "cpu",
    on_round: Callable[[int, ArrayRecord], None] | None = None,
) -> Callable[[int, ArrayRecord], MetricRecord | None]:
    """``evaluate_fn`` for ``Strategy.start``: test-set evaluation of the dense global model
    every ``eval-every`` rounds (and the last), writing the round's metrics, then
    ``on_round(round, arrays)`` (the checkpoint). Rounds are the run's own (a resumed run's
    Flower round r is round r + strategy.round_offset)."""
    test = load_test_set(cfg.dataset, data_dir=cfg.data_dir or None,
                         max_examples=cfg.test_max_examples or None, download=cfg.download)
    loader = DataLoader(test, batch_size=256, shuffle=False)

    def evaluate_fn(flower_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        server_round = flower_round + strategy.round_offset
        if flower_round == 0 and strategy.round_offset > 0:
            return None  # the resumed model was evaluated and recorded before the crash
        metrics: dict[str, float] = dict(strategy.history.get(server_round, {}))
        due = cfg.eval_every > 0 and (
            server_round % cfg.eval_every == 0 or server_round == cfg.num_server_rounds
        )
        if due:
            model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
            res = evaluate(model, loader, device=device)
            metrics.update({"test-loss": res.loss, "test-accuracy": res.accuracy,
                            "test-examples": float(res.num_examples)})
        recorder.record_round(server_round, metrics)
        if on_round is not None and server_round > 0:
            on_round(server_round, arrays)
        if not due:
            return None
        return MetricRecord({k: metrics[k] for k in ("test-loss", "test-accuracy")})

    return evaluate_fn
