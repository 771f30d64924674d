"""The process's pool of fast steps, :data:`STEP_POOL` (:attr:`FastOptions.reuse_step`)."""

from __future__ import annotations

from fedshard.client.train.fast.pool import StepPool

__all__ = ["STEP_POOL"]

#: The process's pooled steps (``FastOptions.reuse_step``); ``STEP_POOL.clear()`` frees them.
STEP_POOL = StepPool(size=4)
