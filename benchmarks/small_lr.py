"""A project's own small learning rate: does the sharded model learn as fast as the dense one in
the first rounds? LeNet-style CNN without normalization on Fashion-MNIST, the project's own
loop (``SGD(lr=1e-3, momentum=0.9)``, batch 32, one local epoch), a few nodes and 3 rounds.

The arms, every one from the same code, data, initial model and seeds:

* ``dense``: Flower's ``FedAvg`` and a plain ``ClientApp`` (what the project runs today);
* ``r<r>-plain`` / ``r<r>-dense``: ``SpectralSharding`` (Collective, one keep ratio r for every
  node: one group of C = ``--nodes``) with the paper's factor step / ``factor_step="dense"``;
  the node's handler is the project's own, with ``shard = receive(msg, Net())`` and
  ``shard.rules.attach(optimizer)`` (``ShardingClientApp`` re-encodes its reply);
* ``r<r>-plain-x<k>``: the same at k times the lr (server and nodes): what to set instead.

Every node trains every round; the server evaluates the dense global model on the first
``--test`` test images after every round. Besides the accuracies it records, for round 1, the
Frobenius norm of the global update of each sharded layer over the dense arm's (both start from
the same model), the first round's multipliers ω (over the sharded layers and nodes), and the
*gradient share*: of the dense model's gradient ``G`` of a sharded layer (mean loss over 500
images of each node), the part a node's step can follow, ``‖P_U G + G P_V − P_U G P_V‖² / ‖G‖²``
with ``U``, ``V`` the singular vectors of the terms it holds, next to the share of a random
isotropic gradient, ``n (m + k − n) / (m k)``; for the sharded arms with the terms each node was
sent in round 1, for the dense arm with the top ⌈rN⌉ terms at the initial and the final model.

The data are ``/usr/share/datasets/fashion-mnist`` (``--data``), the first ``nodes x per-node``
training images split IID over the nodes with a seeded permutation. One process, one torch
thread. Prints one JSON object (machine, torch, date, seeds, setup, runs, a summary per arm);
``--out FILE`` also writes it. Usage::

    OMP_NUM_THREADS=1 python benchmarks/small_lr.py --out results/small-lr/small_lr.json \\
        [--seeds 0 1] [--arms dense r0.25-plain r0.25-plain-x2 ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from flower_grid import InProcessGrid  # noqa: E402
from flwr.app import (  # noqa: E402
    ArrayRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from machine import cpu_name, emit  # noqa: E402
from torch import nn  # noqa: E402

from fedshard import NodePolicy, ShardingClientApp, SpectralSharding, receive  # noqa: E402
from fedshard.data.image_files import read_idx  # noqa: E402
from fedshard.models.lenet import lenet  # noqa: E402

FMNIST = Path("/usr/share/datasets/fashion-mnist")
SHARDED = ("conv2", "fc1", "fc2")  # the default layers of LeNet (all but the first and last)
ARMS = ["dense", "r0.25-plain", "r0.25-dense", "r0.5-plain", "r0.5-dense", "r0.25-plain-x2",
        "r0.5-plain-x2"]
_ARM = re.compile(r"r(0\.\d+|1)-(plain|dense)(-x\d+(\.\d+)?)?")


def load(data: Path, nodes: int, per_node: int, test: int, seed: int
         ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """The nodes' IID partitions and the test set, scaled as the Flower quickstart does."""
    def images(prefix: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = read_idx(data / f"{prefix}-images-idx3-ubyte.gz")[:n].astype(np.float32)
        y = read_idx(data / f"{prefix}-labels-idx1-ubyte.gz")[:n].astype(np.int64)
        return torch.from_numpy((x / 255 - 0.5) / 0.5)[:, None], torch.from_numpy(y)

    x, y = images("train", nodes * per_node)
    order = torch.from_numpy(np.random.default_rng([seed, 1]).permutation(len(y)))
    parts = [(x[idx], y[idx]) for idx in order.chunk(nodes)]
    return parts, images("t10k", test)


def model_for(seed: int) -> nn.Module:
    """The project's ``Net`` (LeNet, no normalization), initialized from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return lenet()


def local_train(model: nn.Module, part: tuple[torch.Tensor, torch.Tensor], lr: float,
                seed: Sequence[int], attach: Callable[[torch.optim.Optimizer], Any] | None
                ) -> float:
    """The project's own loop: one epoch of SGD with momentum 0.9, batch 32; mean loss."""
    x, y = part
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if attach is not None:  # fedshard's client rules, on this optimizer's steps
        attach(optimizer)
    order = torch.from_numpy(np.random.default_rng(list(seed)).permutation(len(y)))
    model.train()
    total = 0.0
    for idx in order.split(32):
        loss = F.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += float(loss) * len(idx)
    return total / len(y)


@torch.no_grad()
def accuracy(model: nn.Module, test: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    return float((model(test[0]).argmax(1) == test[1]).float().mean())


def gradient_share(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                   terms: dict[str, Sequence[int]]) -> dict[str, dict[str, float]]:
    """Per sharded layer: the share of the dense gradient ``G`` (mean loss on ``batch``) that a
    node holding ``terms`` can follow, ``‖P_U G + G P_V − P_U G P_V‖² / ‖G‖²`` (the tangent
    space of those terms of ``W``'s SVD), and the share of an isotropic random gradient,
    ``n (m + k − n) / (m k)``."""
    model.train()
    model.zero_grad()
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    out = {}
    for name, idx in terms.items():
        weight = model.get_submodule(name).weight
        assert weight.grad is not None
        w = weight.detach().reshape(weight.shape[0], -1).double()  # (m, k)
        g = weight.grad.reshape(w.shape).double()
        u, _, vh = torch.linalg.svd(w, full_matrices=False)  # decreasing, as the server's
        left, right = u[:, list(idx)], vh[list(idx)].T  # (m, n), (k, n)
        inner = left.T @ g @ right  # (n, n)
        tangent = left @ (left.T @ g) + (g @ right) @ right.T - left @ inner @ right.T
        (m, k), n = w.shape, len(idx)
        out[name] = {"measured": float((tangent**2).sum() / (g**2).sum()),
                     "isotropic": n * (m + k - n) / (m * k)}
    model.zero_grad()
    return out


def _mean_shares(shares: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {n: {k: round(statistics.fmean(s[n][k] for s in shares), 4)
                for k in ("measured", "isotropic")} for n in SHARDED}


def client_app(parts: list[tuple[torch.Tensor, torch.Tensor]], lr: float, seed: int,
               keep: float | None) -> ClientApp:
    """The project's ClientApp: plain (``keep=None``) or sharded, the same handler."""
    app = ClientApp() if keep is None else ShardingClientApp(default_keep_ratio=keep)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node = int(context.node_config["partition-id"])
        server_round = int(msg.content["config"]["server-round"])
        model, attach = model_for(seed), None
        if keep is None:
            model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        else:
            shard = receive(msg, model)
            model, attach = shard.model, shard.rules.attach
        loss = local_train(model, parts[node], lr, (seed, server_round, node), attach)
        metrics = MetricRecord({"train-loss": loss, "num-examples": len(parts[node][1])})
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": metrics}), reply_to=msg)

    return app


def run(arm: str, parts: list[tuple[torch.Tensor, torch.Tensor]],
        test: tuple[torch.Tensor, torch.Tensor], seed: int, rounds: int, lr: float
        ) -> dict[str, Any]:
    """One run of ``arm`` (``dense`` or ``r<r>-<plain|dense>[-x<k>]``)."""
    nodes = len(parts)
    initial = model_for(seed)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    accuracies: dict[int, float] = {}
    final: list[nn.Module] = []
    probe = (torch.cat([x[:500] for x, _ in parts]), torch.cat([y[:500] for _, y in parts]))

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = model_for(seed)
        model.load_state_dict(arrays.to_torch_state_dict())
        final[:] = [model]
        weights[server_round] = {n: model.get_submodule(n).weight.detach().clone()
                                 for n in SHARDED}
        accuracies[server_round] = accuracy(model, test)
        return MetricRecord({"test-accuracy": accuracies[server_round]})

    common = {"fraction_evaluate": 0.0, "min_train_nodes": nodes, "min_available_nodes": nodes}
    keep = None
    if arm == "dense":
        strategy: FedAvg = FedAvg(**common)
    else:
        ratio, step, *scale = arm[1:].split("-")
        keep = float(ratio)
        lr *= float(scale[0][1:]) if scale else 1.0
        strategy = SpectralSharding.from_model(
            initial, lr=lr, lr_schedule="constant", factor_step=step, seed=seed,
            nodes=NodePolicy(query_timeout=30, node_wait_timeout=30), **common)
    grid = InProcessGrid(client_app(parts, lr, seed, keep),
                         [{"partition-id": i, "num-partitions": nodes} for i in range(nodes)])
    omegas: list[float] = []
    held: list[dict[str, list[int]]] = []  # each node's terms in round 1
    if keep is not None:  # what the nodes receive in round 1
        original = grid.push_messages

        def push(messages: Any) -> Any:
            messages = list(messages)
            train = [m for m in messages if m.metadata.message_type == "train"]
            if train and not held:
                for m in train:
                    arrays = m.content["arrays"]
                    omegas.extend(float(w) for k, a in arrays.items()
                                  if k.endswith(".omega") for w in a.numpy())
                    held.append({n: [int(i) for i in arrays[f"{n}.indices"].numpy()]
                                 for n in SHARDED})
            return original(messages)

        grid.push_messages = push  # type: ignore[method-assign]
    start = time.perf_counter()
    strategy.start(grid=grid, initial_arrays=ArrayRecord(initial.state_dict()),
                   num_rounds=rounds, evaluate_fn=evaluate_fn)
    update = {n: float((weights[1][n] - weights[0][n]).norm()) for n in SHARDED}
    out: dict[str, Any] = {"arm": arm, "seed": seed, "lr": lr, "test-accuracy": accuracies,
                           "round1-update-norm": update,
                           "wall-s": round(time.perf_counter() - start, 1)}
    if omegas:
        out["round1-omega"] = {"min": min(omegas), "median": statistics.median(omegas),
                               "max": max(omegas)}
        out["round1-gradient-share"] = _mean_shares(
            [gradient_share(model_for(seed), probe, terms) for terms in held])
    if keep is None:  # the top ⌈rN⌉ terms, at the initial model and after the last round
        sizes = {n: min(weights[0][n].reshape(weights[0][n].shape[0], -1).shape)
                 for n in SHARDED}
        out["top-terms-gradient-share"] = {
            f"r{r:g}": {when: _mean_shares([gradient_share(model, probe, {
                n: range(math.ceil(r * size)) for n, size in sizes.items()})])
                for when, model in (("initial", model_for(seed)), ("final", final[0]))}
            for r in (0.25, 0.5)}
    return out


def summary(runs: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Per arm: the mean test accuracy per round over the seeds, and per round the paired
    difference to the dense arm (mean and the per-seed values); the round-1 update norms over
    the dense arm's, per layer (mean over seeds)."""
    dense = {r["seed"]: r for r in runs if r["arm"] == "dense"}
    out: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        row: dict[str, Any] = {"test-accuracy-mean": {
            k: round(statistics.fmean(r["test-accuracy"][k] for r in mine), 4)
            for k in range(rounds + 1)}}
        paired = [r for r in mine if r["seed"] in dense]
        if arm != "dense" and paired:
            row["minus-dense"] = {
                k: [round(r["test-accuracy"][k] - dense[r["seed"]]["test-accuracy"][k], 4)
                    for r in paired] for k in range(1, rounds + 1)}
            row["round1-update-over-dense"] = {
                n: round(statistics.fmean(r["round1-update-norm"][n]
                                          / dense[r["seed"]]["round1-update-norm"][n]
                                          for r in paired), 3) for n in SHARDED}
        out[arm] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=FMNIST)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--arms", nargs="+", default=ARMS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--per-node", type=int, default=6000)
    p.add_argument("--test", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # Flower's and fedshard's per-round lines
    bad = [a for a in args.arms if not (a == "dense" or _ARM.fullmatch(a))]
    if bad:
        p.error(f"--arms {bad}: expected dense or r<keep ratio>-<plain|dense>[-x<lr scale>]")
    arms = args.arms
    runs = []
    for seed in args.seeds:
        parts, test = load(args.data, args.nodes, args.per_node, args.test, seed)
        for arm in arms:
            runs.append(run(arm, parts, test, seed, args.rounds, args.lr))
            print(f"# {arm} seed {seed}: {runs[-1]['test-accuracy']}", file=sys.stderr)
    record = {
        "benchmark": "small_lr",
        "machine": {"cpu": cpu_name(), "python": platform.python_version(),
                    "threads": torch.get_num_threads()},
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "seeds": args.seeds,
        "setup": {"model": "lenet (no normalization)", "data": "fashion-mnist",
                  "nodes": args.nodes, "images-per-node": args.per_node, "test": args.test,
                  "rounds": args.rounds, "lr": args.lr, "momentum": 0.9, "batch-size": 32,
                  "local-epochs": 1, "method": "collective", "sharded-layers": list(SHARDED),
                  "server-lr-schedule": "constant"},
        "summary": summary(runs, args.rounds), "runs": runs}
    emit(record, args.out)


if __name__ == "__main__":
    main()
