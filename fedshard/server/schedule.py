"""Learning-rate schedules over server rounds (the lr each round's clients start from)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from fedshard.protocol.settings import RECIPE_KEYS
from fedshard.settings import (
    LR_SCHEDULES,
    LocalTraining,
    ProblemsError,
    SettingsError,
    encoded_none,
    wire_key,
)

__all__ = ["FLOWER_DEFAULT_ROUNDS", "cosine_lr", "round_lr", "round_recipe", "schedule_length"]

#: ``Strategy.start``'s default number of rounds in Flower.
FLOWER_DEFAULT_ROUNDS = 3


def cosine_lr(lr: float, server_round: int, num_rounds: int) -> float:
    """Cosine-annealed learning rate for ``server_round`` (1-based) over ``num_rounds`` rounds.

    ``lr * (1 + cos(pi * (t - 1) / T)) / 2``: round 1 uses ``lr``, the last round a small but
    non-zero rate (Loshchilov & Hutter, as in the paper's Sec. 4.1).
    """
    if num_rounds < 1 or not 1 <= server_round <= num_rounds:
        raise ValueError(f"server_round={server_round} is outside [1, num_rounds={num_rounds}]")
    return lr * 0.5 * (1.0 + math.cos(math.pi * (server_round - 1) / num_rounds))


def round_lr(schedule: str, lr: float, server_round: int, num_rounds: int) -> float:
    """The learning rate of ``server_round`` under ``schedule`` (see :data:`LR_SCHEDULES`)."""
    if schedule == "cosine":
        return cosine_lr(lr, server_round, num_rounds)
    if schedule == "constant":
        return lr
    raise ValueError(f"lr schedule {schedule!r}: expected one of {LR_SCHEDULES}")


def schedule_length(given: int | None, at_start: int | None, completed: int = 0) -> int:
    """The total number of rounds of a run (the length of its lr schedule).

    Parameters
    ----------
    given : int or None
        ``num_rounds`` of the strategy's constructor (optional).
    at_start : int or None
        ``num_rounds`` of ``start()``: the rounds this call runs.
    completed : int
        Rounds done before this ``start()`` (a resumed run).

    Returns
    -------
    int
        ``completed + at_start``; without ``at_start``, ``given`` (or ``completed`` + Flower's
        default of 3 rounds).

    Raises
    ------
    ValueError
        If both are given and disagree, or the result is < 1.
    """
    if at_start is None:
        total = given if given is not None else completed + FLOWER_DEFAULT_ROUNDS
    else:
        total = completed + at_start
        if given is not None and given != total:
            after = f" after {completed} completed rounds" if completed else ""
            raise ValueError(
                f"num_rounds is given twice and differs: SpectralSharding(num_rounds={given}) but "
                f"start(num_rounds={at_start}){after}, i.e. {total} rounds in all. Give it once "
                "(to start(); the lr schedule follows it); no round was run.")
    if total < 1 or total <= completed:
        raise ValueError(f"num_rounds: expected at least one round to run after {completed} "
                         f"completed, found a schedule of {total}; no round was run.")
    return total


def round_recipe(training: LocalTraining, config: Mapping[str, Any], server_round: int,
                 num_rounds: int | None) -> tuple[LocalTraining, float, list[str]]:
    """This round's recipe: the user's ``config`` entries over the strategy's ``training``.

    Precedence, key by key (:data:`RECIPE_KEYS`): a value in ``config`` (what the caller's
    ``train_config`` or its ``configure_train`` override put there) wins and is sent as is;
    a key it does not set takes the strategy's value; the lr then follows ``training``'s
    schedule from its ``lr`` (:data:`fedshard.settings.DEFAULT_LR` if ``None``) over
    ``num_rounds`` (``None``: unknown, the base lr every round). ``clip-lr-tau`` 0 means
    ClipLR off, as on the wire.

    Returns
    -------
    LocalTraining, float, list of str
        The recipe with the user's values, the lr to send, the keys taken from ``config``.

    Raises
    ------
    fedshard.settings.ProblemsError
        (a ``ValueError``) naming every user value that is not a valid setting, by its key;
        the round is not started.
    """
    user = {key: config[key] for key in RECIPE_KEYS if key in config}
    values: dict[str, Any] = {}
    for f in fields(LocalTraining):
        key = wire_key(f)
        if key in user:  # as on the wire: e.g. clip-lr-tau 0 is ClipLR off
            has_none, none = encoded_none(f, "wire")
            values[f.name] = None if has_none and user[key] == none else user[key]
    try:
        recipe = replace(training, **values) if values else training
    except SettingsError as err:  # named as the config's keys (kebab case)
        raise ProblemsError(f"train config of round {server_round} (the entries your "
                            "train_config or configure_train set)",
                            [p.render("run-config") for p in err.found],
                            "this round is not started") from None
    if "lr" in user:
        return recipe, float(user["lr"]), sorted(user)
    base = training.base_lr
    if num_rounds is None or server_round > num_rounds:
        return recipe, base, sorted(user)
    return recipe, round_lr(training.lr_schedule, base, server_round, num_rounds), sorted(user)
