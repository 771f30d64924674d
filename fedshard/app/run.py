"""The server side of fedshard's app: from a validated :class:`~fedshard.app.config.RunConfig`
to strategy, rounds, central evaluation, results and checkpoints.

The ServerApp is thin: it reads ``context.run_config`` once into a ``RunConfig`` and calls
:func:`run_server`. The client side (model, data, keep ratio) is :mod:`fedshard.app.task`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from torch import nn

from fedshard.app.checkpoint import RESUME_MAY_CHANGE, Checkpoint
from fedshard.app.config import RunConfig
from fedshard.app.results import RunRecorder
from fedshard.app.task import build_model, example_input, resolve_device
from fedshard.client.train.batches import batches_for
from fedshard.client.train.loop import evaluate
from fedshard.data import load_test_set
from fedshard.server.metrics import TensorBoardLog
from fedshard.server.nodes import load_keep_ratio_table
from fedshard.server.strategy import SpectralSharding
from fedshard.spectral import sharded_layer_names
from fedshard.spectral.truncation import truncate_, truncate_state

__all__ = ["build_strategy", "central_evaluate_fn", "run_server"]

logger = logging.getLogger(__name__)


def build_strategy(cfg: RunConfig, model: nn.Module, device: str = "cpu") -> SpectralSharding:
    """The strategy for ``cfg``, sharding the paper's default layers of ``model``; its SVD
    and rebuild run on ``device``."""
    return SpectralSharding.from_model(
        model,
        example_input=example_input(cfg),
        num_rounds=cfg.num_server_rounds,
        method=cfg.method,
        design=cfg.design,
        scaled=cfg.scaled,
        prism_exponent=cfg.prism_exponent or None,
        anneal_exponent=cfg.anneal_exponent,
        anneal_rounds=cfg.anneal_rounds,
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
        device=None if device == "cpu" else device,
        max_update_ratio=cfg.max_update_ratio,
        update_policy=cfg.update_policy,
        max_num_examples=cfg.max_num_examples or None,
        aggregation=cfg.aggregation,
        trim_fraction=cfg.trim_fraction,
        max_keep_ratio=cfg.max_keep_ratio,
        keep_ratio_table=(load_keep_ratio_table(cfg.keep_ratio_table)
                          if cfg.keep_ratio_table else None),
        lr_schedule=cfg.lr_schedule,
        fedavg_cosine=cfg.fedavg_cosine,
    )


def run_server(grid: Grid, cfg: RunConfig, *, device: str | None = None) -> dict[str, Any]:
    """The ServerApp's whole job: model, strategy, rounds, results, checkpoints, resume.

    With ``resume`` and a checkpoint in the run's results folder, the run continues after the
    checkpoint's round with the checkpoint's model, capability cache and history; the config
    must be the one the checkpoint was written with (apart from ``RESUME_MAY_CHANGE``: where
    it is stored, where and how fast it runs). ``device`` overrides ``server-device`` (SVD,
    rebuild, central evaluation).
    """
    device = device or resolve_device(cfg.server_device)
    model = build_model(cfg)
    if cfg.init_keep_ratio < 1:  # the low-rank start (a resumed run loads its checkpoint)
        layers = sharded_layer_names(model, example_input=example_input(cfg))
        removed = truncate_(model, layers, cfg.init_keep_ratio)
        logger.info("Low-rank start: the %d sharded layers truncated to rank ⌈%g·N⌉ (%.1f %% "
                    "of their energy removed).", len(layers), cfg.init_keep_ratio, 100 * removed)
    strategy = build_strategy(cfg, model, device)
    directory = cfg.results_path
    initial = ArrayRecord(model.state_dict())
    done = 0
    checkpoint = Checkpoint.load(directory, fallback=True) if cfg.resume else None
    if cfg.resume and checkpoint is None:
        logger.warning("resume=true but %s holds no checkpoint: starting from round 1",
                       directory)
    if checkpoint is not None:
        checkpoint.check_config(cfg.as_dict(), ignore=RESUME_MAY_CHANGE)
        done = checkpoint.server_round
        if done >= cfg.num_server_rounds:
            logger.info("Run %s already finished (%d rounds); nothing to do.", directory, done)
            return {"rounds-completed": done}
        model.load_state_dict({k: torch.from_numpy(v) for k, v in checkpoint.arrays.items()})
        initial = ArrayRecord(model.state_dict())
        strategy.resume(done, checkpoint.capabilities, checkpoint.history)
        logger.info("Resuming %s after round %d of %d", directory, done, cfg.num_server_rounds)
    recorder = RunRecorder(directory, cfg.as_dict(), cfg.num_server_rounds,
                           resume_round=done if checkpoint is not None else None,
                           overwrite=cfg.overwrite)
    config = {k: v for k, v in cfg.as_dict().items() if k not in ("resume", "overwrite")}
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
    summary = recorder.finish(final.to_torch_state_dict())
    if strategy.rounds_trained == 0:
        raise RuntimeError(
            f"No round trained: none of the {cfg.num_server_rounds - done} round(s) of run "
            f"{directory} got a usable training reply, so the saved model is the initial one "
            "(results were written). Check the replies-dropped/dropped-<reason>/"
            "replies-missing metrics in metrics.jsonl and the server log: nodes without a "
            "keep ratio, error replies from the ClientApp, round-timeout too short, or replies "
            "refused by max-update-ratio/max-num-examples.")
    return summary


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
    Flower round r is round r + strategy.round_offset).

    With ``diagnostics``, each evaluation also gives ``test-accuracy-top-n`` and
    ``test-loss-top-n``, the same test set on the model whose sharded layers are truncated to
    their top ``⌈rN⌉`` terms (r: the largest keep ratio of ``keep-ratios``; what a Top-n
    client trains), and ``tail-energy-top-n``, the energy share of the terms cut off."""
    test = load_test_set(cfg.dataset, data_dir=cfg.data_dir or None,
                         max_examples=cfg.test_max_examples or None, download=cfg.download)
    loader = batches_for(test, 256, device=device)  # held on the device when it fits
    board = TensorBoardLog(cfg.results_path / "tensorboard") if cfg.tensorboard else None

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
            if cfg.diagnostics and strategy.sharded_layers:
                state, tail = truncate_state(arrays.to_torch_state_dict(),
                                             strategy.sharded_layers, max(cfg.mixture.ratios))
                model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
                top = evaluate(model, loader, device=device)
                metrics.update({"test-loss-top-n": top.loss, "test-accuracy-top-n": top.accuracy,
                                "tail-energy-top-n": tail})
        recorder.record_round(server_round, metrics)
        if board is not None:
            board.write(server_round, metrics)
        if on_round is not None and server_round > 0:
            on_round(server_round, arrays)
        if not due:
            return None
        return MetricRecord({k: metrics[k] for k in ("test-loss", "test-accuracy")})

    return evaluate_fn
