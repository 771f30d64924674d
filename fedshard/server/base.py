"""``KeepRatioStrategy``, the base of fedshard's Flower strategies: nodes that declare a keep
ratio, their sampling, the checks and bounds on every reply, the run's rounds and their
callbacks.

What a round sends each node and how the valid replies become the new model is a subclass's
(:meth:`KeepRatioStrategy.plan_round`, and the ``combine`` of the
:class:`~fedshard.server.rounds.RoundState` it returns): spectral sharding
(:class:`~fedshard.server.strategy.SpectralSharding`) and width slicing
(:class:`~fedshard.server.width.WidthSlicing`) are siblings on this base. Neither overrides
Flower's ``start()`` or ``summary()``: what a run does around its rounds is its callbacks
(:mod:`fedshard.server.callbacks`), which the round hooks call, whoever drives them.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields, replace
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedshard import protocol as P
from fedshard.server import callbacks as cb
from fedshard.server import rounds
from fedshard.server.callbacks import RoundCallback
from fedshard.server.central_dp import CentralPrivacy
from fedshard.server.legacy import message_api_only
from fedshard.server.metrics import mean_client_metrics
from fedshard.server.nodes import NodeDirectory
from fedshard.server.privacy import driving_strategy, refuse_foreign_driver
from fedshard.server.schedule import RunRounds, round_recipe
from fedshard.server.trust_record import TrustStage
from fedshard.server.trusted import TrustedReference
from fedshard.settings import (
    CONCERNS,
    Cohort,
    LocalTraining,
    NodePolicy,
    Privacy,
    Problem,
    ReplyPolicy,
    SettingsError,
    Sharding,
    group_settings,
)

__all__ = ["KeepRatioStrategy"]


@message_api_only  # Flower's legacy server gets a clear error (both families inherit it)
class KeepRatioStrategy(FedAvg):
    """The base of strategies whose nodes each train a part of the model sized by the keep
    ratio r they declare.

    It owns what every such strategy does alike: ask each new node for its keep ratio (a
    ``query`` message, :class:`~fedshard.server.nodes.NodeDirectory`), sample the round's
    nodes (seeded, reproducible across launches), the round's local-training recipe and lr
    schedule, the checks and bounds on every reply (:class:`~fedshard.settings.ReplyPolicy`),
    client-side evaluation of the dense model, the run's metrics history, resuming a run, and
    the callbacks. A subclass gives :meth:`plan_round` (one message per node and the round's
    state, whose ``combine`` makes the new model of the valid replies) and :meth:`describe`.

    Parameters
    ----------
    sharding : fedshard.settings.Sharding
        Its ``method`` must be one of the subclass's :attr:`METHODS`.
    num_rounds : int, optional
        The run's number of rounds: the length of the lr schedule and the run's last round,
        after which the callbacks' ``on_end`` run. Give Flower's ``start()`` the same number
        (a round beyond it raises ``ValueError`` before it starts). ``None``: unknown (the
        cosine schedule gives the base lr every round, with one WARNING, and the end of the
        run is not marked).
    training, replies, nodes, cohort : fedshard.settings objects, optional
        The local-training recipe, the reply bounds and averaging rule, the operator's rules on
        keep ratios and waits, which nodes a round samples (default: each one's defaults).
    privacy : fedshard.settings.Privacy, optional
        Central differential privacy (default: off; :mod:`fedshard.server.central_dp`). On,
        each node's whole update is clipped to S and every per-term / per-entry sum noised,
        the aggregate is the plain clipped mean over holders (``num-examples`` not used, so
        ``replies.max_weight_ratio`` is switched off), ``replies.max_update_spread`` is
        switched off (its radius, the round's median change, lets one node change how far the
        others move), a ``replies.aggregation`` other than ``"mean"`` is refused, and every
        round's metrics carry the spent ``dp-epsilon``.
    seed : int
        Root of every random stream (:mod:`fedshard.sampling.streams`).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable, optional
        As in :class:`flwr.serverapp.strategy.FedAvg`; default: every numeric client metric's
        weighted mean.
    callbacks : sequence of RoundCallback, optional
        What the run does around its rounds, in order; default
        :func:`~fedshard.server.callbacks.default_callbacks`.
    trusted : fedshard.server.trusted.TrustedReference, optional
        The server's own training on a small clean set (opt-in, FLTrust): each reply is
        weighted by its cosine with the reference update on the same message and rescaled to
        the reference's norm (:mod:`fedshard.server.trusted`). Without it the replies are
        averaged as the reply bounds leave them; either way each node's agreement is recorded
        and a node whose record stays below ``replies.distrust_below`` (against the reference)
        or ``replies.distrust_below_aggregate`` (against the other nodes' aggregate) is named.
    problems : sequence of Problem
        What the subclass found wrong with its own arguments: reported with these arguments'
        problems in one :class:`~fedshard.settings.SettingsError`.

    Raises
    ------
    fedshard.settings.SettingsError
        (a ``ValueError``) listing every problem of the arguments.

    Notes
    -----
    **A run's rounds.** Flower's ``start()`` numbers the rounds of each launch from 1; the
    hooks turn that into the run's round once, on entry (:class:`RunRounds`: after
    :meth:`resume`, round ``completed + k``), and work with the run's round from there: the
    lr schedule, the random streams, :attr:`history`, the callbacks.

    **When the callbacks run.** ``on_configure`` when a round's messages are built
    (``configure_train``), ``on_aggregate`` when its replies are aggregated
    (``aggregate_train``), ``on_round`` when the round is over: at the end of
    ``aggregate_evaluate`` when the nodes evaluate (``cohort.fraction_evaluate > 0``), else at
    the end of ``aggregate_train`` (round 0, the initial model, when round 1 is configured),
    and ``on_end`` after the ``on_round`` of the last round (``num_rounds``). Flower's
    ``start()`` calls the four hooks every round, so does any loop written as it; a loop that
    skips the evaluation hooks of a strategy whose nodes evaluate ends no round.

    **Who may drive the hooks.** Flower's ``start()``, a subclass's own ``start()``, or a
    loop of one's own; another strategy may not (:mod:`fedshard.server.privacy`: Flower's
    differential-privacy wrappers and meta-strategies assume dense replies of the global
    model's shapes): ``configure_train`` refuses before round 1 when another Flower strategy
    is on the call stack, or the round config carries a client-side DP wrapper's keys.
    """

    #: The ``Sharding.method`` values the strategy runs (a subclass's).
    METHODS: tuple[str, ...] = ()
    #: What a method of another family is told (a subclass's).
    _wrong_method = "a method this strategy runs"
    #: Module names of the layers sent as factors (none unless a subclass factorizes some).
    sharded_layers: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        sharding: Sharding,
        num_rounds: int | None = None,
        training: LocalTraining | None = None,
        replies: ReplyPolicy | None = None,
        nodes: NodePolicy | None = None,
        cohort: Cohort | None = None,
        privacy: Privacy | None = None,
        seed: int = 0,
        train_metrics_aggr_fn: rounds.MetricsAggrFn | None = None,
        evaluate_metrics_aggr_fn: rounds.MetricsAggrFn | None = None,
        callbacks: Sequence[RoundCallback] | None = None,
        trusted: TrustedReference | None = None,
        problems: Sequence[Problem] = (),
    ) -> None:
        given: dict[str, tuple[Any, type]] = {
            "sharding": (sharding, Sharding),
            "training": (training if training is not None else LocalTraining(), LocalTraining),
            "replies": (replies if replies is not None else ReplyPolicy(), ReplyPolicy),
            "nodes": (nodes if nodes is not None else NodePolicy(), NodePolicy),
            "cohort": (cohort if cohort is not None else Cohort(), Cohort),
            "privacy": (privacy if privacy is not None else Privacy(), Privacy)}
        found = [Problem(((name, value),), f"expected a {kind.__name__} (fedshard.settings)")
                 for name, (value, kind) in given.items() if not isinstance(value, kind)]
        if num_rounds is not None and not (isinstance(num_rounds, int)
                                           and not isinstance(num_rounds, bool)
                                           and num_rounds >= 1):
            found.append(Problem((("num_rounds", num_rounds),), "expected ≥ 1, or None"))
        if callbacks is not None and not all(isinstance(c, RoundCallback) for c in callbacks):
            found.append(Problem((("callbacks", list(callbacks)),),
                                 "expected RoundCallback objects (fedshard.server.callbacks)"))
        if trusted is not None and not isinstance(trusted, TrustedReference):
            found.append(Problem((("trusted", trusted),), "expected a TrustedReference "
                                 "(fedshard.server.trusted), or None"))
        method = getattr(sharding, "method", None)
        if method is not None and method not in self.METHODS:
            found.append(Problem((("method", method),), self._wrong_method))
        found.extend(privacy_problems(given["privacy"][0], given["replies"][0], num_rounds,
                                      trusted))
        found.extend(problems)
        if found:
            raise SettingsError(f"{type(self).__name__} arguments", found)
        self.sharding: Sharding = sharding
        self.training: LocalTraining = given["training"][0]
        self.replies: ReplyPolicy = given["replies"][0]
        self.cohort: Cohort = given["cohort"][0]
        self.privacy: Privacy = given["privacy"][0]
        # central DP (opt-in): the mechanism; the spread bound off, and the weight cap (the
        # weights are not used): fedshard.server.central_dp
        self.central_dp: CentralPrivacy | None = None
        if given["privacy"][0].enabled:
            self.central_dp = CentralPrivacy(given["privacy"][0], num_rounds, seed)
            self.replies = replace(self.replies, max_update_spread=0.0, max_weight_ratio=0.0)
        c = self.cohort
        super().__init__(
            fraction_train=c.fraction_train, fraction_evaluate=c.fraction_evaluate,
            min_train_nodes=c.min_train_nodes, min_evaluate_nodes=c.min_evaluate_nodes,
            min_available_nodes=c.min_available_nodes, weighted_by_key=P.NUM_EXAMPLES,
            arrayrecord_key=P.ARRAYS, configrecord_key=P.CONFIG,
            train_metrics_aggr_fn=train_metrics_aggr_fn or mean_client_metrics,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn or mean_client_metrics,
        )
        self.seed = seed
        self.run_rounds = RunRounds(num_rounds)
        self.nodes = NodeDirectory(seed=seed, min_available_nodes=c.min_available_nodes,
                                   policy=given["nodes"][0],
                                   sharded=self.sharding.method != "none")
        self.callbacks: list[RoundCallback] = (list(callbacks) if callbacks is not None
                                               else cb.default_callbacks())
        self.rounds_trained = 0  # rounds whose aggregate replaced the global model
        # the run's round -> its metrics (server statistics, client aggregates, callbacks')
        self.history: dict[int, dict[str, float]] = {}
        # the global model: the one the last configured round started from, then its
        # aggregate once the round's replies are in
        self.current_arrays: ArrayRecord | None = None
        self._round: rounds.RoundState | None = None  # what the open round sent
        self._configured: int | None = None  # the last round configure_train was called for
        # each node's agreement record, and the trusted reference's weights where given
        self.trust = TrustStage(trusted, self.replies)

    # ------------------------------------------------------------------ settings and state
    @property
    def num_rounds(self) -> int | None:
        """The run's number of rounds (``None``: unknown); set it before the first round."""
        return self.run_rounds.total

    @num_rounds.setter
    def num_rounds(self, value: int | None) -> None:
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool)
                                      and value > self.run_rounds.completed):
            raise ValueError(f"num_rounds={value!r}: expected an integer above the "
                             f"{self.run_rounds.completed} completed round(s), or None; "
                             "num_rounds is unchanged")
        self.run_rounds.total = value
        if self.central_dp is not None:
            self.central_dp.num_rounds = value

    @property
    def base_lr(self) -> float:
        """The schedule's base lr (``training.lr``, or the default 0.05)."""
        return self.training.base_lr

    @property
    def capabilities(self) -> dict[int, P.Capabilities]:
        """node id -> what it declared (:class:`~fedshard.server.nodes.NodeDirectory`'s cache)."""
        return self.nodes.capabilities

    @classmethod
    def _arguments(cls, options: Mapping[str, Any], *, taken: Iterable[str] = ()
                   ) -> dict[str, Any]:
        """``options`` as constructor arguments: flat setting names routed to their objects
        (:func:`~fedshard.settings.group_settings`); ``taken`` are the names ``from_model``
        gives itself.

        Raises
        ------
        TypeError
            Naming every option that is neither an argument of the constructor nor a setting.
        """
        known = set(inspect.signature(cls).parameters) - set(taken)
        kwargs = group_settings(options)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            settings = sorted({f.name for kind in CONCERNS.values()
                               for f in fields(kind)})  # type: ignore[arg-type]
            raise TypeError(f"{cls.__name__}.from_model: unknown argument(s) {unknown}; "
                            f"expected the strategy's {sorted(known)} or a setting of "
                            f"fedshard.settings: {settings}; no strategy was built")
        return kwargs

    def resume(self, completed_rounds: int, capabilities: Mapping[int, tuple[float, str]],
               history: Mapping[int, Mapping[str, float]],
               trust: Mapping[int, Sequence[float]] | None = None,
               excluded: Mapping[int, int] | None = None) -> None:
        """Continue a run after ``completed_rounds`` rounds (see :mod:`fedshard.app.checkpoint`):
        the nodes' capabilities and the metrics history as the checkpoint holds them.

        Then call ``start(initial_arrays=<checkpoint arrays>, num_rounds=num_rounds -
        completed_rounds)``: Flower's round k is the run's round ``completed_rounds + k``, and
        every random stream continues as if uninterrupted.

        ``trust`` is the nodes' agreement record (:meth:`trust_state`; ``None``: none kept),
        ``excluded`` the nodes ``exclude-distrusted`` left out (node -> the round it was
        named in; ``self.trust.excluded``): they stay out from the first resumed round.

        Raises
        ------
        ValueError
            If ``completed_rounds`` is not in ``[0, num_rounds)``, or ``trust`` or
            ``excluded`` is malformed; nothing is changed.
        """
        total = self.run_rounds.total
        if not (isinstance(completed_rounds, int)
                and 0 <= completed_rounds < (total or completed_rounds + 1)):
            raise ValueError(f"completed_rounds={completed_rounds}: expected in [0, "
                             f"num_rounds={total}); the strategy is not resumed")
        self.trust.restore(trust, excluded)
        self.run_rounds.completed = completed_rounds
        self.nodes.capabilities = {n: P.Capabilities(r, k) for n, (r, k) in capabilities.items()}
        self.history = {int(r): dict(m) for r, m in history.items()}
        self.rounds_trained = int(max([0, *(m.get("rounds-trained", 0)
                                            for m in self.history.values())]))
        if self.central_dp is not None:
            self.central_dp.resume(self.history)

    def trust_state(self) -> dict[int, list[float]]:
        """node id -> its last rounds' cosines: the agreement record as a checkpoint stores it."""
        return self.trust.record.state()

    def capability_table(self) -> dict[int, tuple[float, str]]:
        """node id -> (keep ratio, key): the capability cache as a checkpoint stores it."""
        return {n: (c.keep_ratio, c.key) for n, c in self.capabilities.items()}

    def describe(self) -> list[str]:
        """What the strategy does, as log lines (logged once by
        :class:`~fedshard.server.advice.SettingsSummary`): a subclass puts what it sends
        before these lines, the local-training recipe and its schedule."""
        t = self.training
        schedule = (f"{t.lr_schedule} over {self.num_rounds} rounds"
                    if self.num_rounds is not None or t.lr_schedule == "constant" else
                    "constant: the cosine schedule needs num_rounds")
        rules = (f"FD={t.frobenius_decay:g}, ClipLR τ={t.clip_lr_tau} (the nodes' receive() "
                 "applies both)" if self.sharded_layers else
                 "no factors: Frobenius decay and ClipLR do not apply")
        steps = f" (at most {t.max_steps} steps)" if t.max_steps else ""
        dp = [self.central_dp.describe()] if self.central_dp is not None else []
        return [*dp, f"local training: lr={self.base_lr:g} ({schedule}; a round's config may set "
                f"its own), local epochs={t.local_epochs}{steps}, batch={t.batch_size}, "
                f"momentum={t.momentum:g}, weight decay={t.weight_decay:g}, {rules}"]

    # ------------------------------------------------------------------ what a subclass gives
    def plan_round(self, server_round: int, arrays: ArrayRecord,
                   nodes: dict[int, P.Capabilities], config: ConfigRecord,
                   training: LocalTraining, lr: float,
                   ) -> tuple[list[Message], rounds.RoundState]:
        """The round's messages, one per sampled node (``nodes``, in canonical order), each
        with its own records and its :class:`~fedshard.protocol.TrainSettings` (``training``
        at the round's ``lr``) over the caller's ``config``; and the round's state, whose
        ``combine`` turns the valid replies into the new global ``state_dict``."""
        raise NotImplementedError(f"{type(self).__name__} does not plan rounds: a "
                                  "KeepRatioStrategy subclass gives plan_round")

    # ------------------------------------------------------------------ Flower's round hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes, one message per node (:meth:`plan_round`)."""
        refuse_foreign_driver(config, driving_strategy(self), type(self).__name__)
        server_round = self.run_rounds.of(server_round)
        if server_round == 1:  # the initial model is round 0's
            self.end_round(0, arrays)
        self._round, self._configured, self.current_arrays = None, server_round, arrays
        if self.fraction_train == 0.0:
            return []
        # a first round whose nodes all fail alike is a run that cannot train: it stops, where
        # a callback stops untrained runs (StopWhenUntrained)
        stop = any(getattr(c, "stops_untrained_runs", False) for c in self.callbacks)
        nodes = self.nodes.sample(grid, server_round, self.fraction_train, self.min_train_nodes,
                                  training=True, stop_if_all_fail=stop,
                                  leave_out=self.trust.left_out())
        if not nodes:
            log(WARNING, "Round %d: no connected node declared a keep ratio; no training.",
                server_round)
            return []
        training, lr, _ = round_recipe(self.training, config, server_round, self.num_rounds)
        messages, self._round = self.plan_round(server_round, arrays, nodes, config,
                                                training, lr)
        self._round.trust = self.trust
        if self.central_dp is not None:
            self._round.privacy = self.central_dp.start_round(server_round, len(nodes),
                                                           self.nodes.pool_size)
        cb.run_configure(self.callbacks, self, server_round, config, messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply against what its node was sent, combine the valid ones."""
        server_round = self.run_rounds.of(server_round)
        state = self._round
        if self._configured != server_round:
            log(WARNING, "aggregate_train: round %d was never configured (no configure_train "
                "for it; the last configured round is %s); no reply is aggregated and the "
                "global model is kept.", server_round, self._configured)
        if state is None or state.server_round != server_round:
            cb.run_aggregate(self.callbacks, self, server_round, {}, None)  # an untrained round
            self._train_phase_over(server_round)
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
        if self.central_dp is not None:  # the spent (ε, δ), logged
            metrics.update(self.central_dp.account(state.privacy))
        self.history[server_round] = metrics
        cb.run_aggregate(self.callbacks, self, server_round, metrics, state)
        if new_arrays is not None:  # (after the callbacks: a stop keeps the previous model)
            self.current_arrays = new_arrays
        self._train_phase_over(server_round)
        return new_arrays, client

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Client-side evaluation of the dense global model (off when fraction_evaluate = 0)."""
        server_round = self.run_rounds.of(server_round)
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
        :attr:`history`. With client-side evaluation, the round is then over
        (:meth:`end_round`)."""
        server_round = self.run_rounds.of(server_round)
        out, row = rounds.evaluate_round(server_round, replies, self.evaluate_metrics_aggr_fn,
                                         self.weighted_by_key, self.replies)
        if row:
            self.history.setdefault(server_round, {}).update(row)
        if self.fraction_evaluate > 0.0 and self.current_arrays is not None:
            self.end_round(server_round, self.current_arrays)
        return out

    # ------------------------------------------------------------------ the end of a round
    def _train_phase_over(self, server_round: int) -> None:
        """Without client-side evaluation a round is over once its replies are aggregated."""
        if self.fraction_evaluate == 0.0 and self.current_arrays is not None:
            self.end_round(server_round, self.current_arrays)

    def end_round(self, server_round: int, arrays: ArrayRecord) -> None:
        """The run's round ``server_round`` is over and ``arrays`` is the global model: the
        callbacks' :meth:`~fedshard.server.callbacks.RoundCallback.on_round` in order, each
        seeing the round's row of :attr:`history` with what the ones before it added (added
        to :attr:`history` too); after the last round (``num_rounds``), their
        :meth:`~fedshard.server.callbacks.RoundCallback.on_end`. The round hooks call it (see
        the class's Notes); a loop of one's own that calls them need not."""
        row = self.history.setdefault(server_round, {})
        try:
            cb.run_round(self.callbacks, self, server_round, arrays, row)
        finally:
            if not row:  # nothing to keep of this round
                del self.history[server_round]
        if self.run_rounds.is_last(server_round):
            cb.run_end(self.callbacks, self, arrays)


def privacy_problems(privacy: Privacy, replies: ReplyPolicy, num_rounds: int | None,
                     trusted: object = None) -> list[Problem]:
    """What central DP (``privacy``) cannot run with: an aggregation rule other than the
    clipped mean (a median or trimmed mean of clipped replies has another sensitivity than
    S / m), a target ε without the run's number of rounds (σ is calibrated to it), or a
    defence that drops or re-weights nodes by their updates (trusted data, excluding distrusted
    nodes): which nodes a term's mean divides by would then depend on the data, and the
    accountant assumes holder counts the server drew."""
    if not isinstance(privacy, Privacy) or not privacy.enabled:
        return []
    found = []
    if isinstance(replies, ReplyPolicy) and replies.aggregation != "mean":
        found.append(Problem((("aggregation", replies.aggregation),),
                             "central DP bounds each node's pull on the clipped mean of a "
                             "term's holders (S / m); expected 'mean' (the robust rules' "
                             "sensitivity is another)"))
    if privacy.target_epsilon is not None and num_rounds is None:
        found.append(Problem((("target_epsilon", privacy.target_epsilon),
                              ("num_rounds", None)),
                             "σ is calibrated to the target over the run's rounds: expected "
                             "num_rounds, or a noise_multiplier"))
    if trusted is not None:
        found.append(Problem((("trusted", trusted),),
                             "central DP divides each term's noised sum by the holder count "
                             "the server drew; trusted data drops and re-weights nodes by "
                             "their updates. Expected one of the two: privacy, or trusted"))
    if isinstance(replies, ReplyPolicy) and replies.exclude_distrusted:
        found.append(Problem((("exclude_distrusted", True),),
                             "excluding nodes by their past updates makes who is sampled "
                             "depend on the data, which the accountant does not count. "
                             "Expected exclude_distrusted=False with central DP (the record "
                             "still names such nodes)"))
    return found
