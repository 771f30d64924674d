"""A round of the default run with each client's data prepared once per process vs every round.

The ClientApp reads its partition and standardizes its images (``fedshard.app.task
.client_dataset``); it keeps them per process, so a node that trains every round prepares them
in its first round only. ``FEDSHARD_CLIENT_DATA_CACHE_BYTES=0`` turns the keeping off: every
message reads and standardizes its partition again, as fedshard did before (the baseline).
The workload is ``flwr run .``'s defaults (``pyproject.toml``: MLP width 256, Fashion-MNIST in
10 partitions of ~6,000 images, every node trains every round, Collective at r = 0.2 / 0.4)
for ``--rounds`` rounds, run both ways side by side:

* ``in_process``: the ServerApp's ``run_server`` over the tests' in-process grid of real
  ClientApps (one process, one thread);
* ``flwr_run`` (with ``--flwr-run``): ``flwr run .`` (Ray simulation, its own SuperLink), the
  cache setting passed to Ray's workers through the environment; wrapped in
  ``/tmp/fedshard-flwr.lock`` (one ``flwr run`` per machine at a time).

``client_data`` times the part that changed alone: a round's data preparation for the 10
partitions, every message preparing its own vs taken from the process (interleaved repeats).

Prints one JSON object: per way, ``round_s`` (rounds 2.. from ``metrics.jsonl``'s ``round-s``;
round 1 prepares the data either way), its median, ``first_round_s`` and ``wall_s``, the
median per-round saving, and ``same_model``: whether both final models are equal bit for bit.

Usage: ``python benchmarks/bench_client_data.py [--rounds 3] [--flwr-run] [--data-only]
[--repeats 5]``
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from machine import cpu_name  # noqa: E402

ENV = "FEDSHARD_CLIENT_DATA_CACHE_BYTES"
LOCK = Path("/tmp/fedshard-flwr.lock")



def model_hash(path: Path) -> str:
    state = torch.load(path, weights_only=True)
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def default_config(rounds: int, out: Path, name: str) -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        cfg = dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])
    cfg.update({"num-server-rounds": rounds, "results-dir": str(out), "run-name": name})
    return cfg


def summarize(run_dir: Path, wall_s: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if r["round"] >= 1]
    later = [r["round-s"] for r in rounds[1:]]
    return {"first_round_s": rounds[0]["round-s"], "round_s": later,
            "median_round_s": statistics.median(later), "wall_s": wall_s,
            "model_sha256": model_hash(run_dir / "model.pt")}


@contextlib.contextmanager
def cache_setting(value: str | None) -> Any:
    old = os.environ.get(ENV)
    if value is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def in_process(rounds: int, out: Path, name: str, cache: str | None) -> dict[str, Any]:
    from flower_grid import InProcessGrid

    import client_app
    from fedshard.app import task
    from fedshard.app.config import RunConfig
    from fedshard.app.run import run_server

    cfg = default_config(rounds, out, name)
    task._DATASETS.clear()  # each way starts as a fresh process would
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions":
                                           cfg["num-partitions"]}
                                          for i in range(cfg["num-partitions"])], cfg)
    start = time.perf_counter()
    with cache_setting(cache):
        run_server(grid, RunConfig.from_mapping(cfg))
    result = summarize(out / name, time.perf_counter() - start)
    task._DATASETS.clear()
    return result


def flwr_run(rounds: int, out: Path, name: str, cache: str | None) -> dict[str, Any]:
    from fedshard_lab.experiments.launch import run_simulation

    cfg = default_config(rounds, out, name)
    env = {} if cache is None else {ENV: cache}
    LOCK.touch(exist_ok=True)
    with LOCK.open() as lock, cache_setting(cache):
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = run_simulation(ROOT, cfg, num_supernodes=cfg["num-partitions"],
                             flwr_home=out / f"flwr-{name}", env=env, timeout_s=1800)
    if run.returncode != 0:
        raise RuntimeError(f"flwr run ({name}) failed:\n{run.output[-3000:]}")
    return summarize(out / name, run.wall_s)


def client_data(repeats: int) -> dict[str, Any]:
    """A round's data preparation alone, the default run's 10 partitions: every message
    preparing its partition (``0``) vs taking it from the process (steady state), interleaved
    ``repeats`` times; the median per round."""
    from fedshard.app import task
    from fedshard.app.config import RunConfig

    cfg = RunConfig.from_mapping(default_config(2, Path("/tmp"), "unused"))
    every, once = [], []
    task._DATASETS.clear()
    for pid in range(cfg.num_partitions):  # round 1: the kept copies are made
        task.client_dataset(cfg, pid, cfg.num_partitions)
    for _ in range(repeats):
        for setting, times in (("0", every), (None, once)):
            with cache_setting(setting):
                start = time.perf_counter()
                for pid in range(cfg.num_partitions):
                    task.client_dataset(cfg, pid, cfg.num_partitions)
                times.append(time.perf_counter() - start)
            if setting == "0":  # the 0 setting dropped the kept copies: make them again
                for pid in range(cfg.num_partitions):
                    task.client_dataset(cfg, pid, cfg.num_partitions)
    task._DATASETS.clear()
    return {"every_round_s_per_round": statistics.median(every),
            "once_s_per_round": statistics.median(once), "repeats": repeats,
            "every_round_all": every, "once_all": once}


def side_by_side(way: Any, rounds: int, out: Path) -> dict[str, Any]:
    before = way(rounds, out, f"{way.__name__}-every-round", "0")
    after = way(rounds, out, f"{way.__name__}-once", None)
    return {"every_round": before, "once": after,
            "saving_s_per_round": before["median_round_s"] - after["median_round_s"],
            "speedup_per_round": before["median_round_s"] / after["median_round_s"],
            "same_model": before["model_sha256"] == after["model_sha256"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flwr-run", action="store_true", help="also through `flwr run .`")
    parser.add_argument("--data-only", action="store_true",
                        help="only the data preparation of a round (seconds, not minutes)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: need >= 2 (round 1 prepares the data anyway)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "workload": "flwr run . defaults (mlp width 256, fashion-mnist, 10 partitions, "
                    f"collective 0.2:0.6,0.4:0.4), {args.rounds} rounds",
        "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
        "threads": torch.get_num_threads()}
    result["client_data"] = client_data(args.repeats)
    with tempfile.TemporaryDirectory(prefix="bench-client-data-") as tmp:
        if not args.data_only:
            result["in_process"] = side_by_side(in_process, args.rounds, Path(tmp))
        if args.flwr_run:
            result["flwr_run"] = side_by_side(flwr_run, args.rounds, Path(tmp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
