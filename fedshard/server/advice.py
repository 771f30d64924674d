"""What a run says and warns as it goes: the strategy's own callbacks that look at a round's
settings, messages and receipts and tell the user (:mod:`fedshard.server.callbacks`; the
order they run in is :func:`~fedshard.server.callbacks.default_callbacks`'s).

- :class:`SettingsSummary` - the strategy's settings, once; a round whose lr falls back to
  the base lr;
- :class:`ShardingBudgetReport` - what a node receives, sends and computes at each keep ratio,
  and where sharding saves less than it should;
- :class:`ConfigPrecedence` - which of the round config's entries are sent as they are;
- :class:`UntrainedChannels` - width slicing's channels that no node trains;
- :class:`SingleNodeGroups` - Collective meeting a keep-ratio group of one node;
- :class:`SmallCohort` - a round too small for the spread bound;
- :class:`CompoundingMultipliers` - multipliers above 1 in a model without normalization;
- :class:`TrainingReceipts` - what the nodes say they trained with, against what they were
  sent.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord, Message

from fedshard import protocol as P
from fedshard.protocol.receipts import dp_sgd_problem
from fedshard.spectral.budget import budget_summary, budget_warnings, sharding_budget

if TYPE_CHECKING:
    from fedshard.server.base import KeepRatioStrategy
    from fedshard.server.rounds import RoundState
    from fedshard.server.strategy import SpectralSharding
from fedshard.server.callbacks import RoundCallback

__all__ = [
    "CompoundingMultipliers",
    "ConfigPrecedence",
    "SettingsSummary",
    "ShardingBudgetReport",
    "SingleNodeGroups",
    "SmallCohort",
    "TrainingReceipts",
    "UntrainedChannels",
]

logger = logging.getLogger(__name__)


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
            problem = dp_sgd_problem(sigma, clip)
            if problem is not None:
                self.totals["dp-sgd-not-private"] = (self.totals.get("dp-sgd-not-private", 0)
                                                     + count)
            if ("dp", sigma, clip) not in self.told:
                self.told.add(("dp", sigma, clip))
                if problem is not None:
                    logger.warning("Round %d: %d of %d nodes trained with DP-SGD (Opacus), but "
                                   "their receipts say its %s.", server_round, count, nodes,
                                   problem)
                    continue
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


