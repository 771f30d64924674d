"""What each layer policy shards, and what a node at each keep ratio then receives, sends and
computes, on an autoencoder 784-64-3-64-784 and on every model of fedshard.models.

Prints one JSON object. For each model and policy ("paper": every Linear/Conv2d but the first
and the last; "by-size": the layers whose factors save bytes at the smallest keep ratio, the
ends only when they hold more than an average layer): the sharded layers, their
share of the model's bytes, and per keep ratio the bytes received and sent and the forward
FLOPs against the dense model (fedshard.spectral.sharding_budget: bytes from the shapes, as the
wire carries them; FLOPs counted by torch's FlopCounterMode on the sub-model), with the
warnings fedshard.spectral.budget_warnings gives.

Usage: python benchmarks/layer_policy.py [--ratios 0.1 0.2 0.25 0.5] [--warnings]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import cpu_name  # noqa: E402

from fedshard.models import cct_6_3x2, char_transformer, lenet, mlp, resnet18  # noqa: E402
from fedshard.spectral import (  # noqa: E402
    LAYER_POLICIES,
    budget_warnings,
    sharded_layer_names,
    sharding_budget,
)


class Autoencoder(nn.Module):
    """784 → 64 → 3 → 64 → 784, ReLU between (the user's model of the report)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1, self.enc2 = nn.Linear(784, 64), nn.Linear(64, 3)
        self.dec1, self.dec2 = nn.Linear(3, 64), nn.Linear(64, 784)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = self.enc2(torch.relu(self.enc1(x.flatten(1))))  # (B, 3)
        return self.dec2(torch.relu(self.dec1(code)))  # (B, 784)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "autoencoder-784-64-3-64-784": (Autoencoder, lambda: torch.zeros(1, 784)),
    "mlp (784-512-512-512-10)": (lambda: mlp(784, 10), lambda: torch.zeros(1, 1, 28, 28)),
    "lenet (28x28x1)": (lambda: lenet(10), lambda: torch.zeros(1, 1, 28, 28)),
    "resnet18 (32x32x3, width 64)": (lambda: resnet18(10, 3, seed=0),
                                     lambda: torch.zeros(1, 3, 32, 32)),
    "cct_6_3x2 (32x32x3)": (lambda: cct_6_3x2(10), lambda: torch.zeros(1, 3, 32, 32)),
    "chargpt (vocab 81, 80 chars)": (lambda: char_transformer(81),
                                     lambda: torch.zeros(1, 80, dtype=torch.long)),
}


def measure(model: nn.Module, x: torch.Tensor, ratios: list[float],
            with_warnings: bool) -> dict[str, Any]:
    """Both policies on one model."""
    smallest = min((r for r in ratios if r < 1), default=1.0)
    out: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    for policy in LAYER_POLICIES:
        options = {"keep_ratio": smallest} if policy == "by-size" else {}
        layers = sharded_layer_names(model, example_input=x, policy=policy, **options)
        budget = sharding_budget(model, layers, ratios, example_input=x)
        out["dense-bytes"], out["dense-flops"] = budget.dense_bytes, budget.dense_flops
        weight_bytes = budget.at(ratios[0]).layers
        share = sum(c.dense_bytes for c in weight_bytes) / budget.dense_bytes
        warnings = budget_warnings(budget)
        entry: dict[str, Any] = {
            "sharded": layers, "sharded-count": len(layers),
            "sharded-weight-share": round(share, 4),
            "largest-dense": [f"{u.name} {u.share:.1%}" for u in budget.unsharded[:2]],
            "ratios": {f"r{r.keep_ratio:g}": {
                "received": round(r.received_ratio, 4), "sent": round(r.sent_ratio, 4),
                "flops": None if r.flops_ratio is None else round(r.flops_ratio, 4),
                "layers-costing-more": [c.name for c in r.layers if c.costs_more],
            } for r in budget.ratios},
            "warnings": len(warnings),
        }
        if policy == "by-size":
            entry["keep-ratio"] = smallest
        if with_warnings:
            entry["warning-texts"] = warnings
        out[policy] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.25, 0.5])
    parser.add_argument("--warnings", action="store_true", help="include the warning texts")
    args = parser.parse_args()
    ratios = sorted(set(args.ratios))
    torch.manual_seed(0)
    started = time.perf_counter()
    models = {}
    for name, (build, example) in MODELS.items():
        models[name] = measure(build(), example(), ratios, args.warnings)
    print(json.dumps({
        "benchmark": "layer_policy", "device": cpu_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "keep-ratios": ratios,
        "seconds": round(time.perf_counter() - started, 1), "models": models,
    }, indent=1))


if __name__ == "__main__":
    main()
