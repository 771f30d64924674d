"""What one node pays to train a model: FLOPs of a training step and peak memory, two ways.

Shared by the benchmarks that put a cost beside a result (``bench_client.py``,
``mixed_capacity.py``):

* :func:`train_flops` counts the forward and backward FLOPs of one step with
  ``torch.utils.flop_counter`` (convolutions and matrix products), per example;
* :func:`tensor_peak` is the peak of live tensor bytes over two training steps (parameters,
  gradients, momentum, saved activations, temporaries) from ``torch.profiler``'s memory
  timeline, after two unprofiled steps (so that momentum buffers exist, as in a running
  client); on CUDA, ``torch.cuda.max_memory_allocated``;
* :func:`rss_peak` is what the operating system sees: the model is loaded by a fresh
  subprocess, the kernel's RSS high-water mark is reset (``/proc/self/clear_refs`` = 5), and
  ``VmHWM`` minus the RSS before loading is taken after ``steps`` steps (it adds the
  allocator's caching, which tensor counts miss).

Every step is the one :func:`fedshard.client.train.train` runs for ``cfg`` (by default SGD with
momentum 0.9, Frobenius decay and ClipLR: the rules a fedshard client trains with).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedshard.client.train import TrainConfig, train
from fedshard.settings import LocalTraining
from fedshard.spectral import decompose, num_terms, shard_model, sharded_layer_names


def default_config(device: str = "cpu", channels_last: bool = False) -> TrainConfig:
    """One local epoch at lr 0.01 with fedshard's default rules, seeded, quiet."""
    return TrainConfig(recipe=LocalTraining(local_epochs=1, lr=0.01), log_every_epoch=False,
                       torch_seed=0, device=device, channels_last=channels_last)


def loader(shape: tuple[int, ...], batch: int, steps: int
           ) -> DataLoader[tuple[torch.Tensor, ...]]:
    """``steps`` batches of ``batch`` random inputs of ``shape`` with labels in 0..9."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps, *shape, generator=g)
    y = torch.randint(0, 10, (batch * steps,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def sub_model(dense: nn.Module, ratio: float) -> nn.Module:
    """``dense`` with the top ``ceil(rN)`` terms of every sharded layer and ω from 1 to 20
    (1/π-like multipliers above τ for some terms, so that ClipLR does real work)."""
    indices, omegas = {}, {}
    for name in sharded_layer_names(dense):
        _, _, lam = decompose(dense.get_submodule(name).weight)
        n = num_terms(len(lam), ratio)
        indices[name] = list(range(n))
        omegas[name] = torch.linspace(1.0, 20.0, n)
    return shard_model(dense, indices, omegas)[0]


def train_flops(model: nn.Module, shape: tuple[int, ...], batch: int = 32) -> float:
    """Forward + backward FLOPs of one step on ``batch`` inputs, per example."""
    model = copy.deepcopy(model).train()
    x = torch.randn(batch, *shape)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    return counter.get_total_flops() / batch


def tensor_peak(model: nn.Module, shape: tuple[int, ...], batch: int,
                cfg: TrainConfig | None = None) -> tuple[int, dict[str, float]]:
    """Peak live-tensor bytes of two training steps, and one step's time split (ms) into
    convolution / matrix-product kernels and everything else."""
    cfg = cfg or default_config()
    model = copy.deepcopy(model)
    data = loader(shape, batch, 2)
    train(model, data, cfg)  # momentum buffers exist from here on
    device = torch.device(cfg.device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        train(model, data, cfg)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still the CPU-capable API
        path = Path(tmp) / "timeline.json"
        dev = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
        prof.export_memory_timeline(str(path), device=dev)
        _, sizes = json.loads(path.read_text())
    peak = max(sum(row) for row in sizes)
    split = {"conv_mm": 0.0, "other": 0.0}
    for event in prof.key_averages():
        if event.key.startswith(("ProfilerStep", "enumerate(DataLoader)", "[memory]")):
            continue
        cuda = device.type == "cuda"
        time_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        kind = "conv_mm" if any(k in event.key for k in ("conv", "mm", "matmul")) else "other"
        split[kind] += time_us / 1e3 / 2  # two steps profiled
    return int(peak), {k: round(v, 1) for k, v in split.items()}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _rss_worker(path: str, shape: tuple[int, ...], batch: int, steps: int,
                cfg: TrainConfig) -> int:
    """In a fresh subprocess: peak memory (bytes) of ``steps`` steps of the model in ``path``."""
    data = loader(shape, batch, steps)
    next(iter(data))  # touch the data set before the baseline
    cuda = torch.device(cfg.device).type == "cuda"
    base = torch.cuda.memory_allocated() if cuda else _status_kib("VmRSS") * 1024
    model = torch.load(path, weights_only=False)  # the only model ever allocated here
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    train(model, data, cfg)
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024
    return peak - base


def rss_peak(model: nn.Module, shape: tuple[int, ...], batch: int, steps: int = 3,
             device: str = "cpu", channels_last: bool = False) -> int:
    """Peak process memory (bytes) of ``steps`` training steps, seen by a fresh subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.pt")
        torch.save(model, path)
        cmd = [sys.executable, __file__, path, "--shape", ",".join(map(str, shape)),
               "--batch", str(batch), "--steps", str(steps), "--device", device]
        if channels_last:
            cmd.append("--channels-last")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return int(out)


def main() -> None:  # the subprocess of rss_peak
    ap = argparse.ArgumentParser(description="peak RSS of a saved model's training steps")
    ap.add_argument("path")
    ap.add_argument("--shape", required=True, help="one input's shape, e.g. 1,28,28")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--channels-last", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = tuple(int(s) for s in args.shape.split(","))
    print(_rss_worker(args.path, shape, args.batch, args.steps,
                      default_config(args.device, args.channels_last)))


if __name__ == "__main__":
    main()
