"""The ``train`` message's config: a node's local-training settings for one round."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from flwr.app import ConfigRecord

from fedshard.sampling import as_keep_ratio

__all__ = ["TRAIN_CONFIG_KEYS", "TrainSettings"]


@dataclass(frozen=True)
class TrainSettings:
    """A node's local-training settings for one round: the ``train`` message's ``config``.

    Field ``f`` travels as key ``f`` in kebab case (:data:`TRAIN_CONFIG_KEYS`). ClipLR off is
    ``clip_lr_tau=None`` here and ``0.0`` on the wire.
    """

    server_round: int
    lr: float
    local_epochs: int
    batch_size: int
    momentum: float
    frobenius_decay: float
    clip_lr_tau: float | None
    weight_decay: float
    keep_ratio: float
    train_seed: int
    method: str

    def __post_init__(self) -> None:
        checks = [
            ("lr", math.isfinite(self.lr) and self.lr >= 0, "a finite number >= 0"),
            ("local-epochs", self.local_epochs >= 1, "an integer >= 1"),
            ("batch-size", self.batch_size >= 1, "an integer >= 1"),
            ("momentum", 0 <= self.momentum < 1, "a number in [0, 1)"),
            ("frobenius-decay", math.isfinite(self.frobenius_decay)
             and self.frobenius_decay >= 0, "a finite number >= 0"),
            ("clip-lr-tau", self.clip_lr_tau is None or (
                math.isfinite(self.clip_lr_tau) and self.clip_lr_tau >= 1),
             "τ >= 1, or off"),
            ("weight-decay", math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             "a finite number >= 0"),
        ]
        bad = [f"{k}={getattr(self, k.replace('-', '_'))!r}: expected {want}"
               for k, ok, want in checks if not ok]
        if bad:
            raise ValueError("invalid local-training settings: " + "; ".join(bad))
        as_keep_ratio(self.keep_ratio, "keep-ratio")

    def to_record(self, base: ConfigRecord | None = None) -> ConfigRecord:
        """A fresh ConfigRecord: ``base``'s entries (never modified), then these settings."""
        cfg = ConfigRecord(dict(base) if base is not None else {})
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "clip_lr_tau":
                value = float(value) if value is not None else 0.0
            cfg[f.name.replace("_", "-")] = value
        return cfg

    @classmethod
    def from_record(cls, cfg: ConfigRecord) -> TrainSettings:
        """Read a ``train`` message's config; a missing or mistyped entry raises ``ValueError``
        (the node's reply becomes an error and this round is not trained)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = f.name.replace("_", "-")
            value: Any = cfg.get(key)
            if f.name == "method":
                ok = isinstance(value, str)
            else:
                ok = not isinstance(value, bool) and isinstance(value, (int, float))
            if not ok:
                raise ValueError(
                    f"train config {key}={value!r}: expected a "
                    f"{'string' if f.name == 'method' else 'number'}; the server and this node "
                    "speak different versions of the fedshard protocol, so this round is not "
                    "trained")
            if f.type in ("int", int):
                value = int(value)
            elif f.name != "method":
                value = float(value)
            values[f.name] = value
        if values["clip_lr_tau"] <= 0:
            values["clip_lr_tau"] = None
        return cls(**values)


TRAIN_CONFIG_KEYS = tuple(f.name.replace("_", "-") for f in fields(TrainSettings))
