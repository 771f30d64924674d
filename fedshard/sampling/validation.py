"""Input checks shared by the sampling modules.

Every public function of :mod:`fedshard.sampling` funnels its arguments through these helpers,
so that bad input fails early with one consistent ``ValueError``/``TypeError`` that names the
offending value, says what was expected and what happens next (nothing is sampled).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = [
    "SUM_TOLERANCE",
    "as_count",
    "as_inclusion_probabilities",
    "as_keep_ratio",
    "as_nonnegative_vector",
    "as_sample_size",
]

#: Largest allowed distance of ``sum(pi)`` from the nearest integer.  Inclusion probabilities
#: produced in float64 sum to an integer up to ~1e-13; the slack admits probabilities that went
#: through one float32 round trip for a few thousand terms, and still rejects e.g. ``sum = 2.5``.
SUM_TOLERANCE = 1e-6


def as_count(value: Any, name: str, *, minimum: int = 0) -> int:
    """Return ``value`` as a Python ``int`` after checking it is an integer ``>= minimum``.

    Integral floats such as ``5.0`` are accepted; ``bool``, ``5.5`` and non-numbers are not.

    Raises
    ------
    TypeError
        If ``value`` is not a real number (or is a ``bool``).
    ValueError
        If ``value`` is not integral or is below ``minimum``.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be an integer, got {value!r} of type {type(value).__name__}; "
            "nothing was computed."
        )
    as_float = float(value)
    if not np.isfinite(as_float) or as_float != int(as_float):
        raise ValueError(f"{name} must be an integer, got {value!r}; nothing was computed.")
    count = int(as_float)
    if count < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {count}; nothing was computed.")
    return count


def as_nonnegative_vector(values: Any, name: str) -> np.ndarray:
    """Return ``values`` as a new 1-D float64 array after checking it is finite and ``>= 0``.

    Raises
    ------
    ValueError
        If the array is not 1-D, is empty, or holds NaN, infinite or negative entries.
    """
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{name} must be a 1-D array of real numbers, got {values!r}; nothing was computed."
        ) from err
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"{name} must be a non-empty 1-D array, got shape {array.shape}; nothing was computed."
        )
    bad = ~np.isfinite(array) | (array < 0)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name} must be finite and >= 0, but {name}[{first}] = {float(array[first])!r} "
            f"({int(bad.sum())} bad entries); nothing was computed."
        )
    return array


def as_sample_size(n: Any, num_terms: int) -> int:
    """Check that ``n`` is an integer with ``1 <= n <= num_terms`` and return it.

    Raises
    ------
    TypeError, ValueError
        If ``n`` is not an integer or is out of range.
    """
    count = as_count(n, "n", minimum=1)
    if count > num_terms:
        raise ValueError(
            f"n must be at most the number of terms N = {num_terms}, got n = {count}; "
            "nothing was computed."
        )
    return count


def as_inclusion_probabilities(pi: Any) -> tuple[np.ndarray, int]:
    """Check an inclusion-probability vector and return it with its sample size ``n``.

    Parameters
    ----------
    pi : array_like, shape (N,)
        Marginal inclusion probabilities ``0 <= pi_i <= 1`` whose sum is an integer (to within
        :data:`SUM_TOLERANCE`).

    Returns
    -------
    pi : np.ndarray, shape (N,)
        A float64 copy.
    n : int
        ``round(sum(pi))``, the fixed sample size of any design with these marginals.

    Raises
    ------
    ValueError
        If ``pi`` is not a finite 1-D array in ``[0, 1]`` or its sum is not an integer.
    """
    array = as_nonnegative_vector(pi, "pi")
    above = array > 1.0
    if above.any():
        first = int(np.flatnonzero(above)[0])
        raise ValueError(
            f"pi must lie in [0, 1], but pi[{first}] = {float(array[first])!r}; "
            "nothing was sampled."
        )
    total = float(array.sum())
    n = round(total)
    if abs(total - n) > SUM_TOLERANCE:
        raise ValueError(
            f"pi must sum to an integer sample size (to within {SUM_TOLERANCE:g}), but "
            f"sum(pi) = {total!r}; nothing was sampled."
        )
    return array, int(n)


def as_keep_ratio(value: Any, what: str = "keep ratio", consequence: str = "") -> float:
    """Check a keep ratio ``0 < r ≤ 1`` (a real number, not a bool) and return it as float.

    The one keep-ratio check of fedshard: node configs, capability replies, run configs and
    the client's declaration all go through it.

    Parameters
    ----------
    value : Any
        The value to check.
    what : str
        How the value is named in the error (e.g. ``"node config keep-ratio"``).
    consequence : str
        What happens because of the error, appended to the message.

    Raises
    ------
    ValueError
        If ``value`` is not a finite number in ``(0, 1]``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not (math.isfinite(value) and 0.0 < value <= 1.0)
    ):
        tail = f"; {consequence}" if consequence else ""
        raise ValueError(f"{what}={value!r}: expected a number in (0, 1]{tail}")
    return float(value)
