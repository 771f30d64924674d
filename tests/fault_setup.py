"""A tiny federation for the fault tests: a small net fedshard does not define, real
``Message``s through the in-process grid, and reply tampering helpers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from flower_grid import InProcessGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import TensorDataset

from fedshard import SpectralSharding, handle_evaluate, handle_query, handle_train
from fedshard import protocol as P
from fedshard.settings import group_settings, robust_defaults

LAYERS = ["hidden"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 12)
        self.hidden = nn.Linear(12, 10)
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        return self.head(torch.relu(self.norm(self.hidden(x))))


def make_net() -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net()


def local_data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(24, 16, generator=g), torch.randint(0, 3, (24,), generator=g))


client = ClientApp()


@client.query()
def _query(msg: Message, context: Context) -> Message:
    return handle_query(msg, context.node_config["keep-ratio"],
                        context.node_config.get("node-key"))


@client.train()
def _train(msg: Message, context: Context) -> Message:
    return handle_train(msg, make_net(), local_data(context.node_id))


@client.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return handle_evaluate(msg, make_net(), local_data(context.node_id))


def grid(n: int = 3, ratio: float = 0.5, **extra: object) -> InProcessGrid:
    return InProcessGrid(client, [{"keep-ratio": ratio, **extra} for _ in range(n)])


def strategy(cls: type[SpectralSharding] = SpectralSharding, **kw: object) -> SpectralSharding:
    args: dict = dict(sharded_layers=LAYERS, num_rounds=3, lr=0.05, fraction_train=1.0, seed=3,
                      query_timeout=5, node_wait_timeout=5, fraction_evaluate=0.0,
                      min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    # the app's robust reply rules (these tests are of them); a test's replies= or flat
    # names (max_update_spread=0, ...) override them
    args["replies"] = robust_defaults()
    args.update(kw)
    return cls(**group_settings(args))  # flat names -> Sharding, LocalTraining, ...


def initial() -> ArrayRecord:
    return ArrayRecord(make_net().state_dict())


def one_round(s: SpectralSharding, g: InProcessGrid, server_round: int = 1,
              arrays: ArrayRecord | None = None) -> tuple[ArrayRecord | None, dict[str, float]]:
    """One training round; the new arrays and the round's full metrics (the server's
    statistics live in ``history``; Flower gets only the client-side aggregates)."""
    msgs = list(s.configure_train(server_round, arrays or initial(), ConfigRecord(), g))
    new, _ = s.aggregate_train(server_round, g.send_and_receive(msgs))
    return new, dict(s.history.get(server_round + s.run_rounds.completed, {}))


def scale_arrays(factor: float, keys: Callable[[str], bool] = lambda k: True
                 ) -> Callable[[Message], Message]:
    """A tamper hook that multiplies the reply's float arrays (``keys``) by ``factor``."""

    def hook(reply: Message) -> Message:
        rec = reply.content[P.ARRAYS]
        for k in list(rec.keys()):
            x = rec[k].numpy()
            if np.issubdtype(x.dtype, np.floating) and keys(k):
                rec[k] = Array((x * factor).astype(x.dtype))
        return reply

    return hook


def set_metric(key: str, value: object) -> Callable[[Message], Message]:
    """A tamper hook that sets one metric of the reply (any MetricRecord-legal value)."""

    def hook(reply: Message) -> Message:
        metrics = reply.content[P.METRICS]
        metrics[key] = value
        return reply

    return hook


def replace_metrics(values: dict) -> Callable[[Message], Message]:
    def hook(reply: Message) -> Message:
        reply.content[P.METRICS] = MetricRecord(values)
        return reply

    return hook




def run_app(root: Path, extra: dict, *, tamper: dict | None = None, silent: set | None = None,
            n_nodes: int = 3, n_train: int = 90, n_test: int = 30,
            data: Path | None = None) -> tuple[dict, InProcessGrid]:
    """``run_server`` over fedshard's real ClientApp on ``n_nodes`` simulated nodes (fake
    Fashion-MNIST unless ``data`` is given); returns its summary and the grid."""
    import fakedata

    import client_app
    from fedshard.app.config import RunConfig
    from fedshard.app.run import run_server

    if data is None:
        data = root / "data"
        fakedata.write_fashion_mnist(data, n_train, n_test, np.random.default_rng(0))
    cfg = {"dataset": "fashion-mnist", "data-dir": str(data), "num-server-rounds": 2,
           "num-partitions": n_nodes, "min-available-nodes": n_nodes, "fraction-train": 1.0,
           "batch-size": 16, "results-dir": str(root / "out"), "run-name": "run",
           "test-max-examples": n_test, "seed": 5, "model": "mlp", "model-width": 32,
           "method": "collective", "keep-ratios": "0.5", **extra}
    g = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": n_nodes}
                                       for i in range(n_nodes)], cfg)
    g.tamper.update(tamper or {})
    g.silent.update(silent or set())
    return run_server(g, RunConfig.from_mapping(cfg)), g
