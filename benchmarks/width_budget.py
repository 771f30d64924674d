"""What a node costs under spectral sharding and under width slicing at the same budget: the
cost columns of the width table (experiments/width-table.toml).

Prints one JSON object. For each model (the MLP of width 256 and ResNet-18 of width 16 on
28×28×1 images, ResNet-18 of width 64 on 32×32×3 images, 10 classes) and keep ratio r: the
spectral sub-model at r (the paper's default layers, ⌈rN⌉ terms each) and the narrow model of
the width whose forward FLOPs are nearest (fedshard.width.match_width, as WidthSlicing picks
it; and the width of nearest bytes), each with its forward FLOPs per example, bytes received
and sent per round (the wire's .npy bytes of what a node is sent and returns), and what one
training step on a batch of 32 holds (parameters, gradients, SGD momentum, and the activations
autograd saves, measured with saved-tensor hooks by fedshard.width.training_memory), beside the
dense model's. Ordered dropout trains, per batch, a width of its grid up to the node's: its
mean cost is also given.

Usage: python benchmarks/width_budget.py [--ratios 0.1 0.2 0.4] [--batch 32] [--models ...]
       python benchmarks/width_budget.py --markdown results/width-budget/costs.json
(the second prints the table of docs/width-slicing.md from a saved result)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import client_cost  # noqa: E402
from machine import cpu_name  # noqa: E402

from fedshard.models import mlp, resnet18  # noqa: E402
from fedshard.server.width import od_widths  # noqa: E402
from fedshard.spectral import forward_flops, sharded_layer_names, sharding_budget  # noqa: E402
from fedshard.spectral.budget import submodel_at  # noqa: E402
from fedshard.width import WidthFamily, match_width, state_bytes, training_memory  # noqa: E402


def _mlp(width: int) -> torch.nn.Module:
    return mlp(784, 10, width=width)


def _resnet(width: int) -> torch.nn.Module:
    return resnet18(10, 1, width)


def _resnet_cifar(width: int) -> torch.nn.Module:
    return resnet18(10, 3, width)


#: name -> (family, one input's shape): Fashion-MNIST's MLP and ResNet-18 of the width tables,
#: and CIFAR-10's ResNet-18 of width 64 (experiments/width-cifar10.toml)
FAMILIES = {"mlp-256": (WidthFamily(_mlp, 256), (1, 28, 28)),
            "resnet18-16": (WidthFamily(_resnet, 16, 2), (1, 28, 28)),
            "resnet18-64-cifar10": (WidthFamily(_resnet_cifar, 64, 2), (3, 32, 32))}


def _costs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, received: int,
           sent: int, client: bool = False) -> dict[str, Any]:
    memory = training_memory(model, x, y)
    out = {"forward-flops": forward_flops(model, x[:1]), "bytes-received": received,
           "bytes-sent": sent, "train-memory-bytes": memory["total"],
           "activation-bytes": memory["activations"]}
    if client:  # what a client really runs: fedshard's train() with its rules
        shape, batch = tuple(x.shape[1:]), len(x)
        out["train-flops-per-example"] = client_cost.train_flops(model, shape, batch)
        out["tensor-peak-bytes"] = client_cost.tensor_peak(model, shape, batch)[0]
        out["rss-peak-bytes"] = client_cost.rss_peak(model, shape, batch)
    return out


def measure(family: WidthFamily, shape: tuple[int, ...], ratios: list[float],
            batch: int, client: bool = False) -> dict[str, Any]:
    """Costs of the dense model, and per ratio of the spectral sub-model and the widths of
    equal forward FLOPs and of equal bytes; ``client``: also the training FLOPs per example
    and the peak memory of fedshard's training step (tensors and process RSS,
    ``client_cost.py``)."""
    torch.manual_seed(0)
    dense = family(family.width)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    layers = sharded_layer_names(dense, example_input=x[:1])
    dense_bytes = state_bytes(family.shapes(family.width), dense)
    out: dict[str, Any] = {"dense": _costs(dense, x, y, dense_bytes, dense_bytes, client),
                           "sharded-layers": len(layers), "ratios": {}}
    for r in ratios:
        budget = sharding_budget(dense, layers, [r]).at(r)
        spectral = _costs(submodel_at(dense, layers, r), x, y, budget.received_bytes,
                          budget.sent_bytes, client)
        row: dict[str, Any] = {"spectral": spectral}
        for how in ("flops", "bytes"):
            m = match_width(family, r, how, model=dense, sharded_layers=layers,
                            example_input=x[:1])
            narrow = family(m.width)
            entry = {"width": m.width, "width-ratio": m.width_ratio,
                     **_costs(narrow, x, y, m.bytes, m.bytes, client and how == "flops")}
            if how == "flops":  # ordered dropout: a width of the grid per batch, uniformly
                grid = od_widths(family, m.width, 5)
                entry["ordered-dropout-widths"] = list(grid)
                entry["ordered-dropout-mean-forward-flops"] = sum(
                    forward_flops(family(w), x[:1]) for w in grid) / len(grid)
            row[f"width-same-{how}"] = entry
        out["ratios"][f"{r:g}"] = row
    return out


NAMES = {"mlp-256": "MLP, width 256", "resnet18-16": "ResNet-18, width 16",
         "resnet18-64-cifar10": "ResNet-18, width 64 (CIFAR-10)"}


def markdown(result: dict[str, Any], models: tuple[str, ...] = ("mlp-256", "resnet18-16")) -> str:
    """The cost table of docs/width-slicing.md from a saved result: per model and keep ratio,
    the spectral sub-model and the width of equal FLOPs, against the dense model."""
    rows = ["| model | r | what a node trains | forward FLOPs | bytes received | bytes sent "
            "| training memory |", "|---|---|---|---|---|---|---|"]
    keys = ("forward-flops", "bytes-received", "bytes-sent", "train-memory-bytes")
    for name in models:
        v = result["models"][name]
        dense = v["dense"]
        full = name.split("-")[1]
        for r, row in v["ratios"].items():
            w = row["width-same-flops"]
            for what, entry in ((f"spectral, ⌈{r}·N⌉ terms", row["spectral"]),
                                (f"width {w['width']} of {full} (ρ = {w['width-ratio']:.3f})",
                                 w)):
                cells = " | ".join(f"{entry[k] / dense[k]:.3f}×" for k in keys)
                rows.append(f"| {NAMES[name]} | {r} | {what} | {cells} |")
        rows.append(f"| {NAMES[name]} | | dense model | {dense['forward-flops'] / 1e6:.3g} MFLOP | "
                    f"{dense['bytes-received'] / 1e6:.3g} MB | {dense['bytes-sent'] / 1e6:.3g} "
                    f"MB | {dense['train-memory-bytes'] / 1e6:.3g} MB |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--models", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--markdown", type=Path, metavar="RESULT",
                        help="print the docs' table from a saved result instead of measuring")
    args = parser.parse_args()
    if args.markdown is not None:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    torch.set_num_threads(1)
    result = {
        "machine": cpu_name(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "batch": args.batch,
        "models": {name: measure(*FAMILIES[name], args.ratios, args.batch)
                   for name in args.models},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
