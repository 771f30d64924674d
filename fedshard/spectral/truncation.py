"""Rank truncation of the sharded layers: a low-rank start, and what Top-n really trains.

Two uses of one operation, ``W ↦ Σ_{i ≤ n} λᵢ uᵢ vᵢᵀ`` with ``n = ⌈rN⌉`` per sharded layer:

- **Low-rank start** (:func:`truncate_`): replace the initial weights by their best rank-n
  approximation, so that no untrained random tail stays in the global model. Top-n only ever
  trains the leading ``⌈rN⌉`` terms; at He initialization the other terms hold most of each
  layer's energy and stay in the evaluated model (``docs/results.md``, "Beyond the paper").
- **Diagnostics** (:func:`truncate_state`): the global model truncated to the terms a Top-n
  client trains, and the energy share of the rest (``tail energy``).

Numpy and torch only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedshard.sampling.plan import num_terms

__all__ = ["truncate_", "truncate_state", "truncate_weight"]


def truncate_weight(weight: np.ndarray, keep_ratio: float) -> tuple[np.ndarray, float, float]:
    """Best rank-``n`` approximation of one Linear/Conv2d weight, ``n = ⌈rN⌉``.

    Parameters
    ----------
    weight : np.ndarray
        ``(c_out, c_in)`` or ``(c_out, c_in, k_h, k_w)``; viewed as ``(c_out, c_in·k·k)``.
    keep_ratio : float
        ``r`` in ``(0, 1]``.

    Returns
    -------
    truncated : np.ndarray
        Same shape and dtype as ``weight``: ``Σ_{i ≤ n} λᵢ uᵢ vᵢᵀ`` (float64 SVD).
    tail_energy : float
        ``Σ_{i > n} λᵢ² / Σᵢ λᵢ²`` (0 for a zero weight).
    tail_norm : float
        ``‖W - truncated‖_F = sqrt(Σ_{i > n} λᵢ²)`` (Eckart–Young: the smallest possible).
    """
    w = np.asarray(weight)
    if w.ndim < 2 or not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"truncate_weight() expects a floating weight with >= 2 dimensions, "
                         f"got dtype {w.dtype} and shape {w.shape}; nothing was truncated.")
    # torch's SVD, as fedshard.spectral.decompose: numpy's (OpenBLAS) can hang when called
    # from the ServerApp's thread inside Flower's simulation process (seen with Ray, 2 cores).
    mat = torch.from_numpy(w.reshape(w.shape[0], -1).astype(np.float64))  # (c_out, c_in·k·k)
    u_t, lam_t, vt_t = torch.linalg.svd(mat, full_matrices=False)  # (c_out, N), (N,), (N, cols)
    lam = lam_t.numpy()
    n = num_terms(lam.size, keep_ratio)
    out = ((u_t[:, :n] * lam_t[:n]) @ vt_t[:n]).numpy()
    energy = float(np.sum(lam**2))
    tail = float(np.sum(lam[n:] ** 2))
    share = tail / energy if energy > 0 else 0.0
    return out.reshape(w.shape).astype(w.dtype), share, float(np.sqrt(tail))


def truncate_state(state: Mapping[str, Any], layers: Sequence[str],
                   keep_ratio: float) -> tuple[dict[str, np.ndarray], float]:
    """``state`` (a state dict, numpy or torch values) with every ``"<layer>.weight"`` of
    ``layers`` truncated to rank ``⌈rN⌉``; the other entries are shared, not copied.

    Returns the new state (numpy) and the tail energy share over all ``layers`` together,
    ``Σ_layers Σ_{i > n} λᵢ² / Σ_layers Σᵢ λᵢ²``.
    """
    out = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v))
           for k, v in state.items()}
    tail = total = 0.0
    for layer in layers:
        key = f"{layer}.weight"
        if key not in out:
            raise KeyError(f"truncate_state(): no {key!r} in the state dict; expected the "
                           "weights of the sharded layers named in `layers`.")
        w = out[key]
        out[key], share, _ = truncate_weight(w, keep_ratio)
        energy = float(np.sum(w.astype(np.float64) ** 2))  # = Σ λ²
        tail, total = tail + share * energy, total + energy
    return out, (tail / total if total > 0 else 0.0)


@torch.no_grad()
def truncate_(model: nn.Module, layers: Sequence[str], keep_ratio: float) -> float:
    """In place: truncate the weight of every module in ``layers`` to rank ``⌈rN⌉``.

    The low-rank start: call it on a freshly initialised model before the first round.
    Returns the energy share removed (over all ``layers``).
    """
    modules = dict(model.named_modules())
    missing = [name for name in layers if not isinstance(
        getattr(modules.get(name), "weight", None), torch.Tensor)]
    if missing:
        raise ValueError(f"truncate_(): {missing} are not layers with a weight in this model; "
                         "nothing was truncated.")
    state = {f"{name}.weight": modules[name].weight for name in layers}
    new, share = truncate_state(state, layers, keep_ratio)
    for name in layers:
        weight = modules[name].weight
        weight.copy_(torch.from_numpy(new[f"{name}.weight"]).to(weight.device, weight.dtype))
    return share
