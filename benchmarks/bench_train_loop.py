"""fedshard's local training loop against a bare torch loop, one client's epoch at a time.

The engine's round (``bench_engine.py``) is mostly the clients' training; this isolates it.
``fedshard.client.train.train`` (``TensorBatches``, the recipe's SGD with momentum, the
client rules, the per-step sums of loss, correct predictions and counted targets, the
periodic finiteness check) and a bare loop (``randperm``, index, cross-entropy, backward,
``torch.optim.SGD`` with the same lr and momentum) train the same model from the same
weights on the same examples, alternating, ``--pairs`` times after a warm-up; the figure is
the median of the paired ratios (each fedshard epoch over the bare epoch run right after
it), so that a machine whose speed drifts moves both alike. A third side, the same bare loop
with torch's fused SGD (``train_vs_bare_fused_sgd``: the kernel fedshard's optimizer takes on
a CPU), tells the optimizer's part of the figure from the loop's.

The model is the engine benchmark's: the ``mlp`` of width 200 (three hidden layers with
LayerNorm) on 500 Fashion-MNIST-shaped examples, batch 32, one epoch, without sharding (the
dense model both ways), one torch thread.

Usage: ``python benchmarks/bench_train_loop.py [--pairs 40] [--width 200] [--out FILE]``;
prints one JSON object and, with ``--out``, writes it there with the machine, torch version,
date, command and load average.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import emit, provenance  # noqa: E402

from fedshard.client.train import TrainConfig, train  # noqa: E402
from fedshard.client.train.batches import TensorBatches  # noqa: E402
from fedshard.models.mlp import MLP  # noqa: E402
from fedshard.settings import LocalTraining  # noqa: E402

EXAMPLES, BATCH, LR, MOMENTUM = 500, 32, 0.05, 0.9


def fedshard_epoch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                   cfg: TrainConfig) -> float:
    """Seconds of one ``train`` call (one epoch) on ``model``."""
    batches = TensorBatches(x, y, BATCH, seed=1)
    t0 = time.perf_counter()
    train(model, batches, cfg)
    return time.perf_counter() - t0


def bare_epoch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
               fused: bool = False) -> float:
    """Seconds of one epoch of the bare loop on ``model`` (``fused``: with torch's fused SGD,
    the kernel fedshard's optimizer takes on a CPU, instead of torch's default)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, fused=fused)
    gen = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    order = torch.randperm(len(x), generator=gen)
    for start in range(0, len(x), BATCH):
        idx = order[start:start + BATCH]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--width", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.pairs < 1 or args.width < 1:
        raise SystemExit("bench_train_loop: --pairs and --width must be ≥ 1; nothing was run")
    torch.set_num_threads(1)
    logging.disable(logging.INFO)  # train()'s per-epoch line
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(EXAMPLES, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (EXAMPLES,), generator=gen)
    torch.manual_seed(0)
    start = MLP(784, 10, args.width, 3).state_dict()
    # the paper's recipe at this lr (Frobenius decay and ClipLR act on no layer: no sharding)
    cfg = TrainConfig(recipe=LocalTraining(lr=LR, momentum=MOMENTUM), log_every_epoch=False)

    def fresh() -> torch.nn.Module:
        model = MLP(784, 10, args.width, 3)
        model.load_state_dict(start)
        return model

    for _ in range(3):  # warm-up: allocator, kernels
        fedshard_epoch(fresh(), x, y, cfg)
        bare_epoch(fresh(), x, y)
        bare_epoch(fresh(), x, y, fused=True)
    ours, bare, fused, ratios, fused_ratios = [], [], [], [], []
    for _ in range(args.pairs):
        a = fedshard_epoch(fresh(), x, y, cfg)
        b = bare_epoch(fresh(), x, y)
        c = bare_epoch(fresh(), x, y, fused=True)
        ours.append(a)
        bare.append(b)
        fused.append(c)
        ratios.append(a / b)
        fused_ratios.append(a / c)
    emit({
        **provenance("cpu"),
        "torch_threads": torch.get_num_threads(),
        "shape": {"model": "mlp", "width": args.width, "examples": EXAMPLES, "batch": BATCH,
                  "epochs": 1, "steps": -(-EXAMPLES // BATCH)},
        "pairs": args.pairs,
        "train_vs_bare": round(statistics.median(ratios), 4),
        "train_vs_bare_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
        "train_vs_bare_fused_sgd": round(statistics.median(fused_ratios), 4),
        "train_vs_bare_fused_sgd_quartiles": [round(q, 4) for q in
                                              statistics.quantiles(fused_ratios, n=4)],
        "s_per_epoch": {"fedshard": round(statistics.median(ours), 5),
                        "bare": round(statistics.median(bare), 5),
                        "bare_fused_sgd": round(statistics.median(fused), 5)},
    }, args.out)


if __name__ == "__main__":
    main()
