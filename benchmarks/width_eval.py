"""The final model of each width-slicing run, evaluated at full width and at its widest trained
width: what a deployment that keeps only the trained channels would get.

HeteroFL and ordered dropout train only the leading channels of every hidden dimension when
every node's width is below the global one; the other channels keep their random
initialization, and the global model evaluated at full width (what the suites' tables report,
for every method alike) carries them. The papers evaluate a width-sliced model at the widths
the devices trained. This script loads each finished run's ``model.pt``, builds the narrow
model of the widest width its nodes trained (the ``width-ratio-r<r>`` columns of its
``metrics.jsonl``), loads the leading slice (for FedRolex, whose window rolls over every
channel, the full width is the trained width) and evaluates both on the whole test set.

Prints one JSON object. Usage:
    python benchmarks/width_eval.py results/width-table results/width-resnet
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

from machine import cpu_name  # noqa: E402

from fedshard.app.config import RunConfig  # noqa: E402
from fedshard.app.task import width_family  # noqa: E402
from fedshard.client.train import evaluate  # noqa: E402
from fedshard.client.train.batches import batches_for  # noqa: E402
from fedshard.data import load_test_set  # noqa: E402
from fedshard.settings import WIDTH_METHODS  # noqa: E402


def evaluate_run(folder: Path, tests: dict[str, Any]) -> dict[str, Any] | None:
    """Full-width and trained-width test accuracy of the run in ``folder`` (``None``: not a
    finished width-slicing run)."""
    summary = json.loads((folder / "summary.json").read_text())
    config = json.loads((folder / "config.json").read_text())["config"]
    if summary.get("status") != "finished" or config.get("method") not in WIDTH_METHODS:
        return None
    cfg = RunConfig.from_mapping({k: v for k, v in config.items()
                                  if k not in ("resume", "overwrite")})
    family = width_family(cfg)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    ratios = {float(v) for r in rows for k, v in r.items() if k.startswith("width-ratio-r")}
    widest = round(max(ratios) * family.width)
    trained = family.width if cfg.sharding.method == "fedrolex" else widest
    state = torch.load(folder / "model.pt", weights_only=True)
    if cfg.dataset not in tests:
        tests[cfg.dataset] = batches_for(load_test_set(cfg.dataset), 256)
    out: dict[str, Any] = {"method": cfg.sharding.method, "keep-ratios": cfg.keep_ratios,
                           "seed": cfg.seed, "trained-width": trained,
                           "full-width": family.width}
    for name, width in (("full", family.width), ("trained", trained)):
        model = family(width)
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        model.load_state_dict({k: v[tuple(slice(0, s) for s in shapes[k])]
                               for k, v in state.items()})
        out[f"test-accuracy-{name}-width"] = evaluate(model, tests[cfg.dataset]).accuracy
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="suite results folders")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tests: dict[str, Any] = {}
    runs = {}
    for results in args.results:
        for folder in sorted(p for p in results.iterdir() if (p / "summary.json").is_file()):
            found = evaluate_run(folder, tests)
            if found is not None:
                runs[f"{results.name}/{folder.name}"] = found
    print(json.dumps({"machine": cpu_name(), "torch": torch.__version__,
                      "date": datetime.date.today().isoformat(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
