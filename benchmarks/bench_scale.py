"""Server cost at scale: 1,000 SuperNodes with 100 sampled per round vs 100 with 10 sampled.

A federation of real ClientApps (the library's ``handle_query`` / ``handle_train`` on a tiny
MLP with 16 local examples each) runs in-process (``tests/flower_grid.py``: every message is
deep-copied as if serialized), so that the server's own work can be measured apart from Ray:
per round, the time spent in ``configure_train`` (node sampling, capability queries of new
nodes, SVD, probabilities, sampling, packing) and ``aggregate_train`` (validation,
aggregation, rebuild), and the peak of memory allocated inside them (tracemalloc, which sees
numpy's allocations). Round 1 also asks every node for its keep ratio; it is reported apart.

Prints one JSON object with ``server_time_ratio_1000_vs_100`` (steady-state rounds) and
``server_peak_mb`` (the 1,000-node federation); the server's work should grow like the number
of sampled clients (10×), not like the square of anything; ``--out FILE`` also writes it there
with the machine, torch version, date and command.

Usage: ``python benchmarks/bench_scale.py [--out FILE]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from flower_grid import InProcessGrid  # noqa: E402
from flwr.app import ArrayRecord, Context, Message  # noqa: E402
from flwr.common import logger as flwr_logger  # noqa: E402
from machine import emit, provenance  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from fedshard import (  # noqa: E402
    Cohort,
    Sharding,
    SpectralSharding,
    handle_query,
    handle_train,
)
from fedshard.models import mlp  # noqa: E402
from fedshard.spectral import sharded_layer_names  # noqa: E402

IN, CLASSES, WIDTH = 32, 4, 64


def model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return mlp(IN, CLASSES, width=WIDTH, depth=3)


def client(msg: Message, context: Context) -> Message:
    if msg.metadata.message_type == "query":
        return handle_query(msg, context.node_config["keep-ratio"],
                            context.node_config["partition-id"])
    g = torch.Generator().manual_seed(context.node_config["partition-id"])
    data = TensorDataset(torch.randn(16, IN, generator=g), torch.randint(0, CLASSES, (16,),
                                                                          generator=g))
    return handle_train(msg, model(), data)


def measure(num_nodes: int, sampled: int, rounds: int) -> dict[str, float]:
    ratios = [0.1, 0.2, 0.4]
    grid = InProcessGrid(client, [{"keep-ratio": ratios[i % 3], "partition-id": i}
                                  for i in range(num_nodes)])
    net = model()
    strategy = SpectralSharding(
        sharded_layers=sharded_layer_names(net, example_input=torch.zeros(1, IN)),
        num_rounds=rounds, sharding=Sharding(method="collective"),
        cohort=Cohort(fraction_train=sampled / num_nodes, min_available_nodes=num_nodes,
                      fraction_evaluate=0.0), seed=0)
    times: dict[int, float] = {}
    peaks: list[float] = []

    def timed(name: str):
        inner = getattr(strategy, name)

        def wrapper(server_round, *args):
            tracemalloc.start()
            t = time.perf_counter()
            try:
                return inner(server_round, *args)
            finally:
                times[server_round] = times.get(server_round, 0.0) + time.perf_counter() - t
                peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
                tracemalloc.stop()

        setattr(strategy, name, wrapper)

    timed("configure_train")
    timed("aggregate_train")
    t = time.perf_counter()
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                            num_rounds=rounds, timeout=600)
    wall = time.perf_counter() - t
    used = [strategy.history[r]["replies-used"] for r in range(1, rounds + 1)]
    assert sorted(result.train_metrics_clientapp) == list(range(1, rounds + 1))
    assert all(u == sampled for u in used), used
    return {
        "first_round_server_s": times[1],
        "server_s_per_round": statistics.median(times[r] for r in range(2, rounds + 1)),
        "server_peak_mb": max(peaks),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    flwr_logger.update_console_handler(level=30)  # WARNING: keep the output to the JSON
    rounds = 4
    small = measure(100, 10, rounds)
    large = measure(1000, 100, rounds)
    emit({
        **provenance(),
        "model": f"mlp {IN}-{WIDTH}-{WIDTH}-{WIDTH}-{CLASSES} (2 sharded {WIDTH}x{WIDTH} layers)",
        "keep_ratios": [0.1, 0.2, 0.4],
        "rounds": rounds,
        "nodes_100_sampled_10": small,
        "nodes_1000_sampled_100": large,
        "server_time_ratio_1000_vs_100": large["server_s_per_round"] / small["server_s_per_round"],
        "first_round_ratio_1000_vs_100": (large["first_round_server_s"]
                                          / small["first_round_server_s"]),
        "server_peak_mb": large["server_peak_mb"],
        "server_peak_mb_100": small["server_peak_mb"],
        "arch": platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }, args.out)


if __name__ == "__main__":
    main()
