"""``SpectralSharding``, the Flower strategy: thin hooks over :mod:`fedshard.server.nodes`,
:mod:`fedshard.server.rounds` (plan, protocol, aggregate) and :mod:`fedshard.server.schedule`."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from logging import ERROR, INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedshard import protocol as P
from fedshard.sampling import (
    ANNEALED_METHODS,
    SHARDING_METHODS,
    Stream,
    anneal_exponent,
    method_problems,
    stream_rng,
)
from fedshard.server import rounds
from fedshard.server.metrics import mean_client_metrics
from fedshard.server.nodes import KeepRatioRules, NodeDirectory
from fedshard.server.privacy import refuse_wrappers
from fedshard.server.schedule import DEFAULT_LR, LR_SCHEDULES, base_lr, round_lr, schedule_length
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
    method : str
        ``"unbiased"`` (Theorem 1, ω = 1/π), ``"collective"`` (Theorem 2, C = group size),
        ``"top-n"`` (FedHM), ``"prism"`` (successive sampling ∝ λᵏ, ω = 1),
        ``"prism-wallenius"`` (ω = 1/π, π the Wallenius mean), ``"anneal-unbiased"`` /
        ``"anneal-collective"`` (Theorem 1 / 2 on ``λ^γ_t``, γ annealed from ``anneal_exponent``
        to 1 over ``anneal_rounds`` rounds: :mod:`fedshard.sampling.anneal`) or ``"none"``
        (FedAvg).
    design : str
        ``"cps"`` (conditional Poisson), ``"brewer"`` or ``"min-support"``, for unbiased and
        collective (PriSM samples successively, Top-n is deterministic).
    scaled : bool
        +Scaled (ω_i = sqrt(Σλ²/Σ_sampled λ²)); only with ``top-n`` or ``prism``.
    prism_exponent : float or None
        PriSM's k; ``None`` = 4 if n/N ≤ 0.2 else 2.5.
    anneal_exponent, anneal_rounds : float, int
        γ₀ ≥ 1 and T ≥ 1 of the annealed methods (ignored by the others).
    lr, local_epochs, batch_size, momentum, frobenius_decay, clip_lr_tau, weight_decay :
        Local training (:class:`fedshard.protocol.TrainSettings`; ``clip_lr_tau=None``: off);
        ``lr=None``: the ``train_config["lr"]`` given to :meth:`start`, else 0.05.
    seed : int
        Root of every random stream (:mod:`fedshard.sampling.streams`).
    query_timeout, node_wait_timeout : float
        Seconds to wait for capability answers, for nodes to connect (``None``: forever).
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes :
        As in :class:`flwr.serverapp.strategy.FedAvg`, with its defaults.
    max_update_ratio, update_policy, max_num_examples, aggregation, trim_fraction : optional
        Reply bounds (:class:`fedshard.protocol.ReplyLimits`) and the per-term rule (``"mean"``,
        ``"median"``, ``"trimmed-mean"``); see README's "Faults and attacks".
    max_keep_ratio, keep_ratio_table : optional
        Node rules (:class:`fedshard.server.nodes.KeepRatioRules`).
    device : str or None
        Where the SVD and the rebuild of W run (e.g. ``"cuda"``); ``None``: the CPU.
    fedavg_cosine : bool
        The paper's post-gradient analysis (:mod:`fedshard.server.fedavg_cosine`): nodes also
        train a dense copy and each round's metrics get ``fedavg-cosine``. Doubles the nodes' work.
    lr_schedule : str
        ``"cosine"`` (the paper's, over ``num_rounds``) or ``"constant"``.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable, optional
        As in ``FedAvg``; default: every numeric client metric's weighted mean. Only these go
        to Flower; the server's statistics are logged and kept with them in :attr:`history`.

    Notes
    -----
    The client contract (record keys, shapes, ω, what must come back) is the docstring of
    :mod:`fedshard.protocol`. Every reply is checked (:func:`fedshard.protocol.check_train_reply`);
    a bad one is dropped or clipped with a logged reason, counted in the round's metrics.
    """

    def __init__(
        self,
        *,
        sharded_layers: Sequence[str],
        num_rounds: int | None = None,
        method: str = "collective",
        design: str = "cps",
        scaled: bool = False,
        prism_exponent: float | None = None,
        anneal_exponent: float = 8.0,
        anneal_rounds: int = 30,
        lr: float | None = None,
        local_epochs: int = 1,
        batch_size: int = 32,
        momentum: float = 0.9,
        frobenius_decay: float = 1e-4,
        clip_lr_tau: float | None = 10.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        query_timeout: float = 600.0,
        node_wait_timeout: float | None = 600.0,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        max_update_ratio: float = 10.0,
        update_policy: str = "clip",
        max_num_examples: int | None = None,
        aggregation: str = "mean",
        trim_fraction: float = 0.1,
        max_keep_ratio: float = 1.0,
        keep_ratio_table: Mapping[str, float] | None = None,
        device: str | None = None,
        lr_schedule: str = "cosine",
        fedavg_cosine: bool = False,
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
        problems = method_problems(method, design, scaled, prism_exponent) + [msg for bad, msg in (
            (clip_lr_tau is not None and not clip_lr_tau >= 1,
             f"clip_lr_tau={clip_lr_tau}: expected τ ≥ 1 or None (off)"),
            (num_rounds is not None and num_rounds < 1, f"num_rounds={num_rounds}: expected ≥ 1"),
            (lr_schedule not in LR_SCHEDULES, f"lr_schedule={lr_schedule!r}: expected one of "
             f"{LR_SCHEDULES}"), (lr is not None and not lr > 0, f"lr={lr}: expected > 0"),
            (not anneal_exponent >= 1, f"anneal_exponent={anneal_exponent}: expected γ₀ ≥ 1"),
            (anneal_rounds < 1, f"anneal_rounds={anneal_rounds}: expected T ≥ 1"),
            (len(set(sharded_layers)) != len(sharded_layers),
             f"sharded_layers={list(sharded_layers)}: names repeat")) if bad]
        if problems:
            raise ValueError("SpectralSharding: " + "; ".join(problems))
        self.sharded_layers = tuple(sharded_layers) if method != "none" else ()
        # num_rounds: the schedule's length, set by start() from the one given (see start).
        self.num_rounds, self.lr_schedule, self._given_rounds = num_rounds, lr_schedule, num_rounds
        self.method, self.design, self.scaled, self._given_lr = method, design, scaled, lr
        self.prism_exponent, self.seed, self.device = prism_exponent, seed, device
        self.anneal = (float(anneal_exponent), int(anneal_rounds))
        self.fedavg_cosine = bool(fedavg_cosine)
        # The settings every node gets; round, lr, keep ratio and seed are set per node.
        self.training = P.TrainSettings(
            server_round=0, lr=lr or DEFAULT_LR, local_epochs=local_epochs, batch_size=batch_size,
            momentum=momentum, frobenius_decay=frobenius_decay, clip_lr_tau=clip_lr_tau,
            weight_decay=weight_decay, keep_ratio=1.0, train_seed=0, method=method)
        self.nodes = NodeDirectory(seed=seed, min_available_nodes=min_available_nodes,
                                   query_timeout=query_timeout, node_wait_timeout=node_wait_timeout,
                                   rules=KeepRatioRules(max_keep_ratio, keep_ratio_table))
        limits = P.ReplyLimits(max_update_ratio, update_policy, max_num_examples)
        self.how = rounds.Aggregation(limits, aggregation, trim_fraction)
        self.rounds_trained = 0  # rounds whose aggregate replaced the global model
        # server_round -> the round's metrics (server statistics and client aggregates).
        self.history: dict[int, dict[str, float]] = {}
        # Rounds already completed before this start() (a resumed run): Flower's round r is
        # this run's round r + round_offset, for the schedule, the random streams and history.
        self.round_offset = 0
        self._round: rounds.RoundState | None = None

    @property
    def capabilities(self) -> dict[int, P.Capabilities]:
        """node id -> what it declared (:class:`~fedshard.server.nodes.NodeDirectory`'s cache)."""
        return self.nodes.capabilities

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, *, example_input: torch.Tensor | None = None, **kwargs: Any
    ) -> SpectralSharding:
        """The strategy for ``model``, sharding the paper's default layers (every Linear and
        Conv2d but the first and the last; forward order from ``example_input`` if given).

        Warns when the multipliers can compound: with ω > 1 (Unbiased, Collective, PriSM +
        Wallenius) and no normalization layer, activations grow by up to ω per sharded layer.
        """
        layers = sharded_layer_names(model, example_input=example_input)
        if multipliers_can_compound(model, method := kwargs.get("method", "collective"), layers):
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
        t = self.training
        log(INFO, "\t├──> SpectralSharding: method=%s design=%s scaled=%s", self.method,
            self.design, self.scaled)
        log(INFO, "\t│\t├── sharded layers (%d): %s", len(self.sharded_layers),
            ", ".join(self.sharded_layers))
        log(INFO, "\t│\t└── lr=%g (%s over %s rounds), local epochs=%d, batch=%d, "
            "momentum=%g, FD=%g, ClipLR τ=%s", t.lr, self.lr_schedule, self.num_rounds,
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
        self.training = replace(self.training, lr=base_lr(self._given_lr, caller_lr,
                                                          self.lr_schedule))
        result = super().start(grid, initial_arrays, self.num_rounds - self.round_offset,
                               timeout, train_config, evaluate_config, evaluate_fn)
        if self.rounds_trained == 0:
            log(ERROR, rounds.NO_ROUND_TRAINED)
        return result

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes, shard every sharded layer per keep-ratio group, one message per node."""
        refuse_wrappers(self, sys._getframe(1))
        server_round += self.round_offset
        self._round = None
        if self.fraction_train == 0.0:
            return []
        nodes = self.nodes.sample(grid, server_round, self.fraction_train, self.min_train_nodes)
        if not nodes:
            log(WARNING, "Round %d: no connected node declared a keep ratio; no training.",
                server_round)
            return []
        lr = round_lr(self.lr_schedule, self.training.lr, server_round,
                      self.num_rounds or server_round)
        messages, self._round = rounds.shard_round(
            server_round, arrays, self.sharded_layers, nodes,
            lambda node: self._settings(server_round, node, lr), config, lr=lr,
            method=self.method, design=self.design, seed=self.seed, scaled=self.scaled,
            prism_exponent=self.prism_exponent, how=self.how, device=self.device,
            gamma=anneal_exponent(server_round, *self.anneal)
            if self.method in ANNEALED_METHODS else None, reference=self.fedavg_cosine)
        return messages

    def _settings(self, server_round: int, node: P.Capabilities, lr: float) -> P.TrainSettings:
        seed_rng = stream_rng(self.seed, server_round, Stream.TRAIN, node.stream)
        return replace(self.training, server_round=server_round, lr=lr,
                       keep_ratio=node.keep_ratio, train_seed=int(seed_rng.integers(2**31 - 1)))

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
