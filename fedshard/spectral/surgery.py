"""Model surgery: build client sub-models and read the trained factors back.

Nothing here mutates the caller's model: :func:`build_submodel` and :func:`shard_model`
deep-copy first (as Opacus ``ModuleValidator.fix`` does). Putting trained terms back into W
is the server's aggregation, :mod:`fedshard.spectral.aggregate`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedshard.spectral.decompose import check_indices, decompose, take_terms
from fedshard.spectral.kinds import SPECTRAL_CLASSES
from fedshard.spectral.layers import SpectralLayer
from fedshard.spectral.selection import check_shardable

__all__ = ["LayerFactors", "build_submodel", "extract_factors", "shard_model"]


@dataclass(frozen=True)
class LayerFactors:
    """What a client receives for one sharded layer.

    Attributes
    ----------
    u : torch.Tensor
        ``(c_out, n)``, columns ``u'_{I_j}`` (paper Sec. 3.1, step 2).
    v : torch.Tensor
        ``(c_in * k_h * k_w, n)``, columns ``v'_{I_j}``.
    omega : torch.Tensor
        ``(n,)`` auxiliary multipliers ``ω_{I_j}``, frozen during local training.

    Raises
    ------
    ValueError
        If the shapes are inconsistent.
    """

    u: torch.Tensor
    v: torch.Tensor
    omega: torch.Tensor

    def __post_init__(self) -> None:
        if self.u.ndim != 2 or self.v.ndim != 2 or self.u.shape[1] != self.v.shape[1]:
            raise ValueError(
                f"LayerFactors expects u (c_out, n) and v (c_in*k*k, n) with the same n, got "
                f"u {tuple(self.u.shape)} and v {tuple(self.v.shape)}."
            )
        if self.omega.shape != (self.u.shape[1],):
            raise ValueError(
                f"LayerFactors expects omega of shape ({self.u.shape[1]},), got "
                f"{tuple(self.omega.shape)}."
            )


def build_submodel(model: nn.Module, factors: Mapping[str, LayerFactors]) -> nn.Module:
    """Client sub-model: a copy of ``model`` with the named layers replaced by spectral layers.

    Parameters
    ----------
    model : nn.Module
        The dense model (not modified).
    factors : mapping of str to LayerFactors
        Layer name -> the ``(U, V, ω)`` the client received.

    Returns
    -------
    nn.Module
        Deep copy of ``model`` in which each named ``nn.Linear`` / ``nn.Conv2d`` /
        ``nn.ConvTranspose{1,2,3}d`` is a :class:`SpectralLinear` / :class:`SpectralConv2d` /
        ``SpectralConvTranspose{1,2,3}d`` with trainable ``u``, ``v``, frozen
        ``omega`` and a copy of the original bias, in the original weight's dtype and device.
        Everything else is copied unchanged.

    Raises
    ------
    ValueError
        For unknown names or factors whose shapes do not fit their layer (all listed at once).
    TypeError
        For unsupported modules (all listed at once), see :func:`sharded_layer_names`.
    """
    check_shardable(model, factors)
    bad_shapes = []
    for name, fac in factors.items():
        rows, cols = _matrix_shape(model, name)
        if fac.u.shape[0] != rows or fac.v.shape[0] != cols:
            bad_shapes.append(
                f"{name!r}: u {tuple(fac.u.shape)}, v {tuple(fac.v.shape)} but the layer needs "
                f"u ({rows}, n), v ({cols}, n)"
            )
    if bad_shapes:
        raise ValueError(
            "factors do not fit their layers: " + "; ".join(bad_shapes) + ". No sub-model built."
        )
    # The dense weights of the replaced layers are most of the model; they are not copied:
    # the deepcopy memo maps each replaced module to a placeholder, replaced below.
    # (check_shardable has refused modules that are shared or share their weight, so no
    # other name reaches a placeholder.)
    originals = {name: model.get_submodule(name) for name in factors}
    memo: dict[int, Any] = {id(m): nn.Identity() for m in originals.values()}
    sub = copy.deepcopy(model, memo)
    for name, fac in factors.items():
        layer = originals[name]  # geometry and bias; from_factors copies the bias
        new = SPECTRAL_CLASSES[type(layer)].from_factors(layer, fac.u, fac.v, fac.omega)
        _replace(sub, name, new)
    return sub


def extract_factors(sub: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Trained ``(U, V)`` of every spectral layer of ``sub``.

    Parameters
    ----------
    sub : nn.Module
        A sub-model from :func:`build_submodel` or :func:`shard_model`.

    Returns
    -------
    dict of str to (Tensor, Tensor)
        Layer name -> detached copies ``(u (c_out, n), v (fan_in, n))``, columns in the order
        the client received them. Empty if ``sub`` has no spectral layers.
    """
    return {
        name: (m.u.detach().clone(), m.v.detach().clone())
        for name, m in sub.named_modules()
        if isinstance(m, SpectralLayer)
    }


def shard_model(
    model: nn.Module,
    indices: Mapping[str, Sequence[int]],
    omegas: Mapping[str, torch.Tensor],
) -> tuple[nn.Module, dict[str, tuple[int, ...]]]:
    """Decompose the named layers of a dense model and build the sub-model of the chosen terms.

    Parameters
    ----------
    model : nn.Module
        The dense model (not modified).
    indices : mapping of str to sequence of int
        Layer name -> term indices ``I`` in ``[0, N)`` (column ``j`` of the sub-layer is term
        ``I_j``; terms are numbered by decreasing singular value).
    omegas : mapping of str to Tensor
        Layer name -> ``(len(I),)`` multipliers ``ω_{I_j}``; same keys as ``indices``.

    Returns
    -------
    sub : nn.Module
        The sub-model (see :func:`build_submodel`).
    index_map : dict of str to tuple of int
        Layer name -> term indices, the mapping the aggregation needs to put the trained
        columns back.

    Raises
    ------
    ValueError
        If the keys of ``indices`` and ``omegas`` differ, an index list is invalid, or an
        ``omega`` has the wrong length.
    TypeError
        For unsupported modules, see :func:`sharded_layer_names`.
    """
    if set(indices) != set(omegas):
        raise ValueError(
            "indices and omegas must name the same layers; only in indices: "
            f"{sorted(set(indices) - set(omegas))}, only in omegas: "
            f"{sorted(set(omegas) - set(indices))}. No sub-model built."
        )
    check_shardable(model, indices)
    factors = {}
    index_map = {}
    for name, idx in indices.items():
        u, v, _ = decompose(_weight(model, name))  # float64, (c_out, N), (fan_in, N)
        chosen = check_indices(idx, u.shape[1])
        u_sel, v_sel = take_terms(u, v, chosen)
        factors[name] = LayerFactors(u_sel, v_sel, torch.as_tensor(omegas[name]))
        index_map[name] = tuple(chosen)
    return build_submodel(model, factors), index_map


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name), child, new)


def _weight(model: nn.Module, name: str) -> torch.Tensor:
    weight = model.get_submodule(name).weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _matrix_shape(model: nn.Module, name: str) -> tuple[int, int]:
    """``(rows, cols)`` of the weight of module ``name`` viewed as a matrix."""
    weight = _weight(model, name)
    return int(weight.shape[0]), int(weight[0].numel())
