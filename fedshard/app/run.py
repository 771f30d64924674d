"""The server side of fedshard's app: from a validated :class:`~fedshard.app.config.RunConfig`
to strategy and rounds, with the run's side jobs (central evaluation, result files,
TensorBoard, checkpoints) composed as callbacks (:mod:`fedshard.app.callbacks`).

The ServerApp is thin: it reads ``context.run_config`` once into a ``RunConfig`` and calls
:func:`run_server`. The client side (model, data, keep ratio) is :mod:`fedshard.app.task`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from logging import ERROR
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from torch import nn

from fedshard.app.callbacks import Checkpointing, MetricsLog, central_evaluation
from fedshard.app.checkpoint import RESUME_MAY_CHANGE, Checkpoint
from fedshard.app.config import RunConfig
from fedshard.app.results import RunRecorder
from fedshard.app.rundir import wait_for_run_lock
from fedshard.app.savings import reference_summary, savings_line, sharding_savings
from fedshard.app.task import (
    RUNTIME_KEY,
    build_model,
    example_input,
    grid_runtime,
    resolve_device,
    trusted_reference,
    width_family,
)
from fedshard.data import dataset_info
from fedshard.server.advice import TrainingReceipts
from fedshard.server.base import KeepRatioStrategy
from fedshard.server.callbacks import RoundCallback
from fedshard.server.savings import SavingsReport
from fedshard.server.side_jobs import TensorBoardLog
from fedshard.server.strategy import SpectralSharding
from fedshard.server.width import WidthSlicing
from fedshard.settings import WIDTH_METHODS, Cohort
from fedshard.spectral import sharded_layer_names
from fedshard.spectral.truncation import truncate_

__all__ = ["build_strategy", "log_data_split", "run_server", "side_jobs"]

logger = logging.getLogger(__name__)


def build_strategy(cfg: RunConfig, model: nn.Module, device: str = "cpu") -> KeepRatioStrategy:
    """The strategy for ``cfg``: spectral sharding of the paper's default layers of ``model``
    (its SVD and rebuild run on ``device``), or width slicing (:class:`WidthSlicing`) for a
    width-slicing method."""
    if cfg.sharding.method in WIDTH_METHODS:
        return WidthSlicing.from_model(model, family=width_family(cfg),
                                       example_input=example_input(cfg),
                                       slicing=cfg.slicing, **_common(cfg),
                                       trusted=trusted_reference(cfg))
    return SpectralSharding.from_model(
        model, example_input=example_input(cfg), device=None if device == "cpu" else device,
        **_common(cfg), trusted=trusted_reference(cfg))


def _common(cfg: RunConfig) -> dict[str, Any]:
    """The strategy arguments both kinds take from ``cfg``: its settings objects, the run's
    rounds (the whole run's, a resumed launch's too) and its cohort (any round may go to a
    single node)."""
    return dict(
        num_rounds=cfg.num_server_rounds,
        sharding=cfg.sharding,
        training=cfg.training,
        replies=cfg.replies,
        privacy=cfg.privacy,
        nodes=cfg.node_policy(),
        cohort=Cohort(fraction_train=cfg.fraction_train,
                      fraction_evaluate=cfg.fraction_evaluate, min_train_nodes=1,
                      min_evaluate_nodes=1, min_available_nodes=cfg.min_available_nodes),
        seed=cfg.seed,
    )


def run_server(grid: Grid, cfg: RunConfig, *, device: str | None = None) -> dict[str, Any]:
    """The ServerApp's whole job: model, strategy, rounds with their side jobs
    (:func:`side_jobs`), results, resume.

    With ``resume`` and a checkpoint in the run's results folder, the run continues after the
    checkpoint's round with the checkpoint's model, capability cache and history; the config
    must be the one the checkpoint was written with (apart from ``RESUME_MAY_CHANGE``: where
    it is stored, where and how fast it runs), and its arrays those of the run's model
    (:class:`~fedshard.app.checkpoint.CheckpointError` before round 1 otherwise; an unusable
    results folder is a :class:`~fedshard.app.rundir.RunDirectoryError`). A resume first
    waits for another process's lock on the folder, up to
    :data:`~fedshard.app.rundir.RESUME_LOCK_WAIT_S`
    (:func:`~fedshard.app.rundir.wait_for_run_lock`). ``device`` overrides ``server-device``
    (SVD, rebuild, central evaluation).
    """
    device = device or resolve_device(cfg.server_device)
    model = build_model(cfg)
    if cfg.init_keep_ratio < 1:  # the low-rank start (a resumed run loads its checkpoint)
        layers = sharded_layer_names(model, example_input=example_input(cfg))
        removed = truncate_(model, layers, cfg.init_keep_ratio)
        logger.info("Low-rank start: the %d sharded layers truncated to rank ⌈%g·N⌉ (%.1f %% "
                    "of their energy removed).", len(layers), cfg.init_keep_ratio, 100 * removed)
    strategy = build_strategy(cfg, model, device)
    _without_library_report(strategy)
    directory = cfg.results_path
    initial = ArrayRecord(model.state_dict())
    done = 0
    if cfg.resume:  # the last launch's ServerApp may still be stopping: it holds run.lock
        wait_for_run_lock(directory)
    checkpoint = Checkpoint.load(directory, fallback=True) if cfg.resume else None
    if cfg.resume and checkpoint is None:
        if _started_before(directory, cfg):  # stopped before its round 1 completed
            (directory / "metrics.jsonl").unlink()  # its round-0 row is written again
            logger.warning("resume=true: %s holds this run's first rows but no checkpoint (it "
                           "stopped before round 1 completed): the run starts again from "
                           "round 1", directory)
        else:
            logger.warning("resume=true but %s holds no checkpoint: starting from round 1",
                           directory)
    if checkpoint is not None:
        checkpoint.check_config(cfg.as_dict(), ignore=RESUME_MAY_CHANGE,
                                defaults=RunConfig().as_dict())
        if strategy.central_dp is not None:
            _refuse_a_second_release(directory, checkpoint)
        done = checkpoint.server_round
        if done >= cfg.num_server_rounds:
            logger.info("Run %s already finished (%d rounds); nothing to do.", directory, done)
            return {"rounds-completed": done}
        checkpoint.check_arrays({k: tuple(v.shape) for k, v in model.state_dict().items()})
        model.load_state_dict({k: torch.from_numpy(v) for k, v in checkpoint.arrays.items()})
        initial = ArrayRecord(model.state_dict())
        strategy.resume(done, checkpoint.capabilities, checkpoint.history, checkpoint.trust,
                        checkpoint.excluded)
        logger.info("Resuming %s after round %d of %d: this launch runs rounds %d-%d. Flower's "
                    "[ROUND k/%d] lines count this launch's rounds (k = run round - %d); "
                    "fedshard's lines give the run's round.", directory, done,
                    cfg.num_server_rounds, done + 1, cfg.num_server_rounds,
                    cfg.num_server_rounds - done, done)
    runtime = grid_runtime(grid)
    log_data_split(cfg, grid)
    recorder = RunRecorder(directory, cfg.as_dict(), cfg.num_server_rounds,
                           resume_round=done if checkpoint is not None else None,
                           overwrite=cfg.overwrite)
    width_of = None
    if isinstance(strategy, WidthSlicing):  # a device of keep ratio r runs this width
        def width_of(r: float, s: WidthSlicing = strategy) -> int:
            return s.width_of(r).width
    jobs = side_jobs(cfg, model, strategy.sharded_layers, recorder, device=device,
                     width_of=width_of)
    strategy.callbacks.extend(jobs)
    try:
        # Flower's own start(): the strategy's hooks call the callbacks (the last round's
        # on_end among them: a run that trained nothing raises there, its rounds recorded)
        result = strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=cfg.num_server_rounds - done,
            timeout=cfg.round_timeout,
            # where this ServerApp runs, so that a deployed node that looks simulated is warned
            train_config=ConfigRecord({RUNTIME_KEY: runtime} if runtime else {}),
        )
    except Exception as err:  # a stop, a timeout, a bug: the run's status says so first
        _fail(recorder, strategy.current_arrays or initial, err)
        raise
    finally:  # a run stopped early calls no on_end: its files are closed here
        for job in jobs:
            if isinstance(job, TensorBoardLog):
                job.close()
    # Flower's Result holds no arrays when no round produced an update, and then the model
    # is still the one the rounds started from.
    final = result.arrays if len(result.arrays) > 0 else initial
    receipts = [c.totals for c in strategy.callbacks if isinstance(c, TrainingReceipts)]
    by_memory = [{"node-key": c.key, "keep-ratio": c.keep_ratio, "memory-mb": c.memory_mb,
                  "training-peak-mb": c.training_peak_mb}
                 for c in strategy.capabilities.values() if c.memory_mb is not None]
    summary = recorder.finish(final.to_torch_state_dict(),
                              {"status": "finished",
                               "sharding": _savings(cfg, model, strategy, recorder.rows),
                               **({"receipts": receipts[0]} if receipts else {}),
                               # nodes that chose their keep ratio from their memory-mb
                               **({"nodes-by-memory": by_memory} if by_memory else {})})
    return summary


def log_data_split(cfg: RunConfig, grid: Grid) -> None:
    """Say once, before round 1, how the simulated nodes' data is split (deployed nodes with
    their own ``data-dir`` or partition train on what they are given)."""
    info = dataset_info(cfg.dataset)
    if info.task == "next-char":
        how = "by speaking role (LEAF's split)"
    else:
        alpha = cfg.dirichlet_alpha or info.default_alpha
        how = (f"with Dirichlet(α = {alpha:g}) class priors" if alpha
               else "uniformly at random")
    try:
        connected = len(list(grid.get_node_ids()))
    except Exception:  # a grid that cannot list its nodes yet: the split is said without it
        connected = -1
    nodes = f" ({connected} node(s) connected now)" if connected >= 0 else ""
    if cfg.num_partitions:
        ways = f"{cfg.num_partitions} partitions (num-partitions={cfg.num_partitions})"
    else:
        ways = ("one partition per simulated node (num-partitions = 0 follows the "
                f"simulation's node count{nodes})")
    logger.info("Data: each simulated node trains on its partition of %s's training set, "
                "split into %s %s; a deployed node trains on its own data-dir or partition.",
                cfg.dataset, ways, how)


def _refuse_a_second_release(directory: Path, checkpoint: Checkpoint) -> None:
    """Under central DP, refuse to resume from a checkpoint older than the last noised round
    ``metrics.jsonl`` records (the newest checkpoint was lost, and the resume fell back on the
    one before): that round's model is out, and running it again would release a second
    aggregate of the same round, which the accountant holds once."""
    released = 0
    try:
        for line in (directory / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if isinstance(row, dict) and "dp-epsilon" in row and isinstance(row.get("round"), int):
                released = max(released, row["round"])
    except (OSError, ValueError):
        return  # the recorder names a damaged metrics.jsonl itself
    if released > checkpoint.server_round:
        raise ValueError(
            f"Cannot resume under central DP: {checkpoint.path or 'the checkpoint'} holds "
            f"round {checkpoint.server_round}, but {directory / 'metrics.jsonl'} records the "
            f"noised aggregate of round {released} (its checkpoint was lost). Running round "
            f"{checkpoint.server_round + 1} again would release a second noised aggregate of "
            "it, and the difference of two releases is a node's update with less noise than "
            "the accountant counts. Start a new run (another run-name, or overwrite=true).")


def _started_before(directory: Path, cfg: RunConfig) -> bool:
    """Whether ``directory`` holds this run's ``config.json`` (the same settings, apart from
    :data:`~fedshard.app.checkpoint.RESUME_MAY_CHANGE`) and no round after 0 in
    ``metrics.jsonl``: the run stopped before its first checkpoint, so a resume starts again
    from round 1."""
    try:
        used = json.loads((directory / "config.json").read_text())["config"]
        rows = (directory / "metrics.jsonl").read_text().splitlines()
        rounds = {json.loads(x)["round"] for x in rows if x.strip()}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(used, dict) or rounds - {0}:
        return False
    mine = cfg.as_dict()
    return all(used.get(k) == v for k, v in mine.items()
               if k not in RESUME_MAY_CHANGE and k not in ("resume", "overwrite"))


def _fail(recorder: RunRecorder, arrays: ArrayRecord, err: BaseException) -> None:
    """Write the failed run's summary (``"status": "failed"``, the reason) and the model it
    stopped with, and say so in the log's last lines; the exception is raised again after."""
    reason = f"{type(err).__name__}: {err}"
    try:
        recorder.finish(arrays.to_torch_state_dict(), {"status": "failed", "failure": reason})
    except Exception as write_err:  # the run's own error matters more than its files
        logger.error("The failed run's summary could not be written (%s).", write_err)
    # a stop's reason was logged as an ERROR where it was decided: not twice
    shown = ("the reason is the ERROR line above" if getattr(err, "logged", False)
             else reason)
    flwr_log(ERROR, "RUN FAILED after %d round(s): %s. %s has \"status\": \"failed\" "
             "(flwr run exits 0 all the same: a script should read that file).",
             max((r["round"] for r in recorder.rows), default=0), shown,
             recorder.directory / "summary.json")


def _savings(cfg: RunConfig, model: nn.Module, strategy: KeepRatioStrategy,
             rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What sharding bought (:func:`~fedshard.app.savings.sharding_savings`), logged; ``None``
    (with a warning) where it cannot be counted: the run's results are written either way."""
    reference = (reference_summary(cfg.reference_run, cfg.results_path.parent)
                 if cfg.reference_run else None)
    try:
        narrow = None
        if isinstance(strategy, WidthSlicing):  # a client trains the narrow model
            def narrow(r: float, s: WidthSlicing = strategy) -> nn.Module:
                return s.family(s.width_of(r).width)
        savings = sharding_savings(rows, model, strategy.sharded_layers, example_input(cfg),
                                   reference, submodel=narrow)
    except Exception as err:  # a report at the end must not lose the run's files
        logger.warning("what sharding bought could not be counted (%s: %s); summary.json "
                       "has no 'sharding' entry", type(err).__name__, err)
        return None
    logger.info("%s", savings_line(savings))
    return savings


def _without_library_report(strategy: KeepRatioStrategy) -> None:
    """The app writes the end-of-run line itself (with the reference run and into
    ``summary.json``): the strategy's own :class:`~fedshard.server.savings.SavingsReport`
    would say it twice."""
    strategy.callbacks[:] = [c for c in strategy.callbacks if not isinstance(c, SavingsReport)]


def side_jobs(cfg: RunConfig, model: nn.Module, sharded_layers: Sequence[str],
              recorder: RunRecorder, *, device: str = "cpu",
              width_of: Callable[[float], int] | None = None) -> list[RoundCallback]:
    """What runs after every round, after the strategy's own checks, in order: central
    evaluation on the test set (``model`` is loaded with each evaluated round; with
    ``eval-at-budgets`` also the model of each smaller keep ratio, ``width_of`` giving a
    width-slicing run's width), the round's row in ``metrics.jsonl``, TensorBoard (with
    ``tensorboard``), and the checkpoint, written once the round is recorded."""
    jobs: list[RoundCallback] = [central_evaluation(cfg, model, sharded_layers, device=device,
                                                    width_of=width_of),
                                 MetricsLog(recorder)]
    if cfg.tensorboard:
        jobs.append(TensorBoardLog(cfg.results_path / "tensorboard"))
    jobs.append(Checkpointing(cfg.results_path, cfg.as_dict()))
    return jobs
