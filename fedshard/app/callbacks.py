"""The run's side jobs, one callback each: central evaluation, the metrics file, TensorBoard
and the checkpoint after every round.

Flower's ``Strategy.start`` calls one ``evaluate_fn(round, arrays)`` after every round (and
once before the first). :class:`RoundCallbacks` is that function, made of an ordered list of
:class:`RoundCallback` objects, so the ServerApp composes the jobs it wants instead of one
closure carrying them all (pfl-research keeps ``central_evaluation``, ``checkpoint`` and
``tensorboard`` as separate callbacks in ``pfl/callback/`` in the same way).

A round's metrics flow one way: they start as the strategy's own row for the round
(:attr:`SpectralSharding.history`), every callback sees what the ones before it produced,
and what it returns is added for the ones after it. In :func:`~fedshard.app.run.run_server`
the order is evaluation → metrics file → TensorBoard → checkpoint, so a round is checkpointed
only once its row is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord
from torch import nn
from torch.utils.data import DataLoader

from fedshard.app.checkpoint import Checkpoint
from fedshard.app.config import RunConfig
from fedshard.app.results import RunRecorder
from fedshard.client.train.batches import TensorBatches, batches_for
from fedshard.client.train.loop import evaluate
from fedshard.data import load_test_set
from fedshard.protocol import decode_array
from fedshard.server.strategy import SpectralSharding
from fedshard.spectral.truncation import truncate_state

__all__ = [
    "FLOWER_METRICS",
    "CentralEvaluation",
    "Checkpointing",
    "MetricsLog",
    "RoundCallback",
    "RoundCallbacks",
    "TensorBoardLog",
]

#: The central-evaluation metrics handed back to Flower (its ``Result`` and log); every
#: other metric of a round goes only to the callbacks.
FLOWER_METRICS = ("test-loss", "test-accuracy")
#: Run-config keys left out of a checkpoint's config: they say how this invocation started,
#: not what the run computes.
_NOT_CHECKPOINTED = ("resume", "overwrite")


class RoundCallback:
    """One side job of a run, called after every round by :class:`RoundCallbacks`.

    Subclasses override :meth:`on_round` (and :meth:`on_end` if they hold a resource); the
    defaults do nothing.
    """

    def on_round(self, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """Do the job for one round.

        Parameters
        ----------
        server_round : int
            The run's round (a resumed run counts on from its checkpoint); 0 is the initial
            model, before any training.
        arrays : ArrayRecord
            The dense global model after the round.
        metrics : mapping
            The round's metrics so far (read only): the strategy's row and what the earlier
            callbacks returned.

        Returns
        -------
        mapping or None
            Metrics this callback adds to the round (``None``: none).
        """
        return None

    def on_end(self) -> None:
        """Release what the callback holds; called once when the rounds are over (or failed)."""
        return None


class RoundCallbacks:
    """Flower's ``evaluate_fn`` made of ordered callbacks.

    Called as ``evaluate_fn(flower_round, arrays)`` by ``Strategy.start``: it numbers the
    round as the run does (Flower's round ``r`` of a resumed run is the run's round
    ``r + strategy.round_offset``), starts the round's metrics from the strategy's row for
    it, calls every callback in order, and returns to Flower :data:`FLOWER_METRICS` when a
    callback produced them this round (``None`` otherwise, so Flower records no evaluation).

    Flower's round 0 of a resumed run is skipped altogether: it is the checkpoint's model,
    whose round was evaluated, recorded and checkpointed before the run stopped.

    Parameters
    ----------
    strategy : SpectralSharding
        Gives the round offset and the per-round metrics history (read at every call, so a
        :meth:`~SpectralSharding.resume` before ``start`` is seen).
    callbacks : sequence of RoundCallback
        The side jobs, in the order they run.
    """

    def __init__(self, strategy: SpectralSharding, callbacks: Sequence[RoundCallback]) -> None:
        self.strategy = strategy
        self.callbacks = tuple(callbacks)

    def __call__(self, flower_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        offset = self.strategy.round_offset
        if flower_round == 0 and offset > 0:
            return None
        server_round = flower_round + offset
        metrics: dict[str, float] = dict(self.strategy.history.get(server_round, {}))
        added: dict[str, float] = {}
        for callback in self.callbacks:
            new = callback.on_round(server_round, arrays, MappingProxyType(metrics))
            if new:
                metrics.update(new)
                added.update(new)
        if not all(k in added for k in FLOWER_METRICS):
            return None
        return MetricRecord({k: added[k] for k in FLOWER_METRICS})

    def end(self) -> None:
        """Call every callback's :meth:`~RoundCallback.on_end`, in order."""
        for callback in self.callbacks:
            callback.on_end()


class CentralEvaluation(RoundCallback):
    """Test-set loss and accuracy of the dense global model, every ``eval_every`` rounds and
    after the last.

    Adds ``test-loss``, ``test-accuracy`` and ``test-examples`` on the rounds it evaluates
    (round 0, the initial model, is one of them); other rounds get nothing from it.

    With ``top_n_layers``, each evaluation also adds ``test-loss-top-n`` and
    ``test-accuracy-top-n``, the same test set on the model whose layers ``top_n_layers``
    are truncated to their top ``⌈rN⌉`` terms (``r = top_n_ratio``; what a Top-n client of
    keep ratio ``r`` trains), and ``tail-energy-top-n``, the energy share of the terms cut off.

    Parameters
    ----------
    model : nn.Module
        Evaluated in place: each evaluation loads the round's arrays into it (strictly).
    batches : DataLoader or TensorBatches
        The test set, as ``(inputs, targets)`` batches.
    eval_every : int
        Evaluate the rounds that are multiples of it, and ``num_rounds``; 0: never.
    num_rounds : int
        The run's last round, always evaluated (when ``eval_every > 0``).
    device : str
        Where to evaluate.
    top_n_layers : sequence of str
        The sharded layers to truncate for the Top-n diagnostics; empty: no diagnostics.
    top_n_ratio : float
        Keep ratio of the Top-n diagnostics.
    """

    def __init__(self, model: nn.Module, batches: DataLoader[Any] | TensorBatches, *,
                 eval_every: int, num_rounds: int, device: str = "cpu",
                 top_n_layers: Sequence[str] = (), top_n_ratio: float = 1.0) -> None:
        self.model = model
        self.batches = batches
        self.eval_every = eval_every
        self.num_rounds = num_rounds
        self.device = device
        self.top_n_layers = tuple(top_n_layers)
        self.top_n_ratio = top_n_ratio

    @classmethod
    def for_run(cls, cfg: RunConfig, model: nn.Module, sharded_layers: Sequence[str], *,
                device: str = "cpu") -> CentralEvaluation:
        """The run's central evaluation: ``cfg``'s test set (``test-max-examples`` of it,
        held on ``device`` when it fits), ``eval-every``, and with ``diagnostics`` the Top-n
        truncation of ``sharded_layers`` at the largest keep ratio of ``keep-ratios``."""
        test = load_test_set(cfg.dataset, data_dir=cfg.data_dir or None,
                             max_examples=cfg.test_max_examples or None, download=cfg.download)
        return cls(model, batches_for(test, 256, device=device), eval_every=cfg.eval_every,
                   num_rounds=cfg.num_server_rounds, device=device,
                   top_n_layers=sharded_layers if cfg.diagnostics else (),
                   top_n_ratio=max(cfg.mixture.ratios))

    def is_due(self, server_round: int) -> bool:
        """Whether ``server_round`` is evaluated."""
        return self.eval_every > 0 and (server_round % self.eval_every == 0
                                        or server_round == self.num_rounds)

    def on_round(self, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """The test metrics of ``arrays`` if the round is due, else ``None``."""
        if not self.is_due(server_round):
            return None
        state = {k: torch.from_numpy(decode_array(a)) for k, a in arrays.items()}
        self.model.load_state_dict(state, strict=True)
        res = evaluate(self.model, self.batches, device=self.device)
        out = {"test-loss": res.loss, "test-accuracy": res.accuracy,
               "test-examples": float(res.num_examples)}
        if self.top_n_layers:
            truncated, tail = truncate_state(state, self.top_n_layers, self.top_n_ratio)
            self.model.load_state_dict({k: torch.from_numpy(v) for k, v in truncated.items()})
            top = evaluate(self.model, self.batches, device=self.device)
            out.update({"test-loss-top-n": top.loss, "test-accuracy-top-n": top.accuracy,
                        "tail-energy-top-n": tail})
        return out


class MetricsLog(RoundCallback):
    """Every round's metrics as one row of ``metrics.jsonl`` and one log line
    (:meth:`RunRecorder.record_round`).

    Parameters
    ----------
    recorder : RunRecorder
        The run's result files; the caller keeps it (and calls its ``finish``).
    """

    def __init__(self, recorder: RunRecorder) -> None:
        self.recorder = recorder

    def on_round(self, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """Append the round's row."""
        self.recorder.record_round(server_round, metrics)
        return None


class TensorBoardLog(RoundCallback):
    """Per-round metrics as TensorBoard scalars (``torch.utils.tensorboard.SummaryWriter``).

    Parameters
    ----------
    directory : str or Path
        Where the event files are written (local files only).

    Raises
    ------
    ImportError
        If the ``tensorboard`` package is not installed (``pip install tensorboard``).
    """

    def __init__(self, directory: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "TensorBoard logging was asked for (tensorboard=true) but the 'tensorboard' "
                "package is not installed; install it (pip install tensorboard) or set "
                "tensorboard=false. No round was started.") from err
        self.directory = Path(directory)
        self.writer = SummaryWriter(log_dir=str(self.directory))

    def write(self, server_round: int, metrics: Mapping[str, float]) -> None:
        """Add every finite scalar of ``metrics`` at step ``server_round`` and flush."""
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, float(value), global_step=server_round)
        self.writer.flush()

    def close(self) -> None:
        """Close the event file."""
        self.writer.close()

    def on_round(self, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """Write the round's metrics."""
        self.write(server_round, metrics)
        return None

    def on_end(self) -> None:
        """Close the event file."""
        self.close()


class Checkpointing(RoundCallback):
    """A :class:`~fedshard.app.checkpoint.Checkpoint` after every trained round, so a stopped
    run resumes after its last completed round.

    Round 0 (the initial model) is not checkpointed: a run stopped before round 1 ends
    starts again from its config.

    Parameters
    ----------
    directory : Path
        The run directory (it must exist).
    config : mapping
        The run config, stored with each checkpoint for the resume's check; ``resume`` and
        ``overwrite`` are left out (they say how this invocation started).
    strategy : SpectralSharding
        Gives the capability cache and metrics history saved with the model.
    """

    def __init__(self, directory: Path, config: Mapping[str, Any],
                 strategy: SpectralSharding) -> None:
        self.directory = directory
        self.config = {k: v for k, v in config.items() if k not in _NOT_CHECKPOINTED}
        self.strategy = strategy

    def on_round(self, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """Save the round's checkpoint (rounds ≥ 1); a non-finite model raises ``ValueError``
        (see :meth:`Checkpoint.save`)."""
        if server_round > 0:
            Checkpoint(server_round, {k: decode_array(a) for k, a in arrays.items()},
                       self.config, self.strategy.capability_table(), self.strategy.history
                       ).save(self.directory)
        return None
