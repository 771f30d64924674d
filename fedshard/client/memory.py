"""A keep ratio from a device's memory: the node measures what training each keep ratio holds
and declares the largest that fits (:func:`keep_ratio_for_memory`).

A device that knows how much memory it has (a phone, a board, a container with a limit)
declares ``memory-mb`` in its node config instead of a keep ratio, or beside one as a cap.
Nothing is estimated from shapes: the node builds the sub-model at a candidate keep ratio
(the top ``ceil(rN)`` terms of every sharded layer, the shapes the server will send), runs two
training steps of fedshard's eager step on its own batches in low-memory mode
(:func:`fedshard.spectral.low_memory`, the mode it then trains in), and reads what the
process reached: on the CPU its resident-set high-water mark (Linux's ``VmHWM``, reset before
the steps), as a cgroup or a phone's memory limit counts it; on CUDA the device's peak
allocation. What any sharded training holds (one term per sharded layer) is measured first,
then the candidates from the smallest up, each only when the line through the last two
measurements predicts that it fits (a measurement should not run past the budget), and the
largest that fits is declared.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedshard.client.train.config import TrainConfig
from fedshard.client.train.loop import train
from fedshard.spectral import sharded_layer_names, submodel_at

__all__ = ["FIT_SHARE", "KEEP_RATIO_GRID", "MemoryFit", "keep_ratio_for_memory", "resident_bytes",
           "training_growth"]

#: The keep ratios a node chooses among (largest first), the paper's range and r = 1.
KEEP_RATIO_GRID = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05)

#: A candidate fits when the process's high-water mark stays within this share of the budget:
#: the mark of the same two steps varies by up to about a tenth between runs (the C
#: allocator's choices), and the node's later rounds must not reach the limit. A candidate
#: is measured only when the line through the last two measurements (the first: one term
#: per sharded layer) predicts that it fits so.
FIT_SHARE = 0.9

MIB = 2**20


@dataclass(frozen=True)
class MemoryFit:
    """The keep ratio a node's memory allows, and what was measured.

    Attributes
    ----------
    keep_ratio : float
        The largest candidate whose training fits (``peaks[keep_ratio]``).
    memory_mb : float
        The declared budget (MiB).
    resident_mb : float
        The process's resident memory before it measured (MiB; on CUDA the device memory
        allocated then).
    peaks : dict
        keep ratio -> bytes the process grew by at its peak over two training steps (beyond
        ``resident_mb``), for every candidate measured; a ratio fits when
        ``resident + growth ≤`` :data:`FIT_SHARE` ``× memory-mb`` (the node then trains in
        low-memory mode, as it measured).
    batch_size : int
        The batch size of the measured steps.
    """

    keep_ratio: float
    memory_mb: float
    resident_mb: float
    peaks: dict[float, int] = field(default_factory=dict)
    batch_size: int = 0

    @property
    def peak_mb(self) -> float:
        """What the process reached training at the chosen ratio: resident before + growth
        (MiB)."""
        return self.resident_mb + self.peaks[self.keep_ratio] / MIB

    def line(self) -> str:
        """One log line: the budget, what was measured and what was chosen."""
        measured = ", ".join(f"r = {r:g}: +{b / MIB:.0f} MB" for r, b in sorted(self.peaks.items()))
        return (f"memory-mb={self.memory_mb:g}: keep ratio {self.keep_ratio:g} (training "
                f"peaks at {self.peak_mb:.0f} MB: {self.resident_mb:.0f} MB before training, "
                f"grown by two steps at batch {self.batch_size}"
                f" in low-memory mode: {measured})")


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``); 0 where it cannot be read."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def _high_water_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM line in /proc/self/status")


def training_growth(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    cfg: TrainConfig, baseline: int) -> int:
    """Bytes beyond ``baseline`` that the process (CPU: resident set) or device (CUDA:
    allocated memory) reaches while a copy of ``model`` trains on ``batches`` with fedshard's
    loop under ``cfg``.

    Raises
    ------
    OSError
        On a CPU where the resident high-water mark cannot be read and reset (Linux's
        ``/proc/self/status`` and ``/proc/self/clear_refs``).
    """
    device = torch.device(cfg.device)
    inputs = torch.cat([x for x, _ in batches])
    targets = torch.cat([y for _, y in batches])
    data = DataLoader(TensorDataset(inputs, targets), batch_size=len(batches[0][1]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        train(copy.deepcopy(model), data, cfg)
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - baseline)
    _trim()  # what earlier measurements freed goes back to the system first
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    train(copy.deepcopy(model), data, cfg)
    grown = max(0, _high_water_bytes() - baseline)
    _trim()
    return grown


def _trim() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``), so that one
    measurement's freed memory does not hide the next one's growth; nothing elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _submodel(model: nn.Module, layers: Sequence[str], ratio: float) -> nn.Module:
    """The sub-model a node at keep ratio r receives, in shape (its factors zeros: shapes, not
    values, set what training holds; no SVD is taken); ``ratio = 0``: one term per layer."""
    return submodel_at(model, layers, ratio if ratio > 0 else _ONE_TERM)


#: A keep ratio that keeps one term of any layer (``⌈r N⌉ = 1`` for every N below 10⁹).
_ONE_TERM = 1e-9


def keep_ratio_for_memory(model: nn.Module,
                          batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                          memory_mb: float, *, cfg: TrainConfig | None = None,
                          cap: float = 1.0, layers: Sequence[str] | None = None,
                          candidates: Sequence[float] = KEEP_RATIO_GRID) -> MemoryFit:
    """The largest keep ratio in ``candidates`` (at most ``cap``) whose training fits in
    ``memory_mb`` MiB.

    Parameters
    ----------
    model : nn.Module
        The run's dense model (only read).
    batches : sequence of (inputs, targets)
        Two of the node's own batches at its batch size (what it will train on).
    memory_mb : float
        The memory the process may use, in MiB (as a cgroup limit counts it).
    cfg : TrainConfig, optional
        How the node trains (device, recipe), in low-memory mode (turned on here, as the node
        then trains). Default: the paper's recipe on the CPU.
    cap : float
        The node's own ``keep-ratio``, where it declares one beside ``memory-mb``.
    layers : sequence of str, optional
        The layers the server shards (default :func:`~fedshard.spectral.sharded_layer_names`).
    candidates : sequence of float
        The keep ratios to choose among (:data:`KEEP_RATIO_GRID`), measured from the smallest
        up while the measurements predict that the next fits.

    Raises
    ------
    ValueError
        For a ``memory_mb`` that is not a finite number > 0, no batch, or a budget that not
        even the smallest candidate fits: the message names what that candidate reached.
    OSError
        On a CPU without Linux's resident high-water mark (:func:`training_growth`).
    """
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, (int, float)) or not (
            math.isfinite(memory_mb) and memory_mb > 0):
        raise ValueError(f"memory-mb={memory_mb!r}: expected a finite number of MiB > 0 (the "
                         "memory this node may use); it declares no keep ratio until fixed")
    if not batches:
        raise ValueError("keep_ratio_for_memory needs the node's batches (two of them, at its "
                         "batch size); got none, so nothing could be measured")
    cfg = replace(cfg or TrainConfig(), log_every_epoch=False, fast=None, step=None,
                  low_memory=True)
    layers = list(sharded_layer_names(model) if layers is None else layers)
    ratios = sorted({float(r) for r in candidates if 0 < r <= cap})
    if not ratios:
        raise ValueError(f"keep-ratio={cap:g} with memory-mb: no candidate keep ratio of "
                         f"{list(candidates)} is at most it")
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    if not cuda:
        _trim()
    resident = torch.cuda.memory_allocated(device) if cuda else resident_bytes()
    budget = memory_mb * MIB
    grown: dict[float, int] = {}

    def measure(r: float) -> bool:
        grown[r] = training_growth(_submodel(model, layers, r), batches, cfg, resident)
        return resident + grown[r] <= FIT_SHARE * budget

    # r = 0 stands for one term per sharded layer: what any sharded training holds (the dense
    # layers, the blocks' inputs); measured first, it is the intercept of the line that
    # predicts each next candidate from the last two measurements
    floor_fits = measure(0.0)
    if not floor_fits or not measure(ratios[0]):
        r = 0.0 if not floor_fits else ratios[0]
        need = (resident + grown[r]) / MIB
        what = "one term per sharded layer" if r == 0 else f"keep ratio {r:g}"
        raise ValueError(
            f"memory-mb={memory_mb:g}: not even the smallest candidate fits: training "
            f"{what} reached {need:.0f} MB ({resident / MIB:.0f} MB before training + "
            f"{grown[r] / MIB:.0f} MB for two steps at batch {len(batches[0][1])}), more than "
            f"{FIT_SHARE:g} of the budget; expected memory-mb ≥ {math.ceil(need / FIT_SHARE)}, "
            "a smaller batch-size, or a smaller model. This node takes no part until "
            "restarted.")
    chosen = ratios[0]
    for r in ratios[1:]:
        r1, r2 = sorted(grown)[-2:]
        predicted = grown[r2] + (grown[r2] - grown[r1]) / (r2 - r1) * (r - r2)
        if resident + predicted > FIT_SHARE * budget or not measure(r):
            break
        chosen = r
    del grown[0.0]
    return MemoryFit(keep_ratio=chosen, memory_mb=float(memory_mb),
                     resident_mb=resident / MIB, peaks=grown, batch_size=len(batches[0][1]))
