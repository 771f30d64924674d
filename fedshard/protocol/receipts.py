"""What a node says it trained with, in its ``train`` reply: :class:`Receipt`.

The reply's ``"config"`` record (which echoes ``server-round``) carries the optimizer class that
stepped the received factors, its learning rate at the first step, the number of steps the
client rules applied to and whether ClipLR and Frobenius decay were applied; a node that trained
with DP-SGD (Opacus) also says so, with its noise multiplier σ and clipping norm C
(``trained-dp-sgd``, ``trained-noise-multiplier``, ``trained-max-grad-norm``; left out
otherwise, so the replies of nodes without DP are as before). The server
compares them with what it sent (:class:`fedshard.server.advice.TrainingReceipts`). A
receipt is a node's word, bounded and checked like every other value a node sends; a reply
without one (an older node) is used as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["NO_NOISE_BELOW", "RECEIPT_KEYS", "Receipt", "dp_sgd_problem", "read_receipt"]

#: The reply config's receipt keys.
RECEIPT_KEYS = ("trained-optimizer", "trained-lr", "trained-steps", "trained-clip-lr",
                "trained-frobenius-decay", "trained-dp-sgd", "trained-noise-multiplier",
                "trained-max-grad-norm")

#: A DP-SGD noise multiplier below this adds no noise a float32 sum of clipped gradients can
#: hold (its standard deviation σC is under float32's resolution of one example's C).
NO_NOISE_BELOW = 1e-6


def dp_sgd_problem(noise_multiplier: float | None, max_grad_norm: float | None) -> str | None:
    """Why DP-SGD with noise multiplier σ and clipping norm C is not private or trains
    nothing, or ``None`` when it is neither (an unknown value is not judged).

    σ < :data:`NO_NOISE_BELOW` adds no noise (the updates are released as trained); C = 0
    clips every per-example gradient to zero (nothing trains); σC that is not a finite
    float32 makes every update non-finite."""
    sigma, clip = noise_multiplier, max_grad_norm
    if sigma is not None and sigma < NO_NOISE_BELOW:
        return (f"noise multiplier {sigma:g} adds no noise (below {NO_NOISE_BELOW:g}): the "
                "updates are released as trained and the run is not private")
    if clip is not None and clip <= 0:
        return (f"clipping norm {clip:g} clips every per-example gradient to zero: nothing "
                "trains")
    if sigma is not None and clip is not None and not sigma * clip < 3.4e38:
        return (f"noise multiplier {sigma:g} times clipping norm {clip:g} is not a finite "
                "float32: every update is non-finite")
    return None


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
    dp_sgd : bool
        Whether the factors' gradients were privatized by DP-SGD (Opacus's ``DPOptimizer``).
    noise_multiplier, max_grad_norm : float or None
        DP-SGD's noise multiplier σ and per-example clipping norm C, when known.
    """

    optimizer: str
    lr: float | None
    steps: int
    clip_lr: bool
    frobenius_decay: bool
    dp_sgd: bool = False
    noise_multiplier: float | None = None
    max_grad_norm: float | None = None

    def entries(self) -> dict[str, Any]:
        """The reply config's entries (``trained-lr`` left out when unknown; the DP-SGD
        entries only for a node that trained with it)."""
        out: dict[str, Any] = {"trained-optimizer": self.optimizer, "trained-steps": self.steps,
                               "trained-clip-lr": self.clip_lr,
                               "trained-frobenius-decay": self.frobenius_decay}
        if self.lr is not None:
            out["trained-lr"] = float(self.lr)
        if self.dp_sgd:
            out["trained-dp-sgd"] = True
            for key, value in (("trained-noise-multiplier", self.noise_multiplier),
                               ("trained-max-grad-norm", self.max_grad_norm)):
                if value is not None:
                    out[key] = float(value)
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
    dp = config.get("trained-dp-sgd", False)
    if not isinstance(dp, bool):
        return f"trained-dp-sgd={dp!r:.20}: expected True or False"
    dp_values: list[float | None] = []
    for key in ("trained-noise-multiplier", "trained-max-grad-norm"):
        value = config.get(key)
        if value is not None and (not dp or isinstance(value, bool)
                                  or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            return (f"{key}={value!r:.40}: expected a finite number ≥ 0, with "
                    "trained-dp-sgd=True")
        dp_values.append(None if value is None else float(value))
    return Receipt(name, None if lr is None else float(lr), steps, clip, decay, dp, *dp_values)
