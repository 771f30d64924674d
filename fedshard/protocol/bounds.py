"""What a node's reply may hold: bounded updates, a sane ``num-examples``, scalar metrics.

Every value a node sends is untrusted. The checks here turn a malformed or hostile value into
either a reason to drop the reply (a string ``"category: details"``) or a bounded value, never
into an exception in the ServerApp nor into a non-finite global model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MAX_EXACT_COUNT", "UPDATE_POLICIES", "ReplyLimits", "bound_dense", "bound_terms",
    "read_count", "scalar_metrics",
]

UPDATE_POLICIES = ("clip", "drop")
# Largest count a float64 holds exactly: weights up to it (times any float32) cannot overflow.
MAX_EXACT_COUNT = 2**53
# RMS per entry below which a dense array counts as "near zero" for the update bound (a
# zero-initialised bias or norm shift must still be allowed to move).
DENSE_RMS_FLOOR = 0.1


@dataclass(frozen=True)
class ReplyLimits:
    """The operator's bounds on a ``train`` reply.

    Attributes
    ----------
    max_update_ratio : float
        A returned term may differ from the one sent by at most this factor times the sent
        norm, per factor column ``‖u'_i − u_i‖ ≤ ρ·max(‖u_i‖, ‖U‖_F/√n)`` (and the same for v);
        a dense array by ``‖x' − x‖ ≤ ρ·max(‖x‖, 0.1·√size)``. 0 disables the bound. A
        term ``u'v'ᵀ`` can still grow by up to ``(1+ρ)²``; honest replies stay below ρ = 1
        (the golden-run configs: ≤ 0.65), so the default 10 never touches them.
    update_policy : str
        ``"clip"``: scale the excess change down to the bound; ``"drop"``: drop the reply.
    max_num_examples : int or None
        Largest ``num-examples`` accepted (``None``: up to 2**53, the exact float64 range).
    """

    max_update_ratio: float = 10.0
    update_policy: str = "clip"
    max_num_examples: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.max_update_ratio) and self.max_update_ratio >= 0):
            problems.append(f"max_update_ratio={self.max_update_ratio}: expected a finite "
                            "number ≥ 0 (0 = no bound)")
        if self.update_policy not in UPDATE_POLICIES:
            problems.append(f"update_policy={self.update_policy!r}: expected one of "
                            f"{UPDATE_POLICIES}")
        if self.max_num_examples is not None and not 1 <= self.max_num_examples <= MAX_EXACT_COUNT:
            problems.append(f"max_num_examples={self.max_num_examples}: expected an integer in "
                            f"[1, 2**53] or None")
        if problems:
            raise ValueError("ReplyLimits: " + "; ".join(problems) + "; no round was started")


def read_count(value: Any, cap: int | None = None) -> float | str:
    """``num-examples`` as a float if it is a finite integer-valued number in ``[1, cap]``
    (``cap`` ``None``: 2**53), else the reason it is not."""
    limit = MAX_EXACT_COUNT if cap is None else min(cap, MAX_EXACT_COUNT)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r:.40} is not a number (expected an integer ≥ 1)"
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return f"{value!r} is not a finite whole number (expected an integer ≥ 1)"
    if not 1 <= value <= limit:
        return f"{value!r:.40} is outside [1, {limit}]"
    return float(value)


def scalar_metrics(metrics: Mapping[str, Any], skip: str) -> tuple[dict[str, float], list[str]]:
    """The finite scalar metrics (``skip``, the weight key, left out) and a reason per value
    left out (lists, NaN, inf and non-numbers are legal in a MetricRecord but not averaged)."""
    out, ignored = {}, []
    for key, value in metrics.items():
        if key == skip:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            ignored.append(f"{key}={value!r:.40} is not a scalar")
        elif not math.isfinite(value):
            ignored.append(f"{key}={value!r} is not finite")
        else:
            out[key] = float(value)
    return out, ignored


def _scale(norm: np.ndarray, ref: np.ndarray, ratio: float) -> tuple[np.ndarray, float]:
    """Per entry, the factor ``≤ 1`` that brings ``norm`` to ``ρ·ref``, and the largest
    ``norm/ref`` (the observed update ratio)."""
    bound = ratio * ref
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(norm > bound, bound / norm, 1.0)
        observed = float(np.max(norm / ref, initial=0.0))
    return np.asarray(scale), observed


def bound_terms(sent: np.ndarray, got: np.ndarray,
                ratio: float) -> tuple[np.ndarray, int, float]:
    """``got`` (a factor, one column per term) with each column's change from ``sent``
    scaled down to ``ρ·max(‖sent_i‖, ‖sent‖_F/√n)``, the number of columns changed and the
    largest observed ratio ``‖Δ_i‖/max(‖sent_i‖, ‖sent‖_F/√n)``.

    The check runs in the arrays' own precision (a threshold at ρ = 10 against honest ratios
    below 1 needs no float64; this runs on every reply of every round); a column that is
    clipped is recomputed in float64."""
    delta = got - sent  # (rows, n), the arrays' dtype
    col_sq = np.einsum("ij,ij->j", sent, sent).astype(np.float64)  # (n,) ‖sent_i‖²
    floor = math.sqrt(float(col_sq.sum()) / max(col_sq.size, 1))
    ref = np.maximum(np.sqrt(col_sq), floor)
    norm = np.sqrt(np.einsum("ij,ij->j", delta, delta).astype(np.float64))
    scale, observed = _scale(norm, ref, ratio)
    hit = int(np.count_nonzero(scale < 1.0))
    if not hit:
        return got, 0, observed
    s64 = sent.astype(np.float64)
    return (s64 + (got.astype(np.float64) - s64) * scale).astype(got.dtype), hit, observed


def bound_dense(sent: np.ndarray, got: np.ndarray,
                ratio: float) -> tuple[np.ndarray, int, float]:
    """``got`` with its change from ``sent`` scaled down to ``ρ·max(‖sent‖, 0.1·√size)``,
    1 if it was changed (0 if not) and the observed ratio ``‖Δ‖/max(‖sent‖, 0.1·√size)``
    (checked in the arrays' precision, clipped in float64, as :func:`bound_terms`)."""
    flat_s, flat_d = sent.ravel(), (got - sent).ravel()
    ref = max(math.sqrt(float(np.dot(flat_s, flat_s))), DENSE_RMS_FLOOR * math.sqrt(flat_s.size))
    scales, observed = _scale(np.array([math.sqrt(float(np.dot(flat_d, flat_d)))]),
                              np.array([ref]), ratio)
    scale = float(scales[0])
    if scale >= 1.0:
        return got, 0, observed
    s64 = sent.astype(np.float64)
    return (s64 + (got.astype(np.float64) - s64) * scale).astype(got.dtype), 1, observed
