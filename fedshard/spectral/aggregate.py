"""Server-side aggregation: each term averaged over the clients that held it, W rebuilt.

The paper's Sec. 3.1, step 3: client k returns the trained columns ``u'_i``,
``v'_i`` of the terms ``i ∈ I_k`` it held; the server averages every term over its holders,
weighted by their data sizes ``D_k``, keeps the terms nobody held, and sets
``W = Σ_i u'_i v'_iᵀ`` (ω is not part of the stored weight). Dense parameters are averaged
over all clients as in FedAvg.

Robust options (``aggregation="median"`` or ``"trimmed-mean"``) replace each weighted mean by
the coordinate-wise median / trimmed mean over the same holders, unweighted, as Flower's
``FedMedian`` and ``FedTrimmedAvg`` do for dense arrays (those work only on equal-shape arrays,
not on per-term shards). Numpy; torch only when the rebuild is asked to run on a device (a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedshard.spectral.decompose import LayerSpectrum

__all__ = [
    "AGGREGATIONS", "DENSE_AGGREGATIONS", "Alignment", "TermUpdate", "aggregate_state",
    "align_factors", "dense_equivalents", "dense_mean", "rebuild_weight", "relative_change",
    "robust_reduce", "shrink_change", "spread_scales", "squared_difference", "squared_norm",
    "term_means",
]

#: The rules over whole dense-equivalent models (:func:`dense_equivalents`), as Flower's
#: ``FedMedian``, ``FedTrimmedAvg`` and ``Krum`` aggregate dense replies.
DENSE_AGGREGATIONS = ("dense-median", "dense-trimmed-mean", "krum")
AGGREGATIONS = ("mean", "median", "trimmed-mean", *DENSE_AGGREGATIONS)

#: RMS per entry below which a dense array's reference norm is floored (as the update bound
#: does: a zero-initialised bias must still be allowed to move).
DENSE_RMS_FLOOR = 0.1


@dataclass(frozen=True)
class Alignment:
    """One client's factors of one layer, re-expressed against the terms it was sent.

    Attributes
    ----------
    u, v : np.ndarray
        ``(c_out, n)`` and ``(c_in·k·k, n)``: the columns with the same products
        ``u'_i v'_iᵀ`` as the client's, sign and balance chosen as the sent terms' (the
        client's own arrays when nothing changed).
    flipped, rebalanced : int
        How many columns were re-signed / re-balanced.
    """

    u: np.ndarray
    v: np.ndarray
    flipped: int = 0
    rebalanced: int = 0


def align_factors(sent_u: np.ndarray, sent_v: np.ndarray, u: np.ndarray, v: np.ndarray,
                  max_imbalance: float = 4.0) -> Alignment:
    """Choose the representative of each returned term ``(u'_i, v'_i)`` closest to the sent
    one among those with the same product ``u'_i v'_iᵀ``.

    A term is a product: ``(c·u'_i, v'_i/c)`` is the same term for every ``c ≠ 0``, but the
    server averages ``u`` and ``v`` separately, so the representative a client returns
    matters. Two gauge moves are undone, each leaving the client's product unchanged:

    * **balance**: where ``(‖u'_i‖/‖u_i‖) / (‖v'_i‖/‖v_i‖)`` lies outside
      ``[1/max_imbalance, max_imbalance]``, the column pair is rescaled by ``c`` and ``1/c``
      so that the ratio is 1 (the sent terms are balanced: ``‖u_i‖ = ‖v_i‖ = √λ_i``);
    * **sign**: where ``⟨u'_i, u_i⟩ + ⟨v'_i, v_i⟩ < 0``, both columns are negated; this is
      the sign that minimises ``‖u'_i − u_i‖² + ‖v'_i − v_i‖²``.

    An honest client changes its terms little, so neither move applies and its arrays are
    returned as they are (the same objects, bit for bit).

    Parameters
    ----------
    sent_u, sent_v : np.ndarray
        ``(c_out, n)``, ``(c_in·k·k, n)``: the terms the client was sent.
    u, v : np.ndarray
        The same shapes: what it returned.
    max_imbalance : float
        ≥ 1; ``inf`` turns the balance move off.
    """
    u64, v64 = u.astype(np.float64), v.astype(np.float64)
    su, sv = sent_u.astype(np.float64), sent_v.astype(np.float64)
    nu, nv = np.linalg.norm(u64, axis=0), np.linalg.norm(v64, axis=0)  # (n,)
    nsu, nsv = np.linalg.norm(su, axis=0), np.linalg.norm(sv, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        # ratio of the relative growths; c² = ‖u_i‖‖v'_i‖ / (‖v_i‖‖u'_i‖) balances them
        imbalance = (nu * nsv) / (nv * nsu)
        off = np.isfinite(imbalance) & (imbalance > 0) & (
            (imbalance > max_imbalance) | (imbalance < 1.0 / max_imbalance))
    c = np.where(off, 1.0 / np.sqrt(np.where(off, imbalance, 1.0)), 1.0)  # (n,)
    score = np.einsum("ij,ij->j", u64, su) * c + np.einsum("ij,ij->j", v64, sv) / c
    flip = score < 0
    if not off.any() and not flip.any():
        return Alignment(u, v)
    sign = np.where(flip, -1.0, 1.0)
    return Alignment((u64 * (sign * c)).astype(u.dtype), (v64 * (sign / c)).astype(v.dtype),
                     int(np.count_nonzero(flip)), int(np.count_nonzero(off)))


def relative_change(sent: Sequence[np.ndarray], got: Sequence[np.ndarray],
                    dense: bool = False, sent_sq: float | None = None,
                    change_sq: float | None = None) -> float:
    """``‖got − sent‖ / ‖sent‖`` over several arrays taken together (a layer's ``u`` and
    ``v``); ``dense``: the reference norm is floored at ``0.1·√size`` as the dense update
    bound's is (:data:`DENSE_RMS_FLOOR`). ``sent_sq``: ``‖sent‖²`` if known
    (:func:`squared_norm`; the same ``sent`` for every node of a round needs it once);
    ``change_sq``: ``‖got − sent‖²`` if known (:func:`squared_difference` of each pair,
    summed: the reply checks take it for each dense entry).

    The change is taken in the arrays' own precision, at least float32
    (:func:`squared_difference`: within about 1e-6 of float64's for a float32 model, half the
    bytes of a float64 pass, on every reply of every round), and in float64 where its squares
    overflow that precision; the ratio is a float64 number."""
    change = change_sq if change_sq is not None else sum(
        squared_difference(g, s, wide_on_overflow=True) for s, g in zip(sent, got, strict=True))
    ref = squared_norm(sent) if sent_sq is None else sent_sq
    if dense:
        ref = max(ref, DENSE_RMS_FLOOR**2 * sum(s.size for s in sent))
    return float(np.sqrt(change / ref)) if ref > 0 else (0.0 if change == 0 else np.inf)


def squared_difference(got: np.ndarray, sent: np.ndarray, *,
                       wide_on_overflow: bool = False) -> float:
    """``‖got − sent‖²`` in the arrays' own precision, at least float32: each difference
    rounded once, the squares summed pairwise (numpy's ``add.reduce``: an error that grows
    with the logarithm of the size); where the squares overflow that precision ``inf``, or
    with ``wide_on_overflow`` the float64 sum."""
    d = np.subtract(got, sent, dtype=np.result_type(got.dtype, sent.dtype, np.float32))
    flat = d.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        total = float(np.add.reduce(np.square(flat, out=flat)))
    if math.isfinite(total) or not wide_on_overflow:
        return total
    wide = (got.astype(np.float64) - sent).reshape(-1)  # squares beyond float32: float64
    return float(np.dot(wide, wide))


def squared_norm(arrays: Sequence[np.ndarray]) -> float:
    """``Σ ‖a‖²`` over ``arrays``, in float64."""
    total = 0.0
    for a in arrays:
        flat = np.asarray(a, dtype=np.float64).ravel()
        total += float(np.dot(flat, flat))
    return total


def spread_scales(changes: Sequence[float], kappa: float, min_count: int = 3) -> np.ndarray:
    """Per client, the factor ``s_k ≤ 1`` that brings its change ``δ_k`` to at most
    ``κ·median_k δ_k`` (1 where it is within, and for everyone with fewer than
    ``min_count`` clients: a median of two is their mean, which one client controls).

    Notes
    -----
    One step of centred clipping (Karimireddy, He & Jaggi, ICML 2021, Alg. 2, with the
    broadcast model as the centre and L = 1) with the radius ``τ = κ·median_k δ_k`` taken
    from the round itself: a minority of clients cannot move the median, so a client's pull
    on the average is at most κ times a typical honest client's.
    """
    d = np.asarray(changes, dtype=np.float64)
    if kappa <= 0 or d.size < min_count:
        return np.ones(d.size)
    tau = kappa * float(np.median(d))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > tau, tau / d, 1.0)


def shrink_change(sent: np.ndarray, got: np.ndarray, scale: float) -> np.ndarray:
    """``sent + scale·(got − sent)`` in float64, in ``got``'s dtype (``got`` itself when
    ``scale`` is 1)."""
    if scale >= 1.0:
        return got
    s64 = sent.astype(np.float64)
    return (s64 + (got.astype(np.float64) - s64) * scale).astype(got.dtype)


def robust_reduce(stack: np.ndarray, aggregation: str, trim_fraction: float) -> np.ndarray:
    """Coordinate-wise median or trimmed mean over axis 0 (the m contributors).

    The trimmed mean drops the ``⌊trim_fraction·m⌋`` smallest and as many largest values of
    every coordinate and averages the rest (Yin et al., ICML 2018, Def. 2).
    """
    if aggregation == "median":
        return np.asarray(np.median(stack, axis=0))
    if aggregation == "trimmed-mean":
        k = int(np.floor(trim_fraction * stack.shape[0]))
        ordered = np.sort(stack, axis=0)
        return np.asarray(ordered[k: stack.shape[0] - k].mean(axis=0))
    raise ValueError(f"aggregation={aggregation!r}: expected 'median' or 'trimmed-mean'")


@dataclass(frozen=True)
class TermUpdate:
    """One client's trained terms of one layer.

    Attributes
    ----------
    weight : float
        The client's aggregation weight ``D_k`` (> 0).
    indices : np.ndarray
        ``(n,)`` int64, the terms it held.
    u, v : np.ndarray
        ``(c_out, n)`` and ``(c_in·k·k, n)``: the trained ``u'_i``, ``v'_i`` (column j is term
        ``indices[j]``).
    """

    weight: float
    indices: np.ndarray
    u: np.ndarray
    v: np.ndarray


def term_means(
    spec: LayerSpectrum, updates: Sequence[TermUpdate], aggregation: str = "mean",
    trim_fraction: float = 0.1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The held terms and their weighted means (or, with ``aggregation``, their unweighted
    coordinate-wise median / trimmed mean, :func:`robust_reduce`) over their holders.

    Returns
    -------
    held : np.ndarray
        ``(h,)`` sorted indices of the terms at least one client held.
    u_mean, v_mean : np.ndarray
        ``(h, c_out)`` and ``(h, c_in·k·k)`` float64: ``ū_i = Σ_{k ∋ i} D_k u'_{k,i} /
        Σ_{k ∋ i} D_k`` (and the same for v), row j for term ``held[j]``.
    """
    n_terms = spec.lam.size
    mass = np.zeros(n_terms, dtype=np.float64)
    for up in updates:
        mass[up.indices] += up.weight
    held = np.flatnonzero(mass > 0)
    row = np.full(n_terms, -1, dtype=np.int64)
    row[held] = np.arange(held.size)
    u_mean = np.zeros((held.size, spec.ut.shape[1]))  # (h, c_out)
    v_mean = np.zeros((held.size, spec.vt.shape[1]))  # (h, c_in·k·k)
    if aggregation != "mean":
        cols: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(held.size)]
        for up in updates:
            for j, r in enumerate(row[up.indices]):
                cols[r].append((up.u[:, j], up.v[:, j]))
        for r, pairs in enumerate(cols):
            u_mean[r] = robust_reduce(np.stack([u for u, _ in pairs]).astype(np.float64),
                                      aggregation, trim_fraction)
            v_mean[r] = robust_reduce(np.stack([v for _, v in pairs]).astype(np.float64),
                                      aggregation, trim_fraction)
        return held, u_mean, v_mean
    for up in updates:
        rows = row[up.indices]
        u_mean[rows] += up.weight * up.u.T
        v_mean[rows] += up.weight * up.v.T
    u_mean /= mass[held, None]
    v_mean /= mass[held, None]
    return held, u_mean, v_mean


def rebuild_weight(
    spec: LayerSpectrum, held: np.ndarray, u_new: np.ndarray, v_new: np.ndarray,
    device: str | None = None,
) -> np.ndarray:
    """``W = Σ_i u'_i v'_iᵀ`` with the held terms replaced by ``u_new``, ``v_new`` (rows).

    Only the h held terms change: ``W_new = W + Σ_held (ū_i v̄_iᵀ − u'_i v'_iᵀ)``, a rank-2h
    update, used when 2h < N; otherwise the full sum over N terms is cheaper (and then the
    round's ``spec`` is overwritten in place: it is not used after its aggregation). The
    products run in the weight's own precision when it is float32 (2x faster than float64;
    their rounding, ~1e-7 relative, is that of the float32 weight itself).

    ``device``: run the products with torch on that device (e.g. ``"cuda"``); ``None`` runs
    them with numpy on the host. Same formula, same precision, rounding aside.

    Returns
    -------
    np.ndarray
        The new weight, in the original shape and dtype.
    """
    n_terms = spec.lam.size
    cdt = np.dtype(np.float32) if spec.dtype == np.float32 else np.dtype(np.float64)
    if device is not None:
        return _rebuild_torch(spec, held, u_new, v_new, cdt, device)
    w_new: np.ndarray
    if 2 * held.size < n_terms:
        ut, vt = spec.ut[held].astype(cdt), spec.vt[held].astype(cdt)
        w_new = spec.w.astype(cdt)
        w_new += np.matmul(u_new.astype(cdt).T, v_new.astype(cdt))
        w_new -= np.matmul(ut.T, vt)
    else:
        spec.ut[held], spec.vt[held] = u_new, v_new
        w_new = np.matmul(spec.ut.astype(cdt).T, spec.vt.astype(cdt))
    return w_new.reshape(spec.shape).astype(spec.dtype, copy=False)


def _rebuild_torch(spec: LayerSpectrum, held: np.ndarray, u_new: np.ndarray, v_new: np.ndarray,
                   cdt: np.dtype[Any], device: str) -> np.ndarray:
    """:func:`rebuild_weight`'s products with torch on ``device``."""
    import torch  # the one torch use of this module: only when a device is asked for

    tdt = torch.float32 if cdt == np.float32 else torch.float64

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=tdt)

    if 2 * held.size < spec.lam.size:
        w = t(spec.w) + t(u_new).T @ t(v_new) - t(spec.ut[held]).T @ t(spec.vt[held])
    else:
        spec.ut[held], spec.vt[held] = u_new, v_new
        w = t(spec.ut).T @ t(spec.vt)
    return w.cpu().numpy().reshape(spec.shape).astype(spec.dtype, copy=False)


def dense_mean(values: Sequence[np.ndarray], weights: Sequence[float],
               aggregation: str = "mean", trim_fraction: float = 0.1) -> np.ndarray:
    """FedAvg's weighted mean of one dense array (accumulated in float64, cast back), or
    its unweighted coordinate-wise median / trimmed mean (:func:`robust_reduce`)."""
    if aggregation != "mean":
        stack = np.stack([np.asarray(x, dtype=np.float64) for x in values])
        return robust_reduce(stack, aggregation, trim_fraction).astype(values[0].dtype)
    total = sum(weights)
    acc = np.zeros(values[0].shape, dtype=np.float64)
    for w, x in zip(weights, values, strict=True):
        acc += w * x
    return (acc / total).astype(values[0].dtype)


def aggregate_state(
    current: Mapping[str, np.ndarray],
    spectra: Mapping[str, LayerSpectrum],
    weights: Sequence[float],
    dense: Sequence[Mapping[str, np.ndarray]],
    terms: Sequence[Mapping[str, TermUpdate]],
    aggregation: str = "mean",
    trim_fraction: float = 0.1,
    device: str | None = None,
) -> dict[str, np.ndarray]:
    """The new global state: sharded weights rebuilt from their per-term means, floating
    dense entries averaged (FedAvg), integer buffers (e.g. counters) kept.

    Parameters
    ----------
    current : mapping of str to np.ndarray
        The global state the round started from (``"<layer>.weight"`` keys of the layers in
        ``spectra`` are sharded).
    spectra : mapping of str to LayerSpectrum
        The round's decompositions, by layer.
    weights, dense, terms : sequences, one entry per client
        Its weight ``D_k``, its dense entries by key, its :class:`TermUpdate` by layer.
    aggregation, trim_fraction : str, float
        ``"mean"`` (weighted, the paper's), ``"median"`` or ``"trimmed-mean"``
        (:func:`robust_reduce`), per term over its holders and per dense entry over all.
    device : str or None
        Where the rebuild's products run (:func:`rebuild_weight`).
    """
    out: dict[str, np.ndarray] = {}
    for key, value in current.items():
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        if layer is not None and layer in spectra:
            spec = spectra[layer]
            out[key] = rebuild_weight(spec, *term_means(spec, [t[layer] for t in terms],
                                                        aggregation, trim_fraction),
                                      device=device)
        elif not np.issubdtype(value.dtype, np.floating):
            out[key] = value
        else:
            out[key] = dense_mean([d[key] for d in dense], weights, aggregation,
                                  trim_fraction)
    return out


def dense_equivalents(
    current: Mapping[str, np.ndarray],
    spectra: Mapping[str, LayerSpectrum],
    dense: Sequence[Mapping[str, np.ndarray]],
    terms: Sequence[Mapping[str, TermUpdate]],
) -> list[dict[str, np.ndarray]]:
    """Each client's reply as the whole model it stands for (float64, floating entries only):
    a sharded weight is ``W + Σ_{i∈I_k} (u'_i v'_iᵀ − u_i v_iᵀ)`` (its terms replaced by
    the client's, the others as they were), a dense entry is the client's own. The products
    do not depend on the sign or balance a client returns its factors in, so the dense rules
    (:data:`DENSE_AGGREGATIONS`) need no alignment."""
    out = []
    for d, t in zip(dense, terms, strict=True):
        state: dict[str, np.ndarray] = {}
        for key, value in current.items():
            layer = key[: -len(".weight")] if key.endswith(".weight") else None
            if layer is not None and layer in spectra:
                spec, up = spectra[layer], t[layer]
                w = spec.w + up.u.astype(np.float64) @ up.v.astype(np.float64).T
                w -= spec.ut[up.indices].T @ spec.vt[up.indices]
                state[key] = w.reshape(spec.shape)
            elif np.issubdtype(value.dtype, np.floating):
                state[key] = np.asarray(d[key], dtype=np.float64)
        out.append(state)
    return out
