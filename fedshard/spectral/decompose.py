"""SVD of affine-layer weights into rank-one terms, and the inverse.

A weight ``W`` of a linear layer, shape ``(c_out, c_in)``, or of a convolution, shape
``(c_out, c_in, k_h, k_w)``, is viewed as the matrix ``W.reshape(c_out, -1)`` with
``rows = c_out`` and ``cols = c_in * k_h * k_w`` and split into ``N = min(rows, cols)`` terms
``W = sum_i u'_i v'_i^T`` with ``u'_i = sqrt(lambda_i) u_i`` and ``v'_i = sqrt(lambda_i) v_i``
(paper, Sec. 3.1, step 1).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedshard.sampling.plan import num_terms  # re-exported: n = ⌈rN⌉ belongs to the sampling

__all__ = ["LayerSpectrum", "compose", "decompose", "layer_spectrum", "num_terms", "take_terms"]


@dataclass
class LayerSpectrum:
    """One sharded layer's decomposition for one server round (float64, numpy).

    Terms are stored term-major (one row per term) so that selecting, packing and averaging
    a subset of terms touches contiguous rows.

    Attributes
    ----------
    ut : np.ndarray
        ``(N, c_out)``: row i is ``u'_i = √λ_i u_i``.
    vt : np.ndarray
        ``(N, c_in·k·k)``: row i is ``v'_i = √λ_i v_i``.
    lam : np.ndarray
        ``(N,)`` singular values, descending.
    w : np.ndarray
        ``(c_out, c_in·k·k)`` float64, the weight the terms were taken from.
    shape, dtype :
        The original weight's shape and dtype (replies and the rebuilt weight use them).
    """

    ut: np.ndarray
    vt: np.ndarray
    lam: np.ndarray
    w: np.ndarray
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


def layer_spectrum(weight: np.ndarray, device: str | torch.device | None = None) -> LayerSpectrum:
    """The :class:`LayerSpectrum` of a ``Linear``/``Conv2d`` weight (via :func:`decompose`).

    ``device``: where the float64 SVD runs (e.g. ``"cuda"``, much faster than a few CPU cores
    for ResNet-18's layers: ``benchmarks/bench_server.py``); ``None`` is the CPU. The result
    is always numpy on the host.
    """
    w = torch.from_numpy(np.ascontiguousarray(weight))
    u, v, lam = decompose(w if device is None else w.to(device))
    u, v, lam = u.cpu(), v.cpu(), lam.cpu()
    return LayerSpectrum(
        np.ascontiguousarray(u.numpy().T), np.ascontiguousarray(v.numpy().T), lam.numpy(),
        weight.reshape(weight.shape[0], -1).astype(np.float64), tuple(weight.shape),
        weight.dtype,
    )


def decompose(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a weight into its ``N = min(rows, cols)`` singular terms with sqrt(λ) absorbed.

    Parameters
    ----------
    weight : torch.Tensor
        ``(c_out, c_in)`` for a linear layer or ``(c_out, c_in, k_h, k_w)`` for a convolution
        (any tensor with ``ndim >= 2``; trailing dimensions are flattened into columns).

    Returns
    -------
    u : torch.Tensor
        ``(c_out, N)`` float64, column ``i`` is ``u'_i = sqrt(λ_i) u_i``.
    v : torch.Tensor
        ``(c_in * k_h * k_w, N)`` float64, column ``i`` is ``v'_i = sqrt(λ_i) v_i``.
    lam : torch.Tensor
        ``(N,)`` float64 singular values ``λ_1 >= ... >= λ_N >= 0``.

    Raises
    ------
    ValueError
        If ``weight`` has fewer than 2 dimensions, is empty, is not floating point or is not
        finite.

    Notes
    -----
    ``weight.reshape(c_out, -1) == u @ v.T`` up to float64 round-off (paper, Eq. 1 with all
    ``z_i = ω_i = 1``).

    The SVD is computed in float64 even for a float32 weight, for three reasons:

    * the server re-composes ``W = Σ u'_i v'_i^T`` after every round and decomposes it again
      at the start of the next one; float32 round-trip errors (~1e-6 relative) would be injected
      into the global model every round, float64 ones (~1e-15) are negligible;
    * the inclusion probabilities of Theorems 1 and 2 are proportional to ``λ_i``, and a float32
      SVD determines small singular values only to ``~1e-7 * λ_1`` absolute, i.e. with large
      *relative* error for the tail terms that the sampling strategies care about;
    * equivalence checks of a full-rank sub-model against the dense layer can then be made to
      ``1e-10``.

    The cost is a server-side SVD of at most a few ``512 x 4608`` matrices per round.
    Singular vectors are unique only up to a joint sign flip of ``(u_i, v_i)`` (and up to a
    rotation inside a repeated singular value); every product ``u'_i v'_i^T`` is unique.
    """
    if weight.ndim < 2:
        raise ValueError(
            f"decompose() expects a weight with at least 2 dimensions ((c_out, c_in) or "
            f"(c_out, c_in, k_h, k_w)), got shape {tuple(weight.shape)}; nothing was decomposed."
        )
    if weight.numel() == 0:
        raise ValueError(
            f"decompose() got an empty weight of shape {tuple(weight.shape)}; expected at least "
            "one row and one column. Nothing was decomposed."
        )
    if not weight.is_floating_point():
        raise ValueError(
            f"decompose() expects a floating-point weight, got dtype {weight.dtype}; "
            "nothing was decomposed."
        )
    # (c_out, c_in * k_h * k_w), float64 for the reasons given in the docstring.
    matrix = weight.detach().reshape(weight.shape[0], -1).to(torch.float64)
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError(
            f"decompose() got a weight of shape {tuple(weight.shape)} with NaN or inf entries; "
            "an SVD of it is meaningless. Nothing was decomposed."
        )
    # full_matrices=False: U (rows, N), S (N,), Vh (N, cols), N = min(rows, cols).
    left, lam, right_h = torch.linalg.svd(matrix, full_matrices=False)
    root = lam.sqrt()  # (N,)
    u = left * root  # (rows, N), column i scaled by sqrt(λ_i)
    v = right_h.mT * root  # (cols, N)
    return u, v, lam


def compose(u: torch.Tensor, v: torch.Tensor, shape: Sequence[int] | torch.Size) -> torch.Tensor:
    """Inverse of :func:`decompose`: ``W = Σ_i u'_i v'_i^T`` reshaped to ``shape``.

    Parameters
    ----------
    u : torch.Tensor
        ``(c_out, n)`` left factors (any ``n``, e.g. a subset of the terms).
    v : torch.Tensor
        ``(c_in * k_h * k_w, n)`` right factors.
    shape : sequence of int
        Shape of the weight to return, ``(c_out, c_in)`` or ``(c_out, c_in, k_h, k_w)``.

    Returns
    -------
    torch.Tensor
        Float64 tensor of the given shape (computed in float64, see :func:`decompose`).

    Raises
    ------
    ValueError
        If the factor shapes do not agree with each other or with ``shape``.
    """
    shape = tuple(int(s) for s in shape)
    if u.ndim != 2 or v.ndim != 2 or u.shape[1] != v.shape[1]:
        raise ValueError(
            f"compose() expects u of shape (c_out, n) and v of shape (c_in*k*k, n) with the same "
            f"n, got u {tuple(u.shape)} and v {tuple(v.shape)}; nothing was composed."
        )
    if len(shape) < 2 or shape[0] != u.shape[0] or math.prod(shape[1:]) != v.shape[0]:
        raise ValueError(
            f"compose() cannot build a weight of shape {shape} from u {tuple(u.shape)} and v "
            f"{tuple(v.shape)}: expected shape[0] == {u.shape[0]} and prod(shape[1:]) == "
            f"{v.shape[0]}; nothing was composed."
        )
    return (u.to(torch.float64) @ v.to(torch.float64).mT).reshape(shape)


def take_terms(
    u: torch.Tensor, v: torch.Tensor, indices: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns ``indices`` of ``u`` and ``v``, in the given order (the client's ``U``, ``V``).

    Parameters
    ----------
    u, v : torch.Tensor
        ``(c_out, N)`` and ``(c_in * k_h * k_w, N)`` factors from :func:`decompose`.
    indices : sequence of int
        Distinct term indices in ``[0, N)``; column ``j`` of the result is term ``indices[j]``.

    Returns
    -------
    tuple of torch.Tensor
        ``(u[:, indices], v[:, indices])``, new tensors of shapes ``(c_out, n)`` and
        ``(c_in * k_h * k_w, n)``.

    Raises
    ------
    ValueError
        If ``indices`` is empty, has duplicates, non-integers or values outside ``[0, N)``.
    """
    total = u.shape[1]
    idx = check_indices(indices, total)
    index_tensor = torch.tensor(idx, dtype=torch.long, device=u.device)
    return u[:, index_tensor], v[:, index_tensor]


def check_indices(indices: Sequence[int], total: int) -> list[int]:
    """Validate term indices against ``N = total`` and return them as a list of ``int``.

    Parameters
    ----------
    indices : sequence of int
        Candidate term indices.
    total : int
        ``N``, the number of terms of the layer.

    Returns
    -------
    list of int
        The indices, in the given order.

    Raises
    ------
    ValueError
        If ``indices`` is empty, contains duplicates, non-integers or values outside
        ``[0, total)``.
    """
    if isinstance(indices, torch.Tensor):
        indices = indices.tolist()
    try:
        idx = [operator.index(i) for i in indices]
    except TypeError as err:
        raise ValueError(
            f"term indices must be integers, got {list(indices)!r}; no terms were selected."
        ) from err
    if not idx:
        raise ValueError("term indices are empty; expected at least one index in [0, N).")
    bad = [i for i in idx if not 0 <= i < total]
    if bad:
        raise ValueError(
            f"term indices {bad} are outside [0, {total}) (N = {total} terms); "
            "no terms were selected."
        )
    if len(set(idx)) != len(idx):
        dup = sorted({i for i in idx if idx.count(i) > 1})
        raise ValueError(
            f"term indices contain duplicates {dup}; each term may be selected at most once. "
            "No terms were selected."
        )
    return idx
