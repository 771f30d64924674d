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
callbacks in the same way, ``pfl/callback``):

- :class:`SettingsSummary` - logs the strategy's settings once, and warns when a round's lr
  falls back to the base lr because the cosine schedule has no length;
- :class:`ShardingBudgetReport` - says, for every keep ratio when it first appears, what a node
  receives, sends and computes against the dense model, and warns when sharding saves less than
  it should (the largest layers left dense, factors that cost more than their layer);
- :class:`UntrainedChannels` - warns once when width slicing's static slices leave channels
  that no node trains;
- :class:`ConfigPrecedence` - says once which of the round config's entries are sent as they
  are and which are replaced;
- :class:`SingleNodeGroups` - warns when Collective meets a keep-ratio group of one node;
- :class:`SmallCohort` - warns once when a round goes to fewer nodes than the spread bound
  needs (3);
- :class:`CompoundingMultipliers` - warns once when multipliers above 1 meet a model without
  normalization layers;
- :class:`TrainingReceipts` - compares what the nodes say they trained with (optimizer, lr,
  whether the client rules were applied) with what they were sent, and warns once per kind of
  difference;
- :class:`StopOnDivergence` - stops the run when at least two nodes, and most of those that
  replied, report that training diverged;
- :class:`StopWhenEveryReplyFails` - stops the run after a round whose every reply is the same
  error, with the error in full and the likely fix;
- :class:`StopWhenUntrained` - stops the run that trained nothing, with what to check;
- :class:`UnchangingModel` - warns when rounds whose replies were aggregated leave the global
  model unchanged (an lr that vanishes in float32, nodes that return what they were sent);
- :class:`~fedshard.server.progress.SlowStart` - says at the first round how much of a
  sharded layer's gradient a node's step can follow, and why a model started from a random
  initialization learns more slowly than the dense one at the same lr (a WARNING in a short
  run); warns when the dense factor step meets multipliers above 1;
- :class:`~fedshard.server.progress.FallingAccuracy` - warns when an evaluation accuracy falls
  round after round while every reply passes the server's checks.

Metrics flow one way through :meth:`~RoundCallback.on_round`: each callback sees the round's
row (the strategy's statistics and the client aggregates) and what the callbacks before it
added; what it returns is added to the round's row of the strategy's ``history``, for the
ones after it (a test-set evaluation, then the file that records the row, then a checkpoint).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedshard import protocol as P
from fedshard.spectral.budget import budget_summary, budget_warnings, sharding_budget

if TYPE_CHECKING:
    from fedshard.server.base import KeepRatioStrategy
    from fedshard.server.rounds import RoundState
    from fedshard.server.strategy import SpectralSharding

__all__ = [
    "NO_TRAINING_PATIENCE",
    "CompoundingMultipliers",
    "ConfigPrecedence",
    "NoRoundTrainedError",
    "RoundCallback",
    "SettingsSummary",
    "ShardingBudgetReport",
    "SingleNodeGroups",
    "SmallCohort",
    "StopOnDivergence",
    "StopRun",
    "StopWhenEveryReplyFails",
    "StopWhenUntrained",
    "TrainingDivergedError",
    "TrainingReceipts",
    "UnchangingModel",
    "UntrainedChannels",
    "default_callbacks",
    "likely_fix",
    "no_round_trained",
]

logger = logging.getLogger(__name__)

#: When the run's number of rounds is unknown (no ``num_rounds`` given to the strategy),
#: :class:`StopWhenUntrained` stops the run once this many aggregated rounds in a row, from the
#: first, trained nothing.
NO_TRAINING_PATIENCE = 3


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
            "ratio (ShardingClientApp(keep_ratios=...) or keep-ratio in the node/run config), "
            "error replies from the ClientApp, a round timeout too short, or replies refused "
            "by the reply bounds (max-update-ratio, max-num-examples).")


class RoundCallback:
    """One thing a run does around its rounds; override the hooks you need (each does nothing
    by default). ``strategy`` is the :class:`~fedshard.server.base.KeepRatioStrategy` that
    calls it (:class:`~fedshard.server.strategy.SpectralSharding` or
    :class:`~fedshard.server.width.WidthSlicing`); every round is the run's (a resumed run
    counts on from its checkpoint)."""

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


# ---------------------------------------------------------------------------- the strategy's own
def _spectral(strategy: KeepRatioStrategy) -> SpectralSharding | None:
    """``strategy`` where it sends factors (spectral sharding of at least one layer)."""
    from fedshard.server.strategy import SpectralSharding  # (it imports this module)

    return strategy if isinstance(strategy, SpectralSharding) and strategy.sharded_layers \
        else None


class SettingsSummary(RoundCallback):
    """Logs the strategy's settings once, when the first round's messages are built
    (:meth:`~fedshard.server.base.KeepRatioStrategy.describe`: what is sent and how, the
    local-training recipe and its lr schedule), and warns once when a round's lr falls back to
    the base lr: the cosine schedule needs the run's number of rounds, no ``num_rounds`` was
    given to the strategy, and the round's config sets no lr of its own."""

    def __init__(self) -> None:
        self.logged = False
        self.warned = False

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        if not self.logged:
            self.logged = True
            for line in strategy.describe():
                logger.info("%s", line)
        if (not self.warned and strategy.num_rounds is None
                and strategy.training.lr_schedule == "cosine" and P.LR not in config):
            self.warned = True
            logger.warning(
                "The cosine lr schedule needs the run's number of rounds, and none is known "
                "(%s(num_rounds=...) was not given): every round's lr is the base lr=%g. Give "
                "num_rounds to the strategy for the cosine schedule, or an lr in the round "
                "config.", type(strategy).__name__, strategy.base_lr)


class ShardingBudgetReport(RoundCallback):
    """What sharding buys, per keep ratio, logged when a ratio first appears in a round: the
    bytes a node receives and sends and (with the strategy's model and example input, which
    :meth:`~fedshard.server.strategy.SpectralSharding.from_model` keeps) its forward FLOPs,
    against the dense model (INFO); and a WARNING where a keep ratio r < 1 saves less than half
    of what it names (above (1 + r)/2 of the dense model), naming the largest layers left dense
    and the line that shards them, or where a layer's ⌈rN⌉ factors cost more than the layer
    (:func:`fedshard.spectral.budget_warnings`)."""

    def __init__(self) -> None:
        self.reported: set[float] = set()

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        spectral = _spectral(strategy)
        if spectral is None:
            return
        ratios = {float(r) for m in messages
                  if isinstance(r := m.content[P.CONFIG].get(P.KEEP_RATIO), (int, float))}
        new = ratios - self.reported
        if not new:
            return
        self.reported |= new
        source = spectral.budget_model if spectral.budget_model is not None \
            else spectral.current_arrays
        if source is None:
            return
        try:
            budget = sharding_budget(source, spectral.sharded_layers, new,
                                     example_input=spectral.example_input
                                     if spectral.budget_model is not None else None)
        except (TypeError, ValueError) as err:  # a report must not stop the run
            logger.warning("What sharding saves could not be counted (%s); the run goes on.",
                           err)
            return
        logger.info("Round %d, what a node receives and computes against the dense model: %s",
                    server_round, "; ".join(budget_summary(budget)))
        for text in budget_warnings(budget):
            logger.warning("%s", text)


class ConfigPrecedence(RoundCallback):
    """Says once which of the round config's entries are sent as they are, and which are
    replaced (the per-node keys: the keep ratio, the training seed, the method)."""

    def __init__(self) -> None:
        self.told: set[str] = set()

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        replaced = sorted(k for k in P.NODE_KEYS if k in config and k != P.SERVER_ROUND)
        mine = sorted(k for k in P.RECIPE_KEYS if k in config)
        if replaced and self._first("node-keys"):
            logger.warning("The config sets %s: these are per node and always the strategy's; "
                           "the values given are replaced.", ", ".join(replaced))
        if P.LR in mine and strategy.training.lr is not None:
            if self._first("lr"):
                logger.warning(
                    "config['lr']=%g is sent to the nodes as is: the round's config wins over "
                    "the strategy's lr=%g and its %s schedule, which apply only to rounds whose "
                    "config sets no lr.", config[P.LR], strategy.training.lr,
                    strategy.training.lr_schedule)
        elif mine and self._first("mine"):
            logger.info("The round's config sets %s: sent to the nodes as is (the strategy's "
                        "values apply where it sets none).", ", ".join(mine))

    def _first(self, key: str) -> bool:
        first = key not in self.told
        self.told.add(key)
        return first


class UntrainedChannels(RoundCallback):
    """Warns once, under width slicing's static slices (HeteroFL, ordered dropout), when no
    node of a round trains beyond some width below the global one: the global model's other
    channels keep their initial values, and the model at full width (what is evaluated and
    saved) carries them. FedRolex's rolling window covers every channel."""

    def __init__(self) -> None:
        self.told = False

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        from fedshard.server.width import WidthSlicing  # (it imports this module)

        if self.told or not isinstance(strategy, WidthSlicing) or not messages \
                or strategy.sharding.method == "fedrolex":
            return
        ratios = {float(r) for m in messages
                  if isinstance(r := m.content[P.CONFIG].get(P.KEEP_RATIO), (int, float))}
        full = strategy.family.width
        widest = max((strategy.width_of(r).width for r in ratios), default=full)
        if widest >= full:
            return
        self.told = True
        logger.warning(
            "Width slicing (%s): no node trains beyond width %d of %d, so the global model's "
            "other channels keep their initial values and the model at full width (what is "
            "evaluated and saved) carries them (HeteroFL's ResNet-18 of width 6 of 16 on "
            "Fashion-MNIST: 13 %% at full width, 83 %% at width 6). Evaluate and deploy the "
            "narrow model of width %d with the leading channels (fedshard.width.take of "
            "slice_indices(..., 'heterofl', 0); benchmarks/width_eval.py), or let some nodes "
            "train the full width, or use 'fedrolex', whose window covers every channel.",
            strategy.sharding.method, widest, full, widest)


#: Collective's multipliers need C ≥ 2 nodes per keep-ratio group: with C = 1 Theorem 2 gives
#: ω = 1 and the n largest terms (Top-n). The annealed Collective is the same on λ^γ.
_GROUP_SIZE_METHODS = ("collective", "anneal-collective")


class SingleNodeGroups(RoundCallback):
    """Warns when Collective meets a keep-ratio group of one sampled node: a WARNING the first
    time each group is alone, an INFO line in later rounds where it is again (in a federation
    of two nodes, every round).

    Collective's ω = C/(1+π(C−1)) needs C ≥ 2 nodes per keep-ratio group: a group of one
    gets the n largest terms with ω = 1, i.e. Top-n (Unbiased's ω = 1/π does not depend on
    C: one node per group is still unbiased, with more variance).
    """

    def __init__(self) -> None:
        self.warned: set[float] = set()  # the groups already named in a WARNING

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        method = strategy.sharding.method
        if method not in _GROUP_SIZE_METHODS or not strategy.sharded_layers:
            return
        sizes = Counter(float(r) for m in messages
                        if isinstance(r := m.content[P.CONFIG].get(P.KEEP_RATIO), (int, float)))
        alone = sorted(r for r, c in sizes.items() if c == 1 and r < 1.0)
        if not alone:
            return
        groups = ", ".join(f"{r:g}" for r in alone)
        if set(alone) <= self.warned:
            logger.info("Round %d: keep-ratio group(s) r=%s again have a single sampled node "
                        "(Top-n for them this round).", server_round, groups)
            return
        self.warned.update(alone)
        logger.warning(
            "Round %d: keep-ratio group(s) r=%s have a single sampled node: with C = 1, "
            "method=%s gives that node the n largest terms with ω = 1 (Top-n); the other "
            "terms are not trained by it. Let nodes share keep ratios, or sample more nodes "
            "(fraction_train / min_train_nodes) so that every group has ≥ 2. Later rounds where "
            "this recurs are logged at INFO.", server_round, groups, method)


class SmallCohort(RoundCallback):
    """Warns once, at the first round sent to fewer nodes than the robust aggregation needs.

    The spread bound (``max-update-spread``) acts on rounds with at least 3 replies, and the
    median it measures against is an honest node's only while honest replies are more than
    half: against f dishonest nodes a round needs 2f + 1 replies (3 for one, 7 for three).
    With fewer, one dishonest node's reply is averaged in unchecked apart from the per-term
    bounds (``max-update-ratio``, ``max-weight-ratio``).
    """

    #: the fewest replies a round needs for the spread bound to act at all
    NEEDED = 3

    def __init__(self) -> None:
        self.told = False

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        if self.told or not strategy.replies.max_update_spread or not messages:
            return
        if len(messages) < self.NEEDED:
            self.told = True
            logger.warning(
                "Round %d is sent to %d node(s): the spread bound (max-update-spread) needs at "
                "least %d replies to act, and holds against f dishonest nodes only with "
                "2f + 1 or more (3 for one, 7 for three). With %d, a dishonest node's update is "
                "averaged in as it came (within max-update-ratio). Sample more nodes per round "
                "(fraction-train, min-available-nodes) where nodes may be dishonest.",
                server_round, len(messages), self.NEEDED, len(messages))


class CompoundingMultipliers(RoundCallback):
    """Warns once, at the first round whose multipliers exceed 1, when the model has no
    normalization layer (``strategy.unnormalized``, which
    :meth:`~fedshard.server.strategy.SpectralSharding.from_model` sets): ω then scales every
    sharded layer's output and can compound from layer to layer (the paper's models all
    normalize)."""

    def __init__(self) -> None:
        self.told = False

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        spectral = _spectral(strategy)
        if spectral is None or not spectral.unnormalized or self.told:
            return
        top = max((float(np.max(P.decode_array(a))) for m in messages
                   for k, a in m.content.array_records[P.ARRAYS].items()
                   if k.endswith(".omega")), default=1.0)
        if top > 1.0 + 1e-6:  # ω = 1 (Top-n, PriSM, r = 1, C = 1) cannot compound
            self.told = True
            logger.warning("The model has no normalization layer: with method=%r the "
                           "multipliers ω (up to %.3g this round) scale every sharded layer's "
                           "output and can compound from layer to layer (the paper's models "
                           "all normalize).", strategy.sharding.method, top)


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
        logger.error("%s", message)
        raise _said(TrainingDivergedError(message))


class TrainingReceipts(RoundCallback):
    """Compares what the nodes say they trained with (their replies' receipts,
    :class:`fedshard.protocol.Receipt`) with what they were sent, and warns once per kind of
    difference, with counts: nodes that trained at another lr than the one sent (their own
    optimizer's, so the lr schedule the server logs is not what they used), nodes whose
    factors no optimizer step moved with the client rules (Frobenius decay, ClipLR not
    applied), receipts that cannot be read. Nodes that trained with DP-SGD (Opacus) are
    logged at INFO, once per noise multiplier and clipping norm, with counts. :attr:`totals`
    sums them over the run (the app puts them in ``summary.json``)."""

    def __init__(self) -> None:
        self.told: set[tuple[Any, ...]] = set()
        self.totals: dict[str, Any] = {"nodes": 0, "lr-differs": 0, "rules-not-applied": 0,
                                       "unreadable": 0, "optimizers": {}, "dp-sgd": 0}
        #: the (noise multiplier, clipping norm) pairs DP-SGD nodes reported (None: unknown)
        self.dp_settings: set[tuple[float | None, float | None]] = set()

    def on_aggregate(self, strategy: KeepRatioStrategy, server_round: int,
                     metrics: Mapping[str, float], state: RoundState | None) -> None:
        if state is None or not state.accepted:
            return
        sent = {m.metadata.dst_node_id: m.content[P.CONFIG] for m in state.messages}
        kinds: Counter[tuple[Any, ...]] = Counter()
        private: Counter[tuple[float | None, float | None]] = Counter()
        nodes = 0
        for reply in state.accepted:
            receipt, config = reply.receipt, sent.get(reply.node)
            if receipt is None or config is None:
                continue
            nodes += 1
            if isinstance(receipt, str):
                kinds[("unreadable", receipt[:80])] += 1
                continue
            if receipt.dp_sgd:
                private[(receipt.noise_multiplier, receipt.max_grad_norm)] += 1
            optimizers = self.totals["optimizers"]
            optimizers[receipt.optimizer] = optimizers.get(receipt.optimizer, 0) + 1
            lr = config.get(P.LR)
            if receipt.lr is not None and isinstance(lr, (int, float)) \
                    and abs(receipt.lr - lr) > 1e-6 * max(abs(lr), 1e-12):
                kinds[("lr", receipt.optimizer, receipt.lr, float(lr))] += 1
            tau, gamma = config.get("clip-lr-tau", 0.0), config.get("frobenius-decay", 0.0)
            wanted = (isinstance(tau, (int, float)) and tau > 0) or \
                (isinstance(gamma, (int, float)) and gamma > 0)
            shard = state.sent.get(reply.node)
            factored = shard is not None and bool(shard.indices)  # it was sent factors
            if wanted and factored and receipt.steps == 0:
                kinds[("rules",)] += 1
        self.totals["nodes"] += nodes
        self.totals["dp-sgd"] += sum(private.values())
        self.dp_settings.update(private)
        for (sigma, clip), count in private.items():
            if ("dp", sigma, clip) not in self.told:
                self.told.add(("dp", sigma, clip))
                logger.info("Round %d: %d of %d nodes trained with DP-SGD (Opacus), noise "
                            "multiplier %s, clipping norm %s.", server_round, count, nodes,
                            "unknown" if sigma is None else f"{sigma:g}",
                            "unknown" if clip is None else f"{clip:g}")
        for kind, count in kinds.items():
            total = {"lr": "lr-differs", "rules": "rules-not-applied",
                     "unreadable": "unreadable"}[kind[0]]
            self.totals[total] += count
            key = kind[:2] if kind[0] != "lr" else kind[:3]
            if key in self.told:
                continue
            self.told.add(key)
            logger.warning("Round %d: %s", server_round, _receipt_text(kind, count, nodes))


def _receipt_text(kind: tuple[Any, ...], count: int, nodes: int) -> str:
    if kind[0] == "lr":
        _, optimizer, used, sent = kind
        return (f"{count} of {nodes} nodes trained with {optimizer or 'their optimizer'} at lr "
                f"{used:g}, not the lr {sent:g} sent: the lr the server logs (and schedules) is "
                "not what they used. Build the optimizer with the lr sent "
                "(shard.settings.lr, or msg.content['config']['lr']) to follow the schedule, or, "
                "where a framework owns the optimizer, give the strategy their lr: "
                f"LocalTraining(lr={used:g}, lr_schedule='constant') (from_model(..., "
                f"lr={used:g}, lr_schedule='constant')).")
    if kind[0] == "rules":
        return (f"{count} of {nodes} nodes trained without the client rules (Frobenius decay, "
                "ClipLR): no step of an optimizer the rules were attached to moved their "
                "received factors. Attach them to the optimizer that trains the received "
                "model (shard = receive(msg, model); shard.rules.attach(optimizer)), or call "
                "shard.rules.before_step()/after_step() around your own update.")
    return (f"{count} of {nodes} nodes sent a receipt (what they trained with) that cannot be "
            f"read ({kind[1]}); their arrays are used as usual.")


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
        logger.error("%s", message)
        raise _said(StopRun(message))


def _said(stop: StopRun) -> StopRun:
    """``stop``, marked as already logged."""
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
    if "keep ratio" in reason or "keep-ratio" in reason:
        return ("every node must declare a keep ratio: ShardingClientApp(keep_ratios=...), or "
                "keep-ratio in the node or run config.")
    return ""


class StopWhenUntrained(RoundCallback):
    """Stops a run in which no round trained (no usable reply, the model is the initial one),
    with :class:`NoRoundTrainedError` (logged as an ERROR) naming what to check.

    With the run's number of rounds known (``num_rounds``), every round runs and is
    recorded, and the error comes after the last one (:meth:`~RoundCallback.on_end`); with it
    unknown, after :data:`NO_TRAINING_PATIENCE` untrained rounds from the first. Not with
    ``fraction_train=0`` (no training asked for).
    """

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
        logger.error("%s", message)
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


def default_callbacks() -> list[RoundCallback]:
    """The strategy's own callbacks, in order (see the module docstring); fresh objects (each
    keeps its own state: what it already said, untrained rounds in a row)."""
    from fedshard.server.progress import FallingAccuracy, SlowStart  # they build on this module

    return [SettingsSummary(), ShardingBudgetReport(), UntrainedChannels(), ConfigPrecedence(),
            SingleNodeGroups(), SmallCohort(), CompoundingMultipliers(), SlowStart(),
            TrainingReceipts(), StopOnDivergence(), StopWhenEveryReplyFails(),
            StopWhenUntrained(), FallingAccuracy(),
            UnchangingModel()]


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
