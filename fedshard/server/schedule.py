"""A run's rounds (:class:`RunRounds`: Flower's round to the run's) and the learning-rate
schedule over them (the lr each round's clients start from)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
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

__all__ = ["RunRounds", "cosine_lr", "round_lr", "round_recipe"]


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


@dataclass
class RunRounds:
    """A run's rounds: how many it has and how many were done before this launch. The one
    place where Flower's round number becomes the run's.

    Flower counts the rounds of every ``start()`` from 1. A run resumed after ``completed``
    rounds (:meth:`~fedshard.server.base.KeepRatioStrategy.resume`) goes on at round
    ``completed + 1``, so that its lr schedule, random streams, history and files continue as
    if it had not stopped: the strategy's hooks take Flower's round and work with
    :meth:`of` it.

    Attributes
    ----------
    total : int or None
        The run's number of rounds (its lr schedule's length, its last round); ``None``:
        unknown (the cosine schedule then gives the base lr, and the end of the run is
        nowhere marked).
    completed : int
        Rounds completed before this launch (0 for a fresh run).
    """

    total: int | None = None
    completed: int = 0

    def of(self, flower_round: int) -> int:
        """The run's round for Flower's ``flower_round`` of this launch.

        Raises
        ------
        ValueError
            If that round lies beyond :attr:`total`: Flower's ``start()`` was given more
            rounds than the strategy (the round is not started).
        """
        server_round = flower_round + self.completed
        if self.total is not None and server_round > self.total:
            after = (f" after {self.completed} completed rounds, i.e. "
                     f"num_rounds={self.total - self.completed} for this launch"
                     if self.completed else "")
            raise ValueError(
                f"Round {server_round} of a run the strategy was built for with "
                f"num_rounds={self.total} (its lr schedule's length and its last round): "
                "Flower's start() was given more rounds than the strategy. Give start() the "
                f"strategy's number of rounds{after}; round {server_round} is not started.")
        return server_round

    def is_last(self, server_round: int) -> bool:
        """Whether the run's round ``server_round`` is its last (``False`` when the number of
        rounds is unknown)."""
        return self.total is not None and server_round == self.total


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
