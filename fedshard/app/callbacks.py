"""fedshard's own app's side jobs, as the strategy's callbacks
(:class:`~fedshard.server.callbacks.RoundCallback`): the run's files (:class:`MetricsLog`,
:class:`Checkpointing`) and the run's central evaluation (:func:`central_evaluation`).

In :func:`~fedshard.app.run.run_server` they run after the strategy's own checks, in the order
evaluation → metrics file → TensorBoard → checkpoint, so a round is checkpointed only once its
row is written; a round's metrics flow one way through them (each sees what the ones before
it added).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord
from torch import nn

from fedshard.app.checkpoint import Checkpoint
from fedshard.app.config import RunConfig
from fedshard.app.results import RunRecorder
from fedshard.client.train.batches import batches_for
from fedshard.data import load_test_set
from fedshard.protocol import decode_array
from fedshard.server.callbacks import RoundCallback
from fedshard.server.side_jobs import CentralEvaluation
from fedshard.server.strategy import SpectralSharding

__all__ = ["Checkpointing", "MetricsLog", "central_evaluation"]

#: Run-config keys left out of a checkpoint's config: they say how this invocation started,
#: not what the run computes.
_NOT_CHECKPOINTED = ("resume", "overwrite")


def central_evaluation(cfg: RunConfig, model: nn.Module, sharded_layers: Sequence[str], *,
                       device: str = "cpu") -> CentralEvaluation:
    """The run's central evaluation: ``cfg``'s test set (``test-max-examples`` of it, held on
    ``device`` when it fits), ``eval-every``, and with ``diagnostics`` the Top-n truncation of
    ``sharded_layers`` at the largest keep ratio of ``keep-ratios``."""
    test = load_test_set(cfg.dataset, data_dir=cfg.data_dir or None,
                         max_examples=cfg.test_max_examples or None, download=cfg.download)
    return CentralEvaluation(model, batches_for(test, 256, device=device),
                             eval_every=cfg.eval_every, num_rounds=cfg.num_server_rounds,
                             device=device,
                             top_n_layers=sharded_layers if cfg.diagnostics else (),
                             top_n_ratio=max(cfg.mixture.ratios))


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

    def on_round(self, strategy: SpectralSharding, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """Append the round's row."""
        self.recorder.record_round(server_round, metrics)
        return None


class Checkpointing(RoundCallback):
    """A :class:`~fedshard.app.checkpoint.Checkpoint` after every trained round, so a stopped
    run resumes after its last completed round: the model, the strategy's capability cache
    and its metrics history.

    Round 0 (the initial model) is not checkpointed: a run stopped before round 1 ends
    starts again from its config.

    Parameters
    ----------
    directory : Path
        The run directory (it must exist).
    config : mapping
        The run config, stored with each checkpoint for the resume's check; ``resume`` and
        ``overwrite`` are left out (they say how this invocation started).
    """

    def __init__(self, directory: Path, config: Mapping[str, Any]) -> None:
        self.directory = directory
        self.config = {k: v for k, v in config.items() if k not in _NOT_CHECKPOINTED}

    def on_round(self, strategy: SpectralSharding, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """Save the round's checkpoint (rounds ≥ 1); a non-finite model raises ``ValueError``
        (see :meth:`Checkpoint.save`)."""
        if server_round > 0:
            Checkpoint(server_round, {k: decode_array(a) for k, a in arrays.items()},
                       self.config, strategy.capability_table(), strategy.history
                       ).save(self.directory)
        return None
