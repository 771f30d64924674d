"""What a run does around its rounds, as callbacks the strategy composes: :class:`RoundCallback`.

:class:`~fedshard.server.base.KeepRatioStrategy` (spectral sharding and width slicing) calls
its callbacks from its round hooks, in order, at four points of a run: a round's train
messages are built (:meth:`~RoundCallback.on_configure`), its replies aggregated
(:meth:`~RoundCallback.on_aggregate`), the round is over and its model is the global one
(:meth:`~RoundCallback.on_round`), and the last round is over (:meth:`~RoundCallback.on_end`).
So they hold whoever drives the hooks: Flower's ``start()``, a subclass's own, a loop of one's
own. A callback can stop the run: it raises :class:`StopRun` (or a subclass), which ends
``start()`` with the reason.

The strategy's own checks are callbacks too (:func:`default_callbacks`), so a user of the
library gets them and can leave one out or add their own (pfl-research composes its
callbacks in the same way, ``pfl/callback``). This module holds the protocol (the hooks, the
stop, the dispatch); the checks live by concern in :mod:`~fedshard.server.advice` (what a run
says and warns as it goes), :mod:`~fedshard.server.stops` (runs that cannot go on or train
nothing) and :mod:`~fedshard.server.progress` (is the run learning):

In :mod:`~fedshard.server.advice`:

- ``SettingsSummary`` - logs the strategy's settings once, and warns when a round's lr falls
  back to the base lr because the cosine schedule has no length;
- ``ShardingBudgetReport`` - says, for every keep ratio when it first appears, what a node
  receives, sends and computes against the dense model, and warns when sharding saves less
  than it should (the largest layers left dense, factors that cost more than their layer);
- ``UntrainedChannels`` - warns once when width slicing's static slices leave channels that
  no node trains;
- ``ConfigPrecedence`` - says once which of the round config's entries are sent as they are
  and which are replaced;
- ``SingleNodeGroups`` - warns when Collective meets a keep-ratio group of one node;
- ``SmallCohort`` - warns once when a round goes to fewer nodes than the spread bound needs
  (3);
- ``CompoundingMultipliers`` - warns once when multipliers above 1 meet a model without
  normalization layers;
- ``TrainingReceipts`` - compares what the nodes say they trained with (optimizer, lr,
  whether the client rules were applied) with what they were sent, and warns once per kind
  of difference.

In :mod:`~fedshard.server.stops`:

- ``StopOnDivergence`` - stops the run when at least two nodes, and most of those that
  replied, report that training diverged;
- ``StopWhenEveryReplyFails`` - stops the run after a round whose every reply is the same
  error, with the error in full and the likely fix;
- ``StopWhenUntrained`` - stops the run that trained nothing, with what to check;
- ``UnchangingModel`` - warns when rounds whose replies were aggregated leave the global
  model unchanged (an lr that vanishes in float32, nodes that return what they were sent).

In :mod:`~fedshard.server.progress`:

- ``SlowStart`` - says at the first round how much of a sharded layer's gradient a node's
  step can follow, and why a model started from a random initialization learns more slowly
  than the dense one at the same lr (a WARNING in a short run); warns when the dense factor
  step meets multipliers above 1;
- ``FallingAccuracy`` - warns when an evaluation accuracy falls round after round while every
  reply passes the server's checks;
- ``SpreadShrinksHonestNodes`` (not a default: README's first run, honest nodes on non-IID
  data, would trigger it) - warns once when the spread bound keeps shrinking the updates of
  nodes it does not name (honest heterogeneity, otherwise INFO lines only).

Metrics flow one way through :meth:`~RoundCallback.on_round`: each callback sees the round's
row (the strategy's statistics and the client aggregates) and what the callbacks before it
added; what it returns is added to the round's row of the strategy's ``history``, for the
ones after it (a test-set evaluation, then the file that records the row, then a checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message

if TYPE_CHECKING:
    from fedshard.server.base import KeepRatioStrategy
    from fedshard.server.rounds import RoundState

__all__ = [
    "NoRoundTrainedError",
    "RoundCallback",
    "StopRun",
    "TrainingDivergedError",
    "default_callbacks",
    "no_round_trained",
    "run_aggregate",
    "run_configure",
    "run_end",
    "run_round",
]

class StopRun(RuntimeError):
    """Raised by a callback to stop the run; its message says why (and what to change).

    ``logged``: whether the message was already logged as an ERROR where the stop was decided
    (fedshard's own stops do; the app then does not repeat it)."""

    logged = False


class NoRoundTrainedError(StopRun):
    """No round of the run changed the model: the global model is the initial one."""


class TrainingDivergedError(StopRun):
    """At least two nodes, and more than
    :attr:`~fedshard.settings.ReplyPolicy.max_diverged_fraction` of the nodes that replied in
    a round, reported that training diverged (:class:`StopOnDivergence`): the run stops after
    that round (the global model is the previous round's)."""


def no_round_trained(rounds: int) -> str:
    """The message of a run that trained nothing in ``rounds`` round(s)."""
    return (f"No round trained: none of the {rounds} round(s) got a usable training reply, so "
            "the model is the initial one. Check the server log above and the round metrics "
            "(replies-dropped, dropped-<reason>, replies-missing): nodes that declare no keep "
            "ratio (a deployed SuperNode: keep-ratio or memory-mb in its --node-config; "
            "simulated nodes: ShardingClientApp(keep_ratios=...) or keep-ratio in the run "
            "config), "
            "error replies from the ClientApp, a round timeout too short, or replies refused "
            "by the reply bounds (max-update-ratio, max-num-examples).")


class RoundCallback:
    """One thing a run does around its rounds; override the hooks you need (each does nothing
    by default). ``strategy`` is the :class:`~fedshard.server.base.KeepRatioStrategy` that
    calls it (:class:`~fedshard.server.strategy.SpectralSharding` or
    :class:`~fedshard.server.width.WidthSlicing`); every round is the run's (a resumed run
    counts on from its checkpoint).

    ``stops_untrained_runs``: whether this callback stops a run that cannot train; with one
    such callback among the strategy's, a first round whose sampled nodes all fail the
    capability query alike stops the run instead of leaving it to train nothing.
    """

    stops_untrained_runs: bool = False

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        """The round's train messages were built from the caller's ``config`` (not sent yet;
        the global model they were cut from is ``strategy.current_arrays``)."""

    def on_aggregate(self, strategy: KeepRatioStrategy, server_round: int,
                     metrics: Mapping[str, float], state: RoundState | None) -> None:
        """The round's replies were checked and aggregated; ``metrics`` is its row so far and
        ``state`` what it sent (``None``: the round sent nothing, e.g. no node had declared
        a keep ratio). Raise :class:`StopRun` to stop the run here."""

    def on_round(self, strategy: KeepRatioStrategy, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        """The round is over and ``arrays`` is the global model (round 0: the initial one,
        when round 1 is configured); ``metrics`` the round's row and what earlier callbacks
        added (read only). Returns metrics to add to the row (``None``: none). Raise
        :class:`StopRun` to stop the run here."""
        return None

    def on_end(self, strategy: KeepRatioStrategy, arrays: ArrayRecord) -> None:
        """The run's last round (the strategy's ``num_rounds``) is over and ``arrays`` is its
        final model; every callback's ``on_round`` of that round ran. Not called when the
        number of rounds is unknown, nor when the run stops early (an exception ends
        ``start()``): whoever holds a resource releases it then (fedshard's app closes its
        TensorBoard file). Release what the callback holds; raise to fail the run."""


def default_callbacks() -> list[RoundCallback]:
    """The strategy's own callbacks, in order (see the module docstring); fresh objects (each
    keeps its own state: what it already said, untrained rounds in a row)."""
    # they build on this module
    from fedshard.server.advice import (
        CompoundingMultipliers,
        ConfigPrecedence,
        SettingsSummary,
        ShardingBudgetReport,
        SingleNodeGroups,
        SmallCohort,
        TrainingReceipts,
        UntrainedChannels,
    )
    from fedshard.server.progress import FallingAccuracy, SlowStart
    from fedshard.server.savings import SavingsReport
    from fedshard.server.stops import (
        StopOnDivergence,
        StopWhenEveryReplyFails,
        StopWhenUntrained,
        UnchangingModel,
    )

    return [SettingsSummary(), ShardingBudgetReport(), UntrainedChannels(), ConfigPrecedence(),
            SingleNodeGroups(), SmallCohort(), CompoundingMultipliers(), SlowStart(),
            TrainingReceipts(), StopOnDivergence(), StopWhenEveryReplyFails(),
            StopWhenUntrained(), FallingAccuracy(),
            UnchangingModel(), SavingsReport()]



# ---------------------------------------------------------------------------- dispatch
def run_configure(callbacks: Sequence[RoundCallback], strategy: KeepRatioStrategy,
                  server_round: int, config: ConfigRecord, messages: Sequence[Message]) -> None:
    for callback in callbacks:
        callback.on_configure(strategy, server_round, config, messages)


def run_aggregate(callbacks: Sequence[RoundCallback], strategy: KeepRatioStrategy,
                  server_round: int, metrics: Mapping[str, float],
                  state: RoundState | None) -> None:
    view = MappingProxyType(dict(metrics))
    for callback in callbacks:
        callback.on_aggregate(strategy, server_round, view, state)


def run_round(callbacks: Sequence[RoundCallback], strategy: KeepRatioStrategy,
              server_round: int, arrays: ArrayRecord, row: dict[str, float]) -> None:
    """Every callback's :meth:`~RoundCallback.on_round` in order, each seeing ``row`` (read
    only); what each returns is added to ``row``."""
    view = MappingProxyType(row)
    for callback in callbacks:
        new = callback.on_round(strategy, server_round, arrays, view)
        if new:
            row.update(new)


def run_end(callbacks: Sequence[RoundCallback], strategy: KeepRatioStrategy,
            arrays: ArrayRecord) -> None:
    """Every callback's :meth:`~RoundCallback.on_end`, in order, even when one raises (the
    first exception is raised after the others ran)."""
    first: BaseException | None = None
    for callback in callbacks:
        try:
            callback.on_end(strategy, arrays)
        except BaseException as err:
            first = first or err
    if first is not None:
        raise first
