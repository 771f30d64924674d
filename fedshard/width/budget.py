"""The same budget for width slicing and spectral sharding: the width that costs what the
spectral sub-model at keep ratio r costs, counted from the model.

A keep ratio r and a width ratio ρ mean different things: at r = 0.1 spectral sharding keeps
the first and last layers dense and 10 % of the terms of the others, so a node may compute far
more than 10 % of the dense model, while a width ratio ρ shrinks every hidden layer's inputs
and outputs, so ρ² of most of the compute. :func:`match_width` picks, among the widths the
family builds, the one whose forward FLOPs (or bytes received) are nearest those of the
spectral sub-model at r (:func:`fedshard.spectral.budget.sharding_budget`), and reports both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedshard.settings import WIDTH_MATCHES
from fedshard.spectral.budget import forward_flops, sharding_budget
from fedshard.spectral.cost import array_bytes, numpy_dtype
from fedshard.width.slicing import WidthFamily

__all__ = ["WidthMatch", "match_width", "state_bytes", "training_memory"]


@dataclass(frozen=True)
class WidthMatch:
    """The width a node at ``keep_ratio`` trains, and what it and the spectral sub-model at
    ``keep_ratio`` cost (forward FLOPs of one example when the example input holds one;
    bytes of the ``train`` message's arrays; the narrow model's reply is as large)."""

    keep_ratio: float
    match: str
    width: int
    full_width: int
    flops: int | None
    bytes: int
    spectral_flops: int | None
    spectral_received_bytes: int
    spectral_sent_bytes: int
    dense_flops: int | None
    dense_bytes: int

    @property
    def width_ratio(self) -> float:
        """``width / full_width``."""
        return self.width / self.full_width

    def line(self) -> str:
        """One log line: the width and both costs against the dense model's."""
        def share(x: int | None, dense: int | None) -> str:
            return f"{x / dense:.3f}×" if x is not None and dense else "not counted"

        return (f"keep ratio {self.keep_ratio:g} -> width {self.width} of {self.full_width} "
                f"(ratio {self.width_ratio:.3f}, matched on {self.match}): forward FLOPs "
                f"{share(self.flops, self.dense_flops)} the dense model's (the spectral "
                f"sub-model at r = {self.keep_ratio:g}: "
                f"{share(self.spectral_flops, self.dense_flops)}), bytes received "
                f"{share(self.bytes, self.dense_bytes)} (spectral: "
                f"{share(self.spectral_received_bytes, self.dense_bytes)})")


def state_bytes(shapes: dict[str, tuple[int, ...]], model: nn.Module) -> int:
    """Bytes on the wire of a ``state_dict`` of these ``shapes`` in ``model``'s dtypes."""
    dtypes = {k: numpy_dtype(v.dtype) for k, v in model.state_dict().items()}
    return sum(array_bytes(shape, dtypes[k]) for k, shape in shapes.items())


def match_width(family: WidthFamily, keep_ratio: float, match: str, *, model: nn.Module,
                sharded_layers: Sequence[str], example_input: Any = None) -> WidthMatch:
    """The width for a node at ``keep_ratio`` (:data:`~fedshard.settings.WIDTH_MATCHES`).

    Parameters
    ----------
    family : WidthFamily
        The model's widths; ``model`` is the global one (``family(family.width)``'s shapes).
    keep_ratio : float
        The node's keep ratio r in ``(0, 1]``.
    match : str
        ``"flops"``: the width whose forward FLOPs are nearest the spectral sub-model's at r
        (needs ``example_input``); ``"bytes"``: nearest in bytes received; ``"keep-ratio"``:
        :meth:`WidthFamily.width_for` of r. A tie goes to the narrower width.
    sharded_layers : sequence of str
        The layers spectral sharding would shard (its cost is counted with them).
    example_input : Tensor or tuple, optional
        One input of the model (FLOPs are counted on it).

    Raises
    ------
    ValueError
        For an unknown ``match``, or ``"flops"`` without an example input.
    """
    if match not in WIDTH_MATCHES:
        raise ValueError(f"match={match!r}: expected one of {WIDTH_MATCHES}")
    if match == "flops" and example_input is None:
        raise ValueError("match='flops' counts forward FLOPs: give an example input of the "
                         "model (e.g. one image), or match on 'bytes'")
    spectral = sharding_budget(model, sharded_layers, [keep_ratio],
                               example_input=example_input).at(keep_ratio)
    flops: dict[int, int] = {}

    def flops_at(width: int) -> int:
        if width not in flops:
            flops[width] = forward_flops(family(width), example_input)
        return flops[width]

    def bytes_at(width: int) -> int:
        return state_bytes(family.shapes(width), model)

    widths = list(family.widths)
    if match == "keep-ratio":
        width = family.width_for(keep_ratio)
    else:
        cost, target = ((flops_at, spectral.forward_flops) if match == "flops"
                        else (bytes_at, spectral.received_bytes))
        assert target is not None
        lo, hi = 0, len(widths) - 1  # the first width costing at least the target
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if cost(widths[mid]) < target else (lo, mid)
        near = [widths[i] for i in (lo - 1, lo) if 0 <= i < len(widths)]
        width = min(near, key=lambda w: (abs(cost(w) - target), w))
    return WidthMatch(
        keep_ratio=float(keep_ratio), match=match, width=width, full_width=family.width,
        flops=flops_at(width) if example_input is not None else None, bytes=bytes_at(width),
        spectral_flops=spectral.forward_flops, spectral_received_bytes=spectral.received_bytes,
        spectral_sent_bytes=spectral.sent_bytes, dense_flops=spectral.dense_flops,
        dense_bytes=spectral.dense_bytes)


def training_memory(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                    optimizer_states: int = 1) -> dict[str, int]:
    """What one training step of ``model`` on a batch holds: its parameters, their gradients,
    ``optimizer_states`` buffers per parameter (1: SGD's momentum) and the activations
    autograd saves for the backward pass (each storage counted once), in bytes.

    Measured by running the forward pass under
    :func:`torch.autograd.graph.saved_tensors_hooks`, not estimated from shapes: a
    factorized layer saves its ``n``-wide intermediate, a narrow layer its narrow output.
    """
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:  # the parameters are counted above
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(inputs), targets)
    del loss
    activations = sum(seen.values())
    return {"parameters": params, "gradients": params,
            "optimizer": optimizer_states * params, "activations": activations,
            "total": (2 + optimizer_states) * params + activations}
