"""A ClientApp's host work per train message before its first step: model and sub-model.

Before: the ClientApp built the model for every message (random initialization of every
weight, only to be overwritten by the server's) and ``build_submodel`` deep-copied all of it
(the dense weights of the sharded layers too, only to replace them). Now: one model per
process (``fedshard.app.task.template_model``), and ``build_submodel`` copies only what the
sub-model keeps. Both ways side by side in this process on the same train message (ResNet-18
GroupNorm width 64, CIFAR-shaped, r = 0.1, Collective), median of ``--repeats``.

Usage: ``python benchmarks/bench_receive.py [--width 64] [--keep-ratio 0.1] [--repeats 7]
[--out FILE]``; prints one JSON object (seconds per message) and, with ``--out``, writes it
there with the machine, torch version, date and command.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from flower_grid import InProcessGrid  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common import logger as flwr_logger  # noqa: E402
from machine import emit, provenance  # noqa: E402
from torch import nn  # noqa: E402

import fedshard.client.shard as shard_module  # noqa: E402
from fedshard import (  # noqa: E402
    SpectralSharding,
    handle_query,
    receive,
)
from fedshard.models import resnet18  # noqa: E402
from fedshard.spectral import LayerFactors, SpectralConv2d, SpectralLinear  # noqa: E402


def build_submodel_full_copy(model: nn.Module, factors: dict[str, LayerFactors]) -> nn.Module:
    """The previous ``build_submodel`` (commit 71cdc0f): copy all, then replace."""
    sub = copy.deepcopy(model)
    for name, fac in factors.items():
        layer = sub.get_submodule(name)
        cls = SpectralConv2d if isinstance(layer, nn.Conv2d) else SpectralLinear
        parent, _, child = name.rpartition(".")
        setattr(sub.get_submodule(parent), child, cls.from_factors(layer, fac.u, fac.v,
                                                                   fac.omega))
    return sub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--keep-ratio", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    flwr_logger.update_console_handler(level=30)

    def model() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return resnet18(num_classes=10, in_channels=3, width=args.width)

    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Any) -> Message:
        return handle_query(msg, args.keep_ratio)

    net = model()
    strategy = SpectralSharding.from_model(
        net, example_input=torch.zeros(1, 3, 32, 32), method="collective", seed=0,
        min_train_nodes=1, min_available_nodes=1)
    strategy.num_rounds = 1
    msg = next(iter(strategy.configure_train(1, ArrayRecord(net.state_dict()), ConfigRecord(),
                                             InProcessGrid(app, [{}]))))
    template = model()

    def before() -> nn.Module:
        fresh = model()  # what the ClientApp did per message
        saved = shard_module.build_submodel
        shard_module.build_submodel = build_submodel_full_copy  # type: ignore[assignment]
        try:
            return receive(msg, fresh).model
        finally:
            shard_module.build_submodel = saved

    def after() -> nn.Module:
        return receive(msg, template).model

    timings: dict[str, list[float]] = {"before": [], "after": [], "model_init": []}
    for _ in range(args.repeats):
        for name, fn in (("before", before), ("after", after), ("model_init", model)):
            t0 = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - t0)
    a, b = before(), after()
    same = all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))
    if not same:
        raise SystemExit("bench_receive: the two ways built different sub-models")
    med = {k: statistics.median(v) for k, v in timings.items()}
    emit({
        **provenance(), "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "shape": {"resnet18_width": args.width, "keep_ratio": args.keep_ratio,
                  "params": sum(p.numel() for p in net.parameters())},
        "before_s": round(med["before"], 4),
        "after_s": round(med["after"], 4),
        "model_init_s": round(med["model_init"], 4),
        "saved_s_per_message": round(med["before"] - med["after"], 4),
        "speedup": round(med["before"] / med["after"], 1),
        "same_submodel": same,
    }, args.out)


if __name__ == "__main__":
    main()
