"""``with_(cfg, **changes)``: a :class:`TrainConfig` with some fields of it, of its recipe
(:class:`LocalTraining`) or of its fast options (:class:`FastOptions`) changed, for tests that
vary one setting at a time."""

from __future__ import annotations

import dataclasses
from typing import Any

from fedshard.client.train import TrainConfig
from fedshard.client.train.fast import FastOptions
from fedshard.settings import LocalTraining

_RECIPE = {f.name for f in dataclasses.fields(LocalTraining)}
_FAST = {f.name for f in dataclasses.fields(FastOptions)}


def with_(cfg: TrainConfig | None = None, **changes: Any) -> TrainConfig:
    cfg = cfg or TrainConfig()
    recipe = {k: changes.pop(k) for k in list(changes) if k in _RECIPE}
    fast = {k: changes.pop(k) for k in list(changes) if k in _FAST}
    if recipe:
        changes["recipe"] = dataclasses.replace(cfg.recipe, **recipe)
    if fast:
        base = cfg.fast if isinstance(cfg.fast, FastOptions) else FastOptions()
        changes["fast"] = dataclasses.replace(base, **fast)
    return dataclasses.replace(cfg, **changes)
