"""Which layers of a model are sharded: the layer policies, forward order, support checks."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fedshard.spectral.cost import layer_cost, numpy_dtype
from fedshard.spectral.kinds import SHARDABLE_NAMES, SPECTRAL_CLASSES
from fedshard.spectral.layers import SpectralLayer

__all__ = [
    "LAYER_POLICIES",
    "check_shardable",
    "multipliers_can_compound",
    "shardable_layers",
    "sharded_layer_names",
]

#: The layer policies of :func:`sharded_layer_names`: ``"paper"`` (the default) and
#: ``"by-size"``.
LAYER_POLICIES = ("paper", "by-size")

#: torch's batch-norm layers (running statistics), by their public classes.
BATCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


def multipliers_can_compound(model: nn.Module, method: str, layers: Iterable[str]) -> bool:
    """Whether ω > 1 (Unbiased, Collective, PriSM + Wallenius) can compound from sharded layer
    to sharded layer: some layer is sharded and the model has no normalization layer."""
    norms = (nn.GroupNorm, nn.LayerNorm, *BATCH_NORMS)
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
    policy: str = "paper",
    keep_ratio: float | None = None,
) -> list[str]:
    """Names of the layers to shard, in forward order.

    Parameters
    ----------
    model : nn.Module
        The dense model (not modified).
    include : iterable of str, optional
        Exactly these modules instead of the policy's choice; each must be a plain
        ``nn.Linear``, or an ``nn.Conv2d`` or ``nn.ConvTranspose1d/2d/3d`` with
        ``groups == 1``.
    exclude : iterable of str, optional
        Modules removed from the policy's choice (or from ``include``).
    example_input : Tensor or tuple, optional
        If given, ``model(example_input)`` (``model(*example_input)`` for a tuple) is run once
        in eval mode under ``torch.no_grad()`` with forward hooks to find the forward order;
        the modules' train/eval flags are restored afterwards. A WARNING (logger
        ``fedshard.spectral.selection``) names every ``nn.Linear`` / ``nn.Conv2d`` the pass
        did not reach.
    policy : {"paper", "by-size"}
        Which layers to shard when ``include`` is not given (see Notes). ``"paper"`` is the
        default.
    keep_ratio : float, optional
        ``"by-size"`` only, and required there: the keep ratio the layers are sized for, the
        smallest one below 1 that the nodes use (the nodes sharding is for).

    Returns
    -------
    list of str
        Module names ordered as the layers run (see Notes).

    Raises
    ------
    ValueError
        If a name in ``include`` or ``exclude`` is not a module of ``model`` (all such names
        listed at once), ``policy`` is unknown, or ``keep_ratio`` is missing with
        ``policy="by-size"``, outside ``(0, 1]``, or given with ``policy="paper"``.
    TypeError
        If ``include`` names modules that cannot be sharded (all listed at once): anything but
        an exact ``nn.Linear`` / ``nn.Conv2d`` / ``nn.ConvTranspose1d/2d/3d`` (``Conv1d``,
        ``Conv3d``, subclasses such
        as ``nn.MultiheadAttention.out_proj`` whose parent reads ``.weight`` directly), convs
        with ``groups > 1``, uninitialized lazy layers, layers whose weight is shared with
        another module, or the root module itself.

    Notes
    -----
    ``"paper"`` (Sec. 4.1: "we do not decompose the very first and very last layers"): every
    supported layer except the first and the last *affine* layer, where affine layers are
    ``Linear``, ``Bilinear``, all convolutions (incl. transposed), ``Embedding`` and
    ``EmbeddingBag`` -- whether or not they are supported themselves.

    ``"by-size"``: sharding is there to cut what a node receives and computes (Sec. 3.1:
    "with a sufficiently low value of r, this reduces both communication costs and
    computational complexity"). The paper leaves the first and the last layer dense because
    in its models they are a sliver of the weights (ResNet-18: 0.02 % and 0.05 %) that sees
    the raw input or makes the output; in a small model they can be nearly all of it (an
    autoencoder 784-64-3-64-784: 99.6 %), and then no keep ratio saves anything. So a
    supported layer is sharded when

    1. its ``n = ⌈rN⌉`` factors at ``r = keep_ratio`` cost fewer bytes on the wire than its
       dense weight (:func:`~fedshard.spectral.cost.layer_cost`): a layer that cannot save
       anything for the smallest nodes is left dense (CCT's 1×256 ``pool.score``, N = 1; a
       rank-3 bottleneck at ``r = 0.5``, where 2 of 3 terms cost more than the 64×3 weight).
       The smallest keep ratio, because the nodes sharding is for are the weakest: a layer
       that saves bytes for them may cost a little more for nodes at larger ratios (a square
       layer breaks even at ``r = 0.5``), which :func:`~fedshard.spectral.budget_warnings`
       reports; and
    2. if it is the first or the last affine layer, it holds more weights than the average
       affine layer: an end layer stays dense, as in the paper, unless leaving it dense would
       cap what sharding can save. A classifier's output layer (``classes × width``) is such
       a sliver in every model of :mod:`fedshard.models`, so the logits are not
       rank-truncated there.

    At keep ratios up to 0.25 both policies choose the same layers on ResNet-18, LeNet and
    CharGPT; on CCT ``"by-size"`` leaves out ``pool.score``, on the MLP it adds the first
    layer (43 % of the weights), on the autoencoder the first and the last
    (``benchmarks/layer_policy.py`` measures both on each). Sized for ``r = 0.5`` it leaves
    out the square layers, which break even there.

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
    if policy not in LAYER_POLICIES:
        raise ValueError(f"policy={policy!r}: expected one of {LAYER_POLICIES}; no layers "
                         "were chosen.")
    if keep_ratio is not None and policy != "by-size":
        raise ValueError(f"keep_ratio={keep_ratio!r} is read only by policy='by-size', not "
                         f"policy={policy!r}; drop it or pass policy='by-size'.")
    if policy == "by-size" and keep_ratio is None:
        raise ValueError("policy='by-size' needs keep_ratio, the smallest keep ratio below 1 "
                         "that the nodes use (a layer is sharded where its factors at that "
                         "ratio save bytes), e.g. sharded_layer_names(model, policy='by-size', "
                         "keep_ratio=0.25); no layers were chosen.")
    ratio = 1.0 if keep_ratio is None else keep_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"keep_ratio={keep_ratio!r}: expected the smallest keep ratio the "
                         "nodes use, in (0, 1]; no layers were chosen.")
    modules = dict(model.named_modules())
    include_list = None if include is None else list(include)
    exclude_set = set() if exclude is None else set(exclude)
    missing = [n for n in [*(include_list or []), *sorted(exclude_set)] if n not in modules]
    if missing:
        raise ValueError(_missing_message(missing, modules, "include/exclude"))

    order, ends, unreached = _affine_order(model, modules, example_input)
    if include_list is not None:
        check_shardable(model, include_list)
        chosen = set(include_list)
    else:
        supported = set(shardable_layers(model))
        chosen = {n for n in order if n not in ends and n in supported}
        if policy == "by-size":
            chosen = _by_size(modules, order, ends, supported, float(ratio))
    names = [n for n in order if n in chosen and n not in exclude_set]
    if example_input is not None:
        _warn_unreached(modules, order, unreached, set(names), include_list is None)
    logger.debug("sharded layers: %s", names)
    return names


def shardable_layers(model: nn.Module) -> list[str]:
    """Every module of ``model`` that can be sharded, in registration order: exact
    ``nn.Linear`` / ``nn.Conv2d`` / ``nn.ConvTranspose1d/2d/3d`` with ``groups == 1``,
    initialized, weight not shared, not the root (see :func:`sharded_layer_names`)."""
    tied = _tied_weights(model)
    return [n for n, m in model.named_modules() if _unsupported_reason(n, m, tied) is None]


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
            f"Only plain {SHARDABLE_NAMES} with groups=1 are supported; remove these names "
            "from the request (nothing was changed)."
        )


def _affine_order(
    model: nn.Module, modules: dict[str, nn.Module], example_input: Any
) -> tuple[list[str], set[str], list[str]]:
    """Affine module names in forward (or registration) order, the first and last of them,
    and those the ``example_input`` pass never called (empty without one).

    With ``example_input``, modules the pass never called (e.g. ``nn.MultiheadAttention``'s
    ``out_proj``, whose weight the parent uses directly) come last and are never an end.
    """
    registered = [n for n, m in modules.items() if isinstance(m, _AFFINE_TYPES)]
    if example_input is None:
        return registered, set(registered[:1] + registered[-1:]), []
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
    unreached = [n for n in registered if n not in called_set]
    return called + unreached, set(called[:1] + called[-1:]), unreached


def _by_size(modules: dict[str, nn.Module], order: list[str], ends: set[str],
             supported: set[str], keep_ratio: float) -> set[str]:
    """The ``"by-size"`` choice (see :func:`sharded_layer_names`, Notes)."""
    sizes = {n: w.numel() for n in order
             if isinstance(w := getattr(modules[n], "weight", None), torch.Tensor)
             and not isinstance(w, nn.parameter.UninitializedParameter)}
    average = sum(sizes.values()) / max(len(sizes), 1)
    chosen = set()
    for name in order:
        if name not in supported or (name in ends and sizes[name] <= average):
            continue
        weight = modules[name].weight
        assert isinstance(weight, torch.Tensor)
        cost = layer_cost(name, tuple(weight.shape), numpy_dtype(weight.dtype), keep_ratio)
        if cost.received_bytes < cost.dense_bytes:
            chosen.add(name)
    return chosen


def _warn_unreached(modules: dict[str, nn.Module], order: list[str], unreached: list[str],
                    sharded: set[str], by_policy: bool) -> None:
    """WARN about the Linear/Conv2d layers the ``example_input`` pass did not call.

    Their place in the order, and so the first and last layer, came from the pass: a model
    whose ``forward()`` is not its training path gets the wrong ends, silently otherwise.
    """
    missed = [n for n in unreached if type(modules[n]) in SPECTRAL_CLASSES]
    if not missed:
        return
    reached = order[: len(order) - len(unreached)]  # the called layers come first
    listed = ", ".join(f"{n!r} ({'sharded' if n in sharded else 'left dense'})"
                       for n in missed)
    if not by_policy:
        how = "The layers were named (include): only their order came from the pass."
    elif reached:
        how = (f"The first and last layers, which the policy leaves dense, were chosen among "
               f"the layers it reached (first {reached[0]!r}, last {reached[-1]!r}); the "
               "unreached ones were ordered after them.")
    else:
        how = "It reached no affine layer, so none was taken as the first or the last."
    logger.warning(
        "the example_input forward pass did not reach %d Linear/Conv2d layer(s): %s. %s If the "
        "model trains through another path than forward() (a loss that calls a decoder or a "
        "head itself), pass an example_input that runs every layer, or name the layers: "
        "SpectralSharding(sharded_layers=[...]).", len(missed), listed, how)


def _tied_weights(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> every name under which it is registered (more than one: tied)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _unsupported_reason(name: str, module: nn.Module, tied: dict[int, list[str]]) -> str | None:
    """Why ``module`` cannot be replaced by a spectral layer, or ``None`` if it can."""
    label = f"{name!r} ({type(module).__name__})"
    if type(module) not in SPECTRAL_CLASSES:
        return (
            f"{label} is not exactly one of {SHARDABLE_NAMES} (1-D/3-D convs, other layer "
            "types and subclasses such as nn.MultiheadAttention.out_proj, whose parent reads "
            ".weight directly, cannot be replaced)"
        )
    if name == "":
        return f"{label} is the root module and cannot be replaced in place"
    groups = getattr(module, "groups", 1)
    if groups != 1:
        return f"{label} has groups={groups}, only groups=1 is supported"
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
