"""Batches held on the device (``TensorBatches``) vs a DataLoader, for a client and the server.

fedshard's data sets (``ImageDataset``, ``ShakespeareDataset``) give all their examples at
once (``example_tensors()``), so ``fedshard.client.train.batches_for`` keeps them on the
training device and takes every batch by indexing, in the order a shuffling DataLoader gives. The
baseline is that DataLoader: one ``__getitem__`` per example (per-image standardization),
``torch.stack`` per batch, one host-to-device copy per batch. Both ways side by side in this
process, on the same device, median of ``--repeats``:

* ``client``: one client's round of the CIFAR-10 preset's shape (``--examples`` 3×32×32
  images, batch 32, ``--epochs``), the data path alone (everything the training loop does to
  get ``(inputs, targets)`` on the device, including building the batches: a ClientApp
  builds them for every message) and, with ``--train``, the whole round training a
  ResNet-18 (GroupNorm) width ``--width`` sub-model at r = ``--keep-ratio`` (Collective),
  whose trained parameters must agree both ways (bit for bit on the CPU);
* ``server``: one central evaluation's data path over a ``--test-examples`` test set at
  batch 256 (built once per run; the building is reported apart).

Usage: ``python benchmarks/bench_batches.py [--device cpu|cuda] [--train] [--width 64]
[--repeats 7] [--out FILE]``; prints one JSON object (seconds) and, with ``--out``, writes it there
with the machine, torch version, date and command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_simulation import NoTensors, sync  # noqa: E402
from machine import emit, provenance  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fedshard.client.train.batches import TensorBatches, batches_for, unpack_batch  # noqa: E402
from fedshard.data.images import ImageArrays, ImageDataset  # noqa: E402


def _images(n: int, seed: int) -> ImageDataset:
    rng = np.random.default_rng(seed)
    return ImageDataset(ImageArrays(rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
                                    rng.integers(0, 10, n).astype(np.int64)))


def _consume(batches: Iterable[Any], epochs: int, device: torch.device) -> int:
    seen = 0
    for _ in range(epochs):
        for batch in batches:
            _, targets = unpack_batch(batch, device)
            seen += int(targets.shape[0])
    return seen


def _median(fn: Callable[[], object], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _train_round(args: argparse.Namespace, data: ImageDataset, device: str) -> dict[str, Any]:
    """One client's round both ways: seconds each, max abs difference of the parameters."""
    from flower_grid import InProcessGrid
    from flwr.app import ArrayRecord, ConfigRecord, Message
    from flwr.clientapp import ClientApp
    from flwr.common import logger as flwr_logger

    from fedshard import SpectralSharding, handle_query, receive
    from fedshard import protocol as P
    from fedshard.client.train import train
    from fedshard.models import resnet18

    flwr_logger.update_console_handler(level=30)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = resnet18(num_classes=10, in_channels=3, width=args.width)
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Any) -> Message:
        return handle_query(msg, args.keep_ratio)

    strategy = SpectralSharding.from_model(
        net, example_input=torch.zeros(1, 3, 32, 32), method="collective", seed=0,
        local_epochs=args.epochs, batch_size=32, min_train_nodes=1, min_available_nodes=1)
    strategy.num_rounds = 1
    msg = next(iter(strategy.configure_train(1, ArrayRecord(net.state_dict()), ConfigRecord(),
                                             InProcessGrid(app, [{}]))))
    seed = P.TrainSettings.from_record(msg.content.config_records[P.CONFIG]).train_seed
    models: dict[str, torch.nn.Module] = {}
    first: dict[str, torch.nn.Module] = {}
    times: dict[str, list[float]] = {"data_loader": [], "tensor_batches": []}
    for _ in range(args.train_repeats):
        for name, source in (("data_loader", NoTensors(data)), ("tensor_batches", data)):
            shard = receive(msg, net, device=device)
            sync(device)
            t0 = time.perf_counter()
            train(shard.model, batches_for(source, 32, seed=seed, device=device),
                  shard.train_config(log_every_epoch=False))
            sync(device)
            times[name].append(time.perf_counter() - t0)
            models[name] = shard.model
            first.setdefault(name, shard.model)
    diff = _max_abs_diff(models["data_loader"], models["tensor_batches"])
    # The same path twice: on a GPU, cuDNN's default (nondeterministic, TF32) kernels make
    # two runs of one path differ too; this is the scale that `diff` is to be read against.
    repeat = max(_max_abs_diff(first[k], models[k]) for k in models)
    before, after = (statistics.median(times[k]) for k in ("data_loader", "tensor_batches"))
    return {"width": args.width, "keep_ratio": args.keep_ratio,
            "data_loader_s": round(before, 4), "tensor_batches_s": round(after, 4),
            "saved_s": round(before - after, 4), "max_abs_param_diff": diff,
            "same_path_repeat_max_abs_param_diff": repeat if args.train_repeats > 1 else None}


def _max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(
        a.state_dict().values(), b.state_dict().values(), strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--examples", type=int, default=500)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--test-examples", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--train", action="store_true", help="also one client round of training")
    ap.add_argument("--train-repeats", type=int, default=3)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--keep-ratio", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    device, dev = args.device, torch.device(args.device)
    client, test = _images(args.examples, 1), _images(args.test_examples, 2)

    def client_loader() -> int:
        return _consume(batches_for(NoTensors(client), 32, seed=7, device=device),
                        args.epochs, dev)

    def client_tensors() -> int:
        return _consume(batches_for(client, 32, seed=7, device=device), args.epochs, dev)

    # both ways give the same batches (the tests check the order against torch's DataLoader)
    a = list(batches_for(NoTensors(client), 32, seed=7, device=device))
    b = list(batches_for(client, 32, seed=7, device=device))
    same = all(torch.equal(x.to(dev), u) and torch.equal(y.to(dev), v)
               for (x, y), (u, v) in zip(a, b, strict=True))
    if not same or len(a) != len(b):
        raise SystemExit("bench_batches: the two ways gave different batches")

    loader = DataLoader(NoTensors(test), batch_size=256)
    t0 = time.perf_counter()
    held = batches_for(test, 256, device=device)
    sync(device)
    build_s = time.perf_counter() - t0
    assert isinstance(held, TensorBatches)
    out: dict[str, Any] = {
        **provenance(device), "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "client": {"examples": args.examples, "epochs": args.epochs, "batch": 32,
                   "data_loader_s": round(_median(client_loader, args.repeats, device), 4),
                   "tensor_batches_s": round(_median(client_tensors, args.repeats, device), 4)},
        "server_eval": {"examples": args.test_examples, "batch": 256,
                        "data_loader_s": round(_median(lambda: _consume(loader, 1, dev),
                                                       args.repeats, device), 4),
                        "tensor_batches_s": round(_median(lambda: _consume(held, 1, dev),
                                                          args.repeats, device), 4),
                        "tensor_batches_build_once_s": round(build_s, 4)},
        "same_batches": same,
    }
    for part in ("client", "server_eval"):
        out[part]["speedup"] = round(out[part]["data_loader_s"]
                                     / max(out[part]["tensor_batches_s"], 1e-9), 1)
    if args.train:
        out["client_round"] = _train_round(args, client, device)
    emit(out, args.out)


if __name__ == "__main__":
    main()
