"""``SpectralSharding``, the Flower strategy: thin hooks over :mod:`fedshard.server.nodes`,
:mod:`fedshard.server.rounds` (plan, protocol, aggregate) and :mod:`fedshard.server.schedule`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from logging import ERROR, INFO, WARNING
from typing import Any

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
from fedshard.server.schedule import DEFAULT_LR, base_lr, round_lr, schedule_length
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

__all__ = ["SHARDING_METHODS", "SpectralSharding"]


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
        :meth:`start` (once: both and different raise ``ValueError`` at ``start``).
    sharding : fedshard.settings.Sharding, optional
        What is sharded and how: method, sampling design, +Scaled, PriSM's exponent, the
        annealed methods' γ₀ and T, the FedAvg-cosine analysis (default: Collective, CPS).
    training : fedshard.settings.LocalTraining, optional
        The local-training recipe every node gets: lr and its schedule over the rounds,
        epochs, batch size, momentum, Frobenius decay, ClipLR's τ, weight decay. Its
        ``lr=None`` (the default): the ``train_config["lr"]`` given to :meth:`start`, else 0.05.
    replies : fedshard.settings.ReplyPolicy, optional
        Bounds on each reply and the per-term averaging rule (``"mean"``, ``"median"``,
        ``"trimmed-mean"``); see README's "Faults and attacks".
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
        # num_rounds: the schedule's length, set by start() from the one given (see start).
        self.num_rounds, self._given_rounds = num_rounds, num_rounds
        # The schedule's base lr; start() may take it from its train_config (see base_lr).
        self.base_lr = self.training.lr if self.training.lr is not None else DEFAULT_LR
        self.seed, self.device = seed, device
        self.nodes = NodeDirectory(seed=seed, min_available_nodes=min_available_nodes,
                                   policy=node_policy)
        self.rounds_trained = 0  # rounds whose aggregate replaced the global model
        # server_round -> the round's metrics (server statistics and client aggregates).
        self.history: dict[int, dict[str, float]] = {}
        # Rounds already completed before this start() (a resumed run): Flower's round r is
        # this run's round r + round_offset, for the schedule, the random streams and history.
        self.round_offset = 0
        self._round: rounds.RoundState | None = None
        self._starting = False  # inside this strategy's own start() (see configure_train)

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

        Warns when the multipliers can compound: with ω > 1 (Unbiased, Collective, PriSM +
        Wallenius) and no normalization layer, activations grow by up to ω per sharded layer.
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
        if multipliers_can_compound(model, method, layers):
            log(WARNING, "The model has no normalization layer: with method=%r the multipliers "
                "ω ≥ 1 scale every sharded layer's output and can compound from layer to layer "
                "(the paper's models all normalize).", method)
        return cls(sharded_layers=layers, **kwargs)

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
        log(INFO, "\t│\t└── lr=%g (%s over %s rounds), local epochs=%d, batch=%d, "
            "momentum=%g, FD=%g, ClipLR τ=%s", self.base_lr, t.lr_schedule, self.num_rounds,
            t.local_epochs, t.batch_size, t.momentum, t.frobenius_decay, t.clip_lr_tau)
        super().summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None = None,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
        """Flower's ``start``; ``num_rounds`` (after resumed rounds) sets the schedule too.
        Ends with an ERROR in the log if no round changed the model."""
        self.num_rounds = schedule_length(self._given_rounds, num_rounds, self.round_offset)
        caller_lr = train_config.get(P.LR) if train_config else None
        self.base_lr = base_lr(self.training.lr, caller_lr, self.training.lr_schedule)
        self._starting = True
        try:
            result = super().start(grid, initial_arrays, self.num_rounds - self.round_offset,
                                   timeout, train_config, evaluate_config, evaluate_fn)
        finally:
            self._starting = False
        if self.rounds_trained == 0:
            log(ERROR, rounds.NO_ROUND_TRAINED)
        return result

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
        self._round = None
        if self.fraction_train == 0.0:
            return []
        nodes = self.nodes.sample(grid, server_round, self.fraction_train, self.min_train_nodes)
        if not nodes:
            log(WARNING, "Round %d: no connected node declared a keep ratio; no training.",
                server_round)
            return []
        lr = round_lr(self.training.lr_schedule, self.base_lr, server_round,
                      self.num_rounds or server_round)
        messages, self._round = rounds.shard_round(
            server_round, arrays, self.sharded_layers, nodes, config, sharding=self.sharding,
            training=self.training, lr=lr, replies=self.replies, seed=self.seed,
            device=self.device)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate every reply, average each term over its holders, rebuild W."""
        server_round += self.round_offset
        state = self._round
        if state is None or state.server_round != server_round:
            return None, None
        new_arrays, client, metrics = state.finish(replies, self.train_metrics_aggr_fn,
                                                   self.weighted_by_key)
        if new_arrays is not None:
            self._round = None
            self.rounds_trained += 1
        metrics["rounds-trained"] = float(self.rounds_trained)
        self.history[server_round] = metrics
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
        """``evaluate_metrics_aggr_fn`` over the valid evaluation replies (invalid ones are
        logged in one line and dropped); the aggregate and ``eval-nodes`` go to :attr:`history`."""
        server_round += self.round_offset
        out, row = rounds.evaluate_round(server_round, replies, self.evaluate_metrics_aggr_fn,
                                  self.weighted_by_key)
        self.history.setdefault(server_round, {}).update(row)
        return out
