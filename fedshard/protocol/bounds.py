"""What a node's reply may hold: bounded updates, a sane ``num-examples``, scalar metrics.

Every value a node sends is untrusted. The checks here turn a malformed or hostile value into
either a reason to drop the reply (a string ``"category: details"``) or a bounded value, never
into an exception in the ServerApp nor into a non-finite global model. The operator's bounds
are :class:`fedshard.settings.ReplyPolicy`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedshard.protocol.keys import EVAL_ACCURACY, EVAL_LOSS
from fedshard.settings import MAX_EXACT_COUNT, UPDATE_POLICIES  # the operator's bounds: ReplyPolicy
from fedshard.spectral.aggregate import DENSE_RMS_FLOOR, squared_difference

__all__ = [
    "MAX_EXACT_COUNT", "MAX_METRIC_NAME", "MAX_REPLY_METRICS", "UPDATE_POLICIES", "all_finite",
    "bound_dense", "bound_terms", "bounded_metrics", "printable", "read_count", "scalar_metrics",
]

#: Most metric values one reply may bring (the weight key aside); the rest are left out,
#: logged and counted in ``ignored-metrics``. An honest node sends two or three.
MAX_REPLY_METRICS = 32
#: Longest metric name kept (characters); a longer one is left out, logged and counted.
MAX_METRIC_NAME = 64


def printable(text: str, limit: int | None = None) -> str:
    """``text`` as it may appear in a log line: every character that is not printable (line
    breaks, carriage returns, terminal escapes, tabs) written as its Python escape (``\\n``,
    ``\\x1b``), so that a string a node sent cannot start a line of its own in the server's
    log; at most ``limit`` characters (``None``: all), an ellipsis marking the cut."""
    out = text if text.isprintable() else "".join(
        c if c.isprintable() else repr(c)[1:-1] for c in text)
    if limit is not None and len(out) > limit:
        out = out[: limit - 1] + "…"
    return out


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


def scalar_metrics(metrics: Mapping[str, Any],
                   skip: str) -> tuple[dict[str, float], list[str], int]:
    """The finite scalar metrics (``skip``, the weight key, left out), the reasons values were
    left out (lists, NaN, inf and non-numbers are legal in a MetricRecord but not averaged)
    and how many were.

    Only the first :data:`MAX_REPLY_METRICS` values of the reply are looked at, and a name
    longer than :data:`MAX_METRIC_NAME` characters or holding a character that is not
    printable (a line break, a terminal escape: it could forge lines in the server's log) is
    left out; the values beyond the cap share one reason (a reply may send thousands) but
    each one is counted. Names in the reasons are escaped (:func:`printable`)."""
    out, ignored = {}, []
    examined = beyond = 0
    for key, value in metrics.items():
        if key == skip:
            continue
        examined += 1
        if examined > MAX_REPLY_METRICS:
            beyond += 1
        elif len(key) > MAX_METRIC_NAME:
            ignored.append(f"a metric name of {len(key)} characters ({key[:20]!r}…; at most "
                           f"{MAX_METRIC_NAME})")
        elif not key.isprintable():
            ignored.append(f"a metric name with control characters ({key!r})")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            ignored.append(f"{printable(key)}={value!r:.40} is not a scalar")
        elif not math.isfinite(value):
            ignored.append(f"{printable(key)}={value!r} is not finite")
        else:
            out[key] = float(value)
    count = len(ignored) + beyond
    if beyond:
        ignored.insert(0, f"{beyond} metric(s) beyond the first {MAX_REPLY_METRICS}")
    return out, ignored, count


#: The values an evaluation reply's documented metrics can take: an accuracy is a share, a
#: loss is not negative (and, being a checked scalar, finite).
EVAL_RANGES: dict[str, tuple[float, float]] = {EVAL_ACCURACY: (0.0, 1.0),
                                               EVAL_LOSS: (0.0, math.inf)}


def all_finite(x: np.ndarray) -> bool:
    """Whether a floating array holds no NaN or ±inf: for float32 and float64, ``x·x`` is
    finite (one BLAS pass, no mask), else (that sum overflowed, or another dtype)
    ``isfinite`` entry by entry."""
    if x.dtype in _BLAS_FLOATS:
        flat = x.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            total = float(np.dot(flat, flat))
        if math.isfinite(total):
            return True
    return bool(np.isfinite(x).all())


_BLAS_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def bounded_metrics(values: Mapping[str, float], ranges: Mapping[str, tuple[float, float]],
                    ) -> tuple[dict[str, float], list[str]]:
    """``values`` without those of ``ranges``'s names that lie outside their range, and why
    each was left out."""
    kept, reasons = {}, []
    for key, value in values.items():
        low, high = ranges.get(key, (-math.inf, math.inf))
        if low <= value <= high:
            kept[key] = value
        elif high == math.inf and low == 0.0:
            reasons.append(f"{key}={value!r} is negative (expected a loss ≥ 0)")
        else:
            reasons.append(f"{key}={value!r} is outside [{low:g}, {high:g}]")
    return kept, reasons


def _scale(norm: np.ndarray, ref: np.ndarray, ratio: float) -> tuple[np.ndarray, float]:
    """Per entry, the factor ``≤ 1`` that brings ``norm`` to ``ρ·ref``, and the largest
    ``norm/ref`` (the observed update ratio)."""
    bound = ratio * ref
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(norm > bound, bound / norm, 1.0)
        observed = float(np.max(norm / ref, initial=0.0))
    return np.asarray(scale), observed


def _scale_one(norm: float, ref: float, ratio: float) -> tuple[float, float]:
    """:func:`_scale` of one entry, in Python floats (the same numbers; a dense array is one
    entry, and numpy's arrays of one cost more than the arithmetic): ``norm/ref`` is ``inf``
    or ``nan`` for ``ref = 0`` as numpy's division gives."""
    bound = ratio * ref
    scale = bound / norm if norm > bound else 1.0
    if ref != 0:
        return scale, norm / ref
    return scale, (math.nan if norm == 0 or math.isnan(norm) else math.inf)


def bound_terms(sent: np.ndarray, got: np.ndarray,
                ratio: float) -> tuple[np.ndarray, int, float]:
    """``got`` (a factor, one column per term) with each column's change from ``sent``
    scaled down to ``ρ·max(‖sent_i‖, ‖sent‖_F/√n)``, the number of columns changed and the
    largest observed ratio ``‖Δ_i‖/max(‖sent_i‖, ‖sent‖_F/√n)``.

    The check runs in the arrays' own precision (a threshold at ρ = 10 against honest ratios
    below 1 needs no float64; this runs on every reply of every round); a column that is
    clipped is recomputed in float64. A change whose squares overflow that precision is
    removed whole; the observed ratio is then taken in float64 (finite, for the metrics)."""
    delta = got - sent  # (rows, n), the arrays' dtype
    col_sq = np.einsum("ij,ij->j", sent, sent).astype(np.float64)  # (n,) ‖sent_i‖²
    floor = math.sqrt(float(col_sq.sum()) / max(col_sq.size, 1))
    ref = np.maximum(np.sqrt(col_sq), floor)
    norm = np.sqrt(np.einsum("ij,ij->j", delta, delta).astype(np.float64))
    scale, observed = _scale(norm, ref, ratio)
    if not math.isfinite(observed):  # squares beyond float32 (scale 0): the ratio in float64
        d64 = got.astype(np.float64) - sent.astype(np.float64)
        observed = _scale(np.sqrt(np.einsum("ij,ij->j", d64, d64)), ref, ratio)[1]
    hit = int(np.count_nonzero(scale < 1.0))
    if not hit:
        return got, 0, observed
    s64 = sent.astype(np.float64)
    return (s64 + (got.astype(np.float64) - s64) * scale).astype(got.dtype), hit, observed


def bound_dense(sent: np.ndarray, got: np.ndarray, ratio: float, *,
                sent_sq: float | None = None,
                change_sq: float | None = None) -> tuple[np.ndarray, int, float]:
    """``got`` with its change from ``sent`` scaled down to ``ρ·max(‖sent‖, 0.1·√size)``,
    1 if it was changed (0 if not) and the observed ratio ``‖Δ‖/max(‖sent‖, 0.1·√size)``
    (checked in the arrays' precision, clipped in float64, as :func:`bound_terms`).

    ``sent_sq``: ``‖sent‖²`` in ``sent``'s precision if known (what every node was sent is
    one array: its norm is taken once a round); ``change_sq``: ``‖got − sent‖²`` if known
    (:func:`~fedshard.spectral.aggregate.squared_difference`, which computes it
    otherwise)."""
    flat_s = sent.ravel()
    if sent_sq is None:
        sent_sq = float(np.dot(flat_s, flat_s))
    if change_sq is None:
        change_sq = squared_difference(got, sent)
    ref = max(math.sqrt(sent_sq), DENSE_RMS_FLOOR * math.sqrt(flat_s.size))
    scale, observed = _scale_one(math.sqrt(change_sq), ref, ratio)
    if not math.isfinite(observed):  # squares beyond float32 (scale 0): the ratio in float64
        observed = math.sqrt(squared_difference(got, sent, wide_on_overflow=True)) / ref
    if scale >= 1.0:
        return got, 0, observed
    s64 = sent.astype(np.float64)
    return (s64 + (got.astype(np.float64) - s64) * scale).astype(got.dtype), 1, observed
