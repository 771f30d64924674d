"""Learning-rate schedules over server rounds (the lr each round's clients start from)."""

from __future__ import annotations

import math
from logging import INFO, WARNING
from typing import Any

from flwr.common.logger import log

from fedshard.settings import LR_SCHEDULES

__all__ = [
    "DEFAULT_LR", "FLOWER_DEFAULT_ROUNDS", "LR_SCHEDULES", "base_lr", "cosine_lr", "round_lr",
    "schedule_length",
]

#: The strategy's lr when neither its ``lr`` nor the caller's ``train_config["lr"]`` gives one.
DEFAULT_LR = 0.05

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


def base_lr(given: float | None, caller: Any, schedule: str) -> float:
    """The lr the schedule starts from: the strategy's ``lr`` if given, else the caller's
    ``train_config["lr"]`` (``caller``, ``None`` if absent; FedAvg users pass it there), else
    :data:`DEFAULT_LR`. A caller's lr that the strategy's replaces is warned about."""
    if given is not None:
        if caller is not None:
            log(WARNING, "train_config['lr']=%s is replaced: the strategy's lr=%g and its %s "
                "schedule set the lr each node gets every round.", caller, given, schedule)
        return given
    if caller is not None:
        if isinstance(caller, bool) or not isinstance(caller, (int, float)) or not caller > 0:
            raise ValueError(f"train_config['lr']={caller!r}: expected a number > 0 (the base "
                             "of the strategy's lr schedule); no round was run.")
        log(INFO, "lr=%g from train_config['lr'], with the %s schedule.", caller, schedule)
        return float(caller)
    return DEFAULT_LR
