"""fedshard's optimizer (paper, Sec. 3.3): SGD with momentum over two parameter groups, the
client rules attached (:func:`build_optimizer`), and the Frobenius-decay term's value
(:func:`frobenius_penalty`).

The rules themselves (Frobenius decay, the dense factor step, ClipLR) are
:class:`~fedshard.client.train.rules.ClientRules`, the same for every optimizer and trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedshard.client.train.config import TrainConfig
from fedshard.client.train.rules import ClientRules
from fedshard.spectral.layers import SpectralLayer

__all__ = ["build_optimizer", "frobenius_penalty", "parameter_groups"]


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters of ``model`` in two optimizer groups: the spectral factors
    ``u``, ``v`` with ``weight_decay=0`` (they get Frobenius decay instead, from the client
    rules), and all other trainable parameters with ``weight_decay``. Empty groups are left
    out, and so is every layer's ω (a frozen parameter, never trained, even if someone set
    its ``requires_grad``).

    Raises
    ------
    ValueError
        If ``model`` has no trainable parameter.
    """
    factors: list[nn.Parameter] = []
    omegas: set[int] = set()
    for m in model.modules():
        if isinstance(m, SpectralLayer):
            factors += [p for p in (m.u, m.v) if p.requires_grad]
            omegas.add(id(m.omega))
    factor_ids = {id(p) for p in factors} | omegas
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in factor_ids]
    groups: list[dict[str, Any]] = []
    if factors:
        groups.append({"params": factors, "weight_decay": 0.0})
    if dense:
        groups.append({"params": dense, "weight_decay": weight_decay})
    if not groups:
        raise ValueError("the model has no trainable parameters; there is nothing to train.")
    return groups


def build_optimizer(model: nn.Module, cfg: TrainConfig,
                    rules: ClientRules | None = None) -> torch.optim.SGD:
    """SGD with momentum for ``model`` (:func:`parameter_groups`), with the recipe's client
    rules attached (:meth:`ClientRules.attach`: Frobenius decay and, under
    ``factor_step="dense"``, the dense factor step before each step; ClipLR after it).

    Parameters
    ----------
    model : nn.Module
        The (sub-)model to train.
    cfg : TrainConfig
        Its ``recipe`` gives the lr, momentum, weight decay and the rules' γ, τ and factor
        step.
    rules : ClientRules, optional
        The rules to attach (to read their :meth:`~ClientRules.report` later); by default
        ``ClientRules.of(model, cfg.recipe)``.

    Returns
    -------
    torch.optim.SGD
        A plain torch optimizer (``zero_grad``, ``step``, ``state_dict``, schedulers).

    Raises
    ------
    ValueError
        If ``model`` has no trainable parameter.
    """
    recipe = cfg.recipe
    sgd = torch.optim.SGD(parameter_groups(model, recipe.weight_decay), lr=cfg.lr,
                          momentum=recipe.momentum)
    (rules or ClientRules.of(model, recipe)).attach(sgd)
    return sgd


def frobenius_penalty(model: nn.Module) -> torch.Tensor:
    """``Σ_layers ‖U Ω V^T‖_F^2`` over the spectral layers of ``model`` (differentiable).

    Parameters
    ----------
    model : nn.Module
        The sub-model.

    Returns
    -------
    torch.Tensor
        Scalar; ``0.`` if there are no spectral layers.

    Notes
    -----
    Frobenius decay (paper, Sec. 3.3, after Khodak et al. 2022); each term comes from
    ``n x n`` Gram matrices, see :meth:`SpectralLayer.frobenius_norm_sq`. The client rules
    add its analytic gradient (:class:`~fedshard.client.train.rules.ClientRules`); this is its
    value, e.g. to log ``γ · frobenius_penalty(model)``.
    """
    terms = [m.frobenius_norm_sq() for m in model.modules() if isinstance(m, SpectralLayer)]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()
