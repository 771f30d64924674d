"""The ``train`` message of width slicing: a narrow model's arrays and what the node builds.

Under :class:`~fedshard.server.width.WidthSlicing` a node is sent, instead of factors, the
``state_dict`` of a narrow model of the same family (every entry under its own name, sliced
from the global one: :mod:`fedshard.width.slicing`) and, in its ``"config"``, the keys of
:class:`SliceOrder` next to :class:`~fedshard.protocol.TrainSettings`'s: the width to build,
the full width, HeteroFL's scaler and ordered dropout's widths. The reply is the trained
``state_dict`` (same keys, shapes and dtypes, finite), checked as any reply
(:func:`~fedshard.protocol.check_train_reply`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord

from fedshard.protocol.arrays import array_record, encode_array
from fedshard.protocol.shards import SentShard
from fedshard.settings import (
    BOOL,
    Problem,
    Settings,
    SettingsError,
    missing_on_wire,
    rule,
    setting,
    wire_key,
)

__all__ = ["SLICE_ORDER_KEYS", "SliceOrder", "encode_slices"]


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _widths(v: Any) -> bool:
    return isinstance(v, tuple) and all(_whole(w) and w >= 1 for w in v) \
        and list(v) == sorted(set(v))


@dataclass(frozen=True)
class SliceOrder(Settings):
    """What a node of width slicing builds and how it trains it this round.

    Each field is declared with its wire key (:func:`fedshard.settings.setting`'s ``wire``),
    the ``train`` config key it travels under; the keys are :data:`SLICE_ORDER_KEYS`.

    Attributes
    ----------
    width : int
        The width of the narrow model (its family's width argument, e.g. the MLP's hidden
        units or ResNet's first-stage channels), ``1 ≤ width ≤ full_width``; ``slice-width``
        on the wire.
    full_width : int
        The global model's width; ``model-width`` on the wire, as in the run config.
    scaler : bool
        HeteroFL's scaler for this node: divide each hidden layer's output by
        ``width / full_width`` while training; ``slice-scaler`` on the wire (the run config's
        ``width-scaler`` is the run's switch, which ordered dropout ignores).
    od_widths : tuple of int
        Ordered dropout: the widths a batch may train (ascending, the last is ``width``);
        empty for the other methods; ``od-batch-widths`` on the wire (the run config's
        ``od-widths`` is the grid size D they are drawn from).
    od_distill : bool
        Ordered dropout's self-distillation; ``od-distill`` on the wire, as in the run config.

    Raises
    ------
    ValueError
        (:class:`~fedshard.settings.SettingsError`) naming every field that breaks its rule,
        by its wire key: the node cannot build its narrow model, so the round is not trained.
    """

    width: int = setting(MISSING, rule(lambda v: _whole(v) and v >= 1,
                                       "expected an integer ≥ 1"), run=False,
                         wire="slice-width")
    full_width: int = setting(MISSING, rule(lambda v: _whole(v) and v >= 1,
                                            "expected an integer ≥ 1"), run=False,
                              wire="model-width")
    scaler: bool = setting(False, BOOL, run=False, wire="slice-scaler", wire_missing=False)
    od_widths: tuple[int, ...] = setting(
        (), rule(_widths, "expected ascending distinct integers ≥ 1"), run=False,
        wire="od-batch-widths", wire_missing=())
    od_distill: bool = setting(False, BOOL, run=False, wire="od-distill", wire_missing=False)

    def __post_init__(self) -> None:
        found = self.problems()
        if found:  # named by their wire keys: what a node reads, and what it logs
            keys = {f.name: _key(f) for f in _WIRE}
            raise SettingsError(
                "train config of width slicing",
                [Problem(tuple((keys.get(n, n), v) for n, v in p.about), p.expected)
                 for p in found],
                "the node cannot build its narrow model, so this round is not trained")

    def _combinations(self) -> list[Problem]:
        out = []
        if _whole(self.width) and _whole(self.full_width) and self.width > self.full_width:
            out.append(Problem((("width", self.width), ("full_width", self.full_width)),
                               "expected the narrow width to be at most the global one"))
        if self.od_widths and _widths(self.od_widths) and self.od_widths[-1] != self.width:
            out.append(Problem((("od_widths", self.od_widths), ("width", self.width)),
                               "expected ordered dropout's widths to end with the node's own"))
        return out

    @property
    def ratio(self) -> float:
        """``width / full_width``: the scaler's rate."""
        return self.width / self.full_width

    def to_record(self, cfg: ConfigRecord) -> ConfigRecord:
        """``cfg`` with these keys set (``cfg`` is the node's own fresh record)."""
        for f in _WIRE:
            value = getattr(self, f.name)
            cfg[_key(f)] = list(value) if isinstance(value, tuple) else value
        return cfg

    @classmethod
    def from_record(cls, cfg: Mapping[str, Any]) -> SliceOrder:
        """Read a ``train`` config; a missing or invalid entry raises ``ValueError``."""
        missing = [_key(f) for f in _WIRE if _key(f) not in cfg and not missing_on_wire(f)[0]]
        if missing:
            raise ValueError(f"train config: missing {missing}; a width-slicing message "
                             "names the width to build, so this round is not trained (the "
                             "server and this node speak different versions of the fedshard "
                             "protocol)")
        values: dict[str, Any] = {}
        for f in _WIRE:
            value = cfg.get(_key(f), missing_on_wire(f)[1])
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


def _key(f: Field[Any]) -> str:
    key = wire_key(f)
    assert key is not None
    return key


#: The fields of :class:`SliceOrder`, in the order they are written.
_WIRE: tuple[Field[Any], ...] = tuple(f for f in fields(SliceOrder) if wire_key(f))

#: The ``train`` config keys of width slicing (:class:`SliceOrder`), next to
#: :data:`fedshard.protocol.TRAIN_CONFIG_KEYS`.
SLICE_ORDER_KEYS: tuple[str, ...] = tuple(_key(f) for f in _WIRE)


def encode_slices(sliced: Mapping[str, np.ndarray], keep_ratio: float,
                  ) -> tuple[ArrayRecord, SentShard]:
    """One node's ``train`` arrays (fresh, its own) and what its reply is checked against:
    every entry of the narrow ``state_dict`` ``sliced``, same key, shape and dtype back."""
    out = {k: encode_array(np.ascontiguousarray(v)) for k, v in sliced.items()}
    expected = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in sliced.items()}
    nbytes = sum(len(a.data) for a in out.values())
    return array_record(out), SentShard(keep_ratio, {}, expected, nbytes, dict(sliced))
