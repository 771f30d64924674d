"""Server-side cost of one SpectralSharding round (ResNet-18, width 64, 10 clients, 2 groups).

Prints one JSON object: ``svd_s``, ``sampling_s``, ``pack_s``, ``aggregate_s``,
``overhead_ratio`` = (sampling + pack + aggregate) / svd, and ``svd_vs_bare_ratio`` = the
strategy's SVD time over a bare ``torch.linalg.svd`` loop on the same matrices, in float64
(the precision the strategy decomposes in), measured side by side in this process.
Medians over ``--repeats`` rounds.

Usage: ``python benchmarks/bench_server.py [--width 64] [--method collective] [--repeats 3]
[--out FILE]``; ``--out`` also writes the JSON (with the machine, torch version, date and
command) there.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flower_grid import InProcessGrid
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from machine import emit, provenance

from fedshard import Sharding, SpectralSharding, handle_query
from fedshard import protocol as P
from fedshard.models import resnet18
from fedshard.spectral import sharded_layer_names


def echo_client(msg: Message, context: Context) -> Message:
    """Replies what it received (no training): isolates the server's work."""
    if msg.metadata.message_type == "query":
        return handle_query(msg, context.node_config["keep-ratio"])
    rec = msg.content[P.ARRAYS]
    out = {k: Array(a.numpy()) for k, a in rec.items() if not k.endswith(".omega")}
    return Message(RecordDict({P.ARRAYS: ArrayRecord(out),
                    P.METRICS: MetricRecord({P.NUM_EXAMPLES: 100})}), reply_to=msg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--method", default="collective")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()

    model = resnet18(num_classes=10, in_channels=3, width=args.width)
    layers = sharded_layer_names(model, example_input=torch.zeros(1, 3, 32, 32))
    arrays = ArrayRecord(model.state_dict())
    ratios = [0.1] * 5 + [0.2] * 5
    grid = InProcessGrid(echo_client, [{"keep-ratio": r} for r in ratios])
    strategy = SpectralSharding(sharded_layers=layers, num_rounds=args.repeats + 1,
                                sharding=Sharding(method=args.method), seed=0)
    rows = []
    for r in range(1, args.repeats + 1):
        msgs = list(strategy.configure_train(r, arrays, ConfigRecord(), grid))
        replies = grid.send_and_receive(msgs)
        strategy.aggregate_train(r, replies)
        metrics = strategy.history[r]  # the server's statistics (Flower gets client metrics)
        assert metrics["replies-used"] == len(ratios), metrics
        rows.append({k: metrics[k] for k in ("svd-s", "sampling-s", "pack-s", "aggregate-s")})

    # The same matrices through a bare torch.linalg.svd loop (float64, reduced SVD).
    mats = [torch.from_numpy(arrays[f"{layer}.weight"].numpy()).double() for layer in layers]
    mats = [m.reshape(m.shape[0], -1) for m in mats]
    bare = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for m in mats:
            torch.linalg.svd(m, full_matrices=False)
        bare.append(time.perf_counter() - t)

    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    bare_s = statistics.median(bare)
    emit({
        **provenance(), "repeats": args.repeats,
        "model": f"resnet18-width{args.width}",
        "method": args.method,
        "clients": len(ratios),
        "keep_ratios": sorted(set(ratios)),
        "sharded_layers": len(layers),
        "largest_matrix": max((tuple(m.shape) for m in mats), key=lambda s: s[0] * s[1]),
        "svd_s": med["svd-s"],
        "sampling_s": med["sampling-s"],
        "pack_s": med["pack-s"],
        "aggregate_s": med["aggregate-s"],
        "overhead_ratio": (med["sampling-s"] + med["pack-s"] + med["aggregate-s"]) / med["svd-s"],
        "bare_svd_s": bare_s,
        "svd_vs_bare_ratio": med["svd-s"] / bare_s,
        "torch_threads": torch.get_num_threads(),
        "arch": platform.machine(),
        "numpy": np.__version__,
    }, args.out)


if __name__ == "__main__":
    main()
