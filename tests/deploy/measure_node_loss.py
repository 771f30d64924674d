"""Lose a SuperNode in the middle of a run and add it again (docs/deployment.md, "Losing
and re-adding nodes").

Usage: python tests/deploy/measure_node_loss.py [kill] [term] [--out FILE]

A SuperLink and three SuperNodes on 127.0.0.1 (:class:`deploy_cluster.LocalDeployment`) run the
MLP with ``min-available-nodes = 2`` and ``round-timeout = 60``. While round 2's training is in
flight one node is stopped (``kill``: SIGKILL to the SuperNode and everything it started, as a
crash or a power cut; ``term``: SIGTERM to the SuperNode, as Ctrl-C). The script prints how
long round 2 then took and what its metrics say (replies used, dropped, missing), restarts the
node with its own command, and prints the round it trained in again. Stops everything it
started. Each mode given runs in turn, in a deployment of its own; ``--out`` also writes one
JSON record of them all (with the machine, torch and Flower versions, the date and the
command) there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import flwr
from deploy_cluster import LocalDeployment
from machine import emit, provenance

from fedshard_lab.experiments.launch import _children

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
KEYS = ("replies-used", "replies-dropped", "replies-missing", "nodes-sent")


def _rows(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    return [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]


def _wait_round(metrics: Path, k: int, timeout_s: float, dep: LocalDeployment) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if any(r["round"] >= k for r in _rows(metrics)):
            return time.monotonic()
        time.sleep(0.2)
    raise TimeoutError(f"round {k} not recorded after {timeout_s} s\n{dep.tails()}")


def measure(mode: str) -> dict[str, object]:
    """One deployment, one node stopped by ``mode`` (kill or term) and started again; what
    round 2 and the restarted node did."""
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp, \
            LocalDeployment(Path(tmp) / "deploy") as dep:
        results = Path(tmp) / "results"
        dep.start_superlink()
        configs = [{"keep-ratio": 0.5, "data-dir": str(FMNIST), "partition-id": i,
                    "num-partitions": 60} for i in range(3)]
        for i, config in enumerate(configs):
            dep.start_supernode(f"node-{i}", config)
        dep.wait_online(3)
        overrides = dep.root / "run-config.toml"
        overrides.write_text(
            'model = "mlp"\nmodel-width = 32\nnum-server-rounds = 6\nmin-available-nodes = 2\n'
            'num-partitions = 60\ntest-max-examples = 100\nbatch-size = 64\nround-timeout = 60\n'
            f'results-dir = "{results}"\nrun-name = "loss"\n')
        submit = dep.flwr("run", str(ROOT), dep.connection, "--run-config", str(overrides),
                          cwd=ROOT, timeout_s=120)
        assert submit.returncode == 0, submit.stdout
        metrics = results / "loss" / "metrics.jsonl"
        _wait_round(metrics, 1, 300, dep)
        victim = dep.nodes[2]
        # round 2's train message reached the victim: its ClientApp is running
        while victim.count("Receiving: train message") < 2:
            time.sleep(0.1)
        t0 = time.monotonic()
        if mode == "kill":
            family, todo = [], [victim.popen.pid]
            tree = _children()
            while todo:
                pid = todo.pop()
                family.append(pid)
                todo.extend(tree.get(pid, []))
            for pid in family:
                os.kill(pid, signal.SIGKILL)
        else:
            victim.popen.send_signal(signal.SIGTERM)
        victim.popen.wait(timeout=60)
        t2 = _wait_round(metrics, 2, 900, dep)
        row = next(r for r in _rows(metrics) if r["round"] == 2)
        record: dict[str, object] = {
            "mode": mode, "round-2-recorded-after-stop-s": round(t2 - t0, 1),
            **{k: row.get(k) for k in KEYS},
            **{k: v for k, v in row.items() if k.startswith("dropped-")}}
        print(f"{mode}: round 2 recorded {t2 - t0:.1f} s after the node was stopped; "
              + ", ".join(f"{k}={row.get(k)}" for k in KEYS)
              + "; " + ", ".join(f"{k}={v}" for k, v in row.items() if k.startswith("dropped-")),
              flush=True)
        restarted = dep.start_supernode("node-2-again", configs[2])
        t3 = time.monotonic()
        while restarted.count("Receiving: train message") < 1:
            if time.monotonic() - t3 > 600:
                raise TimeoutError(dep.tails())
            time.sleep(0.2)
        trained_in = max(r["round"] for r in _rows(metrics)) + 1
        record.update({"restarted-node-queries": restarted.count("Receiving: query"),
                       "restarted-node-trains-in-round": trained_in,
                       "restarted-node-trains-after-start-s": round(time.monotonic() - t3, 1)})
        print(f"restarted: asked for its keep ratio {restarted.count('Receiving: query')} "
              f"time(s), trains again in round {trained_in}, "
              f"{time.monotonic() - t3:.1f} s after its start", flush=True)
        log = dep.flwr("log", submit.stdout.split("Successfully started run ")[1].split()[0],
                       dep.connection, "--show", timeout_s=60)
        lines = [x for x in log.stdout.splitlines() if "Round 2" in x or "node" in x.lower()]
        print("\n".join(lines[:20]))
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modes", nargs="*", choices=("kill", "term"), default=["kill"])
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    runs = [measure(mode) for mode in args.modes]
    emit({**provenance(), "flwr": flwr.__version__, "nodes": 3, "min-available-nodes": 2,
          "round-timeout": 60, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
