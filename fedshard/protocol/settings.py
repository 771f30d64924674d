"""The ``train`` message's config: the round's :class:`~fedshard.settings.LocalTraining`
recipe plus the node's per-round fields (:class:`TrainSettings`).

Which settings travel, under which keys and how ``None`` is written, is declared with each
setting (:func:`fedshard.settings.setting`'s ``wire``); the keys below are derived from it.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, ClassVar

from flwr.app import ConfigRecord

from fedshard.sampling import SHARDING_METHODS, as_keep_ratio
from fedshard.settings import (
    ROUND_LR,
    WIDTH_METHODS,
    LocalTraining,
    Problem,
    Rule,
    SettingsError,
    encoded_none,
    missing_on_wire,
    one_of,
    rule,
    setting,
    value_type,
    wire_key,
)

__all__ = ["NODE_KEYS", "RECIPE_KEYS", "TRAIN_CONFIG_KEYS", "TrainSettings"]

_COUNT = rule(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "expected an integer ≥ 0")


@dataclass(frozen=True, kw_only=True)
class TrainSettings(LocalTraining):
    """A node's settings for one round, the ``train`` message's ``config``: the run's
    :class:`~fedshard.settings.LocalTraining` recipe for this round plus the per-round fields.

    Attributes
    ----------
    lr : float
        This round's rate, the schedule's value (≥ 0: a schedule or a round's config may take
        it to 0, a round that changes nothing); ``lr_schedule`` is ``"constant"`` (within the
        round).
    server_round : int
        The run's round (resumed rounds included).
    keep_ratio : float
        The keep ratio the node trains at, in ``(0, 1]``.
    train_seed : int
        Seeds the node's data order and its torch RNG for this round.
    sharding_method : str
        The sharding method (``"none"``: the node trains the dense model; a width-slicing
        method: a narrow model, :mod:`fedshard.protocol.slices`); ``method`` on the wire.

    Notes
    -----
    The recipe's fields travel under their names in kebab case (:data:`TRAIN_CONFIG_KEYS`),
    all but ``lr_schedule``; ClipLR off is ``clip_lr_tau=None`` here and ``0.0`` on the wire.
    A config without ``factor-step`` (an older server) means ``"plain"``.
    """

    _RULES: ClassVar[dict[str, Rule]] = {"lr": ROUND_LR}

    server_round: int = setting(MISSING, _COUNT, run=False, wire=True)
    keep_ratio: float = setting(MISSING, None, run=False, wire=True)  # as_keep_ratio's check
    train_seed: int = setting(MISSING, _COUNT, run=False, wire=True)
    sharding_method: str = setting(MISSING, one_of(SHARDING_METHODS + WIDTH_METHODS), run=False,
                                   wire="method")

    def __post_init__(self) -> None:
        super().__post_init__()
        as_keep_ratio(self.keep_ratio, "keep-ratio")

    def problems(self) -> list[Problem]:
        found = super().problems()
        if self.lr is None:  # a recipe may leave it to the schedule; a round may not
            found.append(Problem((("lr", None),), "expected the round's lr (≥ 0)"))
        return found

    @classmethod
    def of(cls, training: LocalTraining, *, lr: float, server_round: int, keep_ratio: float,
           train_seed: int, method: str) -> TrainSettings:
        """``training`` at round ``server_round`` (its scheduled rate ``lr``) for one node."""
        recipe = {f.name: getattr(training, f.name) for f in fields(LocalTraining)}
        recipe.update(lr=lr, lr_schedule="constant")
        return cls(**recipe, server_round=server_round, keep_ratio=keep_ratio,
                   train_seed=train_seed, sharding_method=method)

    def to_record(self, base: ConfigRecord | None = None) -> ConfigRecord:
        """A fresh ConfigRecord: ``base``'s entries (never modified), then these settings."""
        cfg = ConfigRecord(dict(base) if base is not None else {})
        for f in _WIRE:
            value = getattr(self, f.name)
            has_none, none = encoded_none(f, "wire")
            cfg[_key(f)] = none if value is None and has_none else value
        return cfg

    @classmethod
    def from_record(cls, cfg: ConfigRecord) -> TrainSettings:
        """Read a ``train`` message's config; a missing, mistyped or invalid entry raises
        ``ValueError`` (the node's reply becomes an error and this round is not trained)."""
        values: dict[str, Any] = {}
        for f in _WIRE:
            key, kind = _key(f), value_type(cls, f.name)
            may_miss, meaning = missing_on_wire(f)
            value: Any = cfg.get(key, meaning if may_miss else None)
            ok = isinstance(value, str) if kind is str else (
                isinstance(value, (int, float)) and not isinstance(value, bool))
            if not ok:
                raise ValueError(
                    f"train config {key}={value!r}: expected a "
                    f"{'string' if kind is str else 'number'}; the server and this node "
                    "speak different versions of the fedshard protocol, so this round is not "
                    "trained")
            value = kind(value)
            has_none, none = encoded_none(f, "wire")
            if has_none and value <= none:
                value = None
            values[f.name] = value
        try:
            return cls(lr_schedule="constant", **values)
        except SettingsError as err:
            raise ValueError(f"{err}\nThe server sent settings this node cannot train with, "
                             "so this round is not trained.") from err


def _key(f: Field[Any]) -> str:
    key = wire_key(f)
    assert key is not None
    return key


#: The settings that travel in every ``train`` config, in the order they are written.
_WIRE: tuple[Field[Any], ...] = tuple(f for f in fields(TrainSettings) if wire_key(f))

#: The ``train`` config's keys, in the order they are written.
TRAIN_CONFIG_KEYS: tuple[str, ...] = tuple(_key(f) for f in _WIRE)

#: The ``train`` config's keys that are the local-training recipe: a value the user's round
#: config sets for one of them is sent as is (:func:`fedshard.server.schedule.round_recipe`).
RECIPE_KEYS: tuple[str, ...] = tuple(_key(f) for f in fields(LocalTraining) if wire_key(f))

#: The per-node keys of the ``train`` config: always the strategy's (the node's keep ratio,
#: its training seed, the method and the run's round describe what it was sent).
NODE_KEYS: tuple[str, ...] = tuple(k for k in TRAIN_CONFIG_KEYS if k not in RECIPE_KEYS)
