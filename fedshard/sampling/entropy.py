"""Average normalized marginal entropy (ANME), the paper's exploration measure (Sec. 4.2.2).

A strategy that sends the same terms to every client (Top-n) is *exploitative*: its marginal
inclusion indicators are deterministic and carry no entropy.  One that spreads the terms evenly
(``πᵢ = n/N``) is as *explorative* as a fixed-size design can be.  ANME places every strategy on
that scale, per layer, and averages over the sharded layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from fedshard.sampling.validation import as_inclusion_probabilities

__all__ = ["anme", "normalized_marginal_entropy"]


def _bernoulli_entropy(p: np.ndarray) -> np.ndarray:
    """``-p log p - (1-p) log(1-p)`` in nats, 0 at ``p ∈ {0, 1}``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(p * np.log(p) + (1.0 - p) * np.log1p(-p))
    return np.where((p > 0) & (p < 1), h, 0.0)


def normalized_marginal_entropy(pi: Any) -> float:
    """Mean Bernoulli entropy of one layer's ``π``, divided by its value at ``π = n/N``.

    Parameters
    ----------
    pi : array_like, shape (N,)
        Inclusion probabilities of one layer (in ``[0, 1]``, integer sum ``n``).

    Returns
    -------
    float
        In ``[0, 1]``: 0 for a deterministic selection (Top-n), 1 for uniform ``π``.  A layer
        with ``n = N`` (or ``n = 0``) has no choice to make; its value is defined as 0.

    Raises
    ------
    ValueError
        If ``pi`` is not a valid inclusion-probability vector.

    Notes
    -----
    Paper Sec. 4.2.2: ``H(π) = (1/N) Σ_{i: 0<πᵢ<1} (-πᵢ log πᵢ - (1-πᵢ) log(1-πᵢ))``.  Among
    vectors with ``Σ πᵢ = n`` the (concave) mean entropy is largest at ``πᵢ = n/N``, so the
    normalization is ``h(n/N)`` with ``h`` the Bernoulli entropy; the base of the logarithm
    cancels.
    """
    p, n = as_inclusion_probabilities(pi)
    if n in (0, p.size):
        return 0.0
    uniform = float(_bernoulli_entropy(np.array([n / p.size]))[0])
    return float(_bernoulli_entropy(p).mean() / uniform)


def anme(pis: Any) -> float:
    """Average normalized marginal entropy over layers (paper Sec. 4.2.2).

    Parameters
    ----------
    pis : sequence of array_like, or array_like of shape (L, N) or (N,)
        One inclusion-probability vector per sharded layer (layers may have different ``N``).
        A single 1-D vector is treated as one layer.

    Returns
    -------
    float
        Mean of :func:`normalized_marginal_entropy` over the layers, in ``[0, 1]``.

    Raises
    ------
    ValueError
        If there are no layers or a layer's ``π`` is invalid (the message names the layer).
    """
    layers: list[Any]
    if isinstance(pis, np.ndarray):
        layers = [pis] if pis.ndim == 1 else list(pis)
    elif isinstance(pis, Iterable):
        layers = list(pis)
        if layers and all(np.ndim(x) == 0 for x in layers):
            layers = [np.asarray(layers, dtype=np.float64)]
    else:
        raise ValueError(
            f"pis must be a sequence of inclusion-probability vectors, got {pis!r}; "
            "no ANME was computed."
        )
    if not layers:
        raise ValueError("pis holds no layers; ANME needs at least one π vector.")
    values = []
    for index, layer in enumerate(layers):
        try:
            values.append(normalized_marginal_entropy(layer))
        except ValueError as err:
            raise ValueError(f"layer {index} of pis: {err}") from err
    return float(np.mean(values))
