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
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord

from fedshard.protocol.arrays import array_record, encode_array
from fedshard.protocol.shards import SentShard

__all__ = ["FULL_WIDTH", "OD_DISTILL", "OD_WIDTHS", "SCALER", "WIDTH", "SliceOrder",
           "encode_slices"]

WIDTH = "model-width"  # the width the node builds its narrow model with
FULL_WIDTH = "full-width"  # the global model's width
SCALER = "width-scaler"  # HeteroFL's scaler on (bool)
OD_WIDTHS = "od-widths"  # ordered dropout: the widths a batch may take (list of int)
OD_DISTILL = "od-distill"  # ordered dropout: self-distillation on (bool)


@dataclass(frozen=True)
class SliceOrder:
    """What a node of width slicing builds and how it trains it this round.

    Attributes
    ----------
    width : int
        The width of the narrow model (its family's width argument, e.g. the MLP's hidden
        units or ResNet's first-stage channels), ``1 ≤ width ≤ full_width``.
    full_width : int
        The global model's width.
    scaler : bool
        HeteroFL's scaler: divide each hidden layer's output by ``width / full_width`` while
        training.
    od_widths : tuple of int
        Ordered dropout: the widths a batch may train (ascending, the last is ``width``);
        empty for the other methods.
    od_distill : bool
        Ordered dropout's self-distillation.
    """

    width: int
    full_width: int
    scaler: bool = False
    od_widths: tuple[int, ...] = ()
    od_distill: bool = False

    def __post_init__(self) -> None:
        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        problems = []
        if not (whole(self.full_width) and self.full_width >= 1):
            problems.append(f"{FULL_WIDTH}={self.full_width!r}: expected an integer ≥ 1")
        elif not (whole(self.width) and 1 <= self.width <= self.full_width):
            problems.append(f"{WIDTH}={self.width!r}: expected an integer in "
                            f"[1, {FULL_WIDTH}={self.full_width}]")
        if not isinstance(self.scaler, bool):
            problems.append(f"{SCALER}={self.scaler!r}: expected true or false")
        if not isinstance(self.od_distill, bool):
            problems.append(f"{OD_DISTILL}={self.od_distill!r}: expected true or false")
        widths = self.od_widths
        if widths and not (all(whole(w) for w in widths) and list(widths) == sorted(set(widths))
                           and widths[0] >= 1 and widths[-1] == self.width):
            problems.append(f"{OD_WIDTHS}={list(widths)!r}: expected ascending distinct "
                            f"integers ≥ 1 ending with {WIDTH}={self.width!r}")
        if problems:
            raise ValueError("train config: " + "; ".join(problems) + "; the node cannot build "
                             "its narrow model, so this round is not trained")

    @property
    def ratio(self) -> float:
        """``width / full_width``: the scaler's rate."""
        return self.width / self.full_width

    def to_record(self, cfg: ConfigRecord) -> ConfigRecord:
        """``cfg`` with these keys set (``cfg`` is the node's own fresh record)."""
        cfg[WIDTH], cfg[FULL_WIDTH], cfg[SCALER] = self.width, self.full_width, self.scaler
        if self.od_widths:
            cfg[OD_WIDTHS], cfg[OD_DISTILL] = list(self.od_widths), self.od_distill
        return cfg

    @classmethod
    def from_record(cls, cfg: Mapping[str, Any]) -> SliceOrder:
        """Read a ``train`` config; a missing or invalid entry raises ``ValueError``."""
        missing = [k for k in (WIDTH, FULL_WIDTH) if k not in cfg]
        if missing:
            raise ValueError(f"train config: missing {missing}; a width-slicing message "
                             "names the width to build, so this round is not trained")
        widths = cfg.get(OD_WIDTHS, [])
        return cls(cfg[WIDTH], cfg[FULL_WIDTH], cfg.get(SCALER, False),
                   tuple(widths) if isinstance(widths, list) else widths,
                   cfg.get(OD_DISTILL, False))


def encode_slices(sliced: Mapping[str, np.ndarray], keep_ratio: float,
                  ) -> tuple[ArrayRecord, SentShard]:
    """One node's ``train`` arrays (fresh, its own) and what its reply is checked against:
    every entry of the narrow ``state_dict`` ``sliced``, same key, shape and dtype back."""
    out = {k: encode_array(np.ascontiguousarray(v)) for k, v in sliced.items()}
    expected = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in sliced.items()}
    nbytes = sum(len(a.data) for a in out.values())
    return array_record(out), SentShard(keep_ratio, {}, expected, nbytes, dict(sliced))
