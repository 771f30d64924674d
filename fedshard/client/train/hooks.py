"""A gradient rule as an optimizer step pre-hook: :func:`before_step`.

fedshard's client rules that rewrite the factors' gradients right before a step (ClipLR,
:class:`~fedshard.client.train.optim.ClipLR`; the dense factor step,
:class:`~fedshard.client.train.precondition.DenseFactorStep`) attach to any
:class:`torch.optim.Optimizer` through its public ``register_step_pre_hook``; this is the one
place that handles ``step(closure)`` for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepPreHook", "before_step"]

#: What ``Optimizer.register_step_pre_hook`` takes.
StepPreHook = Callable[[torch.optim.Optimizer, tuple[Any, ...], dict[str, Any]],
                       tuple[tuple[Any, ...], dict[str, Any]] | None]


def before_step(rewrite: Callable[[], None]) -> StepPreHook:
    """A step pre-hook that calls ``rewrite()`` (which edits the parameters' ``.grad``) before
    the optimizer's step.

    With ``step(closure)`` the closure runs first (its ``backward()`` sets the gradients),
    then ``rewrite()``, and the optimizer, and any pre-hook after this one, gets a closure
    that returns the loss already computed. Optimizers that evaluate the closure several times
    per step (L-BFGS) are not supported.
    """

    def pre_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        closure: Callable[[], Any] | None = kwargs.get(
            "closure", args[1] if len(args) > 1 else None)
        if closure is None:
            rewrite()
            return None
        with torch.enable_grad():
            loss = closure()
        rewrite()
        rest = {k: v for k, v in kwargs.items() if k != "closure"}
        return (args[0], *args[2:]), {**rest, "closure": lambda: loss}

    return pre_step
