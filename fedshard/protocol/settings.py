"""The ``train`` message's config: the round's :class:`~fedshard.settings.LocalTraining`
recipe plus the node's per-round fields (:class:`TrainSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from flwr.app import ConfigRecord

from fedshard.sampling import as_keep_ratio
from fedshard.settings import LocalTraining, Problem, SettingsError

__all__ = ["TRAIN_CONFIG_KEYS", "TrainSettings"]

#: The ``train`` config's keys, in the order they are written.
TRAIN_CONFIG_KEYS = (
    "server-round", "lr", "local-epochs", "batch-size", "momentum", "frobenius-decay",
    "clip-lr-tau", "weight-decay", "keep-ratio", "train-seed", "method", "factor-step",
)

# key -> its type on the wire (lr_schedule stays on the server: a node gets its round's lr)
_WIRE_TYPES = {"server-round": int, "lr": float, "local-epochs": int, "batch-size": int,
               "momentum": float, "frobenius-decay": float, "clip-lr-tau": float,
               "weight-decay": float, "keep-ratio": float, "train-seed": int, "method": str,
               "factor-step": str}

#: Keys a node may miss (a server from before the key existed) -> the value that means.
_WIRE_DEFAULTS = {"factor-step": "plain"}


@dataclass(frozen=True, kw_only=True)
class TrainSettings(LocalTraining):
    """A node's settings for one round, the ``train`` message's ``config``: the run's
    :class:`~fedshard.settings.LocalTraining` recipe for this round plus the per-round fields.

    Attributes
    ----------
    lr : float
        This round's rate, the schedule's value (≥ 0: a schedule may reach 0, a round that
        changes nothing); ``lr_schedule`` is ``"constant"`` (within the round).
    server_round : int
        The run's round (resumed rounds included).
    keep_ratio : float
        The keep ratio the node trains at, in ``(0, 1]``.
    train_seed : int
        Seeds the node's data order and its torch RNG for this round.
    method : str
        The sharding method (``"none"``: the node trains the dense model).

    Notes
    -----
    Every field but ``lr_schedule`` travels as its name in kebab case
    (:data:`TRAIN_CONFIG_KEYS`); ClipLR off is ``clip_lr_tau=None`` here and ``0.0`` on the wire.
    A config without ``factor-step`` (an older server) means ``"plain"``.
    """

    _RULE_OF: ClassVar[dict[str, str]] = {"lr": "round_lr"}

    lr: float = 0.0  # keeps LocalTraining's field order; always given (of, from_record)
    server_round: int
    keep_ratio: float
    train_seed: int
    method: str

    def __post_init__(self) -> None:
        super().__post_init__()
        as_keep_ratio(self.keep_ratio, "keep-ratio")

    def problems(self) -> list[Problem]:
        found = super().problems()
        if self.lr is None:  # a recipe may leave it to start(); a round may not
            found.append(Problem((("lr", None),), "expected the round's lr (≥ 0)"))
        return found

    @classmethod
    def of(cls, training: LocalTraining, *, lr: float, server_round: int, keep_ratio: float,
           train_seed: int, method: str) -> TrainSettings:
        """``training`` at round ``server_round`` (its scheduled rate ``lr``) for one node."""
        recipe = {f.name: getattr(training, f.name) for f in fields(LocalTraining)}
        recipe.update(lr=lr, lr_schedule="constant")
        return cls(**recipe, server_round=server_round, keep_ratio=keep_ratio,
                   train_seed=train_seed, method=method)

    def to_record(self, base: ConfigRecord | None = None) -> ConfigRecord:
        """A fresh ConfigRecord: ``base``'s entries (never modified), then these settings."""
        cfg = ConfigRecord(dict(base) if base is not None else {})
        for key in TRAIN_CONFIG_KEYS:
            value = getattr(self, key.replace("-", "_"))
            if key == "clip-lr-tau":
                value = float(value) if value is not None else 0.0
            cfg[key] = value
        return cfg

    @classmethod
    def from_record(cls, cfg: ConfigRecord) -> TrainSettings:
        """Read a ``train`` message's config; a missing, mistyped or invalid entry raises
        ``ValueError`` (the node's reply becomes an error and this round is not trained)."""
        values: dict[str, Any] = {}
        for key, kind in _WIRE_TYPES.items():
            value: Any = cfg.get(key, _WIRE_DEFAULTS.get(key))
            if kind is str:
                ok = isinstance(value, str)
            else:
                ok = not isinstance(value, bool) and isinstance(value, (int, float))
            if not ok:
                raise ValueError(
                    f"train config {key}={value!r}: expected a "
                    f"{'string' if kind is str else 'number'}; the server and this node "
                    "speak different versions of the fedshard protocol, so this round is not "
                    "trained")
            values[key.replace("-", "_")] = kind(value)
        if values["clip_lr_tau"] <= 0:
            values["clip_lr_tau"] = None
        try:
            return cls(lr_schedule="constant", **values)
        except SettingsError as err:
            raise ValueError(f"{err}\nThe server sent settings this node cannot train with, "
                             "so this round is not trained.") from err
