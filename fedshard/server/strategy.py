"""``SpectralSharding``, the Flower strategy of spectral model sharding: what a round sends and
how its replies are combined (:mod:`fedshard.server.rounds`), on the base every keep-ratio
strategy shares (:class:`~fedshard.server.base.KeepRatioStrategy`: nodes, reply checks, the
run's rounds, callbacks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedshard import protocol as P
from fedshard.sampling import SHARDING_METHODS
from fedshard.server import rounds
from fedshard.server.base import KeepRatioStrategy
from fedshard.server.callbacks import (
    NoRoundTrainedError,
    RoundCallback,
    TrainingDivergedError,
)
from fedshard.server.stops import NO_TRAINING_PATIENCE
from fedshard.server.trusted import TrustedReference
from fedshard.settings import (
    Cohort,
    LocalTraining,
    NodePolicy,
    Privacy,
    Problem,
    ReplyPolicy,
    Sharding,
)
from fedshard.spectral import multipliers_can_compound, sharded_layer_names

__all__ = ["NO_TRAINING_PATIENCE", "SHARDING_METHODS", "NoRoundTrainedError", "SpectralSharding",
           "TrainingDivergedError"]


class SpectralSharding(KeepRatioStrategy):
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
        The run's number of rounds: the length of the lr schedule (cosine by default) and the
        run's last round. Give Flower's ``start()`` the same number: a round beyond it raises
        ``ValueError`` before it starts. ``None``: unknown; then every round whose config sets
        no lr gets the base lr (one WARNING), and a run that trains nothing stops after
        :data:`NO_TRAINING_PATIENCE` untrained rounds.
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
    cohort : fedshard.settings.Cohort, optional
        Which nodes a round is sent to: ``FedAvg``'s ``fraction_train``,
        ``fraction_evaluate``, ``min_train_nodes``, ``min_evaluate_nodes`` and
        ``min_available_nodes``, with its defaults.
    privacy : fedshard.settings.Privacy, optional
        Central differential privacy (default: off): each node's update clipped to S, Gaussian
        noise on every per-term and per-entry sum, the spent (ε, δ) in every round's metrics
        (:mod:`fedshard.server.central_dp`; ``docs/privacy.md``).
    seed : int
        Root of every random stream (:mod:`fedshard.sampling.streams`).
    device : str or None
        Where the SVD and the rebuild of W run (e.g. ``"cuda"``); ``None``: the CPU.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable, optional
        As in ``FedAvg``; default: every numeric client metric's weighted mean. Only these go
        to Flower; the server's statistics are logged and kept with them in :attr:`history`.
    callbacks : sequence of RoundCallback, optional
        What the run does around its rounds, in order
        (:class:`~fedshard.server.callbacks.RoundCallback`: warnings, stops, evaluation,
        files, ...); default :func:`~fedshard.server.callbacks.default_callbacks`, the
        strategy's own checks. Add yours to those (``[*default_callbacks(), mine]``) or to
        :attr:`callbacks` before the first round.

    Raises
    ------
    fedshard.settings.SettingsError
        (a ``ValueError``) listing every problem of the arguments; a settings object checks
        its own fields when it is built.

    See Also
    --------
    from_model : the paper's default layers of a model, and flat settings
        (``method="top-n"``, ``lr=0.01``, ``fraction_train=0.5``, ...) routed to these
        objects.
    fedshard.server.base.KeepRatioStrategy : what every keep-ratio strategy does alike (the
        nodes, the reply checks, the run's rounds, when the callbacks run).

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
    round hooks, so they hold whoever drives the hooks: Flower's ``start()`` (this strategy
    overrides neither it nor ``summary()``), a subclass's own ``start()``, a loop of one's
    own. They log the settings at round 1, stop a run that trained nothing
    (:class:`~fedshard.server.stops.StopWhenUntrained`: :class:`NoRoundTrainedError`
    after the last round), stop a run whose training diverged (:class:`TrainingDivergedError`),
    and warn about the round config, keep-ratio groups of one node and compounding
    multipliers.

    The client contract (record keys, shapes, ω, what must come back) is the docstring of
    :mod:`fedshard.protocol`. Every reply is checked (:func:`fedshard.protocol.check_train_reply`);
    a bad one is dropped or clipped with a logged reason, counted in the round's metrics.
    Flower's differential-privacy wrappers and other meta-strategies cannot drive this
    strategy (:mod:`fedshard.server.privacy`): a round driven by another strategy, and a
    client-side DP wrapper's round config, are refused before round 1.

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
        cohort: Cohort | None = None,
        privacy: Privacy | None = None,
        seed: int = 0,
        device: str | None = None,
        train_metrics_aggr_fn: rounds.MetricsAggrFn | None = None,
        evaluate_metrics_aggr_fn: rounds.MetricsAggrFn | None = None,
        callbacks: Sequence[RoundCallback] | None = None,
        trusted: TrustedReference | None = None,
    ) -> None:
        problems = []
        if len(set(sharded_layers)) != len(sharded_layers):
            problems.append(Problem((("sharded_layers", list(sharded_layers)),),
                                    "expected distinct names"))
        super().__init__(
            sharding=sharding if sharding is not None else Sharding(), num_rounds=num_rounds,
            training=training, replies=replies, nodes=nodes, cohort=cohort, privacy=privacy,
            seed=seed,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn, callbacks=callbacks,
            trusted=trusted, problems=problems)
        self.sharded_layers = tuple(sharded_layers) if self.sharding.method != "none" else ()
        self.device = device
        # set by from_model: the model has no normalization layer (CompoundingMultipliers),
        # the model and an input of it (ShardingBudgetReport counts FLOPs with them)
        self.unnormalized = False
        self.budget_model: torch.nn.Module | None = None
        self.example_input: Any = None

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
        :class:`~fedshard.settings.ReplyPolicy`, :class:`~fedshard.settings.NodePolicy` or
        :class:`~fedshard.settings.Cohort` (``method="top-n"``, ``lr=0.01``,
        ``fraction_train=0.5``, ...), routed to its object (on top of one given as
        ``sharding=...`` etc.). An unknown name raises ``TypeError``.

        Remembers whether the model has a normalization layer (:attr:`unnormalized`): without
        one, the first round whose multipliers exceed 1 (Unbiased, PriSM + Wallenius,
        Collective with ≥ 2 nodes of a keep ratio < 1) logs a WARNING that ω can compound
        from layer to layer (:class:`~fedshard.server.advice.CompoundingMultipliers`). Keeps
        ``model`` and ``example_input`` so that the first round with each keep ratio logs what
        a node receives and computes against the dense model, and warns where sharding saves
        less than it should (:class:`~fedshard.server.advice.ShardingBudgetReport`).
        """
        kwargs = cls._arguments(options, taken=("sharded_layers",))
        layers = sharded_layer_names(model, example_input=example_input,
                                     include=sharded_layers)  # names checked against model
        method = getattr(kwargs.get("sharding"), "method", Sharding.method)
        strategy = cls(sharded_layers=layers, **kwargs)
        strategy.unnormalized = multipliers_can_compound(model, method, layers)
        strategy.budget_model, strategy.example_input = model, example_input
        return strategy

    def describe(self) -> list[str]:
        """What is sharded and how, then the local-training recipe (the base's lines)."""
        sh = self.sharding
        return [f"SpectralSharding: method={sh.method} design={sh.design} scaled={sh.scaled}",
                f"sharded layers ({len(self.sharded_layers)}): "
                f"{', '.join(self.sharded_layers)}", *super().describe()]

    def plan_round(self, server_round: int, arrays: ArrayRecord,
                   nodes: dict[int, P.Capabilities], config: ConfigRecord,
                   training: LocalTraining, lr: float,
                   ) -> tuple[list[Message], rounds.RoundState]:
        """The round's messages, one per sampled node, and its state
        (:func:`~fedshard.server.rounds.shard_round`: the SVD and each node's terms; its
        ``combine`` averages every term over its holders and rebuilds W)."""
        return rounds.shard_round(
            server_round, arrays, self.sharded_layers, nodes, config, sharding=self.sharding,
            training=training, lr=lr, replies=self.replies, seed=self.seed,
            device=self.device)
