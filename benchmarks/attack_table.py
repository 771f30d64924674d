"""Whole-run attack table: final test accuracy on real Fashion-MNIST with dishonest nodes.

Each cell is one whole run of fedshard's real ServerApp (:func:`fedshard.app.run.run_server`)
and ClientApp over the in-process grid (``tests/flower_grid.py``: real ``Message``s, every
message deep-copied as if serialized), 10 nodes, the run-config defaults except the size
(``--width``, ``--rounds``, ``--train``, ``--test``). ``--attackers`` nodes (the first ones)
answer every training message dishonestly, each attack within the bounds the server checks:

* ``sign-flip``: factors ``U, V -> -U, -V`` (each node's ``UVᵀ`` unchanged, update ratio 2);
* ``x1e3`` / ``x-1e3``: factors times 1e3 / -1e3 (clipped at ``max-update-ratio``);
* ``replay``: the arrays of the node's first reply, sent again in a fresh reply each round
  (this round's indices and ``server-round`` echo, so the framing checks pass);
* ``num-examples``: honest arrays, ``num-examples = 2**53`` (the largest accepted);
* ``num-examples+sign``: both;
* ``noise``: every array's update replaced by Gaussian noise of the same norm;
* ``gauge``: ``U, V -> 10 U, V / 10`` (``UVᵀ`` unchanged, update ratio 9).

Each defence is a set of run-config keys on top of the defaults (:data:`DEFENCES`;
``--defences`` picks them by name, default ``paper-mean,default,median,drop``): ``paper-mean``
turns alignment and the spread bound off (the paper's plain averages), ``fedmedian`` and
``krum`` are Flower's rules over the dense-equivalent models. Prints one JSON object: the
size, and per defence its clean run and, per attack and attacker count, the final test
accuracy with the round metrics that show the defences at work (summed counts, largest
ratios). The table and its finding are in ``docs/robustness.md``.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/attack_table.py [--attacks a,b] [--defences d,e]
[--attackers 1,3] [--rounds 8] [--width 64] [--train 6000] [--test 1000]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from fakedata import write_idx  # noqa: E402
from flower_grid import InProcessGrid  # noqa: E402
from flwr.app import Array, Context, Message  # noqa: E402

import client_app  # noqa: E402
from fedshard import protocol as P  # noqa: E402
from fedshard.app.config import RunConfig  # noqa: E402
from fedshard.app.run import run_server  # noqa: E402

REAL = Path("/usr/share/datasets/fashion-mnist")
N_NODES = 10

#: defence name -> run-config keys
DEFENCES: dict[str, dict[str, Any]] = {
    "paper-mean": {"align-factors": False, "max-update-spread": 0.0},  # the averages alone
    "default": {},
    "align-only": {"max-update-spread": 0.0},
    "spread-3": {"max-update-spread": 3.0},
    "spread-10": {"max-update-spread": 10.0},
    "median": {"aggregation": "median"},
    "trimmed-mean": {"aggregation": "trimmed-mean", "trim-fraction": 0.34},
    "drop": {"update-policy": "drop"},
    "weight-ratio-2": {"max-weight-ratio": 2.0},
    "weight-ratio-1": {"max-weight-ratio": 1.0},
    # Flower's own rules over each reply's dense-equivalent model, nothing else added
    "fedmedian": {"aggregation": "dense-median", "align-factors": False,
                  "max-update-spread": 0.0},
    "krum": {"aggregation": "krum", "trim-fraction": 0.3, "align-factors": False,
             "max-update-spread": 0.0},
}

Attack = Callable[[Message, Message, dict[str, Any]], Message]


def _factor(key: str) -> bool:
    return key.endswith((".u", ".v"))


def _map_arrays(reply: Message, fn: Callable[[str, np.ndarray], np.ndarray]) -> Message:
    rec = reply.content[P.ARRAYS]
    for k in list(rec.keys()):
        x = rec[k].numpy()
        if np.issubdtype(x.dtype, np.floating):
            rec[k] = Array(np.ascontiguousarray(fn(k, x)).astype(x.dtype))
    return reply


def _scale(factor: float) -> Attack:
    return lambda sent, reply, memo: _map_arrays(
        reply, lambda k, x: x * factor if _factor(k) else x)


def _gauge(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    return _map_arrays(reply, lambda k, x: x * 10 if k.endswith(".u")
                       else x / 10 if k.endswith(".v") else x)


def _replay(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    first = memo.setdefault("first", {k: a.numpy().copy()
                                      for k, a in reply.content[P.ARRAYS].items()})
    return _map_arrays(reply, lambda k, x: first[k] if first[k].shape == x.shape else x)


def _big_n(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    reply.content[P.METRICS][P.NUM_EXAMPLES] = 2**53
    return reply


def _noise(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    rng = np.random.default_rng([7, len(memo.setdefault("calls", [])) + 1])
    memo["calls"].append(1)
    before = sent.content[P.ARRAYS]

    def fn(k: str, x: np.ndarray) -> np.ndarray:
        s = before[k].numpy().astype(np.float64)
        norm = np.linalg.norm(x - s)
        z = rng.normal(size=x.shape)
        return s + z * (norm / max(np.linalg.norm(z), 1e-30))

    return _map_arrays(reply, fn)


ATTACKS: dict[str, Attack] = {
    "sign-flip": _scale(-1.0),
    "x1e3": _scale(1e3),
    "x-1e3": _scale(-1e3),
    "replay": _replay,
    "num-examples": _big_n,
    "num-examples+sign": lambda s, r, m: _scale(-1.0)(s, _big_n(s, r, m), m),
    "noise": _noise,
    "gauge": _gauge,
}


class _Dishonest:
    """A ClientApp stand-in: the real ClientApp, then ``attack`` on the train replies of
    ``nodes`` (the grid calls ``app(message, context)``)."""

    def __init__(self, attack: Attack | None, nodes: set[int]) -> None:
        self.attack, self.nodes = attack, nodes
        self.memo: dict[int, dict[str, Any]] = {}

    def __call__(self, msg: Message, context: Context) -> Message:
        reply = client_app.app(msg, context)
        if (self.attack is None or context.node_id not in self.nodes
                or msg.metadata.message_type != "train" or reply.has_error()):
            return reply
        return self.attack(msg, reply, self.memo.setdefault(context.node_id, {}))


def _subset(folder: Path, n_train: int, n_test: int) -> Path:
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


def run_cell(root: Path, data: Path, base: dict[str, Any], attack: str | None,
             attackers: int) -> dict[str, float]:
    cfg = {**base, "results-dir": str(root), "run-name": "run"}
    app = _Dishonest(ATTACKS[attack] if attack else None,
                     {1000 + i for i in range(attackers)})
    grid = InProcessGrid(app, [{"partition-id": i, "num-partitions": N_NODES}
                               for i in range(N_NODES)], cfg)
    t0 = time.perf_counter()
    summary = run_server(grid, RunConfig.from_mapping(cfg))
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    seen = {k: max(r.get(k, 0.0) for r in rows) for k in (
        "update-spread-max", "update-ratio-max")}
    counts = {k: sum(r.get(k, 0.0) for r in rows) for k in (
        "re-signed-terms", "rebalanced-terms", "clipped-update-spread", "clipped-update-norm",
        "clipped-num-examples")}
    return {"accuracy": round(float(summary["final-test-accuracy"]), 4),
            **{k: round(v, 3) for k, v in seen.items() if v},
            **{k: v for k, v in counts.items() if v}, "s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--defences", default="paper-mean,default,median,drop")
    ap.add_argument("--attackers", default="1,3")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # the runs' own warnings are what they count; quiet here
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in attacks if a not in ATTACKS] + [
        d for d in args.defences.split(",") if d not in DEFENCES]
    if unknown:
        raise SystemExit(f"unknown attack or defence {unknown}; expected attacks from "
                         f"{list(ATTACKS)}, defences from {list(DEFENCES)}")
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "size": {"nodes": N_NODES, "rounds": args.rounds, "model": f"mlp width {args.width}",
                 "train-examples": args.train, "test-examples": args.test,
                 "dirichlet-alpha": "the data set's paper value", "seed": args.seed},
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = _subset(Path(tmp) / "data", args.train, args.test)
        base = {"dataset": "fashion-mnist", "data-dir": str(data), "model": "mlp",
                "model-width": args.width, "num-server-rounds": args.rounds,
                "num-partitions": N_NODES, "min-available-nodes": N_NODES,
                "test-max-examples": args.test, "eval-every": args.rounds, "seed": args.seed}
        cell = 0
        for name in args.defences.split(","):
            cfg = {**base, **DEFENCES[name]}
            rows: dict[str, Any] = {"keys": DEFENCES[name]}
            cell += 1
            rows["clean"] = run_cell(Path(tmp) / f"c{cell}", data, cfg, None, 0)
            for attack in attacks:
                for k in (int(x) for x in args.attackers.split(",")):
                    cell += 1
                    rows[f"{attack}/{k}"] = run_cell(Path(tmp) / f"c{cell}", data, cfg,
                                                     attack, k)
                    print(name, attack, k, rows[f"{attack}/{k}"], file=sys.stderr)
            out["results"][name] = rows
    out["wall-s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
