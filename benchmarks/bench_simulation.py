"""One federated round of the CIFAR-10 preset's shape through Flower vs a bare training loop.

10 clients of 500 CIFAR-shaped images (3×32×32 ``uint8``, synthetic: this measures time, not
accuracy; an ``ImageDataset`` each, standardized per image as the app's data sets are),
2 local epochs, batch 32, ResNet-18 (GroupNorm) width 64, every client at r = 0.1, Collective
with CPS, SGD-m + Frobenius decay + ClipLR. Two ways, side by side in this process, on the
same device:

* **fedshard**: ``SpectralSharding.start`` on Flower's Message API over an in-process grid of
  real ClientApps (``tests/flower_grid.py``: every message deep-copied as if serialized; no
  Ray, so that this runs where only flwr is installed). Per round: node sampling, SVD, plan,
  packing, client decoding + training (``fedshard.client.handlers.handle_train`` on ``--device``),
  reply checks, aggregation, rebuild of W (the server's work on ``--device`` too);
* **bare loop**: the same 10 sub-models (decoded from the same round's messages) trained with
  the same settings by ``fedshard.client.train.loop.train`` in a plain Python loop.

Prints one JSON object: ``s_per_round`` (median over rounds after the first), the projected
wall time of a 1,000-round cell, ``bare_s_per_round`` and ``flower_overhead_ratio`` =
(fedshard − bare) / bare. ``--quick`` runs a reduced size (width 16, 100 images per client,
1 epoch) for a CPU.

Usage: ``python benchmarks/bench_simulation.py [--device auto|cpu|cuda] [--quick] [--rounds 3]
[--cuda-graph] [--compile] [--graph-warmup N] [--no-reuse-step] [--data-loader]``;
``clients_s`` is the time
spent in the ClientApps' training handlers per round (the rest of ``round_s`` is the server
and Flower). ``--no-reuse-step`` gives every client its own step (and CUDA graphs): the
baseline of ``TrainConfig.reuse_step``, on by default with ``--cuda-graph``.
``--data-loader`` reads the clients' data through a DataLoader (both ways): the baseline of
``fedshard.client.train.batches.TensorBatches``, which holds each client's examples on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from flower_grid import InProcessGrid  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message  # noqa: E402
from flwr.common import logger as flwr_logger  # noqa: E402
from machine import cpu_name  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from fedshard import (  # noqa: E402
    SpectralSharding,
    handle_query,
    handle_train,
)
from fedshard import protocol as P  # noqa: E402
from fedshard.client import submodel_from_record  # noqa: E402
from fedshard.client.train import TrainConfig, train  # noqa: E402
from fedshard.client.train.batches import batches_for  # noqa: E402
from fedshard.client.train.fast import FastOptions  # noqa: E402
from fedshard.data.images import ImageArrays, ImageDataset  # noqa: E402
from fedshard.models import resnet18  # noqa: E402


class NoTensors(Dataset[Any]):
    """A data set without ``example_tensors()``: read through a DataLoader (``--data-loader``)."""

    def __init__(self, data: ImageDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return self.data[i]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--keep-ratio", type=float, default=0.1)
    ap.add_argument("--cuda-graph", action="store_true",
                    help="clients capture their training step as a CUDA graph (both ways)")
    ap.add_argument("--compile", action="store_true",
                    help="clients compile forward/backward with torch.compile (both ways)")
    ap.add_argument("--graph-warmup", type=int, default=None,
                    help="eager steps per batch shape before a CUDA graph is captured "
                         "(fedshard.client.train.fast.step._StepGraphs._WARMUP; measurement only)")
    ap.add_argument("--no-reuse-step", action="store_true",
                    help="every client builds (and captures) its own step: TrainConfig."
                         "reuse_step=False, the baseline of the step pool (both ways)")
    ap.add_argument("--data-loader", action="store_true",
                    help="clients read their data through a DataLoader, not held on the "
                         "device (the baseline of TensorBatches; both ways)")
    ap.add_argument("--merge-terms", action="store_true",
                    help="clients train each sharded conv as one dense conv of U diag(ω) Vᵀ "
                         "(TrainConfig.merge_terms; both ways)")
    args = ap.parse_args()
    if args.graph_warmup is not None:
        import fedshard.client.train.fast.step as step_module
        step_module._StepGraphs._WARMUP = args.graph_warmup
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    width, examples, epochs = (16, 100, 1) if args.quick else (64, 500, 2)
    flwr_logger.update_console_handler(level=30)  # WARNING: keep the output to the JSON

    def model() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return resnet18(num_classes=10, in_channels=3, width=width)

    data: dict[int, Dataset[Any]] = {}
    for pid in range(args.clients):
        rng = np.random.default_rng([0, pid])
        images = ImageDataset(ImageArrays(
            rng.integers(0, 256, (examples, 3, 32, 32), dtype=np.uint8),
            rng.integers(0, 10, examples).astype(np.int64)))
        data[pid] = NoTensors(images) if args.data_loader else images

    template = model()
    fast = FastOptions(cuda_graph=args.cuda_graph, compile=args.compile,
                       reuse_step=False if args.no_reuse_step else None,
                       merge_terms=args.merge_terms)
    client_s: dict[int, float] = {}

    def client(msg: Message, context: Context) -> Message:
        pid = context.node_config["partition-id"]
        if msg.metadata.message_type == "query":
            return handle_query(msg, args.keep_ratio, pid)
        t0 = time.perf_counter()
        # one model per process, as the ClientApp does (fedshard.app.task.template_model)
        reply = handle_train(msg, template, data[pid], device=device, fast=fast)
        sync(device)
        key = len(marks)  # rounds started so far
        client_s[key] = client_s.get(key, 0.0) + time.perf_counter() - t0
        return reply

    grid = InProcessGrid(client, [{"partition-id": i} for i in range(args.clients)])
    net = model()
    strategy = SpectralSharding.from_model(
        net, example_input=torch.zeros(1, 3, 32, 32), num_rounds=args.rounds,
        method="collective", local_epochs=epochs, batch_size=32, fraction_train=1.0,
        fraction_evaluate=0.0,  # the round timed is the training round
        min_available_nodes=args.clients, seed=0,
        device=None if device == "cpu" else device)

    # --- fedshard: time each round from configure_train to the end of aggregate_train
    marks: list[float] = []
    sent: list[list[Message]] = []
    inner_cfg, inner_agg = strategy.configure_train, strategy.aggregate_train

    def configure(server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                  grid_: Any) -> Any:
        sync(device)
        marks.append(time.perf_counter())
        msgs = list(inner_cfg(server_round, arrays, config, grid_))
        sent.append(msgs)
        return msgs

    def aggregate(server_round: int, replies: Any) -> Any:
        out = inner_agg(server_round, replies)
        sync(device)
        marks.append(time.perf_counter())
        return out

    strategy.configure_train = configure  # type: ignore[method-assign]
    strategy.aggregate_train = aggregate  # type: ignore[method-assign]
    strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                   num_rounds=args.rounds)
    rounds = [marks[2 * i + 1] - marks[2 * i] for i in range(args.rounds)]

    # --- bare loop: the same sub-models (last round's messages), same settings
    bare = []
    for _ in range(max(1, args.rounds - 1)):
        sync(device)
        t0 = time.perf_counter()
        for msg in sent[-1]:
            s = P.TrainSettings.from_record(msg.content.config_records[P.CONFIG])
            sub, _ = submodel_from_record(template, msg.content.array_records[P.ARRAYS])
            pid = grid.contexts[msg.metadata.dst_node_id].node_config["partition-id"]
            loader = batches_for(data[pid], s.batch_size, seed=s.train_seed, device=device)
            train(sub, loader, TrainConfig(recipe=s, device=device, torch_seed=s.train_seed,
                                           log_every_epoch=False, fast=fast))
        sync(device)
        bare.append(time.perf_counter() - t0)

    steady = rounds[1:] or rounds
    s_round, s_bare = statistics.median(steady), statistics.median(bare)
    m = strategy.history[max(strategy.history)]
    used = [strategy.history[r].get("replies-used") for r in sorted(strategy.history)]
    if any(u != args.clients for u in used):
        raise SystemExit(f"bench_simulation: replies used per round {used}, expected "
                         f"{args.clients} each: a client failed, so the timings are not a round's")
    print(json.dumps({
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else cpu_name(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "shape": {"clients": args.clients, "examples_per_client": examples, "epochs": epochs,
                  "batch": 32, "resnet18_width": width, "keep_ratio": args.keep_ratio,
                  "method": "collective", "cuda_graph": args.cuda_graph,
                  "compile": args.compile, "graph_warmup": args.graph_warmup,
                  "reuse_step": args.cuda_graph and not args.no_reuse_step,
                  "merge_terms": args.merge_terms,
                  "data": "data-loader" if args.data_loader else "tensor-batches"},
        "round_s": [round(x, 3) for x in rounds],
        "clients_s": [round(client_s.get(2 * i + 1, float("nan")), 3)
                      for i in range(args.rounds)],
        "s_per_round": round(s_round, 3),
        "projected_1000_rounds_min": round(1000 * s_round / 60, 1),
        "bare_s_per_round": round(s_bare, 3),
        "flower_overhead_ratio": round((s_round - s_bare) / s_bare, 3),
        "server_svd_s": round(m.get("svd-s", float("nan")), 3),
        "server_aggregate_s": round(m.get("aggregate-s", float("nan")), 3),
        "replies_used": m.get("replies-used"),
    }))


if __name__ == "__main__":
    main()
