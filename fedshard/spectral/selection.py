"""Which layers of a model are sharded: default selection, forward order, support checks."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fedshard.spectral.layers import SpectralLayer

__all__ = ["check_shardable", "multipliers_can_compound", "sharded_layer_names"]


def multipliers_can_compound(model: nn.Module, method: str, layers: Iterable[str]) -> bool:
    """Whether ω > 1 (Unbiased, Collective, PriSM + Wallenius) can compound from sharded layer
    to sharded layer: some layer is sharded and the model has no normalization layer."""
    norms = (nn.GroupNorm, nn.LayerNorm, nn.modules.batchnorm._BatchNorm)
    return method in ("unbiased", "collective", "prism-wallenius", "anneal-unbiased",
                      "anneal-collective") and any(True for _ in layers) \
        and not any(isinstance(m, norms) for m in model.modules())

logger = logging.getLogger(__name__)

# Modules counted as "affine layers" when locating the first and the last one. Embeddings count
# (a lookup is a linear map of a one-hot input): for a GPT the first affine layer is then the
# token embedding and the first attention projection is sharded, as in the paper (Sec. 4.1).
_AFFINE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Embedding,
    nn.EmbeddingBag,
    SpectralLayer,
)


def sharded_layer_names(
    model: nn.Module,
    *,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    example_input: Any = None,
) -> list[str]:
    """Names of the layers to shard, in forward order.

    Parameters
    ----------
    model : nn.Module
        The dense model (not modified).
    include : iterable of str, optional
        Exactly these modules instead of the default; each must be a plain ``nn.Linear`` or an
        ``nn.Conv2d`` with ``groups == 1``.
    exclude : iterable of str, optional
        Modules removed from the default (or from ``include``).
    example_input : Tensor or tuple, optional
        If given, ``model(example_input)`` (``model(*example_input)`` for a tuple) is run once
        in eval mode under ``torch.no_grad()`` with forward hooks to find the forward order;
        the modules' train/eval flags are restored afterwards.

    Returns
    -------
    list of str
        Module names ordered as the layers run (see Notes).

    Raises
    ------
    ValueError
        If a name in ``include`` or ``exclude`` is not a module of ``model`` (all such names
        listed at once).
    TypeError
        If ``include`` names modules that cannot be sharded (all listed at once): anything but
        an exact ``nn.Linear`` / ``nn.Conv2d`` (``ConvTranspose2d``, ``Conv1d``, subclasses such
        as ``nn.MultiheadAttention.out_proj`` whose parent reads ``.weight`` directly), convs
        with ``groups > 1``, uninitialized lazy layers, layers whose weight is shared with
        another module, or the root module itself.

    Notes
    -----
    Default (paper, Sec. 4.1: "we do not decompose the very first and very last layers"): every
    supported layer except the first and the last *affine* layer, where affine layers are
    ``Linear``, ``Bilinear``, all convolutions (incl. transposed), ``Embedding`` and
    ``EmbeddingBag`` -- whether or not they are supported themselves.

    Forward order is the order of the first call of each affine layer during the
    ``example_input`` pass; affine layers that the pass never calls are never "first" or "last"
    and come after the called ones, in registration order. Without ``example_input`` the order
    is module registration order (``model.named_modules()``), which equals forward order for
    models that register layers in the order they use them (e.g. the ResNets of
    :mod:`fedshard.models`).
    """
    if isinstance(include, str) or isinstance(exclude, str):
        raise TypeError(
            "include/exclude must be iterables of module names, got a single string "
            f"({include if isinstance(include, str) else exclude!r}); wrap it in a list."
        )
    modules = dict(model.named_modules())
    include_list = None if include is None else list(include)
    exclude_set = set() if exclude is None else set(exclude)
    missing = [n for n in [*(include_list or []), *sorted(exclude_set)] if n not in modules]
    if missing:
        raise ValueError(_missing_message(missing, modules, "include/exclude"))

    order, ends = _affine_order(model, modules, example_input)
    if include_list is not None:
        check_shardable(model, include_list)
        chosen = set(include_list)
    else:
        tied = _tied_weights(model)
        chosen = {
            n for n in order if n not in ends and _unsupported_reason(n, modules[n], tied) is None
        }
    names = [n for n in order if n in chosen and n not in exclude_set]
    logger.debug("sharded layers: %s", names)
    return names


def check_shardable(model: nn.Module, names: Iterable[str]) -> None:
    """Raise if any of ``names`` cannot be replaced by a spectral layer.

    Parameters
    ----------
    model : nn.Module
        The dense model.
    names : iterable of str
        Requested module names.

    Raises
    ------
    ValueError
        Listing every name that is not a module of ``model``.
    TypeError
        Listing every module that is not supported, each with the reason.
    """
    modules = dict(model.named_modules())
    names = list(names)
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(_missing_message(missing, modules, "the requested layers"))
    tied = _tied_weights(model)
    problems = [r for n in names if (r := _unsupported_reason(n, modules[n], tied)) is not None]
    if problems:
        raise TypeError(
            f"cannot shard {len(problems)} requested module(s): " + "; ".join(problems) + ". "
            "Only plain nn.Linear and nn.Conv2d with groups=1 are supported; remove these names "
            "from the request (nothing was changed)."
        )


def _affine_order(
    model: nn.Module, modules: dict[str, nn.Module], example_input: Any
) -> tuple[list[str], set[str]]:
    """Affine module names in forward (or registration) order, and the first and last of them.

    With ``example_input``, modules the pass never called (e.g. ``nn.MultiheadAttention``'s
    ``out_proj``, whose weight the parent uses directly) come last and are never an end.
    """
    registered = [n for n, m in modules.items() if isinstance(m, _AFFINE_TYPES)]
    if example_input is None:
        return registered, set(registered[:1] + registered[-1:])
    called: list[str] = []
    seen: set[int] = set()

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if id(module) not in seen:
                seen.add(id(module))
                called.append(name)

        return hook

    handles = [modules[n].register_forward_hook(record(n)) for n in registered]
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            if isinstance(example_input, tuple):
                model(*example_input)
            else:
                model(example_input)
    finally:
        for handle in handles:
            handle.remove()
        for module, flag in flags.items():
            module.training = flag
    called_set = set(called)
    return called + [n for n in registered if n not in called_set], set(called[:1] + called[-1:])


def _tied_weights(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> every name under which it is registered (more than one: tied)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _unsupported_reason(name: str, module: nn.Module, tied: dict[int, list[str]]) -> str | None:
    """Why ``module`` cannot be replaced by a spectral layer, or ``None`` if it can."""
    label = f"{name!r} ({type(module).__name__})"
    if type(module) not in (nn.Linear, nn.Conv2d):
        return (
            f"{label} is not exactly nn.Linear or nn.Conv2d (transposed/1-D/3-D convs, other "
            "layer types and subclasses such as nn.MultiheadAttention.out_proj, whose parent "
            "reads .weight directly, cannot be replaced)"
        )
    if name == "":
        return f"{label} is the root module and cannot be replaced in place"
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return f"{label} has groups={module.groups}, only groups=1 is supported"
    weight = module.weight
    if isinstance(weight, nn.parameter.UninitializedParameter):
        return f"{label} is an uninitialized lazy layer; run one forward pass first"
    aliases = tied.get(id(weight), [])
    if len(aliases) > 1:
        others = sorted(a for a in aliases if a != f"{name}.weight")
        return f"{label} shares its weight with {others}"
    return None


def _missing_message(missing: list[str], modules: dict[str, nn.Module], what: str) -> str:
    known = [n for n, m in modules.items() if isinstance(m, _AFFINE_TYPES)]
    return (
        f"unknown module name(s) {missing} in {what}; expected names from "
        f"model.named_modules(), e.g. the affine layers {known[:8]}"
        f"{' ...' if len(known) > 8 else ''}. Nothing was changed."
    )
