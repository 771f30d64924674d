"""What sharding will buy, known before the first round: per keep ratio, the bytes a node
receives and sends and its sub-model's forward FLOPs against the dense model, per layer the
dense weight against its factors; and the WARNING / INFO texts that say when it buys little.

Bytes follow the wire format exactly, from the shapes and dtypes of the state dict
(:mod:`fedshard.spectral.cost`): the dense entries as they are, each sharded layer's weight
replaced by its ``u``, ``v``, ``omega`` and ``indices`` (the reply leaves ``omega`` out). FLOPs
are counted by :class:`torch.utils.flop_counter.FlopCounterMode` on the sub-model a node at
keep ratio ``r`` trains (the end-of-run report, :mod:`fedshard.server.savings`, counts them the
same way). The strategy logs :func:`budget_summary` and :func:`budget_warnings` once, when the
nodes' keep ratios are first known.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedshard.spectral.cost import LayerCost, array_bytes, layer_cost, numpy_dtype
from fedshard.spectral.selection import shardable_layers
from fedshard.spectral.surgery import LayerFactors, build_submodel

__all__ = ["RatioBudget", "ShardingBudget", "UnshardedLayer", "budget_summary",
           "budget_warnings", "forward_flops", "sharding_budget", "submodel_at"]

#: A warning names at most this many layers (and counts the rest).
_LISTED = 8


@dataclass(frozen=True)
class UnshardedLayer:
    """A Linear/Conv2d layer that is sent dense.

    ``kind`` is the module's class name, or ``"2-D weight"`` / ``"4-D weight"`` for a budget
    made from shapes only (an ``nn.Embedding`` weight is 2-D too); ``params`` counts its
    weight and bias, ``share`` is their bytes over the dense model's.
    """

    name: str
    kind: str
    weight_shape: tuple[int, ...]
    dtype: str
    params: int
    share: float


@dataclass(frozen=True)
class RatioBudget:
    """One keep ratio: bytes (both ways) and, when counted, forward FLOPs of one node.

    ``received_bytes``: server → node (the ``train`` message's arrays); ``sent_bytes``: node →
    server (its reply's); ``forward_flops``: one forward pass of the sub-model on the example
    input, ``None`` when none was given. ``layers``: each sharded layer at this ratio.
    """

    keep_ratio: float
    received_bytes: int
    sent_bytes: int
    dense_bytes: int
    forward_flops: int | None
    dense_flops: int | None
    layers: tuple[LayerCost, ...]

    @property
    def received_ratio(self) -> float:
        """Bytes received against the dense model's."""
        return self.received_bytes / self.dense_bytes

    @property
    def sent_ratio(self) -> float:
        """Bytes sent back against the dense model's."""
        return self.sent_bytes / self.dense_bytes

    @property
    def flops_ratio(self) -> float | None:
        """Forward FLOPs against the dense model's, or ``None`` when not counted."""
        if self.forward_flops is None or not self.dense_flops:
            return None
        return self.forward_flops / self.dense_flops


@dataclass(frozen=True)
class ShardingBudget:
    """:func:`sharding_budget`'s result: the dense model, the sharded layers, every Linear/
    Conv2d left dense (largest first) and one :class:`RatioBudget` per keep ratio (ascending).
    """

    dense_bytes: int
    dense_flops: int | None
    sharded_layers: tuple[str, ...]
    unsharded: tuple[UnshardedLayer, ...]
    ratios: tuple[RatioBudget, ...]
    #: every layer with a 2-D or larger weight, in state-dict (registration) order
    order: tuple[str, ...] = ()
    #: the state-dict entries of neither a sharded nor a shardable layer, ``(key, bytes)``,
    #: largest first (ties: by key): what no keep ratio shrinks
    other: tuple[tuple[str, int], ...] = ()

    def at(self, keep_ratio: float) -> RatioBudget:
        """The :class:`RatioBudget` of ``keep_ratio``.

        Raises
        ------
        KeyError
            If the budget was not made for that keep ratio.
        """
        for ratio in self.ratios:
            if ratio.keep_ratio == keep_ratio:
                return ratio
        raise KeyError(f"keep ratio {keep_ratio!r} is not in this budget; it holds "
                       f"{[r.keep_ratio for r in self.ratios]}.")


def sharding_budget(
    model: nn.Module | Mapping[str, Any],
    sharded_layers: Sequence[str],
    keep_ratios: Iterable[float],
    *,
    example_input: Any = None,
) -> ShardingBudget:
    """What a node at each keep ratio receives, sends and computes, against the dense model.

    Parameters
    ----------
    model : nn.Module or mapping
        The dense model, or its state dict's shapes: a mapping of key to anything with
        ``.shape`` and ``.dtype`` (tensors, numpy arrays, the strategy's ``ArrayRecord``).
        Only shapes and dtypes are read; the model is not modified.
    sharded_layers : sequence of str
        The sharded layers' module names (each ``<name>.weight`` must be in the state dict).
    keep_ratios : iterable of float
        The keep ratios in use, each in ``(0, 1]`` (repeats are counted once).
    example_input : Tensor or tuple, optional
        One input of ``model`` (``model(*example_input)`` for a tuple); with it the forward
        FLOPs are counted (per example when it holds one example). Needs the model.

    Returns
    -------
    ShardingBudget

    Raises
    ------
    ValueError
        If ``keep_ratios`` is empty or holds a ratio outside ``(0, 1]``, a sharded layer's
        weight is missing from the state dict or not 2-D or more (all listed at once), or
        ``example_input`` is given with shapes instead of a model.
    TypeError
        With ``example_input``, if a sharded layer cannot be replaced by a spectral layer
        (:func:`~fedshard.spectral.check_shardable`'s message).
    """
    ratios = sorted(set(keep_ratios))
    bad = [r for r in ratios
           if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1]
    if not ratios or bad:
        raise ValueError(f"keep_ratios={ratios!r}: expected one or more keep ratios in "
                         f"(0, 1]{f', found {bad}' if bad else ''}; no budget was made.")
    if example_input is not None and not isinstance(model, nn.Module):
        raise ValueError("example_input was given with a state dict's shapes: counting FLOPs "
                         "needs the model itself; pass the nn.Module, or leave example_input "
                         "out to count bytes only.")
    state = model.state_dict() if isinstance(model, nn.Module) else model
    shapes = {k: (tuple(int(s) for s in a.shape), numpy_dtype(a.dtype)) for k, a in state.items()}
    problems = [f"{n!r} (no {n}.weight)" for n in sharded_layers if f"{n}.weight" not in shapes]
    problems += [f"{n!r} (weight shape {shapes[f'{n}.weight'][0]})" for n in sharded_layers
                 if f"{n}.weight" in shapes and len(shapes[f"{n}.weight"][0]) < 2]
    if problems:
        raise ValueError(f"cannot count the sharded layer(s) {', '.join(problems)}: expected "
                         "a Linear/Conv2d weight of 2 or more dimensions in the state dict; "
                         "no budget was made.")
    dense = sum(array_bytes(shape, dt) for shape, dt in shapes.values())
    unsharded = _unsharded(model, shapes, set(sharded_layers), dense)
    dense_flops = (forward_flops(model, example_input)
                   if isinstance(model, nn.Module) and example_input is not None else None)
    out = []
    for r in ratios:
        layers = tuple(layer_cost(n, *shapes[f"{n}.weight"], float(r)) for n in sharded_layers)
        received = dense + sum(c.received_bytes - c.dense_bytes for c in layers)
        sent = dense + sum(c.sent_bytes - c.dense_bytes for c in layers)
        flops = dense_flops  # (no sharded layer: the dense model)
        if dense_flops is not None and isinstance(model, nn.Module) and sharded_layers:
            # at r = 1 too: a node trains all N terms as factors, not the dense layer
            flops = forward_flops(submodel_at(model, sharded_layers, r), example_input)
        out.append(RatioBudget(float(r), received, sent, dense, flops, dense_flops, layers))
    order = tuple(k[: -len(".weight")] for k, (shape, _) in shapes.items()
                  if k.endswith(".weight") and len(shape) >= 2)
    layers_of = set(sharded_layers) | {u.name for u in unsharded}
    other = sorted(((k, array_bytes(*shapes[k])) for k in shapes
                    if k.rpartition(".")[0] not in layers_of), key=lambda e: (-e[1], e[0]))
    return ShardingBudget(dense, dense_flops, tuple(sharded_layers), unsharded, tuple(out),
                          order, tuple(other))


def forward_flops(model: nn.Module, example_input: Any) -> int:
    """FLOPs of one forward pass of ``model`` on ``example_input`` (``model(*example_input)``
    for a tuple), as :class:`~torch.utils.flop_counter.FlopCounterMode` counts them: matrix
    products and convolutions, 2 per multiply-add; normalizations, activations and ``ω``
    scalings are not counted (they are a small, equal share of both models). The model runs
    in eval mode under ``torch.no_grad()``; its train/eval flags are restored. The input's
    tensors are moved to the device of the model's first parameter (a model on the GPU, an
    example input made on the CPU)."""
    flags = {m: m.training for m in model.modules()}
    first = next(iter(model.parameters()), None)
    if first is not None:
        example_input = _on_device(example_input, first.device)
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            if isinstance(example_input, tuple):
                model(*example_input)
            else:
                model(example_input)
    finally:
        for module, flag in flags.items():
            module.training = flag
    return int(counter.get_total_flops())


def _on_device(example_input: Any, device: torch.device) -> Any:
    """``example_input`` (a tensor, or a tuple of tensors and other values) on ``device``."""
    if isinstance(example_input, torch.Tensor):
        return example_input.to(device)
    if isinstance(example_input, tuple):
        return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in example_input)
    return example_input


def submodel_at(model: nn.Module, layers: Iterable[str], keep_ratio: float) -> nn.Module:
    """The sub-model a node at ``keep_ratio`` trains, for counting its cost: each of
    ``layers`` (``N`` terms) as ``n = ⌈rN⌉`` terms, ``ω = 1``, in the weight's dtype and
    device. Its factors are zeros: shapes, not values, set the cost (no SVD is taken)."""
    modules = dict(model.named_modules())
    factors = {}
    for name in layers:
        weight = modules[name].weight
        assert isinstance(weight, torch.Tensor)
        cost = layer_cost(name, tuple(weight.shape), numpy_dtype(weight.dtype), keep_ratio)
        rows, cols = weight.shape[0], weight[0].numel()
        dtype, device = weight.dtype, weight.device
        factors[name] = LayerFactors(torch.zeros(rows, cost.kept, dtype=dtype, device=device),
                                     torch.zeros(cols, cost.kept, dtype=dtype, device=device),
                                     torch.ones(cost.kept, dtype=dtype, device=device))
    return build_submodel(model, factors)


def _unsharded(model: nn.Module | Mapping[str, Any],
               shapes: Mapping[str, tuple[tuple[int, ...], Any]], sharded: set[str],
               dense: int) -> tuple[UnshardedLayer, ...]:
    """Every shardable layer left dense, largest first (ties: by name). From shapes only,
    every 2-D to 5-D ``<name>.weight`` is a candidate (its kind is unknown)."""
    if isinstance(model, nn.Module):
        # a supported layer can be added to the sharded ones; other Linear/Conv2d cannot
        names = [n for n in shardable_layers(model) if n not in sharded]
        kinds = {n: type(model.get_submodule(n)).__name__ for n in names}
    else:
        names = [k[: -len(".weight")] for k, (shape, _) in shapes.items()
                 if k.endswith(".weight") and len(shape) in (2, 3, 4, 5)]
        names = [n for n in names if n not in sharded]
        kinds = {n: f"{len(shapes[f'{n}.weight'][0])}-D weight" for n in names}
    out = []
    for name in names:
        parts = [shapes[k] for k in (f"{name}.weight", f"{name}.bias") if k in shapes]
        params = sum(math.prod(shape) for shape, _ in parts)
        share = sum(array_bytes(shape, dt) for shape, dt in parts) / dense
        shape, dt = shapes[f"{name}.weight"]
        out.append(UnshardedLayer(name, kinds[name], shape, str(dt), params, share))
    return tuple(sorted(out, key=lambda u: (-u.params, u.name)))


def budget_summary(budget: ShardingBudget) -> list[str]:
    """One INFO line per keep ratio, e.g. ``"r = 0.25: receives 0.28x of the dense model's
    bytes, sends 0.27x, forward 0.30x FLOPs"`` (ratios that round to 1.00 get four decimals:
    1.0009x is not 1.00x)."""
    lines = []
    for ratio in budget.ratios:
        line = (f"r = {ratio.keep_ratio:g}: receives {_times(ratio.received_ratio)} of the "
                f"dense model's bytes, sends {_times(ratio.sent_ratio)}")
        flops = ratio.flops_ratio
        line += (f", forward {_times(flops)} FLOPs" if flops is not None
                 else " (forward FLOPs not counted: no example input)")
        lines.append(line)
    return lines


def budget_warnings(budget: ShardingBudget) -> list[str]:
    """The WARNING texts for ``budget``: none when sharding pays, else one or both of

    - when, at some keep ratio ``r < 1``, a node receives more than ``(1 + r)/2`` of the
      dense model's bytes, or computes more than ``(1 + r)/2`` of its forward FLOPs (when
      counted): per such ``r`` the ratios and what the sharded layers' factors cost, the
      largest Linear/Conv2d layers sent dense with their share of the model, and the line
      that shards them too, with the ratios it would give;
    - when the factors of sharded layers cost more bytes than their dense weights at some
      ``r < 1``: each such layer with ``r``, ``n``, ``N`` and both sizes (layers of one
      shape together).

    ``r = 1`` is not sharding and is not checked.

    Notes
    -----
    ``(1 + r)/2`` is halfway between sharding every weight (about ``r``: ``n = ⌈rN⌉`` of
    ``N`` terms, paper Sec. 3.1) and no sharding at all (1): above it, most of the model
    travels dense, or the factors cost nearly what the layers do. ``n`` terms of a
    ``c_out × fan_in`` weight hold ``n (c_out + fan_in)`` entries, ``r (1 + N / max(c_out,
    fan_in))`` of the weight: up to ``2r`` for a square layer.
    """
    sharded = [r for r in budget.ratios if r.keep_ratio < 1]
    over = [r for r in sharded if r.received_ratio > _bound(r.keep_ratio)
            or (r.flops_ratio is not None and r.flops_ratio > _bound(r.keep_ratio))]
    out = [_dense_warning(budget, over)] if over else []
    groups: dict[tuple[Any, ...], tuple[list[str], list[float]]] = {}
    for ratio in sharded:
        for c in ratio.layers:
            if c.costs_more:  # layers of one shape cost the same: listed together
                key = (c.weight_shape, c.kept, c.terms, c.received_bytes, c.dense_bytes,
                       c.factor_params, c.dense_params)
                names, ratios = groups.setdefault(key, ([], []))
                names += [c.name] if c.name not in names else []
                ratios += [ratio.keep_ratio] if ratio.keep_ratio not in ratios else []
    if groups:
        out.append(_costly_warning(groups))
    return out


def _dense_warning(budget: ShardingBudget, over: Sequence[RatioBudget]) -> str:
    clauses = []
    for ratio in over:
        flops = ratio.flops_ratio
        computes = (f" and computes {_times(flops, 3)} of its forward FLOPs"
                    if flops is not None else "")
        factors = ""
        if ratio.layers:
            cost = (sum(c.received_bytes for c in ratio.layers)
                    / sum(c.dense_bytes for c in ratio.layers))
            factors = f"; the sharded layers' factors cost {_times(cost)} of their weights"
        bound = _bound(ratio.keep_ratio)
        above = [what for what, x in (("bytes", ratio.received_ratio), ("FLOPs", flops))
                 if x is not None and x > bound]
        clauses.append(f"at r = {ratio.keep_ratio:g} a node receives "
                       f"{_times(ratio.received_ratio, 3)} of the dense model's bytes"
                       f"{computes} (its {' and its '.join(above)} more than (1 + r)/2 = "
                       f"{bound:.3g}x of the dense model's{factors})")
    text = "Sharding buys little: " + "; ".join(clauses) + ". "
    weights = sum(c.dense_bytes for c in over[0].layers) / budget.dense_bytes
    text += (f"The {len(over[0].layers)} sharded layer(s) hold {weights:.1%} of the bytes. "
             if over[0].layers else "No layer is sharded. ")
    largest = budget.unsharded[:3]
    if not largest:
        rest = ", ".join(f"{key!r} ({size / budget.dense_bytes:.1%})"
                         for key, size in budget.other[:3])
        return text + ("Every layer a spectral layer can replace is sharded already: the rest "
                       "is in entries no keep ratio shrinks, the largest "
                       f"{rest or 'none'}.")
    named = ", ".join(f"{u.name!r} ({u.kind}, weight {_shape(u.weight_shape)}, "
                      f"{u.params:,} parameters, {u.share:.1%} of the model's bytes)"
                      for u in largest)
    text += f"The largest layers sent dense: {named}."
    smallest = over[0].keep_ratio
    saving = [u for u, c in ((u, _cost(u, smallest)) for u in largest)
              if c.received_bytes < c.dense_bytes]
    if not saving:
        return text + f" Their factors at r = {smallest:g} would cost more than their weights."
    # sharded layers whose factors cost more than the layer at one of these ratios: left dense
    dropped = sorted({c.name for r in over for c in r.layers if c.costs_more})
    after = {r.keep_ratio: (r.received_bytes
                            - sum(c.received_bytes - c.dense_bytes for c in r.layers
                                  if c.name in dropped)
                            + sum(c.received_bytes - c.dense_bytes for c in (
                                _cost(u, r.keep_ratio) for u in saving))) / budget.dense_bytes
             for r in over}
    names = [u.name for u in saving]
    instead = (f" instead of {', '.join(map(repr, dropped))} (whose factors cost more than "
               "their weights)" if dropped else " as well")
    text += (f" Sharding {'it' if len(saving) == 1 else 'them'} ({', '.join(map(repr, names))})"
             f"{instead} would make it " + ", ".join(f"{_times(x, 3)} at r = {r:g}"
                                                     for r, x in after.items()) + ".")
    still = [r for r, x in after.items() if x > _bound(r)]
    if still:
        text += (f" At r = {', '.join(f'{r:g}' for r in still)} that is still more than "
                 "(1 + r)/2: there the factors themselves save little (n terms of a c_out × "
                 "fan_in weight cost r (1 + N / max(c_out, fan_in)) of it: a square layer "
                 "breaks even at r = 0.5).")
    if len(still) == len(after):
        return text
    kept = [n for n in budget.sharded_layers if n not in dropped]
    wanted = {*kept, *names}
    layers = [n for n in budget.order if n in wanted]
    layers += [n for n in kept if n not in layers]
    listed = (repr(layers) if len(layers) <= _LISTED else  # long: "sharded now, plus ..."
              f"[<the {len(kept)} layers sharded now that save bytes>, "
              f"{', '.join(map(repr, names))}]")
    by_size = min(r.keep_ratio for r in budget.ratios)
    return text + (f" Name the layers, SpectralSharding(sharded_layers={listed}, ...), or let "
                   "the size policy choose them: SpectralSharding(sharded_layers="
                   f"sharded_layer_names(model, policy='by-size', keep_ratio={by_size:g}), "
                   "...).")


def _costly_warning(groups: Mapping[tuple[Any, ...], tuple[list[str], list[float]]]) -> str:
    parts = []
    for (shape, kept, terms, factor_bytes, dense_bytes, factor_params, dense_params), (
            names, ratios) in groups.items():
        listed = ", ".join(map(repr, names[:_LISTED]))
        if len(names) > _LISTED:
            listed += f" and {len(names) - _LISTED} more"
        parts.append(
            f"{listed} at r = {', '.join(f'{r:g}' for r in ratios)} (n = {kept} of N = {terms} "
            f"terms: {factor_params:,} factor entries, {factor_bytes:,} bytes with omega and "
            f"indices, against {dense_params:,} entries, {dense_bytes:,} bytes for the dense "
            f"{_shape(shape)} weight)")
    return ("The factors of some sharded layers cost more bytes than their dense weights: "
            + "; ".join(parts) + ". A node at such a keep ratio receives more for them than for "
            "the dense layers. If they are sharded for nodes at smaller keep ratios, that is the "
            "price; otherwise leave them dense (drop them from sharded_layers).")


def _bound(keep_ratio: float) -> float:
    return (1 + keep_ratio) / 2


def _cost(layer: UnshardedLayer, keep_ratio: float) -> LayerCost:
    return layer_cost(layer.name, layer.weight_shape, layer.dtype, keep_ratio)


def _times(x: float, digits: int = 2) -> str:
    """``0.28x``; four decimals when two would round to 1.00 (``0.9995x``, ``1.0009x``)."""
    return f"{x:.4f}x" if abs(x - 1) < 0.005 else f"{x:.{digits}f}x"


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(str(s) for s in shape)
