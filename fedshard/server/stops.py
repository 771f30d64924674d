"""Runs that cannot go on or train nothing: the strategy's own callbacks that stop a run
(raising :class:`~fedshard.server.callbacks.StopRun` with what to change) or warn that its
rounds leave the model as it was (:mod:`fedshard.server.callbacks`).

- :class:`StopOnDivergence` - most of a round's nodes report that training diverged;
- :class:`StopWhenEveryReplyFails` - every reply of a round is the same error
  (:func:`likely_fix` says what to change);
- :class:`StopWhenUntrained` - the run trained nothing (:data:`NO_TRAINING_PATIENCE` rounds
  in a row when the number of rounds is unknown);
- :class:`UnchangingModel` - aggregated rounds leave the global model unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord

from fedshard import protocol as P

if TYPE_CHECKING:
    from fedshard.server.base import KeepRatioStrategy
    from fedshard.server.rounds import RoundState
from fedshard.server.callbacks import (
    NoRoundTrainedError,
    RoundCallback,
    StopRun,
    TrainingDivergedError,
    no_round_trained,
)

__all__ = [
    "NO_TRAINING_PATIENCE",
    "StopOnDivergence",
    "StopWhenEveryReplyFails",
    "StopWhenUntrained",
    "UnchangingModel",
    "likely_fix",
]

logger = logging.getLogger(__name__)

#: When the run's number of rounds is unknown (no ``num_rounds`` given to the strategy),
#: :class:`StopWhenUntrained` stops the run once this many aggregated rounds in a row, from the
#: first, trained nothing.
NO_TRAINING_PATIENCE = 3


class StopOnDivergence(RoundCallback):
    """Stops the run after a round in which at least :attr:`min_nodes` (2) nodes, and more
    than ``max_diverged_fraction`` of the nodes that replied, report that their training
    diverged (NaN or inf): the nodes were sent an lr their sub-models cannot take, and
    averaging the few that survived hides it. Raises :class:`TrainingDivergedError` (logged
    as an ERROR) with the lr sent and what to change.

    Nodes are counted, not replies: a node's second reply is a duplicate and counts nowhere.
    A single node never stops the run (it may be lying, and with one node sampled per round
    one liar would end every run): a round in which fewer than :attr:`min_nodes` nodes
    diverged but the share is exceeded logs a WARNING and the run goes on (the diverged
    replies are dropped like any other; a run that trains nothing is stopped at its end by
    :class:`StopWhenUntrained`).

    Parameters
    ----------
    min_nodes : int
        The fewest diverged nodes that stop the run (≥ 2; default 2).
    """

    #: The fewest diverged nodes in a round that stop the run.
    min_nodes = 2

    def __init__(self, min_nodes: int = 2) -> None:
        if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) or min_nodes < 2:
            raise ValueError(f"StopOnDivergence(min_nodes={min_nodes!r}): expected an integer "
                             "≥ 2 (one node alone must not stop a run); no callback was built")
        self.min_nodes = min_nodes

    def on_aggregate(self, strategy: KeepRatioStrategy, server_round: int,
                     metrics: Mapping[str, float], state: RoundState | None) -> None:
        if state is None:
            return
        nodes = {r.node for r in state.accepted} | {n for n, _ in state.dropped}
        diverged = len({n for n, reason in state.dropped if reason.startswith("diverged")})
        replied = len(nodes)
        limit = strategy.replies.max_diverged_fraction
        if not diverged or diverged <= limit * replied:
            return
        if diverged < self.min_nodes:
            logger.warning("Round %d: %d of the %d nodes that replied report that training "
                           "diverged; the run goes on: StopOnDivergence stops it only when at "
                           "least %d nodes (and more than max_diverged_fraction=%g of them) "
                           "do, so that one node cannot end a run. Their replies are dropped.",
                           server_round, diverged, replied, self.min_nodes, limit)
            return
        sent = [m.content[P.CONFIG] for m in state.messages]
        lrs = sorted({float(lr) for c in sent if isinstance(lr := c.get(P.LR), (int, float))})
        steps = sorted({str(c.get("factor-step", "plain")) for c in sent})
        lr_text = "/".join(f"{v:g}" for v in lrs) or "?"
        advice = [f"lower the lr the nodes are sent (lr={lr_text}: the strategy's lr, or "
                  "config['lr'] where your train config or configure_train sets it), e.g. to "
                  f"{lrs[0] / 10:g}" if lrs else "lower the lr the nodes are sent"]
        if "plain" in steps:
            advice.append("take the dense model's steps on the factors: factor_step='dense' "
                          "(LocalTraining / from_model) or run config factor-step = \"dense\"")
        message = (f"Round {server_round}: training diverged (NaN or inf) on {diverged:.0f} of "
                   f"the {replied:.0f} nodes that replied (max_diverged_fraction={limit:g}); "
                   "the run stops here and the global model stays the previous round's. To "
                   f"fix: {'; or '.join(advice)}.")
        logger.error("RUN FAILED: %s", message)
        raise _said(TrainingDivergedError(message))




class StopWhenEveryReplyFails(RoundCallback):
    """Stops the run after a round in which every node answered with an error and all the
    errors are one: the same error would come back every round, so the run stops at once
    (:class:`StopRun`, logged as an ERROR) with the error in full and, where it is a known
    one, the likely fix (a state dict that does not fit the received arrays: was
    ``receive(msg, model)`` called?)."""

    def on_aggregate(self, strategy: KeepRatioStrategy, server_round: int,
                     metrics: Mapping[str, float], state: RoundState | None) -> None:
        if state is None or metrics.get("replies-used", 0.0) or not state.dropped:
            return
        reasons = {reason for _, reason in state.dropped}
        if len(state.dropped) < len(state.sent) or len(reasons) != 1:
            return  # some node did not answer, or the nodes failed differently
        (reason,) = reasons
        if not reason.startswith("error-reply"):
            return
        message = (f"Round {server_round}: every one of the {len(state.dropped)} nodes answered "
                   f"with the same error, so every round would: the run stops here. The "
                   f"error: {reason}")
        hint = likely_fix(reason)
        if hint:
            message += f" Likely fix: {hint}"
        logger.error("RUN FAILED: %s", message)
        raise _said(StopRun(message))


def _said(stop: StopRun) -> StopRun:
    """``stop``, marked as already logged (its ERROR line begins ``RUN FAILED:``, the signal a
    run's log ends with, in fedshard's app and in a project of its own)."""
    stop.logged = True
    return stop


def likely_fix(reason: str) -> str:
    """What usually causes an error a ClientApp replies with, and what to change ("" when the
    error is not a known one)."""
    if "state_dict" in reason or "Missing key" in reason or "Unexpected key" in reason:
        return ("the ClientApp's model does not take the arrays it was sent. A node of "
                "SpectralSharding receives a sub-model (factors u, v, omega of the sharded "
                "layers): build it with model = receive(msg, Net()).model (fedshard.receive) "
                "instead of loading msg.content['arrays'] into your dense model, and make sure "
                "server and nodes build the same model.")
    if "run config num-partitions=" in reason:
        return ("the run config's num-partitions disagrees with the number of simulated nodes. "
                "Leave num-partitions out (its default 0 gives one partition per simulated "
                "node, whatever their number), or set it equal to the federation's "
                "num-supernodes (flwr run . --federation-config \"num-supernodes=N\").")
    if "memory-mb=" in reason:
        return ("the nodes' memory-mb budgets are too small for the model at the run's "
                "batch-size (each node's error names what its smallest keep ratio needs): "
                "raise memory-mb on the nodes that can spare it, or lower batch-size or the "
                "model's size in the run config.")
    if "deployed node" in reason and ("keep ratio" in reason or "keep-ratio" in reason):
        return ("a deployed SuperNode declares its own keep ratio: restart it with "
                "--node-config \"keep-ratio=0.25 ...\" (or memory-mb=<MB> to let it choose "
                "from its memory); a ClientApp's keep_ratios mix applies to simulated nodes "
                "only.")
    if "keep ratio" in reason or "keep-ratio" in reason:
        return ("every node must declare a keep ratio: simulated nodes take "
                "ShardingClientApp(keep_ratios=...) or keep-ratio in the run config; a "
                "deployed SuperNode keep-ratio (or memory-mb) in its --node-config.")
    return ""


class StopWhenUntrained(RoundCallback):
    """Stops a run in which no round trained (no usable reply, the model is the initial one),
    with :class:`NoRoundTrainedError` (logged as an ERROR) naming what to check.

    With the run's number of rounds known (``num_rounds``), every round runs and is
    recorded, and the error comes after the last one (:meth:`~RoundCallback.on_end`); with it
    unknown, after :data:`NO_TRAINING_PATIENCE` untrained rounds from the first. Not with
    ``fraction_train=0`` (no training asked for).
    """

    stops_untrained_runs = True

    def __init__(self) -> None:
        self.streak = 0  # aggregated rounds in a row that trained nothing

    def on_aggregate(self, strategy: KeepRatioStrategy, server_round: int,
                     metrics: Mapping[str, float], state: RoundState | None) -> None:
        self.streak = 0 if strategy.rounds_trained else self.streak + 1
        if strategy.rounds_trained or strategy.fraction_train == 0.0 \
                or strategy.num_rounds is not None:
            return
        if self.streak >= NO_TRAINING_PATIENCE:
            self._stop(no_round_trained(self.streak) + " The number of rounds is unknown, so "
                       f"the run stops after {NO_TRAINING_PATIENCE} untrained rounds.")

    def on_end(self, strategy: KeepRatioStrategy, arrays: ArrayRecord) -> None:
        if strategy.rounds_trained == 0 and strategy.fraction_train > 0:
            total = strategy.num_rounds
            assert total is not None  # on_end comes after the last of num_rounds
            self._stop(no_round_trained(total - strategy.run_rounds.completed))

    @staticmethod
    def _stop(message: str) -> None:
        logger.error("RUN FAILED: %s", message)
        raise _said(NoRoundTrainedError(message))


class UnchangingModel(RoundCallback):
    """Warns when the global model stops changing: :attr:`patience` (3) rounds in a row whose
    aggregate replaced the global model but left it equal to the model before it, to float
    rounding (the change of all its floating arrays together at most :attr:`tolerance` times
    their norm; the rebuild of ``W`` from its factors is not bitwise). Such a run trains
    nothing without any reply being dropped; the WARNING (once per such stretch) names the
    likely causes: an lr so small that every step vanishes in float32 (lr 1e-30; below
    :data:`fedshard.settings.MIN_LR` an lr is refused), or nodes that return what they were
    sent. Normalization statistics (``running_mean``, ``running_var``,
    ``num_batches_tracked``: a forward pass moves them, whatever the lr) are not counted as
    a change. Rounds that trained nothing (no usable reply) do not count: they are reported
    by the reply warnings and :class:`StopWhenUntrained`.

    Parameters
    ----------
    patience : int
        Unchanged rounds in a row before the WARNING (≥ 1; default 3).
    tolerance : float
        Largest change of the model, relative to its norm, that counts as no change (default
        1e-6, a few float32 roundings).
    """

    #: Unchanged rounds in a row before the WARNING.
    patience = 3
    #: Largest relative change of the model that counts as none.
    tolerance = 1e-6

    def __init__(self, patience: int = 3, tolerance: float = 1e-6) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1 \
                or not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
            raise ValueError(f"UnchangingModel(patience={patience!r}, tolerance={tolerance!r}): "
                             "expected an integer patience ≥ 1 and a tolerance in [0, 1); no "
                             "callback was built")
        self.patience, self.tolerance = patience, float(tolerance)
        self.before: dict[str, np.ndarray] | None = None  # the model a trained round started from
        self.streak = 0  # unchanged trained rounds in a row
        self.lrs: list[float] = []  # the lr sent in each of them

    def on_aggregate(self, strategy: KeepRatioStrategy, server_round: int,
                     metrics: Mapping[str, float], state: RoundState | None) -> None:
        self.before = None
        if state is not None and state.accepted and not metrics.get("aggregate-non-finite"):
            self.before = state.current or {k: P.decode_array(a) for k, a in state.arrays.items()}

    def on_round(self, strategy: KeepRatioStrategy, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        before, self.before = self.before, None
        if before is None:
            return None
        if not self._unchanged(before, arrays):
            self.streak, self.lrs = 0, []
            return None
        self.streak += 1
        if isinstance(lr := metrics.get(P.LR), float):
            self.lrs.append(lr)
        if self.streak == self.patience:
            ratio = metrics.get("update-ratio-max")
            nodes = ("the nodes returned the arrays they were sent (update-ratio-max=0)"
                     if ratio == 0 else "nodes that return what they were sent, or changes "
                     f"that vanish in the average (update-ratio-max={ratio:.3g})"
                     if ratio is not None else "nodes that return what they were sent")
            logger.warning(
                "Round %d: the global model has not changed for %d rounds in a row (rounds "
                "%d-%d): each round's aggregate equals the model before it, to float rounding, "
                "so the run trains nothing. Likely causes: an lr so small that every step "
                "vanishes in float32 (the lr sent in these rounds: at most %s; the strategy's "
                "lr: %g), or %s. Raise the lr (check its schedule), or check what the nodes "
                "train.", server_round, self.streak, server_round - self.streak + 1,
                server_round, f"{max(self.lrs):g}" if self.lrs else "?", strategy.base_lr,
                nodes)
        return None

    #: Entries a forward pass changes without any training: batch normalization's statistics.
    STATISTICS = (".running_mean", ".running_var", ".num_batches_tracked")

    def _unchanged(self, before: Mapping[str, np.ndarray], arrays: ArrayRecord) -> bool:
        """Whether ``arrays`` equal ``before``: the same keys and shapes, integer entries
        equal, and the change of the floating entries, all together, at most
        :attr:`tolerance` times their norm (together: a zero-initialized bias moved by 1e-31
        is no change of the model); normalization statistics left out."""
        if set(before) != set(arrays.keys()):
            return False
        change_sq = norm_sq = 0.0
        for key, record in arrays.items():
            if key.endswith(self.STATISTICS):
                continue
            new, old = P.decode_array(record), before[key]
            if new.shape != old.shape:
                return False
            if not np.issubdtype(new.dtype, np.floating):
                if not np.array_equal(new, old):
                    return False
                continue
            old64 = old.astype(np.float64).ravel()
            delta = new.astype(np.float64).ravel() - old64
            change_sq += float(np.dot(delta, delta))
            norm_sq += float(np.dot(old64, old64))
        return change_sq <= self.tolerance**2 * norm_sq

