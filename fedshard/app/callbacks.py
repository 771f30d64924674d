"""fedshard's own app's side jobs, as the strategy's callbacks
(:class:`~fedshard.server.callbacks.RoundCallback`): the run's files (:class:`MetricsLog`,
:class:`Checkpointing`) and the run's central evaluation (:func:`central_evaluation`).

In :func:`~fedshard.app.run.run_server` they run after the strategy's own checks, in the order
evaluation → metrics file → TensorBoard → checkpoint, so a round is checkpointed only once its
row is written; a round's metrics flow one way through them (each sees what the ones before
it added).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import nn

from fedshard.app.checkpoint import Checkpoint
from fedshard.app.config import RunConfig
from fedshard.app.results import RunRecorder
from fedshard.app.task import example_input, width_family
from fedshard.client.train.batches import batches_for
from fedshard.data import load_test_set
from fedshard.protocol import decode_array
from fedshard.server.base import KeepRatioStrategy
from fedshard.server.callbacks import RoundCallback
from fedshard.server.side_jobs import CentralEvaluation
from fedshard.spectral import sharded_layer_names
from fedshard.spectral.truncation import truncate_state

__all__ = ["Checkpointing", "MetricsLog", "budget_models", "central_evaluation"]

#: Run-config keys left out of a checkpoint's config: they say how this invocation started,
#: not what the run computes.
_NOT_CHECKPOINTED = ("resume", "overwrite")


def central_evaluation(cfg: RunConfig, model: nn.Module, sharded_layers: Sequence[str], *,
                       device: str = "cpu",
                       width_of: Callable[[float], int] | None = None) -> CentralEvaluation:
    """The run's central evaluation: ``cfg``'s test set (``test-max-examples`` of it, held on
    ``device`` when it fits), ``eval-every``, with ``diagnostics`` the Top-n truncation of
    ``sharded_layers`` at the largest keep ratio of ``keep-ratios``, and with
    ``eval-at-budgets`` the model each keep ratio below 1 of ``keep-ratios`` would run
    (:func:`budget_models`; ``width_of``: a width-slicing run's width for a keep ratio)."""
    test = load_test_set(cfg.dataset, data_dir=cfg.data_dir or None,
                         max_examples=cfg.test_max_examples or None, download=cfg.download)
    # without sharding (method = "none") no layer is sharded, but a weak device would still
    # run the truncation of the paper's default layers
    truncated = sharded_layers or (sharded_layer_names(model, example_input=example_input(cfg))
                                   if cfg.eval_at_budgets and width_of is None else ())
    budgets = budget_models(cfg, model, truncated, width_of) if cfg.eval_at_budgets else {}
    return CentralEvaluation(model, batches_for(test, 256, device=device),
                             eval_every=cfg.eval_every, num_rounds=cfg.num_server_rounds,
                             device=device,
                             top_n_layers=sharded_layers if cfg.diagnostics else (),
                             top_n_ratio=max(cfg.mixture.ratios), budgets=budgets)


def budget_models(cfg: RunConfig, model: nn.Module, sharded_layers: Sequence[str],
                  width_of: Callable[[float], int] | None = None,
                  ) -> dict[str, Callable[[Mapping[str, torch.Tensor]], nn.Module]]:
    """For each keep ratio ``r < 1`` of ``cfg``'s mix, named ``"r<r>"``: the model a device of
    that budget would run, as a function of the global state dict.

    - width slicing (``width_of`` given): the global model's leading slice at the width the
      run trains at ``r`` (HeteroFL's and FjORD's deployed sub-model; for FedRolex, whose
      window rolls over all channels, the same leading slice);
    - otherwise (spectral sharding, or no sharding): every sharded layer truncated to its
      top ``⌈rN⌉`` SVD terms (:func:`~fedshard.spectral.truncation.truncate_state`), the
      best rank-``⌈rN⌉`` model in each layer (Eckart–Young), which a device stores and runs
      as the two factors of that rank.
    """
    out: dict[str, Callable[[Mapping[str, torch.Tensor]], nn.Module]] = {}
    for r in sorted(x for x in cfg.mixture.ratios if x < 1):
        if width_of is not None:
            family = width_family(cfg)
            out[f"r{r:g}"] = functools.partial(_sliced, family(width_of(r)))
        else:
            out[f"r{r:g}"] = functools.partial(_truncated, copy.deepcopy(model),
                                               tuple(sharded_layers), r)
    return out


def _sliced(narrow: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    shapes = {k: v.shape for k, v in narrow.state_dict().items()}
    narrow.load_state_dict({k: v[tuple(slice(0, s) for s in shapes[k])]
                            for k, v in state.items()})
    return narrow


def _truncated(model: nn.Module, layers: tuple[str, ...], keep_ratio: float,
               state: Mapping[str, torch.Tensor]) -> nn.Module:
    truncated, _ = truncate_state(state, layers, keep_ratio)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in truncated.items()})
    return model


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

    def on_round(self, strategy: KeepRatioStrategy, server_round: int, arrays: ArrayRecord,
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

    def on_round(self, strategy: KeepRatioStrategy, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """Save the round's checkpoint (rounds ≥ 1); a non-finite model raises ``ValueError``
        (see :meth:`Checkpoint.save`)."""
        if server_round > 0:
            Checkpoint(server_round, {k: decode_array(a) for k, a in arrays.items()},
                       self.config, strategy.capability_table(), strategy.history,
                       trust=strategy.trust_state(),
                       excluded=dict(strategy.trust.excluded)).save(self.directory)
        return None
