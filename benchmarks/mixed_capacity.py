"""The mixed-capacity table (experiments/mixed-capacity.toml): every finished run's final test
accuracy at full size and at each budget of its column, mean ± std over seeds, each cell's
paired difference to the column's best baseline, and each method's cost per budget.

- **Accuracy** comes from the runs' own ``metrics.jsonl`` (their last evaluated round):
  ``test-accuracy`` for the global model and ``test-accuracy-at-r<r>`` for the model a device
  of keep ratio ``r`` runs (``eval-at-budgets``: a width slice, or every sharded layer
  truncated to its top ⌈rN⌉ terms). The small models are evaluated as they are, so their one
  accuracy stands in every budget; the whole model trained by every node is an upper bound no
  weak device could train (a reference row).
- **Paired statistics**: a seed fixes the data split and the node sampling of every row, so
  each cell's difference to the column's best baseline (the width rows, the small model and the
  strong-only row) is taken seed by seed: its mean ± std and ``n`` (and whether the mean
  exceeds the std, ``beyond-spread``). The table's ``*`` is the stated test, computed from
  them: a two-sided 95 % Student-t interval of the paired differences,
  ``mean ± t(0.975, n − 1)·std/√n`` (:func:`ci95_half`), that excludes 0.
- **Cost per budget** (``--costs``): for the dense model, the spectral sub-model at r and the
  width of equal forward FLOPs (the width rows' slice, and the small model at the weakest r):
  forward and training (forward + backward) FLOPs per example, the bytes a node receives and
  sends per round, what one training step of batch 32 holds (parameters, gradients, momentum,
  saved activations, counted from the model), and client peak memory measured while
  fedshard's training step runs: live tensors (torch.profiler) and process RSS (a fresh
  subprocess's high-water mark); ``benchmarks/width_budget.py`` and
  ``benchmarks/client_cost.py``.

Prints one JSON object (machine, torch, date, the suite, the cells and the costs) and, with
``--markdown``, the table. Usage::

    python benchmarks/mixed_capacity.py results/mixed-capacity results/mixed-capacity-b \\
        --costs --out results/mixed-capacity/table.json
    python benchmarks/mixed_capacity.py --markdown results/mixed-capacity/table.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import emit, provenance  # noqa: E402

from fedshard_lab.experiments.suite import load_suite  # noqa: E402

SUITE = ROOT / "experiments" / "mixed-capacity.toml"
#: rows that are not the paper's method: the baselines each spectral row is compared with
BASELINES = ("HeteroFL", "FedRolex", "Ordered dropout", "Small model", "Strong devices only",
             "Strong devices only, 10 a round")
#: a reference row: every node trains the whole model (no weak device could)
UPPER = "Whole model, every node"
#: cells that are another cell's runs: the small model of width 6 is the same run in the
#: all-weak column as in the few-strong one (plain FedAvg does not read keep ratios)
SAME_RUN = {("Small model", "r = 0.1"): ("Small model", "20 % r = 1 / 80 % r = 0.1")}


def final_row(folder: Path) -> dict[str, Any] | None:
    """The last evaluated round of a finished run (``None``: not finished). Finished means the
    app's ``summary.json`` and the runner's ``runner.json`` both say so (a runner stopped after
    the app finished wrote "interrupted": that record is broken and the run is re-run)."""
    summary, runner = folder / "summary.json", folder / "runner.json"
    if not summary.is_file() or json.loads(summary.read_text()).get("status") != "finished":
        return None
    if not runner.is_file() or json.loads(runner.read_text()).get("status") != "finished":
        return None
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x]
    evaluated = [r for r in rows if "test-accuracy" in r]
    return evaluated[-1] if evaluated else None


def budgets_of(column: str | None, ratios: tuple[float, ...]) -> list[str]:
    """The budgets a column is evaluated at: ``"full"`` and each keep ratio below 1."""
    return ["full", *[f"r{r:g}" for r in sorted(ratios) if r < 1]]


def collect(folders: list[Path], suite_path: Path = SUITE) -> dict[str, Any]:
    """Per (row, column) and budget, the accuracy of each seed; the runs found where the
    suite puts them or in any of ``folders`` (runners may write to separate folders)."""
    suite = load_suite(suite_path, resolve_comparisons=False)
    cells: dict[tuple[str, str], dict[str, dict[int, float]]] = defaultdict(
        lambda: defaultdict(dict))
    columns = list(dict.fromkeys(s.column for s in suite.runs if s.column is not None))
    missing: list[str] = []
    commits: set[str] = set()
    for spec in suite.runs:
        found = next((f / spec.name for f in folders if (f / spec.name).is_dir()), None)
        row = final_row(found) if found is not None else None
        if row is None:
            missing.append(spec.name)
            continue
        assert found is not None
        commits.add(json.loads((found / "config.json").read_text()).get("git-commit", "?"))
        targets = [spec.column] if spec.column is not None else columns
        for column in targets:
            ratios = _column_ratios(suite, column)
            for budget in budgets_of(column, ratios):
                key = "test-accuracy" if budget == "full" else f"test-accuracy-at-{budget}"
                # a model evaluated as it is (the small ones) stands in at every budget
                value = row.get(key, row["test-accuracy"] if not
                                spec.config.eval_at_budgets else None)
                if value is not None:
                    cells[(spec.label, column)][budget][spec.seed] = float(value)
    for (label, column), (from_label, from_column) in SAME_RUN.items():
        if (from_label, from_column) in cells and column in columns:
            cells[(label, column)] = {b: dict(v) for b, v in cells[(from_label, from_column)]
                                      .items() if b in budgets_of(column, _column_ratios(
                                          suite, column))}
    return {"cells": cells, "columns": columns, "expected": len(suite.runs),
            "missing": missing, "commits": sorted(commits)}


def _column_ratios(suite: Any, column: str) -> tuple[float, ...]:
    """The keep ratios of a column's mix (from its spectral runs' configuration)."""
    for spec in suite.runs:
        if spec.column == column and spec.config.sharding.method != "none":
            return tuple(spec.config.mixture.ratios)
    return ()


def statistics_of(cells: dict[tuple[str, str], dict[str, dict[int, float]]]
                  ) -> dict[str, Any]:
    """Mean ± std per cell and budget, and the paired difference to the column's best
    baseline (the baseline with the highest mean at that budget), seed by seed."""
    out: dict[str, Any] = {}
    by_column: dict[str, list[str]] = defaultdict(list)
    for (label, column) in cells:
        by_column[column].append(label)
    for column, labels in by_column.items():
        budgets = sorted({b for label in labels for b in cells[(label, column)]},
                         key=lambda b: (b != "full", b))
        for budget in budgets:
            seeds = {label: cells[(label, column)].get(budget, {}) for label in labels}
            base = [b for b in BASELINES if seeds.get(b)]
            best = max(base, key=lambda b: statistics.mean(seeds[b].values()), default=None)
            for label in labels:
                values = seeds[label]
                if not values:
                    continue
                entry: dict[str, Any] = {
                    "seeds": {str(s): v for s, v in sorted(values.items())},
                    "mean": statistics.mean(values.values()),
                    "std": statistics.stdev(values.values()) if len(values) > 1 else None}
                if best is not None and label != best:
                    paired = [values[s] - seeds[best][s] for s in values if s in seeds[best]]
                    if paired:
                        mean = statistics.mean(paired)
                        std = statistics.stdev(paired) if len(paired) > 1 else None
                        entry["vs-best-baseline"] = {
                            "baseline": best, "mean": mean, "std": std, "n": len(paired),
                            "beyond-spread": std is not None and abs(mean) > std}
                out.setdefault(column, {}).setdefault(budget, {})[label] = entry
    return out


#: t(0.975, df) for df = 1..30 (Student's t, two-sided 95 %); beyond 30, within 0.3 % of
#: 1.96 + 2.4/df (checked against scipy in tests/experiments/test_mixed_capacity_table.py).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ci95_half(std: float | None, n: int) -> float | None:
    """Half the width of the two-sided 95 % Student-t interval of a mean of ``n`` paired
    differences of sample std ``std``: ``t(0.975, n − 1)·std/√n``; ``None`` below 2."""
    if std is None or n < 2:
        return None
    df = n - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df
    return t * std / math.sqrt(n)


def costs(ratios: tuple[float, ...] = (0.1, 0.2, 0.4, 1.0)) -> dict[str, Any]:
    """What a node at each keep ratio computes, receives, sends and holds, for the spectral
    sub-model and the width of equal forward FLOPs (ResNet-18 width 16, 28×28×1)."""
    from width_budget import FAMILIES, measure

    family, shape = FAMILIES["resnet18-16"]
    return measure(family, shape, list(ratios), 32, client=True)


def markdown(result: dict[str, Any]) -> str:
    """The table: one block per column, a row per method, a column per budget, each cell
    "mean ± std (Δ vs the best baseline, * where its 95 % t interval excludes 0)"."""
    lines: list[str] = []
    for column, budgets in result["statistics"].items():
        names = list(budgets)
        labels = sorted({label for b in budgets.values() for label in b})
        seed_sets = {tuple(sorted(e["seeds"], key=int)) for b in budgets.values()
                     for e in b.values()}
        # the most seeds any cell has (ties: the lowest seeds, so the header is the same in
        # every process); a cell with fewer says which it has
        common = max(seed_sets, key=lambda t: (len(t), [-int(x) for x in t]))
        lines += [f"**{column}** (test accuracy, %, mean ± std over seeds {_and(common)})", "",
                  "| method | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        for label in labels:
            cells = []
            for budget in names:
                e = budgets[budget].get(label)
                if e is None:
                    cells.append("—")
                    continue
                text = f"{100 * e['mean']:.1f}" + (f" ± {100 * e['std']:.1f}"
                                                  if e["std"] is not None else "")
                d = e.get("vs-best-baseline")
                if d is not None:
                    half = ci95_half(d["std"], d["n"])  # from the record's own fields
                    mark = "*" if half is not None and abs(d["mean"]) > half else ""
                    text += f" ({100 * d['mean']:+.1f}{mark})"
                seeds = tuple(sorted(e["seeds"], key=int))
                if seeds != common:
                    text += f" [seed{'s' * (len(seeds) > 1)} {_and(seeds)}]"
                cells.append(text)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _and(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def costs_markdown(result: dict[str, Any]) -> str:
    """The cost table: per keep ratio, the model a device of that budget trains (the spectral
    sub-model, and the width slice of the same forward FLOPs, which is also the small model's
    width at the weakest budget), its training FLOPs per example, bytes each way per round and
    client peak memory (live tensors, process RSS)."""
    costs = result["costs"]
    dense = costs["dense"]
    lines = ["| budget | model a device trains | training MFLOPs per example | received per "
             "round (MB) | sent per round (MB) | tensor peak (MB) | process RSS peak (MB) |",
             "|---|---|---|---|---|---|---|"]

    def row(budget: str, model: str, c: dict[str, Any]) -> str:
        cells = [f"{c['train-flops-per-example'] / 1e6:.1f}",
                 *(f"{c[k] / 1e6:.2f}" for k in ("bytes-received", "bytes-sent")),
                 *(f"{c[k] / 1e6:.1f}" for k in ("tensor-peak-bytes", "rss-peak-bytes"))]
        return f"| {budget} | {model} | " + " | ".join(cells) + " |"

    lines.append(row("r = 1", "the whole model (no sharding)", dense))
    for ratio, at in sorted(costs["ratios"].items(), key=lambda kv: -float(kv[0])):
        lines.append(row(f"r = {ratio}", "spectral: every term" if float(ratio) == 1 else
                         f"spectral: top {100 * float(ratio):g} % of terms", at["spectral"]))
        width = at["width-same-flops"]
        if float(ratio) < 1:
            lines.append(row(f"r = {ratio}", f"width {width['width']} of "
                             f"{round(width['width'] / width['width-ratio'])}", width))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="*", help="folders holding the runs")
    parser.add_argument("--suite", type=Path, default=SUITE)
    parser.add_argument("--costs", action="store_true", help="also count the costs per budget")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="print the table of a saved result and exit")
    args = parser.parse_args()
    if args.markdown is not None:
        saved = json.loads(args.markdown.read_text())
        print(markdown(saved))
        if "costs" in saved:
            print(costs_markdown(saved))
        return
    torch.set_num_threads(1)
    found = collect(args.results, args.suite)
    missing = found["missing"]
    result = {**provenance("cpu"), "suite": str(args.suite.name),
              # the runs behind the table: how many of the suite's, which are not finished,
              # and the code they ran (each run's config.json names its commit)
              "runs": {"expected": found["expected"],
                       "finished": found["expected"] - len(missing), "missing": missing,
                       "commits": found["commits"]},
              "complete": not missing,
              "statistics": statistics_of(found["cells"]),
              **({"costs": costs()} if args.costs else {})}
    emit(result, args.out)


if __name__ == "__main__":
    main()
