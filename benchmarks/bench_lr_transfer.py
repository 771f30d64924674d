"""Does the dense model's learning rate work for the sharded model? ``factor-step`` plain vs
dense, against the dense model (``method = "none"``), on real Fashion-MNIST.

Each cell is one whole fedshard run through the real server path (``run_server``, the
ServerApp's job) over an in-process grid of fedshard's own ClientApps, in this process, with
one torch thread. For each model (``--models``) and lr (``--lrs``) the variants are:

* ``dense``: ``method = "none"`` (FedAvg of the dense model);
* ``r1-plain`` / ``r1-dense``: every term (Top-n at keep ratio 1, so ω = 1), the paper's
  factor step / ``factor-step = "dense"``: the same function class as ``dense``, trained
  through the factors;
* ``collective-plain`` / ``collective-dense``: Collective at keep ratio ``--keep-ratio`` for
  every node (one group, C = the number of nodes), the paper's step / the dense step.

The data: the first ``nodes x per-node`` training images of Fashion-MNIST
(``/usr/share/datasets/fashion-mnist``) split over the nodes with Dirichlet class priors
(α = ``--alpha``), the first ``--test`` test images for the server's evaluation; every node
trains every round (1 local epoch, batch 32, SGD momentum 0.9, Frobenius decay 1e-4, ClipLR
τ = 10, constant lr). A run whose nodes all diverge (NaN) keeps its model unchanged that
round (the replies are dropped); ``replies-dropped`` counts them.

Also measures the mechanism (``step_ratio``): from the dense model at initialization and after
``--probe-steps`` dense SGD steps, one SGD step on one batch, dense vs factorized (all terms,
ω = 1), plain vs dense factor step: ``‖ΔW‖_F`` of each sharded layer over the dense step's,
with the layer's top singular value.

Prints one JSON object; ``--out FILE`` also writes it after every finished cell (partial
results). Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_lr_transfer.py --out /tmp/lr.json \\
        [--models lenet mlp resnet18] [--lrs 0.01 0.05 0.1] [--rounds 20] \\
        [--resnet-rounds 20] [--variants dense r1-plain ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fakedata import write_idx  # noqa: E402

from fedshard.data.image_files import read_idx  # noqa: E402

FMNIST = Path("/usr/share/datasets/fashion-mnist")
VARIANTS = {
    "dense": {"method": "none", "keep-ratios": "1"},
    "r1-plain": {"method": "top-n", "keep-ratios": "1", "factor-step": "plain"},
    "r1-dense": {"method": "top-n", "keep-ratios": "1", "factor-step": "dense"},
    "collective-plain": {"method": "collective", "factor-step": "plain"},
    "collective-dense": {"method": "collective", "factor-step": "dense"},
}
WIDTHS = {"lenet": 1, "mlp": 256, "resnet18": 16}




def write_subset(folder: Path, n_train: int, n_test: int) -> None:
    """The first ``n_train`` / ``n_test`` images of real Fashion-MNIST as idx files."""
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            write_idx(folder / f"{prefix}-{kind}.gz",
                       read_idx(FMNIST / f"{prefix}-{kind}.gz")[:n])


def run_cell(data: Path, out: Path, model: str, variant: str, lr: float, rounds: int,
             args: argparse.Namespace) -> dict[str, Any]:
    from flower_grid import InProcessGrid

    import client_app
    from fedshard.app.config import RunConfig
    from fedshard.app.run import run_server

    name = f"{model}-{variant}-lr{lr:g}"
    cfg = {"dataset": "fashion-mnist", "data-dir": str(data), "model": model,
           "model-width": WIDTHS[model], "num-server-rounds": rounds,
           "num-partitions": args.nodes, "min-available-nodes": args.nodes,
           "fraction-train": 1.0, "batch-size": 32, "local-epochs": 1, "lr": lr,
           "lr-schedule": "constant", "dirichlet-alpha": args.alpha,
           "keep-ratios": str(args.keep_ratio), "results-dir": str(out), "run-name": name,
           "test-max-examples": args.test, "eval-every": min(args.eval_every, rounds),
           "seed": args.seed,
           "client-device": "cpu", "server-device": "cpu", **VARIANTS[variant]}
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": args.nodes}
                                          for i in range(args.nodes)], cfg)
    start = time.perf_counter()
    error = None
    try:
        run_server(grid, RunConfig.from_mapping(cfg))
    except RuntimeError as err:  # no round trained: every reply of every round dropped
        error = str(err).splitlines()[0][:200]
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    acc = {r["round"]: r["test-accuracy"] for r in rows if "test-accuracy" in r}
    dropped = sum(int(r.get("replies-dropped", 0)) for r in rows)
    return {"model": model, "variant": variant, "lr": lr, "rounds": rounds,
            "final-test-accuracy": acc.get(rounds), "test-accuracy": acc,
            "replies-dropped": dropped, "replies": rounds * args.nodes,
            "no-round-trained": error, "wall-s": round(time.perf_counter() - start, 1)}


def step_ratio(model_name: str, probe_steps: int, lr: float, seed: int) -> dict[str, Any]:
    """‖ΔW‖ of one factorized SGD step (plain / dense factor step) over the dense step's."""
    from fedshard.app.config import RunConfig
    from fedshard.app.task import build_model, example_input
    from fedshard.client.train import DenseFactorStep
    from fedshard.spectral import sharded_layer_names
    from fedshard.spectral.layers import SpectralLayer
    from fedshard.spectral.surgery import shard_model

    cfg = RunConfig.from_mapping({"model": model_name, "model-width": WIDTHS[model_name]})
    dense = build_model(cfg)
    names = sharded_layer_names(dense, example_input=example_input(cfg))
    images = torch.tensor(read_idx(FMNIST / "train-images-idx3-ubyte.gz")[:2048],
                          dtype=torch.float32)[:, None] / 255
    images = (images - images.mean((1, 2, 3), keepdim=True)) / images.std((1, 2, 3),
                                                                         keepdim=True)
    labels = torch.tensor(read_idx(FMNIST / "train-labels-idx1-ubyte.gz")[:2048].astype(
        np.int64))
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(dense.parameters(), lr=0.01, momentum=0.9)
    for _ in range(probe_steps):  # a partly trained model: larger singular values
        idx = torch.randint(0, len(images), (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(dense(images[idx]), labels[idx]).backward()
        opt.step()
    idx = torch.randint(0, len(images), (32,), generator=gen)
    x, y = images[idx], labels[idx]

    def one_step(model: torch.nn.Module, kind: str) -> dict[str, torch.Tensor]:
        before = {n: _weight(model.get_submodule(n)) for n in names}
        sgd = torch.optim.SGD(model.parameters(), lr=lr)
        if kind == "dense-step":
            DenseFactorStep(sgd, model)
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sgd.step()
        return {n: _weight(model.get_submodule(n)) - before[n] for n in names}

    def sub() -> torch.nn.Module:
        sizes = {n: min(_weight(dense.get_submodule(n)).shape) for n in names}
        model, _ = shard_model(dense, {n: list(range(k)) for n, k in sizes.items()},
                               {n: torch.ones(k) for n, k in sizes.items()})
        return model

    import copy
    ref = one_step(copy.deepcopy(dense), "dense")
    plain, dstep = one_step(sub(), "plain"), one_step(sub(), "dense-step")
    out = {}
    for n in names:
        w = _weight(dense.get_submodule(n))
        out[n] = {"shape": list(w.shape),
                  "top-singular-value": round(float(torch.linalg.svdvals(w)[0]), 3),
                  "plain/dense": round(float(plain[n].norm() / ref[n].norm()), 3),
                  "dense-step/dense": round(float(dstep[n].norm() / ref[n].norm()), 4),
                  "dense-step-vs-dense-rel-diff": round(
                      float((dstep[n] - ref[n]).norm() / ref[n].norm()), 4)}
    assert not isinstance(dense, SpectralLayer)
    return out


def _weight(layer: torch.nn.Module) -> torch.Tensor:
    from fedshard.spectral.layers import SpectralLayer
    if isinstance(layer, SpectralLayer):
        return layer.dense_weight().float()
    return layer.weight.detach().reshape(layer.weight.shape[0], -1).clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["lenet", "mlp", "resnet18"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--lrs", nargs="+", type=float, default=[0.01, 0.05, 0.1])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--resnet-rounds", type=int, default=20)
    p.add_argument("--resnet-variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="the variants for resnet18 (default: --variants)")
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--per-node", type=int, default=300)
    p.add_argument("--test", type=int, default=2000)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--keep-ratio", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-steps", type=int, default=300)
    p.add_argument("--no-cells", action="store_true", help="only the one-step measurement")
    p.add_argument("--no-step-ratio", action="store_true", help="only the runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # Flower's and fedshard's per-round lines
    result: dict[str, Any] = {
        "setup": {"nodes": args.nodes, "images-per-node": args.per_node, "test": args.test,
                  "alpha": args.alpha, "keep-ratio-collective": args.keep_ratio,
                  "rounds": args.rounds, "resnet-rounds": args.resnet_rounds,
                  "eval-every": args.eval_every,
                  "local-epochs": 1, "batch-size": 32, "lr-schedule": "constant",
                  "torch": torch.__version__, "python": platform.python_version(),
                  "threads": torch.get_num_threads()},
        "step_ratio": {}, "cells": []}

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))

    for model in [] if args.no_step_ratio else args.models:
        result["step_ratio"][model] = {
            f"after-{k}-steps": step_ratio(model, k, 0.01, args.seed)
            for k in (0, args.probe_steps)}
        save()
    if not args.no_cells:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "data"
            write_subset(data, args.nodes * args.per_node, args.test)
            for model in args.models:
                resnet = model == "resnet18"
                rounds = args.resnet_rounds if resnet else args.rounds
                variants = (args.resnet_variants or args.variants) if resnet else args.variants
                for lr in args.lrs:
                    for variant in variants:
                        result["cells"].append(run_cell(data, Path(tmp) / "out", model,
                                                        variant, lr, rounds, args))
                        save()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
