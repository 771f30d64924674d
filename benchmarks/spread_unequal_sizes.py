"""Honest nodes holding unequal amounts of data against the spread bound (``max-update-spread``).

The spread bound shrinks a node's change of a layer (or dense entry) to κ times the round's
median change. With a fixed number of local epochs, a node holding more data takes more local
steps and moves further, so in a federation whose nodes hold very different amounts of data an
honest, data-rich node can pass κ × the median. This script measures how far honest nodes go
and what the bound does to them, on real Fashion-MNIST.

Each run is a whole run of fedshard's ServerApp code over the ``sequential`` engine
(:func:`fedshard_lab.engine.run_engine`: fedshard's own client handler, the ClientApp's
replies bit for bit), 10 honest nodes, the run-config defaults (Collective, keep ratios 0.2
and 0.4, one local epoch, batch 32) except the size (``--width``, ``--rounds``). The nodes'
examples are drawn at random without replacement from the first training images (IID, so only
the amount of data differs), in each profile of :data:`PROFILES`; each profile runs with the
default κ = 2, with κ = 5 and with the bound off (κ = 0) as the baseline
(``--max-weight-ratio`` sets that key for all of them). Prints one JSON object: per profile
and κ, the final test accuracy (first 1,000 test images), per round the largest change over
the round's median (``update-spread-max``) and the clipped (node, layer) pairs, and which
nodes were clipped with their number of examples (from the server's log).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/spread_unequal_sizes.py [--rounds 8]
[--width 64] [--profiles equal,20x,200x] [--max-weight-ratio 2]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench_engine import tensors, write_data  # noqa: E402
from machine import cpu_name  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from fedshard.app.config import RunConfig  # noqa: E402
from fedshard.app.task import client_dataset  # noqa: E402
from fedshard_lab.engine import run_engine  # noqa: E402

REAL = Path("/usr/share/datasets/fashion-mnist")
#: Examples per node: equal, a 20× spread and a 200× spread (about 14,000 in all each).
PROFILES: dict[str, list[int]] = {
    "equal": [1388] * 10,
    "20x": [100, 150, 200, 300, 400, 600, 800, 1000, 1500, 2000],
    "200x": [30, 50, 100, 200, 400, 600, 1000, 2000, 3500, 6000],
}
_CLIPPED = re.compile(r"Round (\d+): node (\d+) changed more than max-update-spread")
#: the round's INFO line for the shrunk nodes not named as out of line
#: ("... shrunk to it (node: largest change over the median: 4: 2.1x, 9: 3.05x)")
_NEAR = re.compile(r"Round (\d+): \d+ node\(s\) changed a few layers or entries more than "
                   r"max-update-spread.*largest change over the median: ([^)]*)\)")


class _Clipped(logging.Handler):
    """Collects (round, node) from the server's spread-bound log lines (INFO and WARNING)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _CLIPPED.search(record.getMessage())
        if match:
            self.seen.append((int(match.group(1)), int(match.group(2))))
        near = _NEAR.search(record.getMessage())
        if near:
            self.seen.extend((int(near.group(1)), int(item.split(":")[0]))
                             for item in near.group(2).split(", "))


def one_run(settings: dict[str, Any], name: str, kappa: float,
            pool: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    sizes = PROFILES[name]
    order = np.random.default_rng([int(settings["seed"]), 0]).permutation(len(pool[0]))
    starts = np.concatenate([[0], np.cumsum(sizes)])

    def data(pid: int, num: int) -> TensorDataset:
        idx = torch.from_numpy(order[starts[pid]:starts[pid + 1]])
        return TensorDataset(pool[0][idx], pool[1][idx])

    cfg = RunConfig.from_mapping({**settings, "max-update-spread": kappa,
                                  "run-name": f"{name}-kappa-{kappa:g}"})
    clipped = _Clipped()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(clipped)
    try:
        run_engine(cfg, len(sizes), engine="sequential", device="cpu", server_device="cpu",
                   data=data)
    finally:
        flwr_logger.removeHandler(clipped)
    rows = [json.loads(line) for line in
            (cfg.results_path / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if int(r.get("round", 0)) >= 1]
    nodes = sorted({node for _, node in clipped.seen})
    return {
        "test_accuracy": rounds[-1]["test-accuracy"],
        "spread_max_per_round": [round(float(r.get("update-spread-max", 0.0)), 2)
                                 for r in rounds],
        "clipped_pairs_per_round": [int(r.get("clipped-update-spread", 0)) for r in rounds],
        "rounds_with_clipping": len({rnd for rnd, _ in clipped.seen}),
        # engine node ids are 1 + the partition index
        "clipped_nodes_examples": {str(n): sizes[n - 1] for n in nodes},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--max-weight-ratio", type=float, default=None,
                    help="run-config max-weight-ratio (default: the run config's default)")
    args = ap.parse_args()
    profiles = args.profiles.split(",")
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        raise SystemExit(f"--profiles: {unknown} unknown; expected some of {list(PROFILES)}")
    torch.set_num_threads(1)
    for handler in logging.getLogger("flwr").handlers:  # the bound's lines are counted
        handler.setLevel(logging.WARNING)
    n_train = max(sum(PROFILES[p]) for p in profiles)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_data("fmnist", root / "data", n_train, 1000, REAL)
        settings = {
            "dataset": "fashion-mnist", "data-dir": str(root / "data"), "model": "mlp",
            "model-width": args.width, "num-server-rounds": args.rounds,
            "num-partitions": 10, "min-available-nodes": 10, "fraction-train": 1.0,
            "fraction-evaluate": 0.0, "test-max-examples": 1000, "seed": 0,
            # the mix the committed record was measured with (the app's default then)
            "keep-ratios": "0.2:0.6,0.4:0.4",
            "client-device": "cpu", "server-device": "cpu", "cuda-graph": False,
            "results-dir": str(root / "out"), "overwrite": True,
            **({} if args.max_weight_ratio is None
               else {"max-weight-ratio": args.max_weight_ratio}),
        }
        pool = tensors(client_dataset(RunConfig.from_mapping(
            {**settings, "num-partitions": 1, "min-available-nodes": 1}), 0, 1))
        out: dict[str, Any] = {}
        for name in profiles:
            out[name] = {"examples_per_node": PROFILES[name],
                         **{f"kappa_{k:g}": one_run(settings, name, k, pool) for k in (2, 5, 0)}}
    print(json.dumps({
        "device": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "width": args.width,
        "profiles": out,
    }))


if __name__ == "__main__":
    main()
