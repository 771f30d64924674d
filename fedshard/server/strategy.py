"""``SpectralSharding``, the Flower strategy: thin hooks over :mod:`fedshard.server.nodes`,
:mod:`fedshard.server.rounds` (plan, protocol, aggregate) and :mod:`fedshard.server.schedule`;
what a run does around its rounds is :mod:`fedshard.server.callbacks`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedshard import protocol as P
from fedshard.sampling import SHARDING_METHODS
from fedshard.server import callbacks as cb
from fedshard.server import rounds
from fedshard.server.callbacks import (
    NO_TRAINING_PATIENCE,
    NoRoundTrainedError,
    RoundCallback,
    TrainingDivergedError,
)
from fedshard.server.metrics import mean_client_metrics
from fedshard.server.nodes import NodeDirectory
from fedshard.server.privacy import driving_strategy, refuse_foreign_driver
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
    callbacks : sequence of RoundCallback, optional
        What the run does around its rounds, in order
        (:class:`~fedshard.server.callbacks.RoundCallback`: warnings, stops, evaluation,
        files, ...); default :func:`~fedshard.server.callbacks.default_callbacks`, the
        strategy's own checks. Add yours to those (``[*default_callbacks(), mine]``) or to
        :attr:`callbacks` before ``start``.

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

    **The run's checks are callbacks** (:mod:`fedshard.server.callbacks`), called from the
    training hooks, so they hold whoever drives the hooks: the end-of-run check
    (:class:`~fedshard.server.callbacks.StopWhenUntrained`: a run that trained nothing ends
    with :class:`NoRoundTrainedError`; under this strategy's own ``start()`` after the last
    round, carrying the result), the divergence stop (:class:`TrainingDivergedError`), and
    the warnings about the round config, keep-ratio groups of one node and compounding
    multipliers. ``start()`` only records the schedule's length and hands Flower's
    ``evaluate_fn`` the callbacks' :meth:`~fedshard.server.callbacks.RoundCallback.on_round`.

    The client contract (record keys, shapes, ω, what must come back) is the docstring of
    :mod:`fedshard.protocol`. Every reply is checked (:func:`fedshard.protocol.check_train_reply`);
    a bad one is dropped or clipped with a logged reason, counted in the round's metrics.
    Flower's differential-privacy wrappers and other meta-strategies cannot drive this
    strategy (:mod:`fedshard.server.privacy`): another strategy's ``start()`` (which calls this
    one's :meth:`summary`, as every Flower strategy's ``start`` does) and a client-side DP
    wrapper's round config are refused before round 1.

    Examples
    --------
    >>> from fedshard import LocalTraining, Sharding, SpectralSharding
    >>> strategy = SpectralSharding(sharded_layers=["layer1.0.conv1"], num_rounds=3,
    ...                             sharding=Sharding(method="unbiased"),
    ...                             training=LocalTraining(lr=0.05, local_epochs=2))
    """

    #: The methods this strategy runs.
    METHODS: tuple[str, ...] = SHARDING_METHODS
    _wrong_method = ("a width-slicing method: use fedshard.WidthSlicing (or a spectral "
                     f"method: {', '.join(SHARDING_METHODS)})")

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
        callbacks: Sequence[RoundCallback] | None = None,
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
        if callbacks is not None and not all(isinstance(c, RoundCallback) for c in callbacks):
            problems.append(Problem((("callbacks", list(callbacks)),),
                                    "expected RoundCallback objects (fedshard.server.callbacks)"))
        method = getattr(self.sharding, "method", None)
        if method is not None and method not in self.METHODS:
            problems.append(Problem((("method", method),), self._wrong_method))
        if problems:
            raise SettingsError(f"{type(self).__name__} arguments", problems)
        self.sharded_layers = tuple(sharded_layers) if self.sharding.method != "none" else ()
        # num_rounds: the schedule's length, the constructor's, or set by start() (see start).
        self.num_rounds, self._given_rounds = num_rounds, num_rounds
        self.seed, self.device = seed, device
        self.nodes = NodeDirectory(seed=seed, min_available_nodes=min_available_nodes,
                                   policy=node_policy, sharded=self.sharding.method != "none")
        self.callbacks: list[RoundCallback] = (list(callbacks) if callbacks is not None
                                               else cb.default_callbacks())
        self.rounds_trained = 0  # rounds whose aggregate replaced the global model
        # server_round -> the round's metrics (server statistics and client aggregates).
        self.history: dict[int, dict[str, float]] = {}
        # Rounds already completed before this start() (a resumed run): Flower's round r is
        # this run's round r + round_offset, for the schedule, the random streams and history.
        self.round_offset = 0
        self.current_arrays: ArrayRecord | None = None  # the global model of the last round
        # set by from_model: the model has no normalization layer (CompoundingMultipliers),
        # the model and an input of it (ShardingBudgetReport counts FLOPs with them)
        self.unnormalized = False
        self.budget_model: torch.nn.Module | None = None
        self.example_input: Any = None
        self.in_own_start = False  # inside this strategy's start() (see StopWhenUntrained)
        self._round: rounds.RoundState | None = None
        self._configured: int | None = None  # the last round configure_train was called for
        self._foreign_start = False  # summary() was called by another strategy's start()
        self._told_schedule = False  # the missing-schedule warning was logged

    @property
    def base_lr(self) -> float:
        """The schedule's base lr (``training.lr``, or the default 0.05)."""
        return self.training.base_lr

    @property
    def capabilities(self) -> dict[int, P.Capabilities]:
        """node id -> what it declared (:class:`~fedshard.server.nodes.NodeDirectory`'s cache)."""
        return self.nodes.capabilities

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, *, example_input: torch.Tensor | None = None,
        sharded_layers: Sequence[str] | None = None, **options: Any,
    ) -> SpectralSharding:
        """The strategy for ``model``, sharding the paper's default layers (every Linear and
        Conv2d but the first and the last; forward order from ``example_input`` if given), or
        ``sharded_layers`` when given (e.g. ``sharded_layer_names(model, policy="by-size",
        keep_ratio=0.25)``, or the layers by name).

        ``options`` are the constructor's arguments and, as shortcuts, any field of
        :class:`~fedshard.settings.Sharding`, :class:`~fedshard.settings.LocalTraining`,
        :class:`~fedshard.settings.ReplyPolicy` or :class:`~fedshard.settings.NodePolicy`
        (``method="top-n"``, ``lr=0.01``, ...), routed to its object (on top of one given as
        ``sharding=...`` etc.). An unknown name raises ``TypeError``.

        Remembers whether the model has a normalization layer (:attr:`unnormalized`): without
        one, the first round whose multipliers exceed 1 (Unbiased, PriSM + Wallenius,
        Collective with ≥ 2 nodes of a keep ratio < 1) logs a WARNING that ω can compound
        from layer to layer (:class:`~fedshard.server.callbacks.CompoundingMultipliers`). Keeps
        ``model`` and ``example_input`` so that the first round with each keep ratio logs what
        a node receives and computes against the dense model, and warns where sharding saves
        less than it should (:class:`~fedshard.server.callbacks.ShardingBudgetReport`).
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
        layers = sharded_layer_names(model, example_input=example_input,
                                     include=sharded_layers)  # names checked against model
        method = getattr(kwargs.get("sharding"), "method", Sharding.method)
        strategy = cls(sharded_layers=layers, **kwargs)
        strategy.unnormalized = multipliers_can_compound(model, method, layers)
        strategy.budget_model, strategy.example_input = model, example_input
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
        """Log the configuration (Flower's ``start()`` calls it before round 1). Called outside
        this strategy's own :meth:`start` (by a DP wrapper's or a meta-strategy's ``start``,
        or by you) while its class runs this :meth:`start`, it marks this strategy as driven by
        another one: its training hooks then refuse to run until its own ``start()``
        (:func:`fedshard.server.privacy.refuse_foreign_driver`). A subclass with a ``start()``
        of its own drives itself and may call it freely. To log the configuration and drive
        the hooks yourself, call ``summary()`` after them."""
        if not self.in_own_start and type(self).start is SpectralSharding.start:
            self._foreign_start = True  # a class with its own start() drives itself
        self.describe()
        t = self.training
        schedule = (f"{t.lr_schedule} over {self.num_rounds} rounds"
                    if self.num_rounds is not None or t.lr_schedule == "constant" else
                    "constant: the cosine schedule needs num_rounds")
        rules = (f"FD={t.frobenius_decay:g}, ClipLR τ={t.clip_lr_tau} (the nodes' receive() "
                 "applies both)" if self.sharded_layers else
                 "no factors: Frobenius decay and ClipLR do not apply")
        log(INFO, "\t│\t└── lr=%g (%s; a round's config may set its own), local epochs=%d%s, "
            "batch=%d, momentum=%g, weight decay=%g, %s", self.base_lr, schedule,
            t.local_epochs, f" (at most {t.max_steps} steps)" if t.max_steps else "",
            t.batch_size, t.momentum, t.weight_decay, rules)
        super().summary()

    def describe(self) -> None:
        """Log what is sharded and how (the first lines of :meth:`summary`)."""
        sh = self.sharding
        log(INFO, "\t├──> SpectralSharding: method=%s design=%s scaled=%s", sh.method,
            sh.design, sh.scaled)
        log(INFO, "\t│\t├── sharded layers (%d): %s", len(self.sharded_layers),
            ", ".join(self.sharded_layers))

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None = None,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
        """Flower's ``start``; ``num_rounds`` (after resumed rounds) sets the schedule too, and
        after every round the callbacks' :meth:`~RoundCallback.on_round` run (after your
        ``evaluate_fn``, whose metrics they see), then their ``on_end``.

        Raises
        ------
        StopRun
            What a callback raised to stop the run; by default :class:`NoRoundTrainedError`
            (also logged as an ERROR) after the last round if no round changed the model
            (its ``result`` is the run's) and :class:`TrainingDivergedError`.
        """
        self.num_rounds = schedule_length(self._given_rounds, num_rounds, self.round_offset)
        self.in_own_start, self._foreign_start = True, False
        result: Result | None = None
        try:
            result = super().start(grid, initial_arrays, self.num_rounds - self.round_offset,
                                   timeout, train_config, evaluate_config,
                                   self.after_round_fn(evaluate_fn))
        finally:
            self.in_own_start = False
            cb.run_end(self.callbacks, self, result)
        return result

    def after_round_fn(
        self, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Callable[[int, ArrayRecord], MetricRecord | None]:
        """What :meth:`start` gives Flower as ``evaluate_fn``: yours (if any), then the
        callbacks' :meth:`~RoundCallback.on_round` on the run's round (a resumed run's Flower
        round 0, the checkpoint's model, is not a round); returns to Flower your metrics and
        those the callbacks added."""

        def after_round(flower_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if flower_round == 0 and self.round_offset > 0:
                return None
            server_round = flower_round + self.round_offset
            record = evaluate_fn(flower_round, arrays) if evaluate_fn is not None else None
            yours = {k: float(v) for k, v in (record or {}).items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
            row = {**self.history.get(server_round, {}), **yours}
            added = cb.run_round(self.callbacks, self, server_round, arrays, row)
            out: dict[str, Any] = {**yours, **added}
            return MetricRecord(out) if out else None

        return after_round

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes, shard every sharded layer per keep-ratio group, one message per node."""
        refuse_foreign_driver(self._foreign_start, config, driving_strategy(self))
        server_round += self.round_offset
        self._round, self._configured, self.current_arrays = None, server_round, arrays
        if self.fraction_train == 0.0:
            return []
        # a first round whose nodes all fail alike is a run that cannot train: it stops with
        # StopWhenUntrained's error, and only where that check is one of the callbacks
        nodes = self.nodes.sample(grid, server_round, self.fraction_train, self.min_train_nodes,
                                  training=True, stop_if_all_fail=any(
                                      isinstance(c, cb.StopWhenUntrained)
                                      for c in self.callbacks))
        if not nodes:
            log(WARNING, "Round %d: no connected node declared a keep ratio; no training.",
                server_round)
            return []
        if self.num_rounds is None and self.training.lr_schedule == "cosine" \
                and P.LR not in config:
            self._warn_no_schedule()
        training, lr, _ = round_recipe(self.training, config, server_round, self.num_rounds)
        messages, self._round = self.plan_round(server_round, arrays, nodes, config,
                                                training, lr)
        cb.run_configure(self.callbacks, self, server_round, config, messages)
        return messages

    def plan_round(self, server_round: int, arrays: ArrayRecord,
                   nodes: dict[int, P.Capabilities], config: ConfigRecord,
                   training: LocalTraining, lr: float,
                   ) -> tuple[list[Message], rounds.RoundState]:
        """The round's messages, one per sampled node, and its state
        (:func:`~fedshard.server.rounds.shard_round`: the SVD and each node's terms)."""
        return rounds.shard_round(
            server_round, arrays, self.sharded_layers, nodes, config, sharding=self.sharding,
            training=training, lr=lr, replies=self.replies, seed=self.seed,
            device=self.device)

    def _warn_no_schedule(self) -> None:
        if not self._told_schedule:
            self._told_schedule = True
            log(WARNING, "The cosine lr schedule needs num_rounds, and none is known (this "
                "strategy's start() was not called, and SpectralSharding(num_rounds=...) was "
                "not given): every round's lr is the base lr=%g. Give num_rounds to the "
                "constructor for the cosine schedule.", self.base_lr)

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
            cb.run_aggregate(self.callbacks, self, server_round, {}, None)  # an untrained round
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
        cb.run_aggregate(self.callbacks, self, server_round, metrics, state)
        return new_arrays, client

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
        """``evaluate_metrics_aggr_fn`` over the valid evaluation replies, bounded as training
        replies are (``replies``' ``max_num_examples`` and ``max_weight_ratio``; invalid ones
        are logged, one line per reason, and dropped); the aggregate and ``eval-nodes`` go to
        :attr:`history`."""
        server_round += self.round_offset
        out, row = rounds.evaluate_round(server_round, replies, self.evaluate_metrics_aggr_fn,
                                         self.weighted_by_key, self.replies)
        self.history.setdefault(server_round, {}).update(row)
        return out
