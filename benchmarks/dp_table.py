"""What central differential privacy costs in accuracy: Fashion-MNIST, ε ∈ {1, 4, 8} at
δ = 1e-5, three methods, three seeds.

The methods, every one on the same model family (fedshard's MLP, ``--width`` hidden units,
three layers), the same node partitions (fedshard's own: ``client_dataset``, IID over
``--nodes`` nodes of ``--train / --nodes`` images), the same initial model, recipe and seeds:

* ``dense-fedavg``: Flower's ``FedAvg`` of the dense model, with ``--dp`` wrapped in Flower's
  ``DifferentialPrivacyServerSideFixedClipping`` (σ from Opacus's ``get_noise_multiplier``
  for the same ε, δ, rounds and sampling rate); the node trains with a plain SGD loop (the
  recipe below: what fedshard's node does for a dense model without factors);
* ``collective``: fedshard's ``SpectralSharding`` (Collective, keep ratios ``--keep-ratios``)
  through fedshard's app (``run_server``) on the in-process engine of ``fedshard_lab``, with
  fedshard's central DP (``dp-target-epsilon``, ``dp-clipping-norm``);
* ``heterofl``: fedshard's ``WidthSlicing`` (HeteroFL, widths of the spectral sub-models'
  FLOPs) the same way.

Each method also runs without DP (the reference row). Every round samples ``--fraction`` of
the nodes (the sampling rate q of the accountant). The score is the test accuracy of the last
round (central evaluation on ``--test`` test images), and the ε the run reports spent.
One process, one torch thread (``OMP_NUM_THREADS=1``). Prints one JSON object (through
``benchmarks/machine.py``: machine, versions, date, command, the size); ``--out FILE`` also
writes it; ``--markdown FILE`` prints the docs' tables from a saved output, ``--merge A B C``
one record from the outputs of one process per seed. Usage::

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/dp_table.py \\
        --out results/privacy/dp_table.json [--seeds 0 1 2] [--epsilons 1 4 8] [--rounds 4]
    # or one process per seed, then
    python benchmarks/dp_table.py --merge seed0.json seed1.json seed2.json --out OUT.json
    python benchmarks/dp_table.py --markdown results/privacy/dp_table.json
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from fakedata import write_idx  # noqa: E402
from flower_grid import InProcessGrid  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import (  # noqa: E402
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)
from machine import emit, provenance  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fedshard.app.config import RunConfig  # noqa: E402
from fedshard.app.task import build_model, client_dataset  # noqa: E402
from fedshard.client.train import evaluate  # noqa: E402
from fedshard.data import load_test_set  # noqa: E402
from fedshard.server.central_dp import noise_multiplier_for, spent_epsilon  # noqa: E402
from fedshard_lab.engine import run_engine  # noqa: E402

REAL = Path("/usr/share/datasets/fashion-mnist")
METHODS = ("dense-fedavg", "collective", "heterofl")
#: Collective with DP and ``dp-min-holders`` (``--min-holders``): the rows' name
HOLDERS = "collective-min-holders-{}"


def subset(folder: Path, n_train: int, n_test: int) -> Path:
    """The first ``n_train`` / ``n_test`` images of the real Fashion-MNIST files."""
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        for kind in ("images-idx3", "labels-idx1"):
            name = f"{prefix}-{kind}-ubyte.gz"
            raw = gzip.decompress((REAL / name).read_bytes())
            ndim = raw[3]
            shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
            arr = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
            write_idx(folder / name, np.ascontiguousarray(arr[:n]))
    return folder


def run_config(args: argparse.Namespace, data: Path, seed: int, method: str,
               epsilon: float | None, results: Path, min_holders: int = 1) -> dict[str, Any]:
    """The run config of one cell (fedshard's app keys)."""
    cfg: dict[str, Any] = {
        "method": "collective" if method == "dense-fedavg" else method,
        "model": "mlp", "model-width": args.width, "dataset": "fashion-mnist",
        "data-dir": str(data), "download": False, "keep-ratios": args.keep_ratios,
        "num-server-rounds": args.rounds, "fraction-train": args.fraction,
        "lr": args.lr, "lr-schedule": "constant", "local-epochs": 1, "batch-size": 32,
        "dirichlet-alpha": 1000.0, "seed": seed, "results-dir": str(results),
        "run-name": "run", "min-available-nodes": args.nodes, "client-device": "cpu",
        "server-device": "cpu", "eval-every": args.rounds}
    if epsilon is not None:
        cfg.update({"dp-target-epsilon": epsilon, "dp-target-delta": args.delta,
                    "dp-clipping-norm": args.clip, "dp-min-holders": min_holders})
    return cfg


def run_fedshard(args: argparse.Namespace, data: Path, seed: int, method: str,
                 epsilon: float | None, min_holders: int = 1) -> dict[str, Any]:
    """One cell of a fedshard method through its app on the in-process engine."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig.from_mapping(run_config(args, data, seed, method, epsilon, Path(tmp),
                                                min_holders))
        run_engine(cfg, args.nodes)
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text()
                .splitlines()]
    acc = [r["test-accuracy"] for r in rows if "test-accuracy" in r and r.get("round", 0) > 0]
    eps = [r["dp-epsilon"] for r in rows if "dp-epsilon" in r]
    sigma = [r["dp-noise-multiplier"] for r in rows if "dp-noise-multiplier" in r]
    fewest = [r["dp-fewest-holders"] for r in rows if "dp-fewest-holders" in r]
    out = {"accuracy": round(float(acc[-1]), 4)}
    if eps:
        out.update({"epsilon-spent": round(float(eps[-1]), 3),
                    "noise-multiplier": round(float(sigma[-1]), 4),
                    "fewest-holders": min(fewest) if fewest else None})
    return out


def run_dense(args: argparse.Namespace, data: Path, seed: int,
              epsilon: float | None) -> dict[str, Any]:
    """One cell of dense FedAvg: Flower's strategy (and DP wrapper), a plain ClientApp."""
    cfg = RunConfig.from_mapping(run_config(args, data, seed, "dense-fedavg", None,
                                            Path(tempfile.gettempdir())))
    initial = build_model(cfg)
    test = load_test_set("fashion-mnist", data_dir=str(data))
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid, num = int(context.node_config["partition-id"]), args.nodes
        server_round = int(msg.content["config"]["server-round"])
        model = copy.deepcopy(initial)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        dataset = client_dataset(cfg, pid, num)
        loader = DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator()
                            .manual_seed(seed * 1_000_003 + server_round * 1009 + pid))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        model.train()
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": len(dataset)})}),
                       reply_to=msg)

    accuracy: dict[int, float] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round != args.rounds:  # the score is the last round's, as for the others
            return None
        model = copy.deepcopy(initial)
        model.load_state_dict(arrays.to_torch_state_dict())
        accuracy[server_round] = evaluate(model, DataLoader(test, batch_size=500)).accuracy
        return MetricRecord({"test-accuracy": accuracy[server_round]})

    sampled = max(int(args.nodes * args.fraction), 2)
    strategy: FedAvg = FedAvg(fraction_train=args.fraction, fraction_evaluate=0.0,
                              min_train_nodes=2, min_available_nodes=args.nodes)
    out: dict[str, Any] = {}
    if epsilon is not None:
        sigma = noise_multiplier_for(epsilon, args.delta, sampled / args.nodes, args.rounds)
        strategy = DifferentialPrivacyServerSideFixedClipping(  # type: ignore[assignment]
            strategy, noise_multiplier=sigma, clipping_norm=args.clip,
            num_sampled_clients=sampled)
        out = {"epsilon-spent": round(spent_epsilon(
            [(sigma, sampled / args.nodes, args.rounds)], args.delta), 3),
            "noise-multiplier": round(sigma, 4)}
    grid = InProcessGrid(app, [{"partition-id": i, "num-partitions": args.nodes}
                               for i in range(args.nodes)])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        np.random.seed(seed)  # noqa: NPY002 - Flower's noise: numpy's global RNG
        strategy.start(grid=grid, initial_arrays=ArrayRecord(initial.state_dict()),
                       num_rounds=args.rounds, train_config=ConfigRecord({}),
                       evaluate_fn=evaluate_fn)
    return {"accuracy": round(float(accuracy[args.rounds]), 4), **out}


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method and ε: the mean and the per-seed accuracies, and the paired difference to
    the method's no-DP run of the same seed."""
    out: dict[str, Any] = {}
    for method in dict.fromkeys(c["method"] for c in cells):
        plain = "collective" if method.startswith("collective") else method
        base = {c["seed"]: c["accuracy"] for c in cells
                if c["method"] == plain and c["epsilon"] is None}
        for eps in dict.fromkeys(c["epsilon"] for c in cells):
            mine = [c for c in cells if c["method"] == method and c["epsilon"] == eps]
            if not mine:
                continue
            row = {"accuracy-mean": round(statistics.fmean(c["accuracy"] for c in mine), 4),
                   "accuracy": [c["accuracy"] for c in mine]}
            if eps is not None:
                row["minus-no-dp"] = [round(c["accuracy"] - base[c["seed"]], 4)
                                      for c in mine if c["seed"] in base]
                row["epsilon-spent"] = [c.get("epsilon-spent") for c in mine]
            out[f"{method}/{'no-dp' if eps is None else f'eps-{eps:g}'}"] = row
    return out


#: the docs' names of the rows
LABELS = {"dense-fedavg": "dense FedAvg, Flower's `DifferentialPrivacyServerSideFixedClipping`",
          "collective": "Collective (spectral), fedshard's central DP",
          "heterofl": "HeteroFL (width), fedshard's central DP"}


def markdown(record: dict[str, Any]) -> str:
    """The docs' tables from a record of this script: per method, the test accuracy (%) after
    the last round without DP and at each ε, the mean over the seeds and each seed's; then per
    ε the noise multiplier σ, the largest ε a run reports spent and Collective's fewest
    holders of a term."""
    cells, size = record["cells"], record["size"]
    epsilons = size["epsilons"]
    methods = list(dict.fromkeys(c["method"] for c in cells))

    def cell(method: str, eps: float | None) -> str:
        mine = [c["accuracy"] for c in cells if c["method"] == method and c["epsilon"] == eps]
        if not mine:
            return "-"
        seeds = ", ".join(f"{100 * a:.1f}" for a in mine)
        return f"{100 * statistics.fmean(mine):.1f} ({seeds})"

    def label(method: str) -> str:
        if method in LABELS:
            return LABELS[method]
        m0 = method.rsplit("-", 1)[1]
        return f"Collective, fedshard's central DP with `dp-min-holders = {m0}`"

    head = ["| method | no DP | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |",
            "|---|---|" + "---|" * len(epsilons)]
    rows = [f"| {label(m)} | {cell(m, None)} | " + " | ".join(cell(m, e) for e in epsilons)
            + " |" for m in methods]
    second = ["| ε (δ = " + f"{size['delta']:g}) | σ | largest ε spent | Collective's fewest "
              "holders of a term |", "|---|---|---|---|"]
    for e in epsilons:
        mine = [c for c in cells if c["epsilon"] == e]
        sigma = {c["noise-multiplier"] for c in mine}
        fewest = [c["fewest-holders"] for c in mine if c["method"] == "collective"]
        holders = f"{min(fewest):g}" if fewest else "-"
        second.append(f"| {e:g} | {', '.join(f'{s:g}' for s in sorted(sigma))} | "
                      f"{max(c['epsilon-spent'] for c in mine):g} | {holders} |")
    return "\n".join(head + rows) + "\n\n" + "\n".join(second)


def merge(paths: list[Path]) -> dict[str, Any]:
    """One record from complete records of the same size run with other seeds (one process
    per seed): their cells, the summary recomputed; ``parts`` keeps each part's command,
    date, load average and wall time, the top level this process's provenance.

    Raises
    ------
    SystemExit
        If a part is incomplete, the sizes differ or seeds overlap.
    """
    parts = [json.loads(p.read_text()) for p in paths]
    seeds: list[int] = []
    for path, part in zip(paths, parts, strict=True):
        if not part.get("complete") or part["size"] != parts[0]["size"]:
            raise SystemExit(f"--merge {path}: expected a complete record of the same size "
                             "as the first; nothing was merged")
        if set(part["seeds"]) & set(seeds):
            raise SystemExit(f"--merge {path}: seeds {part['seeds']} overlap {seeds}; "
                             "nothing was merged")
        seeds += part["seeds"]
    cells = [c for part in parts for c in part["cells"]]
    return {"benchmark": "dp_table", **provenance(), "complete": True, "seeds": seeds,
            "size": parts[0]["size"], "dp": parts[0]["dp"],
            "parts": [{k: part[k] for k in ("command", "date", "load-average", "wall-s",
                                             "seeds")} for part in parts],
            "wall-s": max(part["wall-s"] for part in parts),
            "summary": summary(cells), "cells": cells}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 4.0, 8.0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=0.5, help="S, the clipping norm")
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--train", type=int, default=10000)
    p.add_argument("--test", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--keep-ratios", default="0.25:0.5,0.5:0.5")
    p.add_argument("--min-holders", type=int, nargs="*", default=[10],
                   help="also Collective with DP and these dp-min-holders")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None,
                   help="print the docs' tables from this saved output; run nothing")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="merge complete outputs of other seeds (one process per seed)")
    args = p.parse_args()
    if args.markdown is not None:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    if args.merge is not None:
        emit(merge(args.merge), args.out)
        return
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # Flower's and fedshard's per-round lines
    cells: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def record(complete: bool) -> dict[str, Any]:
        return {
            "benchmark": "dp_table", **provenance(), "complete": complete, "seeds": args.seeds,
            "size": {"dataset": "fashion-mnist",
                     "model": f"mlp (fedshard's, width {args.width})",
                     "nodes": args.nodes, "train-images": args.train, "test-images": args.test,
                     "partition": "IID (Dirichlet alpha 1000)", "rounds": args.rounds,
                     "sampling-rate": args.fraction, "local-epochs": 1, "batch-size": 32,
                     "lr": args.lr, "lr-schedule": "constant", "momentum": 0.9,
                     "keep-ratios": args.keep_ratios, "clipping-norm": args.clip,
                     "min-holders": args.min_holders,
                     "score": "test accuracy after the last round",
                     "sharded-layers": f"the hidden {args.width}x{args.width} layer (all but "
                                       "the first and last)",
                     "delta": args.delta, "epsilons": args.epsilons},
            "dp": {"dense-fedavg": "Flower DifferentialPrivacyServerSideFixedClipping, sigma "
                                   "from Opacus get_noise_multiplier (RDP)",
                   "collective": "fedshard Privacy (central DP per term)",
                   "collective-min-holders-<m>": "the same, terms held by fewer than m "
                                                 "replies keep their value (dp-min-holders)",
                   "heterofl": "fedshard Privacy (central DP per element)"},
            "wall-s": round(time.perf_counter() - t0, 1),
            "summary": summary(cells), "cells": cells}

    def progress() -> None:  # what is done so far, in case the run is cut short
        print(f"# {cells[-1]}", file=sys.stderr)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record(False), indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        data = subset(Path(tmp) / "fmnist", args.train, args.test)
        for seed in args.seeds:
            for method in args.methods:
                for eps in [None, *args.epsilons]:
                    start = time.perf_counter()
                    cell = (run_dense(args, data, seed, eps) if method == "dense-fedavg"
                            else run_fedshard(args, data, seed, method, eps))
                    cells.append({"method": method, "epsilon": eps, "seed": seed, **cell,
                                  "s": round(time.perf_counter() - start, 1)})
                    progress()
                if method != "collective":
                    continue
                for m0 in args.min_holders:
                    for eps in args.epsilons:
                        start = time.perf_counter()
                        cell = run_fedshard(args, data, seed, method, eps, m0)
                        cells.append({"method": HOLDERS.format(m0), "epsilon": eps,
                                      "seed": seed, **cell,
                                      "s": round(time.perf_counter() - start, 1)})
                        progress()
    emit(record(True), args.out)


if __name__ == "__main__":
    main()
