"""What a device holds to train: the sharded step, low-memory mode, the dense model, the dense
model with activation checkpointing and the narrow model of the same FLOPs, side by side.

Prints one JSON object. For each model (``--models``: ``resnet64`` the paper's ResNet-18 at
width 64 on 32×32×3 images, batch 32; ``resnet16`` the width-16 ResNet of the mixed-capacity
suite on 28×28×1, batch 32; ``chargpt`` the Shakespeare char GPT, embedding width 48, context
80, batch 10) and each keep ratio r in ``--ratios``, two training steps of fedshard's eager
step (SGD-m 0.9, Frobenius decay, ClipLR: what a node runs) are measured for

* ``factorized``: the sub-model with the top ``ceil(rN)`` terms of every sharded layer (ω
  from 1 to 20, so that ClipLR does real work), the plain step;
* ``low_memory``: the same sub-model with ``TrainConfig(low_memory=True)``;
* ``dense``: the dense model (once, r = 1 of the baselines);
* ``dense_checkpointed``: the dense model with each block run under
  :func:`torch.utils.checkpoint.checkpoint` (the blocks low-memory mode would recompute: what
  a memory-bound user of the dense model does);
* ``width``: the narrow model whose forward FLOPs are nearest the sub-model's at r (ResNet:
  its base width; GPT: its embedding width, a multiple of 3), plain step.

Two measures, as a device would see them: ``peak`` (bytes of live tensors at the peak of two
steps, torch.profiler's memory timeline, after two unprofiled steps so that momentum exists)
and ``rss`` (the process's resident-set high-water mark over two steps in a fresh subprocess
that loads only that model, minus its RSS before loading). Keys: ``peak_memory_ratio_<cfg>``
and ``rss_peak_ratio_<cfg>`` over the dense model's, with ``<cfg>`` = ``factorized_r0.1``,
``low_memory_r0.1``, ``width_r0.1``, ``dense_checkpointed``; the raw bytes under ``bytes``.
``step_ms`` times the factorized and low-memory steps and the dense ones round-robin
(median of ``--repeats`` blocks of ``--steps`` steps).

Usage: ``python benchmarks/bench_memory.py [--models resnet64 resnet16 chargpt]
[--ratios 0.1 0.2 0.4 1] [--repeats 5] [--steps 2] [--no-rss] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import client_cost
from machine import emit, provenance

from fedshard.client.train import EagerStep, TrainConfig, train
from fedshard.models import char_transformer, resnet18
from fedshard.settings import LocalTraining
from fedshard.spectral import sharded_layer_names
from fedshard.spectral.budget import forward_flops, sharding_budget
from fedshard.spectral.recompute import blocks_of


@dataclass(frozen=True)
class Task:
    """A model family at its benchmark size: ``build(width)``, the global width, the widths a
    narrow model may take, one batch's inputs and targets."""

    name: str
    build: Callable[[int], nn.Module]
    width: int
    widths: tuple[int, ...]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    batch_size: int


def _images(shape: tuple[int, ...]) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)
    return make


def _text(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 81, (n, 81), generator=g)
    return tokens[:, :80].contiguous(), tokens[:, 1:].contiguous()


TASKS = {
    "resnet64": Task("resnet18(width=64), 32x32x3, batch 32",
                     lambda w: resnet18(10, 3, w, seed=0), 64, tuple(range(2, 65, 2)),
                     _images((3, 32, 32)), 32),
    "resnet16": Task("resnet18(width=16), 28x28x1, batch 32",
                     lambda w: resnet18(10, 1, w, seed=0), 16, tuple(range(2, 17, 2)),
                     _images((1, 28, 28)), 32),
    "chargpt": Task("chargpt(n_embd=48), context 80, batch 10",
                    lambda w: _gpt(w), 48, tuple(range(3, 49, 3)), _text, 10),
}


def _gpt(width: int) -> nn.Module:
    torch.manual_seed(0)
    return char_transformer(81, n_embd=width)


def matched_width(task: Task, dense: nn.Module, ratio: float) -> int:
    """The width whose forward FLOPs (one example) are nearest the sub-model's at ``ratio``."""
    x, _ = task.batch(1)
    target = sharding_budget(dense, sharded_layer_names(dense), [ratio],
                             example_input=x).at(ratio).forward_flops
    return min(task.widths, key=lambda w: (abs(forward_flops(task.build(w), x) - target), w))


class CheckpointedStep(EagerStep):
    """The eager step of a dense model with each block (:func:`blocks_of` over the layers that
    sharding would factorize) under activation checkpointing: only a block's input is kept."""

    def __init__(self, model: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(model, cfg)
        layers = {id(model.get_submodule(n)) for n in sharded_layer_names(model)}
        self.blocks = blocks_of(model, lambda m: id(m) in layers)


def step_config(mode: str) -> TrainConfig:
    """fedshard's eager step at lr 0.01 (one epoch over the given batches), seeded, quiet;
    ``mode`` ``low_memory`` turns low-memory mode on, ``dense_checkpointed`` checkpoints."""
    return TrainConfig(recipe=LocalTraining(local_epochs=1, lr=0.01), log_every_epoch=False,
                       torch_seed=0, low_memory=mode == "low_memory",
                       step=CheckpointedStep if mode == "dense_checkpointed" else None)


def batches(task: Task, steps: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    x, y = task.batch(task.batch_size * steps)
    return DataLoader(TensorDataset(x, y), batch_size=task.batch_size, shuffle=False)


def tensor_peak(model: nn.Module, task: Task, mode: str) -> int:
    """Peak live-tensor bytes of two steps (after two unprofiled ones)."""
    model = copy.deepcopy(model)
    cfg = step_config(mode)
    data = batches(task, 2)
    train(model, data, cfg)  # momentum buffers exist from here on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        train(model, data, cfg)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still the CPU-capable API
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return int(max(sum(row) for row in sizes))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def rss_peak(model: nn.Module, task_key: str, mode: str) -> int:
    """RSS high-water mark of two steps in a fresh subprocess, minus its RSS before the model."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.pt")
        torch.save(model, path)
        out = subprocess.run([sys.executable, __file__, "--worker", path, task_key, mode],
                             check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1])


def _worker(path: str, task_key: str, mode: str) -> None:
    torch.set_num_threads(1)
    task = TASKS[task_key]
    data = batches(task, 2)
    next(iter(data))  # the data set before the baseline
    base = _status_kib("VmRSS") * 1024
    model = torch.load(path, weights_only=False)  # the only model this process allocates
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM reset to the current RSS
    train(model, data, step_config(mode))
    print(_status_kib("VmHWM") * 1024 - base)


def step_times(models: dict[str, tuple[nn.Module, str]], task: Task, steps: int,
               repeats: int) -> dict[str, float]:
    """Median ms per step of each configuration, timed round-robin after a warm-up."""
    x, y = task.batch(task.batch_size)
    runners = {}
    for key, (model, mode) in models.items():
        model = copy.deepcopy(model).train()
        cfg = step_config(mode)
        runners[key] = (cfg.step or EagerStep)(model, cfg)
        for _ in range(2):
            runners[key](x, y)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(repeats):
        for key, step in runners.items():
            start = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            times[key].append((time.perf_counter() - start) / steps * 1e3)
    return {k: round(statistics.median(v), 2) for k, v in times.items()}


def measure(task_key: str, ratios: list[float], args: argparse.Namespace) -> dict[str, Any]:
    task = TASKS[task_key]
    dense = task.build(task.width)
    configs: dict[str, tuple[nn.Module, str]] = {
        "dense": (dense, "plain"), "dense_checkpointed": (dense, "dense_checkpointed")}
    widths = {}
    for r in ratios:
        sub = client_cost.sub_model(dense, r)
        configs[f"factorized_r{r:g}"] = (sub, "plain")
        configs[f"low_memory_r{r:g}"] = (sub, "low_memory")
        if r < 1:
            widths[f"r{r:g}"] = w = matched_width(task, dense, r)
            configs[f"width_r{r:g}"] = (task.build(w), "plain")
    peak = {k: tensor_peak(m, task, mode) for k, (m, mode) in configs.items()}
    rss = ({} if args.no_rss else
           {k: rss_peak(m, task_key, mode) for k, (m, mode) in configs.items()})
    timed = {k: configs[k] for k in configs if k.startswith(("dense", "factorized_r0.1",
                                                             "low_memory_r0.1"))}
    out: dict[str, Any] = {"model": task.name, "matched_widths": widths,
                           "blocks": [b.name for b in blocks_of(client_cost.sub_model(dense, 0.1))],
                           "bytes": {"peak": peak, "rss": rss},
                           "step_ms": step_times(timed, task, args.steps, args.repeats)}
    for k in configs:
        if k == "dense":
            continue
        out[f"peak_memory_ratio_{k}"] = round(peak[k] / peak["dense"], 3)
        if rss:
            out[f"rss_peak_ratio_{k}"] = round(rss[k] / rss["dense"], 3)
    ms = out["step_ms"]
    out["step_time_ratio_low_memory_r0.1_to_factorized"] = round(
        ms["low_memory_r0.1"] / ms["factorized_r0.1"], 3)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(TASKS),
                    default=["resnet64", "resnet16", "chargpt"])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.4, 1.0])
    ap.add_argument("--steps", type=int, default=2, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks per configuration")
    ap.add_argument("--no-rss", action="store_true", help="skip the subprocess RSS measure")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    record: dict[str, Any] = {**provenance(), "threads": 1, "ratios": args.ratios}
    for key in args.models:
        record[key] = measure(key, args.ratios, args)
    emit(record, args.out)


if __name__ == "__main__":
    main()
