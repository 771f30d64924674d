"""Side jobs of a run as callbacks any user of the strategy can compose
(:class:`~fedshard.server.callbacks.RoundCallback`): :class:`CentralEvaluation` on a test set
and :class:`TensorBoardLog`.

Give them to the strategy with its own checks, e.g.::

    strategy = SpectralSharding.from_model(model, callbacks=[
        *default_callbacks(), CentralEvaluation(model, test_loader, eval_every=5,
                                                num_rounds=50),
        TensorBoardLog("runs/tb")])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord
from torch import nn
from torch.utils.data import DataLoader

from fedshard.client.train.batches import TensorBatches
from fedshard.client.train.loop import evaluate
from fedshard.protocol import decode_array
from fedshard.server.callbacks import RoundCallback
from fedshard.spectral.truncation import truncate_state

if TYPE_CHECKING:
    from fedshard.server.base import KeepRatioStrategy

__all__ = ["CentralEvaluation", "TensorBoardLog"]


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
    budgets : mapping of str to callable
        Smaller models to evaluate beside the global one, each round it is evaluated: a name
        (``"r0.1"``) -> a function of the global state dict that returns the model a device
        of that budget would run (e.g. the sharded layers truncated to their top ``⌈rN⌉``
        terms, or a width slice), ready to evaluate. Adds ``test-loss-at-<name>`` and
        ``test-accuracy-at-<name>``.
    """

    def __init__(self, model: nn.Module, batches: DataLoader[Any] | TensorBatches, *,
                 eval_every: int, num_rounds: int, device: str = "cpu",
                 top_n_layers: Sequence[str] = (), top_n_ratio: float = 1.0,
                 budgets: Mapping[str, Callable[[Mapping[str, torch.Tensor]], nn.Module]]
                 | None = None) -> None:
        self.model = model
        self.batches = batches
        self.eval_every = eval_every
        self.num_rounds = num_rounds
        self.device = device
        self.top_n_layers = tuple(top_n_layers)
        self.top_n_ratio = top_n_ratio
        self.budgets = dict(budgets or {})

    def is_due(self, server_round: int) -> bool:
        """Whether ``server_round`` is evaluated."""
        return self.eval_every > 0 and (server_round % self.eval_every == 0
                                        or server_round == self.num_rounds)

    def on_round(self, strategy: KeepRatioStrategy, server_round: int, arrays: ArrayRecord,
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
        for name, at_budget in self.budgets.items():
            small = evaluate(at_budget(state).to(self.device), self.batches, device=self.device)
            out.update({f"test-loss-at-{name}": small.loss,
                        f"test-accuracy-at-{name}": small.accuracy})
        return out


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
        """Close the event file (again: nothing to do); whoever stops a run early calls it,
        :meth:`on_end` after its last round."""
        self.writer.close()

    def on_round(self, strategy: KeepRatioStrategy, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """Write the round's metrics."""
        self.write(server_round, metrics)
        return None

    def on_end(self, strategy: KeepRatioStrategy, arrays: ArrayRecord) -> None:
        """Close the event file (after the last round)."""
        self.close()
