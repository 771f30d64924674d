"""``WidthSlicing``, the width-slicing strategies beside spectral sharding: HeteroFL, FedRolex and
ordered dropout on the same Flower API, the same node-declared keep ratios, the same reply
checks, bounds, callbacks and result files as :class:`~fedshard.server.strategy.SpectralSharding`:
both are siblings on :class:`~fedshard.server.base.KeepRatioStrategy`, and this one gives how a
round is planned and how its replies are combined, nothing else.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import MessageType
from flwr.common.logger import log

from fedshard import protocol as P
from fedshard.protocol.slices import SliceOrder, encode_slices
from fedshard.sampling import Stream, stream_rng
from fedshard.server.base import KeepRatioStrategy
from fedshard.server.callbacks import RoundCallback
from fedshard.server.metrics import send_metrics
from fedshard.server.rounds import MetricsAggrFn, RoundState
from fedshard.server.trusted import TrustedReference
from fedshard.settings import (
    WIDTH_METHODS,
    Cohort,
    LocalTraining,
    NodePolicy,
    Privacy,
    Problem,
    ReplyPolicy,
    Sharding,
    Slicing,
)
from fedshard.spectral import sharded_layer_names
from fedshard.width.budget import WidthMatch, match_width
from fedshard.width.slicing import (
    SliceIndex,
    SliceUpdate,
    WidthFamily,
    aggregate_slices,
    slice_indices,
    take,
)

__all__ = ["SliceRoundState", "WidthSlicing", "od_widths", "slice_round"]


def od_widths(family: WidthFamily, width: int, grid: int) -> tuple[int, ...]:
    """Ordered dropout's widths for a node of ``width``: the grid ratios ``1/D..1``
    (``D = grid``) as widths below the node's own, then its own."""
    below = {family.width_for(j / grid) for j in range(1, grid + 1)}
    return (*sorted(w for w in below if w < width), width)


@dataclass
class SliceRoundState(RoundState):
    """A width-slicing round: what each node was sent and where its slice sits."""

    index: dict[int, SliceIndex] = field(default_factory=dict)  # node -> its slice

    def combine(self, accepted: Sequence[P.TrainReply]) -> dict[str, np.ndarray]:
        """Every element the weighted mean over the nodes that trained it
        (:func:`~fedshard.width.slicing.aggregate_slices`)."""
        current = self.current or {k: P.decode_array(a) for k, a in self.arrays.items()}
        if self.privacy is not None:  # clipped, unweighted, noised (fedshard.server.central_dp)
            return self.privacy.combine_slices(current, accepted, self.sent, self.index)
        return aggregate_slices(current, [SliceUpdate(r.weight, r.values, self.index[r.node])
                                          for r in accepted])


def slice_round(
    server_round: int, arrays: ArrayRecord, nodes: dict[int, P.Capabilities],
    widths: dict[float, int], config: ConfigRecord, *, family: WidthFamily, method: str,
    slicing: Slicing, training: LocalTraining, lr: float, replies: ReplyPolicy, seed: int,
) -> tuple[list[Message], SliceRoundState]:
    """One ``train`` message per node and the round's state: each node's slice of the global
    ``arrays`` at the width of its keep ratio (``widths``), :mod:`fedshard.width.slicing`'s
    channels for ``method`` in ``server_round``, its :class:`~fedshard.protocol.TrainSettings`
    (a per-node training seed from ``seed``) and its :class:`SliceOrder` on top of the
    caller's ``config``."""
    t0 = time.perf_counter()
    current = {k: P.decode_array(a) for k, a in arrays.items()}
    full = {k: tuple(v.shape) for k, v in current.items()}
    messages, sent, index = [], {}, {}
    for node, caps in nodes.items():
        width = widths[caps.keep_ratio]
        index[node] = slice_indices(full, family.shapes(width), method, server_round)
        record, sent[node] = encode_slices(take(current, index[node]), caps.keep_ratio)
        seed_rng = stream_rng(seed, server_round, Stream.TRAIN, caps.stream)
        settings = P.TrainSettings.of(training, lr=lr, server_round=server_round,
                                      keep_ratio=caps.keep_ratio, method=method,
                                      train_seed=int(seed_rng.integers(2**31 - 1)))
        ordered = method == "ordered-dropout"
        order = SliceOrder(width, family.width,
                           scaler=slicing.width_scaler and not ordered,
                           od_widths=od_widths(family, width, slicing.od_widths) if ordered
                           else (), od_distill=slicing.od_distill and ordered)
        content = RecordDict({P.ARRAYS: record,
                              P.CONFIG: order.to_record(settings.to_record(config))})
        messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                                group_id=str(server_round)))
    t1 = time.perf_counter()
    metrics = send_metrics(arrays, sent, lr, (t0, t0, t0, t1))
    for r in sorted({c.keep_ratio for c in nodes.values()}):
        metrics[f"width-ratio-r{r:g}"] = widths[r] / family.width
    state = SliceRoundState(server_round, arrays, {}, sent, metrics, current, messages,
                            replies, index=index)
    log(INFO, "configure_train: round %d, %d nodes (keep ratios %s; widths %s of %d), "
        "lr=%.4g, slicing %.2fs", server_round, len(messages),
        dict(Counter(c.keep_ratio for c in nodes.values())),
        sorted({widths[c.keep_ratio] for c in nodes.values()}), family.width, lr, t1 - t0)
    return messages, state


class WidthSlicing(KeepRatioStrategy):
    """Width slicing as a Flower strategy: each node trains a narrow model of the global one.

    Each round: ask new nodes for their keep ratio r (as spectral sharding does); turn r into
    a width (``slicing.width_match``: by default the width whose forward FLOPs are nearest
    the spectral sub-model's at r, so that both compare at the same compute); send each node
    the slice of the global ``state_dict`` at that width, its channels chosen by the
    ``sharding.method``:

    - ``"heterofl"`` (Diao et al., ICLR 2021): the first ⌈ρK⌉ channels of every hidden
      dimension, every round; the nodes train with HeteroFL's scaler (``slicing.width_scaler``);
    - ``"fedrolex"`` (Alam et al., NeurIPS 2022): a window of ⌈ρK⌉ channels starting at
      channel ``t mod K`` in round t, so every channel gets trained; with the scaler too;
    - ``"ordered-dropout"`` (FjORD, Horváth et al., NeurIPS 2021): HeteroFL's first channels;
      the node trains, per batch, a nested width drawn from ``slicing.od_widths``'s grid below
      its own, with or without self-distillation (``slicing.od_distill``).

    The replies are checked and bounded as spectral sharding's are
    (:class:`~fedshard.settings.ReplyPolicy`); every element of the new model is the mean of
    the values of the nodes that trained it, weighted by ``num-examples``
    (:func:`~fedshard.width.slicing.aggregate_slices`); the others keep theirs. The client
    side is :func:`fedshard.client.width.handle_width_train`, with the same
    :class:`~fedshard.width.slicing.WidthFamily`.

    Parameters
    ----------
    family : WidthFamily
        The model at any width; its global width is the model's.
    model : nn.Module, optional
        The global model: needed to match widths on FLOPs or bytes (:meth:`from_model`).
    example_input : Tensor or tuple, optional
        One input of ``model``: needed to match on FLOPs.
    slicing : fedshard.settings.Slicing, optional
        How a keep ratio becomes a width; the methods' options.
    sharding : fedshard.settings.Sharding, optional
        Its ``method`` (one of :data:`~fedshard.settings.WIDTH_METHODS`; default
        ``"heterofl"``); the other fields are spectral sharding's.
    num_rounds, training, replies, nodes, cohort, privacy, seed :
        As in :class:`~fedshard.server.base.KeepRatioStrategy`: the run's rounds, the
        local-training recipe, the reply bounds, the keep-ratio rules, which nodes a round
        samples, central differential privacy (off by default; each element's sum over the
        nodes that trained it is noised), the random streams' root.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn, callbacks :
        As in :class:`~fedshard.server.base.KeepRatioStrategy`.

    Raises
    ------
    fedshard.settings.SettingsError
        For a spectral method, a dense aggregation rule other than the mean (the robust dense
        rules are not defined over slices of different widths), or a match on FLOPs/bytes
        without the model (and an example input for FLOPs); with every problem of the other
        arguments.
    """

    METHODS = WIDTH_METHODS
    _wrong_method = ("a spectral method: use fedshard.SpectralSharding (or a width-slicing "
                     f"method: {', '.join(WIDTH_METHODS)})")

    def __init__(
        self,
        *,
        family: WidthFamily,
        model: torch.nn.Module | None = None,
        example_input: Any = None,
        slicing: Slicing | None = None,
        sharding: Sharding | None = None,
        num_rounds: int | None = None,
        training: LocalTraining | None = None,
        replies: ReplyPolicy | None = None,
        nodes: NodePolicy | None = None,
        cohort: Cohort | None = None,
        privacy: Privacy | None = None,
        seed: int = 0,
        train_metrics_aggr_fn: MetricsAggrFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggrFn | None = None,
        callbacks: Sequence[RoundCallback] | None = None,
        trusted: TrustedReference | None = None,
    ) -> None:
        slicing = slicing if slicing is not None else Slicing()
        problems = []
        if not isinstance(family, WidthFamily):
            problems.append(Problem((("family", family),),
                                    "expected a fedshard.width.WidthFamily"))
        if not isinstance(slicing, Slicing):
            problems.append(Problem((("slicing", slicing),),
                                    "expected a Slicing (fedshard.settings)"))
        elif slicing.width_match != "keep-ratio" and (
                model is None or (slicing.width_match == "flops" and example_input is None)):
            problems.append(Problem(
                (("width_match", slicing.width_match),),
                "matching a width to the spectral sub-model's cost needs the model (and an "
                "example input for FLOPs): use WidthSlicing.from_model, or width_match="
                "'keep-ratio'"))
        if isinstance(replies, ReplyPolicy) and replies.aggregation != "mean":
            problems.append(Problem((("aggregation", replies.aggregation),),
                                    "width slicing averages each element over the nodes "
                                    "that trained it: expected 'mean'"))
        super().__init__(
            sharding=sharding if sharding is not None else Sharding(method="heterofl"),
            num_rounds=num_rounds, training=training, replies=replies, nodes=nodes,
            cohort=cohort, privacy=privacy, seed=seed, train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn, callbacks=callbacks,
            trusted=trusted, problems=problems)
        self.slicing = slicing
        self.family = family
        self.model, self.example_input = model, example_input
        self.matches: dict[float, WidthMatch] = {}  # keep ratio -> its width and costs

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, family: WidthFamily,
                   example_input: Any = None, **options: Any) -> WidthSlicing:
        """The strategy for ``model`` (its global width ``family.width``); ``options`` are
        the constructor's arguments and, as shortcuts, any setting's name (``method=
        "fedrolex"``, ``width_match="bytes"``, ``lr=0.01``, ``fraction_train=0.5``, ...).
        An unknown name raises ``TypeError``."""
        kwargs = cls._arguments(options, taken=("family", "model", "example_input"))
        return cls(family=family, model=model, example_input=example_input, **kwargs)

    def width_of(self, keep_ratio: float) -> WidthMatch:
        """The width for ``keep_ratio`` and its costs (counted once, logged)."""
        if keep_ratio not in self.matches:
            model = self.model if self.model is not None else self.family(self.family.width)
            layers = sharded_layer_names(model, example_input=self.example_input)
            match = match_width(self.family, keep_ratio, self.slicing.width_match, model=model,
                                sharded_layers=layers, example_input=self.example_input)
            self.matches[keep_ratio] = match
            log(INFO, "Width slicing: %s.", match.line())
        return self.matches[keep_ratio]

    def describe(self) -> list[str]:
        """How keep ratios become widths and what each method adds, then the local-training
        recipe (the base's lines)."""
        s, method = self.slicing, self.sharding.method
        return [f"WidthSlicing: method={method}, width matched on {s.width_match}, global "
                f"width {self.family.width} (multiples of {self.family.multiple})"
                + (", scaler" if s.width_scaler and method != "ordered-dropout" else "")
                + (f", od grid 1/{s.od_widths}..1"
                   f"{' with distillation' if s.od_distill else ''}"
                   if method == "ordered-dropout" else ""), *super().describe()]

    def plan_round(self, server_round: int, arrays: ArrayRecord,
                   nodes: dict[int, P.Capabilities], config: ConfigRecord,
                   training: LocalTraining, lr: float,
                   ) -> tuple[list[Message], RoundState]:
        """Each node's slice at the width of its keep ratio (:func:`slice_round`; the
        state's ``combine`` averages every element over the nodes that trained it)."""
        widths = {c.keep_ratio: self.width_of(c.keep_ratio).width for c in nodes.values()}
        return slice_round(server_round, arrays, nodes, widths, config, family=self.family,
                           method=self.sharding.method, slicing=self.slicing,
                           training=training, lr=lr, replies=self.replies, seed=self.seed)
