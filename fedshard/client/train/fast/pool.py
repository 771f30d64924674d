"""One training step reused by every later model of the same shape in a process
(``FastOptions.reuse_step``).

A CUDA-graphed :class:`~fedshard.client.train.fast.TrainStep` pays an eager warm-up step and a
capture for each batch shape before it replays; built afresh for each client, that is most of
a small sub-model's client time on a GPU. Clients of one keep ratio get
sub-models of the same shapes, so :class:`StepPool` keeps one private copy of such a model
with its step (and its captured graphs) and trains every later model of that shape on it:

1. :meth:`TrainStep.load_state`: the caller's parameters and buffers (ω among them) copied
   into the pooled copy, the momentum restarted at zero;
2. train (replays);
3. :meth:`TrainStep.store_state`: the trained parameters and buffers copied back into the
   caller's model.

Two models share an entry only if everything that shapes their step is equal: module types and
names, every parameter's and buffer's shape, dtype, device, strides and ``requires_grad``, the
plain (number, string, tuple) attributes of every module (stride, padding, groups, ε, dropout
``p``, ``pad_terms_to``...), ``repr(model)``, and the step's settings (lr and momentum are baked
into a graph). A model with forward/backward hooks or an instance-level ``forward`` is never
pooled (the hooks are arbitrary code the pooled copy would not run); ``FastOptions.reuse_step``
turns pooling off for anything else this cannot see.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fedshard.client.train.config import TrainConfig
from fedshard.client.train.fast.step import TrainStep

__all__ = ["StepPool", "model_signature"]

logger = logging.getLogger(__name__)

_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


#: The attributes where torch keeps a module's hooks (no public API lists them; the names are
#: checked against the installed torch by tests/test_torch_internals.py).
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def model_signature(model: nn.Module, cfg: TrainConfig) -> tuple[Any, ...] | None:
    """What must be equal for two models to share a pooled step, or ``None`` if ``model``
    cannot be pooled (it has hooks or an instance-level ``forward``).

    Parameters
    ----------
    model : nn.Module
        On its training device.
    cfg : TrainConfig
        The step's settings; only ``seed``, ``local_epochs`` and ``log_every_epoch`` are left out
        (they do not enter the step).
    """
    modules = []
    for name, m in model.named_modules():
        hooks = [getattr(m, h) for h in MODULE_HOOKS]  # torch's own: pinned by a test
        if any(hooks) or "forward" in m.__dict__:
            return None
        attrs = tuple(sorted((k, v) for k, v in m.__dict__.items()
                             if not k.startswith("_") and _plain(v)))
        modules.append((name, type(m).__module__, type(m).__qualname__, attrs))
    tensors = tuple(
        (kind, name, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device),
         t.requires_grad)
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers()))
        for name, t in named)
    r, fast = cfg.recipe, cfg.fast
    settings = (cfg.lr, r.momentum, r.frobenius_decay, r.clip_lr_tau, r.weight_decay,
                r.factor_step, str(torch.device(cfg.device)), cfg.channels_last,
                cfg.max_grad_norm, repr(fast))
    return (tuple(modules), tensors, repr(model), settings)


class _Entry:
    def __init__(self, model: nn.Module, cfg: TrainConfig) -> None:
        self.model = copy.deepcopy(model)
        self.model.train()
        self.step = TrainStep(self.model, cfg)
        self.busy = False
        self.uses = 0


class StepPool:
    """Pooled training steps, one per model signature (:func:`model_signature`), at most
    ``size`` of them, least recently used dropped first. A new entry replaces any entry of
    the same model with other settings (in a simulation: the previous round's learning rate),
    so a worker captures its graphs once per round and sub-model shape.

    Thread-safe: an entry in use by one thread is not lent to another (that call gets a fresh,
    unpooled step). An entry whose training raised is dropped: a failed capture or a NaN leaves
    its graphs and state unusable.

    Parameters
    ----------
    size : int
        Entries kept, ``>= 1``. Each holds a copy of a model and, under CUDA graphs, the
        graphs' memory pools (about a step's activations per batch shape).
    """

    def __init__(self, size: int = 4) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"StepPool size={size!r}: expected an int >= 1.")
        self.size = size
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (their graphs are freed here; see :meth:`_drop`)."""
        with self._lock:
            for key in list(self._entries):
                self._drop(key)

    def _drop(self, key: tuple[Any, ...]) -> None:
        """Remove an entry (with the lock held) and, unless a thread is training on it, free
        its graphs now: the entry's step is otherwise freed only by the garbage collector
        (:meth:`TrainStep.release_graphs`), and in a simulation an entry is replaced every
        round (the learning rate changes)."""
        entry = self._entries.pop(key)
        if not entry.busy:
            entry.step.release_graphs()

    @contextmanager
    def lease(self, model: nn.Module, cfg: TrainConfig) -> Iterator[TrainStep]:
        """A step that trains ``model``: pooled when possible (see the module), else fresh.

        ``model`` must already be on ``cfg.device`` in its training layout, its convolutions
        configured (:func:`~fedshard.client.train.fast.configure_convolutions`). On a normal
        exit the trained parameters and buffers are in ``model``; if the body raises,
        ``model`` is left as it was and the entry is dropped.
        """
        key = model_signature(model, cfg)
        entry = None
        if key is not None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.busy:
                    entry = None  # another thread trains on it; this call goes unpooled
                    key = None
                elif entry is not None:
                    self._entries.move_to_end(key)
                    entry.busy = True
        if key is None:
            with TrainStep(model, cfg) as step:
                yield step
            return
        if entry is None:
            entry = _Entry(model, cfg)
            entry.busy = True
            with self._lock:
                # the same model with other settings: an earlier round's lr (cosine
                # schedule), which will not come back; free its graphs now
                for old_key in [k for k, e in self._entries.items()
                                if k[:-1] == key[:-1] and not e.busy]:
                    self._drop(old_key)
                self._entries[key] = entry
                while len(self._entries) > self.size:
                    old_key, old = next(iter(self._entries.items()))
                    if old.busy:
                        break
                    self._drop(old_key)
            loaded = True  # the copy starts as model: nothing to load
        else:
            loaded = False
        ok = False
        try:
            if not loaded:
                entry.step.load_state(model)  # step 1
            yield entry.step
            entry.step.store_state(model)  # step 3, before the entry is lent again
            ok = True
        finally:
            with self._lock:
                entry.busy = False
                entry.uses += 1
                if not ok and self._entries.get(key) is entry:
                    self._drop(key)
