"""What a node says it trained with, in its ``train`` reply: :class:`Receipt`.

The reply's ``"config"`` record (which echoes ``server-round``) carries the optimizer class that
stepped the received factors, its learning rate at the first step, the number of steps the
client rules applied to and whether ClipLR and Frobenius decay were applied. The server
compares them with what it sent (:class:`fedshard.server.callbacks.TrainingReceipts`). A
receipt is a node's word, bounded and checked like every other value a node sends; a reply
without one (an older node) is used as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["RECEIPT_KEYS", "Receipt", "read_receipt"]

#: The reply config's receipt keys.
RECEIPT_KEYS = ("trained-optimizer", "trained-lr", "trained-steps", "trained-clip-lr",
                "trained-frobenius-decay")

#: Longest optimizer name a receipt may carry.
MAX_NAME = 64
#: Most steps a receipt may claim.
MAX_STEPS = 2**31


@dataclass(frozen=True)
class Receipt:
    """What a node trained with.

    Attributes
    ----------
    optimizer : str
        The class of the optimizer that stepped the factors ("": none did).
    lr : float or None
        Its learning rate at the first step.
    steps : int
        Optimizer steps the client rules applied to.
    clip_lr, frobenius_decay : bool
        Whether ClipLR and Frobenius decay were applied (set and some step applied them).
    """

    optimizer: str
    lr: float | None
    steps: int
    clip_lr: bool
    frobenius_decay: bool

    def entries(self) -> dict[str, Any]:
        """The reply config's entries (``trained-lr`` left out when unknown)."""
        out: dict[str, Any] = {"trained-optimizer": self.optimizer, "trained-steps": self.steps,
                               "trained-clip-lr": self.clip_lr,
                               "trained-frobenius-decay": self.frobenius_decay}
        if self.lr is not None:
            out["trained-lr"] = float(self.lr)
        return out


def read_receipt(config: Mapping[str, Any] | None) -> Receipt | str | None:
    """The receipt in a reply's config record, ``None`` when it has none, or why it cannot be
    used (the reply's arrays are still used; the caller logs the reason)."""
    if config is None or not any(k in config for k in RECEIPT_KEYS):
        return None
    name, lr, steps = (config.get("trained-optimizer"), config.get("trained-lr"),
                       config.get("trained-steps"))
    clip, decay = config.get("trained-clip-lr"), config.get("trained-frobenius-decay")
    if not (isinstance(name, str) and len(name) <= MAX_NAME
            and (name == "" or name.isidentifier())):
        return (f"trained-optimizer={str(name)[:40]!r}: expected a class name of at most "
                f"{MAX_NAME} characters")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                           or not math.isfinite(lr) or lr < 0):
        return f"trained-lr={lr!r:.40}: expected a finite number ≥ 0"
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_STEPS:
        return f"trained-steps={steps!r:.40}: expected an integer in [0, 2**31]"
    if not isinstance(clip, bool) or not isinstance(decay, bool):
        return (f"trained-clip-lr={clip!r:.20}, trained-frobenius-decay={decay!r:.20}: "
                "expected True or False")
    return Receipt(name, None if lr is None else float(lr), steps, clip, decay)
