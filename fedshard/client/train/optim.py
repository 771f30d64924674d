"""fedshard's optimizer (paper, Sec. 3.3): SGD with momentum over two parameter groups, the
client rules attached (:func:`build_optimizer`), and the Frobenius-decay term's value
(:func:`frobenius_penalty`).

The rules themselves (Frobenius decay, the dense factor step, ClipLR) are
:class:`~fedshard.client.train.rules.ClientRules`, the same for every optimizer and trainer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fedshard.client.train.config import TrainConfig
from fedshard.client.train.rules import ClientRules
from fedshard.spectral.layers import SpectralLayer

__all__ = ["build_optimizer", "frobenius_penalty", "parameter_groups", "sgd_kernel"]


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
    groups = parameter_groups(model, recipe.weight_decay)
    kernel = sgd_kernel(p for g in groups for p in g["params"])
    sgd = torch.optim.SGD(groups, lr=cfg.lr, momentum=recipe.momentum, **kernel)
    if kernel and recipe.momentum:
        # torch's fused SGD starts every buffer of a group at its first step, or none: a
        # parameter whose first gradient comes later would have none (a TypeError there). A
        # zero buffer makes its first momentum step the gradient itself, as torch's default
        # starts it.
        for g in groups:
            for p in g["params"]:
                sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)
    (rules or ClientRules.of(model, recipe)).attach(sgd)
    return sgd


def sgd_kernel(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """How :func:`build_optimizer`'s SGD updates ``params``: ``{"fused": True}`` (torch's
    fused kernel: each parameter's weight decay, momentum and update in one pass over it)
    when every parameter is a floating tensor in a CPU's memory, ``{}`` (torch's default)
    otherwise.

    Notes
    -----
    On a CPU torch's default update takes one kernel per operation and parameter (about 3.5
    passes over each one); the fused kernel took a third of its time for the engine
    benchmark's MLP (``benchmarks/bench_train_loop.py`` measures a client's epoch both ways).
    Its results differ from the default's in the last bit of some entries (it rounds each
    update once where the default rounds after each operation). fedshard's loop, its fast
    path and :meth:`~fedshard.client.Shard.optimizer` take their SGD from
    :func:`build_optimizer`, so all of them compute the same numbers; the lab's batched
    engine keeps torch's default (it puts idle clients' momentum back after a step) and
    agrees with them in float64 to its tested tolerance. On a GPU torch's default is kept.
    :func:`build_optimizer` starts each momentum buffer at zero, so that a parameter whose
    first gradient comes after the first step is updated as torch's default would.
    """
    params = list(params)
    on_cpu = bool(params) and all(p.device.type == "cpu" and p.is_floating_point()
                                  for p in params)
    return {"fused": True} if on_cpu else {}


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
