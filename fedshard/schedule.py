"""Learning-rate schedules over server rounds (the lr each round's clients start from)."""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "cosine_lr", "round_lr"]

#: ``cosine`` (the paper's, Sec. 4.1) or ``constant``.
LR_SCHEDULES = ("cosine", "constant")


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
