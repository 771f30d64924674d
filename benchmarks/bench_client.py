"""Client-side cost of a training step: ResNet-18 sub-models at keep ratio r vs the dense model.

Prints one JSON object with, for each r in ``--ratios`` (sub-model = top ``ceil(rN)`` terms of
every sharded layer, ω between 1 and 20 so that ClipLR does real work):

* ``step_time_ratio_r{r}``: median time of one training step (forward + backward + SGD step,
  Frobenius decay and ClipLR included) over the dense model's (which has no factors: only its
  loss and SGD). The step is the one :func:`fedshard.client.train.train` runs:
  :class:`fedshard.client.train.EagerStep`, or with a fast option
  :class:`fedshard.client.train.fast.TrainStep` (after ``configure_convolutions``), called on
  batches already on the device; on CUDA each timed block of ``--steps`` steps is bracketed
  by ``torch.cuda.synchronize()``. All configurations live in this process, are warmed up,
  and are timed round-robin, so load from other processes hits them alike;
* ``compiled_step_time_ratio_r{r}`` (with ``--compile``): the same with
  ``TrainConfig(compile=True)`` (CUDA graphs on CUDA), sub-model and dense model both compiled;
* ``plain_step_time_ratio_r{r}``: a plain loop (cross-entropy, backward, ``torch.optim.SGD``
  with momentum; no Frobenius decay, no ClipLR, no bookkeeping) on the same models;
  ``step_time_ms`` holds the medians of all three;
* ``flop_ratio_r{r}``: forward + backward FLOPs (``torch.utils.flop_counter``: convolutions
  and matrix products) over the dense model's, the ratio a step could reach if only those
  operations cost time;
* ``bytes_ratio_r{r}``: bytes of the sub-model's state dict (``u``, ``v``, ``omega``, biases,
  the dense stem / classifier / GroupNorm parameters: everything a client receives) over the
  dense model's;
* ``peak_memory_ratio_r{r}``: peak bytes of live tensors during two training steps
  (parameters + gradients + momentum + activations + temporaries), from ``torch.profiler``'s
  memory timeline (``profile_memory=True``), over the dense model's;
* ``rss_peak_ratio_r{r}``: the same seen by the OS: each model is loaded by a fresh subprocess,
  the kernel's RSS high-water mark is reset (``/proc/self/clear_refs`` = 5), and ``VmHWM``
  minus the RSS before loading is taken (adds allocator caching; tracemalloc does not see
  torch's allocations). On CUDA both use ``torch.cuda.max_memory_allocated``.

``time_split_ms`` splits one profiled step into convolution / matmul kernels and everything
else (GroupNorm, ReLU, additions, optimizer): the second part does not shrink with r.

Usage: ``python benchmarks/bench_client.py [--width 64] [--batch 32] [--steps 3] [--repeats 5]
[--channels-last] [--device cpu] [--compile] [--quick] [--out FILE]``; ``--quick`` times steps
only; ``--out`` also writes the JSON (with the machine, torch version, date and command) there.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import client_cost
from machine import cpu_name, emit, provenance

from fedshard.client.train import EagerStep, TrainConfig
from fedshard.client.train.fast import FastOptions, TrainStep, configure_convolutions
from fedshard.models import resnet18
from fedshard.settings import LocalTraining

#: one input's shape: CIFAR-sized images
INPUT = (3, 32, 32)

def config(device: str, channels_last: bool, compile: bool = False,
           cuda_graph: bool = False) -> TrainConfig:
    return TrainConfig(recipe=LocalTraining(local_epochs=1, lr=0.01),
                       fast=FastOptions(compile=compile, cuda_graph=cuda_graph),
                       log_every_epoch=False, torch_seed=0, device=device,
                       channels_last=channels_last)


def with_fast(cfg: TrainConfig, **options: object) -> TrainConfig:
    """``cfg`` with some fast options changed."""
    base = cfg.fast if isinstance(cfg.fast, FastOptions) else FastOptions()
    return dataclasses.replace(cfg, fast=dataclasses.replace(base, **options))


class PlainStep:
    """Baseline: cross-entropy, backward, SGD with momentum; nothing else."""

    def __init__(self, model: nn.Module, cfg: TrainConfig) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.recipe.momentum)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.model(x), y).backward()
        self.opt.step()


def fast_step(model: nn.Module, cfg: TrainConfig) -> TrainStep:
    """The fast step ``train`` builds for ``cfg`` (unpooled): convolutions set, then TrainStep."""
    configure_convolutions(model, cfg)
    return TrainStep(model, cfg)


def prepare(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """A copy of ``model`` placed as :func:`train` places it."""
    model = copy.deepcopy(model).to(cfg.device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    return model.train()


def time_steps(
    steps: dict[str, object], batches: list[tuple[torch.Tensor, torch.Tensor]],
    repeats: int, warmup: int, device: torch.device,
) -> dict[str, list[float]]:
    """Seconds per step of each callable, ``repeats`` timed blocks each, round-robin."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for step in steps.values():  # allocator, kernel selection, compilation, CUDA graphs
        for i in range(warmup):
            step(*batches[i % len(batches)])  # type: ignore[operator]
    times: dict[str, list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            sync()
            start = time.perf_counter()
            for x, y in batches:
                step(x, y)  # type: ignore[operator]
            sync()
            times[key].append((time.perf_counter() - start) / len(batches))
    return times


def build(width: int, ratio: float | None) -> nn.Module:
    """Dense ResNet-18 (``ratio=None``) or its sub-model with the top ``ceil(rN)`` terms."""
    dense = resnet18(num_classes=10, in_channels=3, width=width, seed=0)
    return dense if ratio is None else client_cost.sub_model(dense, ratio)


def loader(batch: int, steps: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    return client_cost.loader(INPUT, batch, steps)


def state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def step_flops(model: nn.Module, batch: int) -> int:
    return round(client_cost.train_flops(model, INPUT, batch) * batch)


def rss_peak(model: nn.Module, args: argparse.Namespace) -> int:
    return client_cost.rss_peak(model, INPUT, args.batch, args.steps, args.device,
                                args.channels_last)


def tensor_peak_and_split(
    model: nn.Module, batch: int, cfg: TrainConfig
) -> tuple[int, dict[str, float]]:
    """Peak live-tensor bytes of two steps, and one step's time split (ms), via torch.profiler."""
    return client_cost.tensor_peak(model, INPUT, batch, cfg)


def kernel_table(model: nn.Module, cfg: TrainConfig,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], top: int) -> dict[str, object]:
    """One eager step under torch.profiler (after two unprofiled ones): kernels launched,
    their summed time (device time on CUDA, CPU time otherwise) and the ``top`` costliest."""
    step = EagerStep(model, cfg)
    for x, y in batches[:2]:
        step(x, y)
    cuda = torch.device(cfg.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step(*batches[0])
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and event.key.startswith(("ProfilerStep", "[memory]")):
            continue
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        rows.append((us / 1e3, event.count, event.key))
    rows.sort(reverse=True)
    return {
        "launches": sum(r[1] for r in rows),
        "ms": round(sum(r[0] for r in rows), 3),
        "top": [[name[:70], round(ms, 3), count] for ms, count, name in rows[:top]],
    }


def setup(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    cpu = cpu_name()
    return {
        "model": f"resnet18(width={args.width})",
        "input": [args.batch, 3, 32, 32],
        "steps_per_call": args.steps,
        "repeats": args.repeats,
        "warmup_steps": args.warmup,
        "torch": torch.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "channels_last": args.channels_last,
        "compile": args.compile,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="training steps per timed call")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per configuration")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.4, 1.0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--channels-last", action="store_true", help="TrainConfig.channels_last")
    ap.add_argument("--compile", action="store_true", help="also time FastOptions.compile=True")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time FastOptions.cuda_graph=True (CUDA only)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    ap.add_argument("--quick", action="store_true", help="time the steps only")
    ap.add_argument("--pad-terms", action="store_true",
                    help="also time FastOptions.pad_terms' other choice: eager padded to 8, "
                         "graph unpadded")
    ap.add_argument("--merge-terms", action="store_true",
                    help="also time FastOptions.merge_terms (one dense conv of U diag(ω) Vᵀ "
                         "per sharded conv): eager, and graphed with --cuda-graph")
    ap.add_argument("--kernels", type=int, default=0,
                    help="with --quick: profile one eager step per model, list its N costliest "
                         "kernels and count all of them")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    cfg = config(args.device, args.channels_last)

    configs: dict[str, float | None] = {"dense": None}
    configs.update({f"r{r:g}": r for r in args.ratios})
    models = {key: build(args.width, r) for key, r in configs.items()}
    device = torch.device(args.device)
    cfg_compiled = config(args.device, args.channels_last, compile=True)
    data = loader(args.batch, args.steps)
    batches = []
    for x, y in data:
        x = x.to(device)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        batches.append((x, y.to(device)))
    modes: dict[str, tuple[Callable[[nn.Module, TrainConfig], object], TrainConfig]] = {
        "fedshard": (EagerStep, cfg)}
    if args.compile:
        modes["compiled"] = (fast_step, cfg_compiled)
    if args.cuda_graph:
        modes["graph"] = (fast_step, config(args.device, args.channels_last, cuda_graph=True))
    if args.compile and args.cuda_graph:  # Inductor's kernels inside the whole-step graph
        modes["compiled_graph"] = (fast_step, config(args.device, args.channels_last,
                                                     compile=True, cuda_graph=True))
    modes["plain"] = (PlainStep, cfg)
    if args.pad_terms:  # the other side of FastOptions.pad_terms' automatic choice
        modes["padded"] = (fast_step, with_fast(cfg, pad_terms=8))
        if args.cuda_graph:
            modes["graph_unpadded"] = (fast_step, with_fast(modes["graph"][1], pad_terms=1))
    if args.merge_terms:
        modes["merged"] = (fast_step, with_fast(cfg, merge_terms=True))
        if args.cuda_graph:
            modes["graph_merged"] = (fast_step, with_fast(modes["graph"][1], merge_terms=True))
    steps = {
        f"{mode}/{key}": make(prepare(m, c), c)
        for mode, (make, c) in modes.items() for key, m in models.items()
    }
    all_times = time_steps(steps, batches, args.repeats, args.warmup, device)
    times = {key: all_times[f"fedshard/{key}"] for key in configs}
    step_ms = {
        mode: {key: round(1e3 * statistics.median(all_times[f"{mode}/{key}"]), 2)
               for key in configs}
        for mode in modes
    }
    if args.quick:
        quick: dict[str, object] = {}
        for mode in modes:
            prefix = "" if mode == "fedshard" else f"{mode}_"
            for key in configs:
                if key != "dense":
                    quick[f"{prefix}step_time_ratio_{key}"] = round(
                        step_ms[mode][key] / step_ms[mode]["dense"], 4)
        for mode in ("graph", "compiled_graph", "graph_merged"):  # against eager dense
            if mode in modes:
                for key in configs:
                    if key != "dense":
                        quick[f"{mode}_vs_eager_dense_{key}"] = round(
                            step_ms[mode][key] / step_ms["fedshard"]["dense"], 4)
        quick["step_time_ms"] = step_ms
        if args.kernels:
            quick["kernels"] = {key: kernel_table(prepare(m, cfg), cfg, batches, args.kernels)
                                for key, m in models.items()}
        quick["setup"] = setup(args, device)
        emit({**provenance(args.device), **quick}, args.out)
        return

    step = {key: statistics.median(t) for key, t in times.items()}
    profiled = {key: tensor_peak_and_split(m, args.batch, cfg) for key, m in models.items()}
    models = {key: m.cpu() for key, m in models.items()}
    flops = {key: step_flops(m, args.batch) for key, m in models.items()}
    size = {key: state_bytes(m) for key, m in models.items()}
    rss = {key: rss_peak(m, args) for key, m in models.items()}

    result: dict[str, object] = {}
    for key in configs:
        if key == "dense":
            continue
        for mode in modes:
            prefix = "" if mode == "fedshard" else f"{mode}_"
            result[f"{prefix}step_time_ratio_{key}"] = round(
                step_ms[mode][key] / step_ms[mode]["dense"], 4)
        result[f"flop_ratio_{key}"] = round(flops[key] / flops["dense"], 4)
        result[f"bytes_ratio_{key}"] = round(size[key] / size["dense"], 4)
        result[f"peak_memory_ratio_{key}"] = round(profiled[key][0] / profiled["dense"][0], 4)
        result[f"rss_peak_ratio_{key}"] = round(rss[key] / rss["dense"], 4)
    result["step_time_ms"] = step_ms
    result["step_time_s"] = {key: round(v, 4) for key, v in step.items()}
    result["step_time_range_s"] = {
        key: [round(min(t), 4), round(max(t), 4)] for key, t in times.items()
    }
    result["gflops_per_step"] = {key: round(v / 1e9, 3) for key, v in flops.items()}
    result["gflops_per_s"] = {key: round(flops[key] / step[key] / 1e9, 1) for key in configs}
    result["time_split_ms"] = {key: p[1] for key, p in profiled.items()}
    result["state_mib"] = {key: round(v / 2**20, 3) for key, v in size.items()}
    result["peak_tensor_mib"] = {key: round(p[0] / 2**20, 1) for key, p in profiled.items()}
    result["rss_peak_mib"] = {key: round(v / 2**20, 1) for key, v in rss.items()}
    result["setup"] = setup(args, device)
    emit({**provenance(args.device), **result}, args.out)


if __name__ == "__main__":
    main()
