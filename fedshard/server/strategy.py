"""``SpectralSharding``, the Flower strategy: thin hooks over :mod:`fedshard.server.nodes`,
:mod:`fedshard.server.rounds` (plan, protocol, aggregate) and :mod:`fedshard.server.schedule`."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from logging import ERROR, INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedshard import protocol as P
from fedshard.sampling import SHARDING_METHODS
from fedshard.server import rounds
from fedshard.server.metrics import mean_client_metrics
from fedshard.server.nodes import NodeDirectory
from fedshard.server.privacy import refuse_wrappers
from fedshard.server.schedule import round_recipe, schedule_length
from fedshard.settings import (
    CONCERNS,
    LocalTraining,
    NodePolicy,
    Problem,
    ReplyPolicy,
    SettingsError,
    Sharding,
    group_settings,
)
from fedshard.spectral import multipliers_can_compound, sharded_layer_names

__all__ = ["NO_TRAINING_PATIENCE", "SHARDING_METHODS", "NoRoundTrainedError", "SpectralSharding",
           "TrainingDivergedError"]

#: When the run's number of rounds is unknown (no ``num_rounds`` given to the constructor, and
#: ``start()`` overridden without calling this strategy's), the run is stopped with a
#: ``RuntimeError`` once this many configured rounds in a row, from the first, trained nothing.
NO_TRAINING_PATIENCE = 3

#: Collective's multipliers need C ≥ 2 nodes per keep-ratio group: with C = 1 Theorem 2 gives
#: ω = 1 and the n largest terms (Top-n). The annealed Collective is the same on λ^γ.
_GROUP_SIZE_METHODS = ("collective", "anneal-collective")


class NoRoundTrainedError(RuntimeError):
    """No round of the run changed the model; ``result`` is what ``start()`` would have
    returned (its ``arrays`` are the initial ones), for an app that writes its files first."""

    def __init__(self, message: str, result: Result) -> None:
        super().__init__(message)
        self.result = result


class TrainingDivergedError(RuntimeError):
    """More than :attr:`~fedshard.settings.ReplyPolicy.max_diverged_fraction` of a round's
    replies reported that training diverged: the run stops after that round (the global model
    is the previous round's), whoever wrote ``start()``."""


class SpectralSharding(FedAvg):
    """Spectral model sharding (Korzhenkov & Louizos, NeurIPS 2024) as a Flower strategy.

    Each round: (1) ask every sampled node not seen before for its keep ratio r (``query``);
    (2) take the SVD ``W = Σ λ_i u_i v_iᵀ`` of every sharded layer; (3) per keep-ratio group
    of C nodes and per layer, compute the ``method``'s π and ω and draw each node's
    n = ⌈rN⌉ terms; (4) send each node its own sub-model; (5) average every term over its
    holders, weighted by ``num-examples``, keep the others, rebuild ``W = Σ u'_i v'_iᵀ``;
    dense parameters are averaged as in FedAvg.

    Parameters
    ----------
    sharded_layers : sequence of str
        Module names of the sharded ``Linear``/``Conv2d`` layers (their ``"<name>.weight"``
        arrays); :meth:`from_model` picks the paper's default (all but the first and last).
    num_rounds : int, optional
        Number of server rounds (the length of the lr schedule); give it here or to
        :meth:`start` (once: both and different raise ``ValueError`` at ``start``). A subclass
        whose own ``start()`` does not call this one's must give it here: else the cosine
        schedule cannot be computed (the base lr is used every round, with one WARNING) and
        the end-of-run check stops a run only after :data:`NO_TRAINING_PATIENCE` rounds.
    sharding : fedshard.settings.Sharding, optional
        What is sharded and how: method, sampling design, +Scaled, PriSM's exponent, the
        annealed methods' γ₀ and T, the FedAvg-cosine analysis (default: Collective, CPS).
    training : fedshard.settings.LocalTraining, optional
        The local-training recipe every node gets: lr and its schedule over the rounds,
        epochs, batch size, momentum, Frobenius decay, ClipLR's τ, weight decay: the defaults
        of every round's ``config`` (see Notes for what wins). ``lr=None``: 0.05.
    replies : fedshard.settings.ReplyPolicy, optional
        Bounds on each reply and the per-term averaging rule (``"mean"``, ``"median"``,
        ``"trimmed-mean"``); see the robustness page (``docs/robustness.md``).
    nodes : fedshard.settings.NodePolicy, optional
        The keep-ratio cap and table, and how long to wait for capability answers and for
        nodes to connect.
    seed : int
        Root of every random stream (:mod:`fedshard.sampling.streams`).
    device : str or None
        Where the SVD and the rebuild of W run (e.g. ``"cuda"``); ``None``: the CPU.
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes :
        As in :class:`flwr.serverapp.strategy.FedAvg`, with its defaults.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable, optional
        As in ``FedAvg``; default: every numeric client metric's weighted mean. Only these go
        to Flower; the server's statistics are logged and kept with them in :attr:`history`.

    Raises
    ------
    fedshard.settings.SettingsError
        (a ``ValueError``) listing every problem of the arguments; a settings object checks
        its own fields when it is built.

    See Also
    --------
    from_model : the paper's default layers of a model, and flat settings
        (``method="top-n"``, ``lr=0.01``, ...) routed to these objects.

    Notes
    -----
    **Whose value a node gets.** Every round, key by key of the ``train`` config: (1) a value
    you set wins and is sent as is, whether in the ``train_config`` given to ``start()``, in
    the ``config`` your ``configure_train`` override passes to ``super()`` (e.g. the lr halved
    at round 5), or written into the returned messages' ``"config"``; (2) a recipe key you did
    not set (``lr``, ``local-epochs``, ``batch-size``, ``momentum``, ``frobenius-decay``,
    ``clip-lr-tau``, ``weight-decay``) takes ``training``'s value, the lr following its
    schedule (cosine over ``num_rounds``) from ``training.lr``. The per-node keys
    (``server-round``, ``keep-ratio``, ``train-seed``, ``method``) are always the strategy's.
    Your other keys travel unchanged.

    **Nothing depends on** :meth:`start`. The schedule's length, the round counter and the
    end-of-run check live in ``configure_train``/``aggregate_train``, which every Flower
    ``start()`` calls: when the last round (``num_rounds``) is aggregated and no round trained,
    or, with ``num_rounds`` unknown, after :data:`NO_TRAINING_PATIENCE` untrained rounds from
    the first, ``aggregate_train`` raises ``RuntimeError`` (this strategy's own ``start()``
    finishes the rounds and then raises :class:`NoRoundTrainedError`, which carries the
    result). Not with ``fraction_train=0`` (no training asked for).

    The client contract (record keys, shapes, ω, what must come back) is the docstring of
    :mod:`fedshard.protocol`. Every reply is checked (:func:`fedshard.protocol.check_train_reply`);
    a bad one is dropped or clipped with a logged reason, counted in the round's metrics.
    Flower's differential-privacy wrappers cannot drive this strategy
    (:mod:`fedshard.server.privacy`); they are refused before round 1.

    Examples
    --------
    >>> from fedshard import LocalTraining, Sharding, SpectralSharding
    >>> strategy = SpectralSharding(sharded_layers=["layer1.0.conv1"], num_rounds=3,
    ...                             sharding=Sharding(method="unbiased"),
    ...                             training=LocalTraining(lr=0.05, local_epochs=2))
    """

    def __init__(
        self,
        *,
        sharded_layers: Sequence[str],
        num_rounds: int | None = None,
        sharding: Sharding | None = None,
        training: LocalTraining | None = None,
        replies: ReplyPolicy | None = None,
        nodes: NodePolicy | None = None,
        seed: int = 0,
        device: str | None = None,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        train_metrics_aggr_fn: rounds.MetricsAggrFn | None = None,
        evaluate_metrics_aggr_fn: rounds.MetricsAggrFn | None = None,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes, weighted_by_key=P.NUM_EXAMPLES,
            arrayrecord_key=P.ARRAYS, configrecord_key=P.CONFIG,
            train_metrics_aggr_fn=train_metrics_aggr_fn or mean_client_metrics,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn or mean_client_metrics,
        )
        self.sharding = sharding if sharding is not None else Sharding()
        self.training = training if training is not None else LocalTraining()
        self.replies = replies if replies is not None else ReplyPolicy()
        node_policy = nodes if nodes is not None else NodePolicy()
        given = {"sharding": (self.sharding, Sharding), "training": (self.training, LocalTraining),
                 "replies": (self.replies, ReplyPolicy), "nodes": (node_policy, NodePolicy)}
        problems = [Problem(((name, value),), f"expected a {kind.__name__} (fedshard.settings)")
                    for name, (value, kind) in given.items() if not isinstance(value, kind)]
        if num_rounds is not None and not (isinstance(num_rounds, int) and num_rounds >= 1):
            problems.append(Problem((("num_rounds", num_rounds),), "expected ≥ 1, or None"))
        if len(set(sharded_layers)) != len(sharded_layers):
            problems.append(Problem((("sharded_layers", list(sharded_layers)),),
                                    "expected distinct names"))
        if problems:
            raise SettingsError("SpectralSharding arguments", problems)
        self.sharded_layers = tuple(sharded_layers) if self.sharding.method != "none" else ()
        # num_rounds: the schedule's length, the constructor's, or set by start() (see start).
        self.num_rounds, self._given_rounds = num_rounds, num_rounds
        # The schedule's base lr (a round's config may set its own lr: see Notes).
        self.base_lr = self.training.base_lr
        self.seed, self.device = seed, device
        self.nodes = NodeDirectory(seed=seed, min_available_nodes=min_available_nodes,
                                   policy=node_policy, sharded=self.sharding.method != "none")
        self.rounds_trained = 0  # rounds whose aggregate replaced the global model
        # server_round -> the round's metrics (server statistics and client aggregates).
        self.history: dict[int, dict[str, float]] = {}
        # Rounds already completed before this start() (a resumed run): Flower's round r is
        # this run's round r + round_offset, for the schedule, the random streams and history.
        self.round_offset = 0
        self._round: rounds.RoundState | None = None
        self._configured: int | None = None  # the last round configure_train was called for
        self._starting = False  # inside this strategy's own start() (see configure_train)
        self._untrained_streak = 0  # aggregated rounds in a row that trained nothing
        self._told: set[str] = set()  # one-time warnings already logged
        # set by from_model: the model has no normalization layer (see _warn_compounding)
        self._unnormalized = False

    @property
    def capabilities(self) -> dict[int, P.Capabilities]:
        """node id -> what it declared (:class:`~fedshard.server.nodes.NodeDirectory`'s cache)."""
        return self.nodes.capabilities

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, *, example_input: torch.Tensor | None = None,
        **options: Any,
    ) -> SpectralSharding:
        """The strategy for ``model``, sharding the paper's default layers (every Linear and
        Conv2d but the first and the last; forward order from ``example_input`` if given).

        ``options`` are the constructor's arguments and, as shortcuts, any field of
        :class:`~fedshard.settings.Sharding`, :class:`~fedshard.settings.LocalTraining`,
        :class:`~fedshard.settings.ReplyPolicy` or :class:`~fedshard.settings.NodePolicy`
        (``method="top-n"``, ``lr=0.01``, ...), routed to its object (on top of one given as
        ``sharding=...`` etc.). An unknown name raises ``TypeError``.

        Remembers whether the model has a normalization layer: without one, the first round
        whose multipliers exceed 1 (Unbiased, PriSM + Wallenius, Collective with ≥ 2 nodes of
        a keep ratio < 1) logs a WARNING that ω can compound from layer to layer.
        """
        known = set(inspect.signature(cls).parameters) - {"sharded_layers"}
        kwargs = group_settings(options)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            settings = sorted({f.name for kind in CONCERNS.values()
                               for f in fields(kind)})  # type: ignore[arg-type]
            raise TypeError(f"SpectralSharding.from_model: unknown argument(s) {unknown}; "
                            f"expected the strategy's {sorted(known)} or a setting of "
                            f"fedshard.settings: {settings}; no strategy was built")
        layers = sharded_layer_names(model, example_input=example_input)
        method = getattr(kwargs.get("sharding"), "method", Sharding.method)
        strategy = cls(sharded_layers=layers, **kwargs)
        # the keep ratios are known at the first round: the warning waits for them
        strategy._unnormalized = multipliers_can_compound(model, method, layers)
        return strategy

    def resume(self, completed_rounds: int, capabilities: dict[int, tuple[float, str]],
               history: dict[int, dict[str, float]]) -> None:
        """Continue a run after ``completed_rounds`` rounds (see :mod:`fedshard.app.checkpoint`).

        Call ``start(initial_arrays=<checkpoint arrays>, num_rounds=num_rounds -
        completed_rounds)`` afterwards; every random stream continues as if uninterrupted.
        """
        if not 0 <= completed_rounds < (self._given_rounds or completed_rounds + 1):
            raise ValueError(f"completed_rounds={completed_rounds}: expected in "
                             f"[0, num_rounds={self._given_rounds})")
        self.round_offset = completed_rounds
        self.nodes.capabilities = {n: P.Capabilities(r, k) for n, (r, k) in capabilities.items()}
        self.history = {int(r): dict(m) for r, m in history.items()}
        self.rounds_trained = int(max([0, *(m.get("rounds-trained", 0) for m in history.values())]))

    def capability_table(self) -> dict[int, tuple[float, str]]:
        return {n: (c.keep_ratio, c.key) for n, c in self.capabilities.items()}  # checkpoints

    def summary(self) -> None:
        """Log the configuration."""
        t, sh = self.training, self.sharding
        log(INFO, "\t├──> SpectralSharding: method=%s design=%s scaled=%s", sh.method,
            sh.design, sh.scaled)
        log(INFO, "\t│\t├── sharded layers (%d): %s", len(self.sharded_layers),
            ", ".join(self.sharded_layers))
        rounds = self._schedule_rounds(warn=False)
        schedule = (f"{t.lr_schedule} over {rounds} rounds" if rounds is not None
                    or t.lr_schedule == "constant" else
                    "constant: the cosine schedule needs num_rounds")
        log(INFO, "\t│\t└── lr=%g (%s; a round's config may set its own), local epochs=%d, "
            "batch=%d, momentum=%g, FD=%g, ClipLR τ=%s (the nodes' receive() applies both)",
            self.base_lr, schedule, t.local_epochs, t.batch_size, t.momentum,
            t.frobenius_decay, t.clip_lr_tau)
        super().summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None = None,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
        """Flower's ``start``; ``num_rounds`` (after resumed rounds) sets the schedule too.

        Raises
        ------
        NoRoundTrainedError
            (a ``RuntimeError``, also logged as an ERROR) after the last round if no round
            changed the model; its ``result`` is the run's.
        """
        self.num_rounds = schedule_length(self._given_rounds, num_rounds, self.round_offset)
        self._starting = True
        try:
            result = super().start(grid, initial_arrays, self.num_rounds - self.round_offset,
                                   timeout, train_config, evaluate_config, evaluate_fn)
        finally:
            self._starting = False
        if self.rounds_trained == 0 and self.fraction_train > 0:
            log(ERROR, rounds.NO_ROUND_TRAINED)
            raise NoRoundTrainedError(self._untrained_message(self.num_rounds), result)
        return result

    def _schedule_rounds(self, warn: bool = True) -> int | None:
        """The schedule's length: :meth:`start`'s, else the constructor's, else ``None`` (one
        WARNING when the cosine schedule then falls back to the base lr)."""
        if self.num_rounds is None and self._given_rounds is not None:
            self.num_rounds = self._given_rounds
        if self.num_rounds is None and warn and self.training.lr_schedule == "cosine":
            self._once("rounds", WARNING, "The cosine lr schedule needs num_rounds, and none "
                       "is known (this strategy's start() was not called, and "
                       "SpectralSharding(num_rounds=...) was not given): every round's lr is "
                       "the base lr=%g. Give num_rounds to the constructor for the cosine "
                       "schedule.", self.base_lr)
        return self.num_rounds

    def _once(self, key: str, level: int, msg: str, *args: Any) -> None:
        if key not in self._told:
            self._told.add(key)
            log(level, msg, *args)

    def _untrained_message(self, rounds_run: int) -> str:
        return (f"No round trained: none of the {rounds_run} round(s) so far got a usable "
                "training reply, the model is the initial one. Check the server log above: "
                "nodes that declare no keep ratio (ShardingClientApp(keep_ratios=...) or "
                "keep-ratio in the node/run config), error replies from the ClientApp, a "
                "timeout too short, replies refused by the reply bounds (dropped-<reason> in "
                "strategy.history).")

    def _check_progress(self, server_round: int, trained: bool) -> None:
        """The end-of-run check (see the class Notes), run by every ``aggregate_train``."""
        self._untrained_streak = 0 if trained else self._untrained_streak + 1
        if self.rounds_trained > 0 or self.fraction_train == 0.0 or self._starting:
            return  # this strategy's own start() checks after the last round's side jobs
        last = self._schedule_rounds(warn=False)
        if last is not None and server_round >= last:
            log(ERROR, rounds.NO_ROUND_TRAINED)
            raise RuntimeError(self._untrained_message(server_round - self.round_offset)
                               + " The run stops here.")
        if last is None and self._untrained_streak >= NO_TRAINING_PATIENCE:
            log(ERROR, rounds.NO_ROUND_TRAINED)
            raise RuntimeError(
                self._untrained_message(self._untrained_streak) + f" The number of rounds is "
                f"unknown, so the run stops after {NO_TRAINING_PATIENCE} untrained rounds.")

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes, shard every sharded layer per keep-ratio group, one message per node.

        Called from outside this strategy's own :meth:`start` (a test, a user's loop, a
        meta-strategy), it first refuses to be driven by a strategy that holds it, as
        Flower's DP wrappers do (:func:`fedshard.server.privacy.refuse_wrappers`)."""
        if not self._starting:  # driven from outside: a plain call, or another strategy
            refuse_wrappers(self)
        server_round += self.round_offset
        self._round, self._configured = None, server_round
        if self.fraction_train == 0.0:
            return []
        nodes = self.nodes.sample(grid, server_round, self.fraction_train, self.min_train_nodes)
        if not nodes:
            log(WARNING, "Round %d: no connected node declared a keep ratio; no training.",
                server_round)
            return []
        training, lr, mine = round_recipe(self.training, config, server_round,
                                          self._schedule_rounds(warn=P.LR not in config))
        self._tell_precedence(config, mine, lr)
        self._warn_single_node_groups(server_round, nodes)
        messages, self._round = rounds.shard_round(
            server_round, arrays, self.sharded_layers, nodes, config, sharding=self.sharding,
            training=training, lr=lr, replies=self.replies, seed=self.seed,
            device=self.device)
        self._warn_compounding(messages)
        return messages

    def _tell_precedence(self, config: ConfigRecord, mine: list[str], lr: float) -> None:
        """Say once which of the user's config entries are sent as they are, and which are
        replaced (the per-node keys)."""
        replaced = sorted(k for k in P.NODE_KEYS if k in config and k != "server-round")
        if replaced:
            self._once("node-keys", WARNING, "The config sets %s: these are per node and "
                       "always the strategy's; the values given are replaced.",
                       ", ".join(replaced))
        if P.LR in mine and self.training.lr is not None:
            self._once("lr", WARNING, "config['lr']=%g is sent to the nodes as is: the "
                       "round's config wins over the strategy's lr=%g and its %s schedule, "
                       "which apply only to rounds whose config sets no lr.", lr,
                       self.training.lr, self.training.lr_schedule)
        elif mine:
            self._once("mine", INFO, "The round's config sets %s: sent to the nodes as is "
                       "(the strategy's values apply where it sets none).", ", ".join(mine))

    def _warn_single_node_groups(self, server_round: int,
                                 nodes: dict[int, P.Capabilities]) -> None:
        """Collective's ω = C/(1+π(C−1)) needs C ≥ 2 nodes per keep-ratio group: a group of one
        node gets the n largest terms with ω = 1, i.e. Top-n (Unbiased's ω = 1/π does not
        depend on C: one node per group is still unbiased, with more variance)."""
        if self.sharding.method not in _GROUP_SIZE_METHODS or not self.sharded_layers:
            return
        sizes = Counter(c.keep_ratio for c in nodes.values())
        alone = sorted(r for r, c in sizes.items() if c == 1 and r < 1.0)
        if alone:
            log(WARNING, "Round %d: keep-ratio group(s) r=%s have a single sampled node: "
                "with C = 1, method=%s gives that node the n largest terms with ω = 1 (Top-n); "
                "the other terms are not trained by it. Let nodes share keep ratios, or sample "
                "more nodes (fraction_train / min_train_nodes) so that every group has ≥ 2.",
                server_round, ", ".join(f"{r:g}" for r in alone), self.sharding.method)

    def _warn_compounding(self, messages: list[Message]) -> None:
        """Once, at the first round whose multipliers exceed 1 in a model without a
        normalization layer (:meth:`from_model`)."""
        if not self._unnormalized or "compound" in self._told:
            return
        top = max((float(np.max(P.decode_array(a))) for m in messages
                   for k, a in m.content.array_records[P.ARRAYS].items()
                   if k.endswith(".omega")),
                  default=1.0)
        if top > 1.0 + 1e-6:  # ω = 1 (Top-n, PriSM, r = 1, C = 1) cannot compound
            self._once("compound", WARNING, "The model has no normalization layer: with "
                       "method=%r the multipliers ω (up to %.3g this round) scale every sharded "
                       "layer's output and can compound from layer to layer (the paper's models "
                       "all normalize).", self.sharding.method, top)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate every reply, average each term over its holders, rebuild W."""
        server_round += self.round_offset
        state = self._round
        if self._configured != server_round:
            log(WARNING, "aggregate_train: round %d was never configured (no configure_train "
                "for it; the last configured round is %s); no reply is aggregated and the "
                "global model is kept.", server_round, self._configured)
        if state is None or state.server_round != server_round:
            self._check_progress(server_round, trained=False)
            return None, None
        sent_lrs = {m.content[P.CONFIG].get(P.LR) for m in state.messages}  # as sent, after
        new_arrays, client, metrics = state.finish(replies, self.train_metrics_aggr_fn,
                                                   self.weighted_by_key)
        if len(sent_lrs) == 1 and isinstance(lr := next(iter(sent_lrs)), (int, float)):
            metrics["lr"] = float(lr)  # a configure_train override may have changed it
        if new_arrays is not None:
            self._round = None
            self.rounds_trained += 1
        metrics["rounds-trained"] = float(self.rounds_trained)
        self.history[server_round] = metrics
        self._check_divergence(server_round, metrics, state)
        self._check_progress(server_round, trained=new_arrays is not None)
        return new_arrays, client

    def _check_divergence(self, server_round: int, metrics: dict[str, float],
                          state: rounds.RoundState) -> None:
        """Stop the run when most nodes' training diverged (NaN or inf): the nodes were sent an
        lr their sub-models cannot take, and averaging the few that survived hides it."""
        diverged = metrics.get("dropped-diverged", 0.0)
        replied = metrics.get("replies-used", 0.0) + metrics.get("replies-dropped", 0.0)
        if not diverged or diverged <= self.replies.max_diverged_fraction * replied:
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
                   f"the {replied:.0f} nodes that replied (max_diverged_fraction="
                   f"{self.replies.max_diverged_fraction:g}); the run stops here and the global "
                   f"model stays the previous round's. To fix: {'; or '.join(advice)}.")
        log(ERROR, "%s", message)
        raise TrainingDivergedError(message)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Client-side evaluation of the dense global model (off when fraction_evaluate = 0)."""
        server_round += self.round_offset
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self.nodes.sample(grid, server_round, self.fraction_evaluate,
                                  self.min_evaluate_nodes)
        return rounds.evaluate_messages(server_round, list(nodes), arrays, config)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """``evaluate_metrics_aggr_fn`` over the valid evaluation replies (invalid ones are
        logged in one line and dropped); the aggregate and ``eval-nodes`` go to :attr:`history`."""
        server_round += self.round_offset
        out, row = rounds.evaluate_round(server_round, replies, self.evaluate_metrics_aggr_fn,
                                  self.weighted_by_key)
        self.history.setdefault(server_round, {}).update(row)
        return out
