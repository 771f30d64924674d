"""Low-memory training of a sharded model: keep the rank-n bottlenecks, recompute the rest.

A sharded layer ``y = U Ω (Vᵀ x)`` has a narrow intermediate ``h = Vᵀ x`` of ``n`` channels
between two full-width tensors. Autograd would store the full-width tensors around it (the
``1 x 1`` / ``U`` product's output, the normalization's input, the nonlinearity's output):
only the weights, their gradients and momentum shrink with the keep ratio, so a node at
r = 0.1 held more than half of the dense model's peak memory. :func:`low_memory` runs each
*block* of the model (a repeated unit: a residual block, a transformer block, or the layers
of a ``Sequential`` from one sharded layer to the next) as an activation checkpoint
(:func:`torch.utils.checkpoint.checkpoint`) whose selective policy keeps the outputs of the
sharded layers' ``Vᵀ`` products (``n`` wide) and the block's input (the residual stream, once
per block), and recomputes everything else in the backward pass: the ``U`` products, the
norms, the nonlinearities and the additions, none of which costs a ``Vᵀ`` product.

The gradients are those of the plain step (the same operations run again on the same values,
dropout with its random state restored): float64 equal to rounding
(``tests/spectral/test_recompute.py``). A model without such blocks (every sharded layer a
direct attribute of one module, as in a LeNet) trains as before, and :func:`blocks_of` says
so by returning no block.

Notes
-----
The dense first and last layers (paper, Sec. 4.1) and everything outside a block are stored
as autograd would; a block is recomputed while the backward pass is inside it, so the peak
holds one block's full-width tensors at a time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Block", "blocks_of", "conv_product", "linear_product", "low_memory"]


class _Tape:
    """The bottleneck outputs of one block's forward pass (detached, ``n`` wide), handed back
    in the same order when the block is recomputed."""

    __slots__ = ("next", "outputs", "replaying")

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.replaying = False
        self.next = 0

    def product(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()`` in the forward pass (kept), the kept output in the recomputation."""
        if self.replaying:  # a fresh tensor of the kept storage: no history of its own
            out = self.outputs[self.next].detach()
            self.next += 1
            return out
        out = compute()
        self.outputs.append(out.detach())  # the same storage, without the forward's graph
        return out


#: The open block's tape while :func:`low_memory` runs it (``None`` outside: the layers then
#: take their plain products, bit for bit those of a step without low-memory mode).
TAPE: ContextVar[_Tape | None] = ContextVar("fedshard_bottleneck_tape", default=None)


class _LinearProduct(torch.autograd.Function):
    """``x @ v`` ``(..., in) @ (in, n)``, its output taken from the tape when recomputed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, v: torch.Tensor, tape: _Tape) -> torch.Tensor:
        ctx.save_for_backward(x, v)
        return tape.product(lambda: torch.matmul(x, v))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, v = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])  # (B·..., n)
        grad_x = (flat @ v.mT).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_v = x.reshape(-1, x.shape[-1]).mT @ flat if ctx.needs_input_grad[1] else None
        return grad_x, grad_v, None


class _ConvProduct(torch.autograd.Function):
    """``conv2d(x, kernel)`` to ``n`` channels (no bias), its output taken from the tape when
    recomputed; the backward pass is torch's own convolution backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: torch.Tensor, tape: _Tape,
                stride: tuple[int, int], padding: tuple[int, int],
                dilation: tuple[int, int]) -> torch.Tensor:
        ctx.save_for_backward(x, kernel)
        ctx.geometry = (stride, padding, dilation)
        return tape.product(
            lambda: torch.nn.functional.conv2d(x, kernel, None, stride, padding, dilation))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, kernel = ctx.saved_tensors
        stride, padding, dilation = ctx.geometry
        grad_x, grad_k, _ = torch.ops.aten.convolution_backward(
            grad, x, kernel, None, stride, padding, dilation, False, [0, 0], 1,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1], False])
        return grad_x, grad_k, None, None, None, None


def linear_product(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A sharded linear layer's bottleneck ``x @ v`` ``(..., n)``: the plain product, or inside
    a low-memory block the product kept for its recomputation."""
    tape = None if torch.compiler.is_compiling() else TAPE.get()  # compiled: the plain step
    if tape is None:
        return torch.matmul(x, v)
    return _LinearProduct.apply(x, v, tape)


def conv_product(x: torch.Tensor, kernel: torch.Tensor, stride: tuple[int, int],
                 padding: tuple[int, int], dilation: tuple[int, int]) -> torch.Tensor | None:
    """A sharded convolution's bottleneck inside a low-memory block (``x`` already padded
    where the padding is not zeros of the given size), or ``None`` outside one."""
    tape = None if torch.compiler.is_compiling() else TAPE.get()  # compiled: the plain step
    if tape is None:
        return None
    return _ConvProduct.apply(x, kernel, tape, stride, padding, dilation)


@dataclass(frozen=True)
class Block:
    """One recomputed unit: ``modules`` of ``parent``, run as one checkpoint.

    ``parent`` is a ``nn.Sequential`` whose children ``start .. stop - 1`` form the block (from
    a child holding a sharded layer to the next such child), or ``None`` for a single module
    (a child of a ``nn.ModuleList`` or a ``nn.Sequential`` that is its own block)."""

    name: str
    modules: tuple[nn.Module, ...]
    parent: nn.Sequential | None = None
    start: int = 0
    stop: int = 0


def _is_spectral(module: nn.Module) -> bool:
    from fedshard.spectral.layers import SpectralLayer

    return isinstance(module, SpectralLayer)


def blocks_of(model: nn.Module,
              is_sharded: Callable[[nn.Module], bool] = _is_spectral) -> list[Block]:
    """The blocks :func:`low_memory` recomputes in ``model``, in module order.

    A child of a ``nn.ModuleList`` that holds a sharded layer is a block (a transformer or
    residual block); the children of a ``nn.Sequential`` are grouped into blocks that start
    at a child holding a sharded layer and run to the next one (``[SpectralLinear, LayerNorm,
    ReLU]``). A block that is one sharded layer alone is left out (nothing to recompute).
    Blocks do not nest: the search stops at a block.

    ``is_sharded`` says which modules are sharded layers (default: the
    :class:`~fedshard.spectral.layers.SpectralLayer` ones); given the dense layers that
    sharding would factorize, the same blocks of a dense model are what per-block activation
    checkpointing of it recomputes (nothing is marked as a bottleneck there, so a block keeps
    only its input).
    """
    found: list[Block] = []

    def holds(module: nn.Module) -> bool:
        return any(is_sharded(m) for m in module.modules())

    def visit(module: nn.Module, prefix: str) -> None:
        children = list(module.named_children())
        if isinstance(module, nn.Sequential):
            starts = [i for i, (_, c) in enumerate(children) if holds(c)]
            bounds = (list(zip(starts, [*starts[1:], len(children)], strict=True)) if starts
                      else [])
            for start, stop in bounds:
                mods = tuple(c for _, c in children[start:stop])
                if len(mods) == 1 and is_sharded(mods[0]):
                    continue
                if len(mods) == 1:
                    found.append(Block(f"{prefix}{children[start][0]}", mods))
                else:
                    found.append(Block(f"{prefix}{children[start][0]}..{children[stop - 1][0]}",
                                       mods, module, start, stop))
            for i, (name, child) in enumerate(children):
                if not any(start <= i < stop for start, stop in bounds):
                    visit(child, f"{prefix}{name}.")
            return
        for name, child in children:
            if isinstance(module, nn.ModuleList) and holds(child) and not is_sharded(child):
                found.append(Block(f"{prefix}{name}", (child,)))
            elif not is_sharded(child):
                visit(child, f"{prefix}{name}.")

    visit(model, "")
    return found


def _run_checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args)`` as one activation checkpoint whose sharded-layer products are kept
    on a tape and handed back when the block is recomputed in the backward pass."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    tape = _Tape()

    def run(*a: Any, **k: Any) -> Any:
        token = TAPE.set(tape)
        try:
            return forward(*a, **k)
        finally:  # also when the recomputation stops early, once it has what it needs
            TAPE.reset(token)
            tape.replaying, tape.next = True, 0

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _sequential_forward(seq: nn.Sequential, blocks: list[Block], x: Any) -> Any:
    """``seq``'s forward with each of its ``blocks`` run as one checkpoint."""
    children = list(seq)
    by_start = {b.start: b for b in blocks}
    i = 0
    while i < len(children):
        block = by_start.get(i)
        if block is None:
            x = children[i](x)
            i += 1
            continue
        x = _run_checkpointed(_chain(block.modules), x)
        i = block.stop
    return x


def _chain(modules: tuple[nn.Module, ...]) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        for m in modules:
            x = m(x)
        return x
    return run


def _refuse_per_sample_hooks(model: nn.Module) -> None:
    """Opacus's ``GradSampleModule`` captures each layer's activations in forward hooks: a
    recomputed block would run them twice per step."""
    if any(type(m).__name__ == "GradSampleModule" for m in model.modules()):
        raise ValueError(
            f"low-memory training of {type(model).__name__}: Opacus's per-sample hooks "
            "(GradSampleModule) see each layer's forward pass, and a recomputed block runs it "
            "twice per step; expected a model without them. Train DP-SGD (Opacus) without "
            "low-memory mode; nothing was trained.")


@contextlib.contextmanager
def low_memory(model: nn.Module, blocks: list[Block] | None = None) -> Iterator[list[Block]]:
    """Within the context, ``model``'s forward passes that build a graph run each block
    (:func:`blocks_of`, or ``blocks``) as a checkpoint that keeps only its input and its
    sharded layers' bottlenecks; yields the blocks. The model's modules and state are not
    changed: the blocks' ``forward`` is redirected for the context's duration only.

    Parameters
    ----------
    model : nn.Module
        A sharded model (``SpectralLinear`` / ``SpectralConv2d`` layers).
    blocks : list of Block, optional
        From an earlier :func:`blocks_of` of the same model (it walks the modules once).

    Raises
    ------
    ValueError
        For a model under Opacus's per-sample hooks (``GradSampleModule``).
    """
    _refuse_per_sample_hooks(model)
    blocks = blocks_of(model) if blocks is None else blocks
    patched: list[nn.Module] = []
    try:
        seqs: dict[int, tuple[nn.Sequential, list[Block]]] = {}
        for block in blocks:
            if block.parent is None:
                (module,) = block.modules
                module.forward = functools.partial(
                    _run_checkpointed, type(module).forward.__get__(module))
                patched.append(module)
            else:
                seqs.setdefault(id(block.parent), (block.parent, []))[1].append(block)
        for seq, seq_blocks in seqs.values():
            seq.forward = functools.partial(  # type: ignore[method-assign]
                _sequential_forward, seq, seq_blocks)
            patched.append(seq)
        yield blocks
    finally:
        for module in patched:
            del module.forward
