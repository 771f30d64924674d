"""How a node of width slicing trains its narrow model (:func:`handle_width_train`): HeteroFL's
scaler and FjORD's ordered dropout, both around fedshard's own training loop and step.

- :func:`attach_scaler`: HeteroFL (Diao et al., 2021, Sec. 3.2) divides the output of every
  hidden layer by the node's width ratio ρ while it trains, so that a narrow layer's outputs
  keep the scale the global model's have (a sum over ρK inputs instead of K); evaluation, of
  the global model, never scales.
- :class:`OrderedDropout`: FjORD (Horváth et al., 2021, Sec. 3) trains, for every batch, the
  nested sub-model of a width drawn uniformly from the grid widths up to the node's own (the
  first channels of each hidden dimension); with self-distillation (Sec. 3.3) the node's own
  width also learns the labels on the batch and teaches the drawn width (KL divergence to its
  softened outputs, temperature 1). Given to :func:`fedshard.client.train.train` as its step
  (``TrainConfig(step=...)``), in place of the eager one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Message
from torch import nn
from torch.func import functional_call
from torch.utils.data import Dataset

from fedshard import protocol as P
from fedshard.client.handlers import Loader, handle_train
from fedshard.client.train.config import FastPath, TrainConfig
from fedshard.client.train.step import EagerStep, cross_entropy_sums
from fedshard.protocol.slices import SliceOrder
from fedshard.width.slicing import WidthFamily

__all__ = ["OD_STREAM", "OrderedDropout", "OrderedDropoutStep", "Scaler", "attach_scaler",
           "handle_width_train"]

#: The tag of ordered dropout's width draws in a node's random stream
#: (``np.random.default_rng([train_seed, OD_STREAM])``).
OD_STREAM = 0x0D


class Scaler:
    """A forward hook: the module's output divided by ``rate`` in training mode, unchanged in
    eval mode (HeteroFL's ``Scaler``). A class, not a closure: a hooked model deep-copies and
    pickles."""

    def __init__(self, rate: float) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"Scaler rate={rate!r}: expected a width ratio in (0, 1]")
        self.rate = rate

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output / self.rate if module.training else output


def attach_scaler(model: nn.Module, layers: Sequence[str], rate: float) -> list[Any]:
    """Hook :class:`Scaler` (``rate``) after each of ``layers`` (module names) of ``model``;
    returns the hook handles. ``rate = 1`` attaches nothing.

    Raises
    ------
    KeyError
        If a name is not a module of ``model``.
    """
    if rate == 1:
        return []
    modules = dict(model.named_modules())
    missing = [n for n in layers if n not in modules]
    if missing:
        raise KeyError(f"attach_scaler: no module {missing[:5]} in the model; expected the "
                       "names of its hidden Linear/Conv2d layers")
    return [modules[n].register_forward_hook(Scaler(rate)) for n in layers]


class OrderedDropout:
    """FjORD's ordered dropout as the training loop's step (``TrainConfig(step=this)``: a
    :data:`~fedshard.client.train.StepFactory`).

    Parameters
    ----------
    family : WidthFamily
        The model's family; the trained model is ``family(widths[-1])``'s shape.
    widths : sequence of int
        The widths a batch may train, ascending; the last is the node's own.
    seed : int
        The node's training seed this round; the draws come from
        ``np.random.default_rng([seed, OD_STREAM])``.
    distill : bool
        Self-distillation (module docstring).
    """

    def __init__(self, family: WidthFamily, widths: Sequence[int], seed: int,
                 distill: bool = False) -> None:
        if not widths or list(widths) != sorted(set(widths)):
            raise ValueError(f"OrderedDropout widths={list(widths)!r}: expected ascending "
                             "distinct widths, the node's own last")
        self.family, self.widths, self.seed, self.distill = family, tuple(widths), seed, distill

    def __call__(self, model: nn.Module, cfg: TrainConfig) -> OrderedDropoutStep:
        """The step that trains ``model`` (the node's own width) under ``cfg``."""
        return OrderedDropoutStep(model, cfg, self)

    def __repr__(self) -> str:
        return (f"OrderedDropout(widths={list(self.widths)}, seed={self.seed}, "
                f"distill={self.distill})")


class OrderedDropoutStep(EagerStep):
    """:class:`~fedshard.client.train.step.EagerStep` whose loss is ordered dropout's: one
    drawn width per batch, its sub-model's parameters the leading slices of the node's own
    (so its gradients land in them and one optimizer steps them all).

    Attributes
    ----------
    drawn : list of int
        The width each batch trained (the draws, in order).
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, od: OrderedDropout) -> None:
        super().__init__(model, cfg)
        self.od = od
        self.rng = np.random.default_rng([od.seed, OD_STREAM])
        device = next(model.parameters()).device
        # sub-models only lend their structure: their own parameters are never used
        self.subs = {w: od.family(w).to(device).train(model.training)
                     for w in od.widths[:-1]}
        self.drawn: list[int] = []

    def _forward(self, width: int, inputs: torch.Tensor) -> torch.Tensor:
        if width == self.od.widths[-1]:
            return self.model(inputs)
        sub = self.subs[width]
        sub.train(self.model.training)
        own: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        own.update(self.model.named_buffers())
        sliced = {k: own[k][tuple(slice(0, s) for s in v.shape)]
                  for k, v in {**dict(sub.named_parameters()),
                               **dict(sub.named_buffers())}.items()}
        return functional_call(sub, sliced, (inputs,))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        width = self.od.widths[int(self.rng.integers(len(self.od.widths)))]
        self.drawn.append(width)
        logits = self._forward(width, inputs)
        if not self.od.distill or width == self.od.widths[-1]:
            loss_sum, correct, count = cross_entropy_sums(logits, targets)
            return loss_sum / count.clamp_min(1), loss_sum, correct, count
        teacher = self.model(inputs)  # the node's own width: the labels, and the teacher
        loss_sum, correct, count = cross_entropy_sums(teacher, targets)
        kd = F.kl_div(F.log_softmax(logits, dim=-1), F.softmax(teacher.detach(), dim=-1),
                      reduction="batchmean")
        return loss_sum / count.clamp_min(1) + kd, loss_sum, correct, count


def handle_width_train(msg: Message, family: WidthFamily, data: Dataset[Any] | Loader, *,
                       device: str = "cpu", fast: FastPath | None = None,
                       **options: Any) -> Message:
    """Train the narrow model a width-slicing ``train`` message describes; reply with it.

    Builds ``family(width)`` (the message's :class:`~fedshard.protocol.slices.SliceOrder`),
    attaches HeteroFL's scaler when the message asks for it, loads the received arrays
    (strictly: another model's arrays raise) and trains with
    :func:`~fedshard.client.handlers.handle_train` (fedshard's loop, the server's recipe),
    taking ordered dropout's step (:class:`OrderedDropout`) when the message lists its widths.

    Parameters
    ----------
    msg : flwr.app.Message
        The ``train`` message of :class:`~fedshard.server.width.WidthSlicing`.
    family : WidthFamily
        The run's model at any width (the server's: same builder, same global width).
    data, device, **options
        As in :func:`~fedshard.client.handlers.handle_train`.
    fast : FastOptions, optional
        The fast path, as in :func:`~fedshard.client.handlers.handle_train`: HeteroFL's and
        FedRolex's narrow models train with it; ordered dropout trains with its own step,
        which the fast path cannot run, so an enabled ``fast`` is refused for it.

    Raises
    ------
    ValueError
        If the message's widths do not fit ``family`` or its config is invalid, or for an
        enabled ``fast`` or a ``step`` of yours with ordered dropout (the node's reply
        becomes an error; the server drops it, logged).
    """
    cfg = msg.content.config_records[P.CONFIG]
    order = SliceOrder.from_record(cfg)
    if order.full_width != family.width or order.width not in family.widths:
        raise ValueError(f"train config: width {order.width} of {order.full_width}, but this "
                         f"node's model family builds widths {family.multiple}..{family.width} "
                         f"in steps of {family.multiple}; server and node must use the same "
                         "model, so this round is not trained")
    if order.od_widths:
        asked = [f"{k}={v!r}" for k, v in (("fast", fast), ("step", options.get("step")))
                 if v is not None and (k != "fast" or v.enabled())]
        if asked:
            raise ValueError(
                f"handle_width_train({', '.join(asked)}): this message asks for ordered "
                "dropout, which trains with its own step (a width drawn per batch); the fast "
                "path cannot run that step, and a step of yours would replace it. Expected "
                "neither (fast=None, or every fast option off: compile, cuda-graph, "
                "merge-terms in a run config); this round is not trained.")
        options["step"] = OrderedDropout(family, order.od_widths,
                                         P.TrainSettings.from_record(cfg).train_seed,
                                         order.od_distill)
    model = family(order.width)
    if order.scaler:
        attach_scaler(model, family.hidden_layers(order.width), order.ratio)
    return handle_train(msg, model, data, device=device, fast=fast, **options)
