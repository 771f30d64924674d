"""Width slicing: which channels of the global model a node trains, and their average.

A *width family* builds the same architecture at any width (the MLP's hidden units,
ResNet-18's first-stage channels): a narrow model has the global model's ``state_dict`` keys,
each entry no larger in any dimension. A node at width ratio ``ρ`` trains, in every dimension
where its entry is smaller (a hidden dimension: ``k = ⌈ρK⌉`` of ``K`` channels), the channels

- ``"heterofl"`` and ``"ordered-dropout"``: ``0, 1, ..., k−1``, the same every round (HeteroFL,
  Diao et al., ICLR 2021, Sec. 3.1; FjORD, Horváth et al., NeurIPS 2021, Sec. 3.1: a nested
  ordered sub-model);
- ``"fedrolex"``: ``t, t+1, ..., t+k−1 (mod K)`` in round ``t``, a window that rolls one
  channel a round, so every channel is trained (FedRolex, Alam et al., NeurIPS 2022, Eq. 2).

Input and output dimensions (pixels, classes) are the same size in every model and are kept
whole. The slice of a dimension depends only on its full and narrow sizes and the round, so
a hidden dimension gets the same channels in every entry that has it: a layer's output
channels are the next layer's input channels (and a residual sum adds matching channels).

The server averages every element over the nodes that trained it, weighted by their data size
(:func:`aggregate_slices`); an element no node trained keeps its value.

Notes
-----
Numpy only, but for :class:`WidthFamily`, which builds torch models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedshard.settings import WIDTH_METHODS

__all__ = ["SliceIndex", "SliceUpdate", "WidthFamily", "aggregate_slices", "channel_indices",
           "slice_indices", "take"]

#: Per entry of a ``state_dict``: for each dimension, the global indices the narrow entry holds.
SliceIndex = dict[str, tuple[np.ndarray, ...]]


class WidthFamily:
    """A model at any width: ``build(width)`` makes it, ``width`` is the global model's.

    Parameters
    ----------
    build : callable
        ``build(width) -> nn.Module``; every width gives the same ``state_dict`` keys, each
        entry no larger than the global model's in any dimension.
    width : int
        The global model's width.
    multiple : int
        Widths are multiples of it (e.g. the GroupNorm groups of a ResNet: every stage's
        channels must divide into them).

    Examples
    --------
    >>> from fedshard.models import mlp
    >>> family = WidthFamily(lambda w: mlp(784, 10, width=w, depth=3), 256)
    >>> family.width_for(0.1)
    26
    """

    def __init__(self, build: Callable[[int], nn.Module], width: int, multiple: int = 1) -> None:
        for name, v in (("width", width), ("multiple", multiple)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"WidthFamily({name}={v!r}): expected an integer ≥ 1; no "
                                 "family was made.")
        if width % multiple:
            raise ValueError(f"WidthFamily(width={width}, multiple={multiple}): the global "
                             "width must be a multiple of `multiple`; no family was made.")
        self.build, self.width, self.multiple = build, width, multiple
        self._shapes: dict[int, dict[str, tuple[int, ...]]] = {}

    def __call__(self, width: int) -> nn.Module:
        """The model at ``width`` (checked against :attr:`widths`)."""
        if width not in self.widths:
            raise ValueError(f"width={width!r}: expected a multiple of {self.multiple} in "
                             f"[{self.multiple}, {self.width}]; no model was built.")
        return self.build(width)

    @property
    def widths(self) -> range:
        """Every width the family builds, ascending."""
        return range(self.multiple, self.width + 1, self.multiple)

    def width_for(self, ratio: float) -> int:
        """HeteroFL's ``⌈ρ·width⌉``, rounded up to a multiple, at least one multiple."""
        if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"width ratio {ratio!r}: expected a number in (0, 1]")
        k = math.ceil(round(ratio * self.width, 9) / self.multiple) * self.multiple
        return min(self.width, max(self.multiple, k))

    def shapes(self, width: int) -> dict[str, tuple[int, ...]]:
        """The ``state_dict`` shapes at ``width`` (built once on the meta device, kept)."""
        if width not in self._shapes:
            with torch.device("meta"):
                model = self(width)
            self._shapes[width] = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        return self._shapes[width]

    def hidden_layers(self, width: int) -> list[str]:
        """The Linear/Conv2d modules whose outputs narrow with the width (HeteroFL's scaler
        follows them): those whose weight's first dimension is smaller at ``width`` than at
        the global width."""
        narrow, full = self.shapes(width), self.shapes(self.width)
        return [k[: -len(".weight")] for k, shape in narrow.items()
                if k.endswith(".weight") and len(shape) >= 2 and shape[0] < full[k][0]]


def channel_indices(method: str, full: int, narrow: int, server_round: int) -> np.ndarray:
    """The ``narrow`` of ``full`` channels a node trains in ``server_round`` (module docstring).

    Raises
    ------
    ValueError
        For an unknown method or sizes outside ``1 ≤ narrow ≤ full``.
    """
    if method not in WIDTH_METHODS:
        raise ValueError(f"method={method!r}: expected one of {WIDTH_METHODS}")
    if not 1 <= narrow <= full:
        raise ValueError(f"narrow={narrow}, full={full}: expected 1 ≤ narrow ≤ full")
    if method != "fedrolex" or narrow == full:
        return np.arange(narrow, dtype=np.int64)
    return (server_round + np.arange(narrow, dtype=np.int64)) % full


def slice_indices(full: Mapping[str, tuple[int, ...]], narrow: Mapping[str, tuple[int, ...]],
                  method: str, server_round: int) -> SliceIndex:
    """For every entry, the global indices of each of its dimensions in the narrow model.

    Raises
    ------
    ValueError
        If the two ``state_dict`` shapes do not have the same keys, or an entry of the narrow
        one is larger in a dimension or has another number of dimensions (all listed).
    """
    problems = [f"{k}: {tuple(narrow.get(k, ()))} vs {tuple(full.get(k, ()))}"
                for k in sorted(set(full) | set(narrow))
                if k not in full or k not in narrow or len(full[k]) != len(narrow[k])
                or any(n > f for n, f in zip(narrow[k], full[k], strict=True))]
    if problems:
        raise ValueError("the narrow model is not a slice of the global one (narrow vs "
                         f"global shape): {'; '.join(problems[:8])}; expected the same "
                         "state_dict keys, each entry no larger in any dimension")
    return {k: tuple(channel_indices(method, f, n, server_round)
                     for n, f in zip(narrow[k], full[k], strict=True)) for k in full}


def take(state: Mapping[str, np.ndarray], index: SliceIndex) -> dict[str, np.ndarray]:
    """The narrow ``state_dict``: each entry's elements at ``index`` (fresh arrays)."""
    return {k: np.ascontiguousarray(v[np.ix_(*index[k])]) if v.ndim else v.copy()
            for k, v in state.items()}


@dataclass(frozen=True)
class SliceUpdate:
    """One node's trained narrow ``state_dict`` (``values``), where it sits in the global one
    (``index``) and its aggregation weight (its data size)."""

    weight: float
    values: Mapping[str, np.ndarray]
    index: SliceIndex


def aggregate_slices(current: Mapping[str, np.ndarray],
                     updates: Sequence[SliceUpdate]) -> dict[str, np.ndarray]:
    """The new global ``state_dict``: every floating element is the weighted mean of the
    values of the nodes that trained it, ``Σ D_k x_k / Σ D_k`` over those nodes; an element
    no node trained, and every non-floating entry, keeps its ``current`` value.

    Notes
    -----
    HeteroFL (Diao et al., 2021, Sec. 3.1, Eq. 2) averages each parameter over the clients
    whose sub-model holds it; FedRolex and FjORD aggregate the same way. The weights here are
    the nodes' data sizes, as in FedAvg.
    """
    out: dict[str, np.ndarray] = {}
    for key, now in current.items():
        if not np.issubdtype(now.dtype, np.floating) or not updates:
            out[key] = now.copy()
            continue
        total = np.zeros(now.shape, dtype=np.float64)  # Σ D_k x_k at each element
        weight = np.zeros(now.shape, dtype=np.float64)  # Σ D_k of the nodes holding it
        for u in updates:
            at = np.ix_(*u.index[key]) if now.ndim else ()
            # np.ix_ index sets are distinct within a dimension, so += adds once per element
            total[at] += u.weight * np.asarray(u.values[key], dtype=np.float64)
            weight[at] += u.weight
        held = weight > 0
        new = np.asarray(now, dtype=np.float64).copy()
        new[held] = total[held] / weight[held]
        out[key] = new.astype(now.dtype)
    return out
