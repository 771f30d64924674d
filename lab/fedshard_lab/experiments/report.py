"""A suite's report: Markdown table, accuracy and ANME plots, and the numbers as JSON.

Only *finished* runs count (see :mod:`fedshard_lab.experiments.runner`); their numbers are read
into cells by :mod:`fedshard_lab.experiments.cells`. Written into the suite's results folder:

- ``table.md`` - rows = labels, columns = column labels (suite order); each cell the final
  test accuracy in %, "mean ± std" over seeds (sample standard deviation, ddof = 1), the best
  cell of each column in bold, cells with fewer seeds or other rounds than the main setting
  marked with † and explained in a footnote, missing cells "—"; reference rows (runs
  without a column, such as r = 1) in a table of their own. Then a per-run table: final,
  mean of the last :data:`LAST_EVALS` evaluations and best accuracy of every finished run,
  and its paired difference to the baseline (the first row of the first table, e.g. Top-n)
  trained on the same seed - hence the same data split - in the same column; and the mean
  of those paired differences per cell. With a skewed split the seed moves every strategy
  by similar amounts, so paired differences are the sharper comparison with few seeds.
- ``accuracy.png`` - test accuracy against round, one panel per column, mean over seeds with
  a ±1 std band (the paper's Fig. 1a); reference rows dashed in every panel.
- ``anme.png`` - average normalized marginal entropy per strategy and column, mean over
  rounds and seeds, with the std over seeds (the paper's Fig. 1b, Sec. 4.3).
- ``results.json`` - every cell's per-seed numbers.
- ``milestones.md``, ``accuracy-per-seed.png`` and, where runs recorded diagnostics,
  ``diagnostics.png``: :mod:`fedshard_lab.experiments.diagnostics`.
- Rows of other suites (``[[compare]]``, :mod:`fedshard_lab.experiments.compare`) appear in all of
  them, labelled as such, and are not counted as this suite's runs.

The plots are drawn by :mod:`fedshard_lab.experiments.plots` (and :mod:`.diagnostics`). They
need matplotlib (``pip install 'fedshard[plots]'``), imported only there, with the Agg canvas
(no display, no global backend switch).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedshard_lab.experiments.cells import LAST_EVALS, Cell, RunResult, collect
from fedshard_lab.experiments.diagnostics import (
    cosine_markdown,
    milestones_markdown,
    plot_cosines,
    plot_diagnostics,
    plot_per_seed,
)
from fedshard_lab.experiments.plots import plot_accuracy, plot_anme
from fedshard_lab.experiments.suite import Suite

__all__ = [
    "Cell",
    "ReportFiles",
    "RunResult",
    "collect",
    "markdown_report",
    "plot_accuracy",
    "plot_anme",
    "results_json",
    "write_report",
]

DAGGER = "†"
MISSING = "—"


@dataclass(frozen=True)
class ReportFiles:
    """Paths written by :func:`write_report`."""

    table: Path
    results: Path
    accuracy_plot: Path
    anme_plot: Path
    milestones: Path | None = None
    diagnostics_plot: Path | None = None  # only when some run recorded a diagnostic
    per_seed_plot: Path | None = None  # only when some run finished
    cosine_table: Path | None = None  # only when some run recorded fedavg-cosine
    cosine_plot: Path | None = None


def _format(cell: Cell | None, bold: bool = False) -> str:
    if cell is None or cell.mean is None:
        return MISSING
    text = f"{cell.mean:.2f}" + (f" ± {cell.std:.2f}" if cell.std is not None else "")
    if bold:
        text = f"**{text}**"
    return text + (DAGGER if cell.marked else "")


def _best(cells: Sequence[Cell], main_rounds: int) -> set[tuple[str, str | None]]:
    """Keys of the best cell(s) of one column (ties by the displayed 2 decimals)."""
    valued = [c for c in cells if c.mean is not None]
    full = [c for c in valued if c.num_rounds == main_rounds]
    pool = full or valued
    if not pool:
        return set()
    top = max(round(c.mean, 2) for c in pool if c.mean is not None)
    return {(c.label, c.column) for c in pool if c.mean is not None and round(c.mean, 2) == top}


def markdown_report(suite: Suite, cells: Sequence[Cell]) -> str:
    """``table.md``: the suite's tables, reference rows and footnotes."""
    by_key = {(c.label, c.column): c for c in cells}
    seeds = ", ".join(str(s) for s in suite.seeds)
    finished = sum(len(c.runs) for c in cells if c.source is None)
    lines = [
        f"# {suite.name}",
        "",
        f"Final test accuracy (%) of the global model, mean ± std over seeds (main setting: "
        f"{suite.main_rounds} rounds, seeds {seeds}). {finished} of {len(suite.runs)} runs "
        "finished.",
        "",
    ]
    for table in suite.tables:
        lines += [f"## {table.title}", ""]
        lines.append("| Strategy | " + " | ".join(table.columns) + " |")
        lines.append("|---|" + "---|" * len(table.columns))
        best = {}
        for column in table.columns:
            column_cells = [by_key[label, column] for label in table.rows
                            if (label, column) in by_key]
            best[column] = _best(column_cells, suite.main_rounds)
        for label in table.rows:
            cells_text = [_format(by_key.get((label, column)), (label, column) in best[column])
                          for column in table.columns]
            lines.append(f"| {label} | " + " | ".join(cells_text) + " |")
        lines.append("")
    if suite.reference_rows:
        lines += ["## Reference (one setting for every column)", "",
                  "| Reference | Accuracy (%) |", "|---|---|"]
        for label in suite.reference_rows:
            lines.append(f"| {label} | {_format(by_key.get((label, None)))} |")
        lines.append("")
    marked = [c for c in cells if c.marked]
    if marked:
        where = "; ".join(
            (f"{c.label}, {c.column}" if c.column is not None else c.label) + f": {c.note}"
            for c in marked
        )
        lines.append(f"{DAGGER} Fewer seeds or other rounds than the main setting "
                     f"({suite.main_rounds} rounds, {len(suite.seeds)} seeds): {where}.")
        lines.append("")
    if suite.comparisons:
        lines.append("Rows from other suites (`[[compare]]`, not run by this suite): " + "; ".join(
            f"{c.label} = {c.suite}'s {c.row!r}" + (f" / {c.column!r}" if c.column else "")
            + f" ({_shown_path(c.runs[0].directory.parent, suite.app_dir)})"
            for c in suite.comparisons) + ".")
        lines.append("")
    lines += [
        f"Std: sample standard deviation (ddof = 1) over seeds; none with one seed. "
        f"**Bold**: best mean in its column among cells trained for {suite.main_rounds} rounds "
        f"(in a column without such cells, among all of its cells). "
        f"{MISSING}: no finished run.",
        "",
    ]
    lines += _per_run_section(suite, cells)
    return "\n".join(lines)


def _shown_path(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` where it lies inside it (reports are committed)."""
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _baseline(suite: Suite) -> str | None:
    """The row paired differences are taken against: the first row of the first table."""
    return suite.tables[0].rows[0] if suite.tables and suite.tables[0].rows else None


def _paired(cell: Cell, by_key: dict[tuple[str, str | None], Cell], baseline: str | None
            ) -> dict[int, float]:
    """Seed -> final accuracy minus the baseline's on the same seed and column (points)."""
    base = by_key.get((baseline, cell.column)) if baseline is not None else None
    if base is None or cell.column is None or cell.label == baseline:
        return {}
    base_final = {r.spec.seed: r.final_accuracy for r in base.runs
                  if r.spec.num_rounds == cell.num_rounds}
    return {r.spec.seed: r.final_accuracy - base_final[r.spec.seed] for r in cell.runs
            if r.spec.seed in base_final}


def _signed(value: float | None) -> str:
    return MISSING if value is None else f"{value:+.2f}"


def _per_run_section(suite: Suite, cells: Sequence[Cell]) -> list[str]:
    runs = [r for c in cells for r in c.runs]
    if not runs:
        return []
    by_key = {(c.label, c.column): c for c in cells}
    baseline = _baseline(suite)
    lines = ["## Per run", "",
             f"Final, mean of the last {LAST_EVALS} evaluations (rounds given) and best test "
             f"accuracy (%); Δ: final accuracy minus {baseline}'s on the same seed (same data "
             "split) and column.", "",
             f"| Strategy | Column | Seed | Rounds | Final | Last {LAST_EVALS} (rounds) | Best "
             f"| Δ vs {baseline} |",
             "|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        paired = _paired(cell, by_key, baseline)
        for r in cell.runs:
            recent = r.recent
            where = f" ({recent[0][0]}–{recent[-1][0]})" if recent else ""
            recent_text = (f"{r.recent_mean:.2f}{where}" if r.recent_mean is not None
                           else MISSING)
            best = f"{r.best_accuracy:.2f}" if r.best_accuracy is not None else MISSING
            lines.append(f"| {cell.label} | {cell.column or '(reference)'} | {r.spec.seed} | "
                         f"{r.spec.num_rounds} | {r.final_accuracy:.2f} | {recent_text} | "
                         f"{best} | {_signed(paired.get(r.spec.seed))} |")
    lines.append("")
    if baseline is None:
        return lines
    table = suite.tables[0]
    lines += [f"## Paired difference to {baseline} (final accuracy, points)", "",
              f"Mean over the seeds both finished of (strategy − {baseline}) on the same seed; "
              "[k] = number of seeds.", "",
              "| Strategy | " + " | ".join(table.columns) + " |",
              "|---|" + "---|" * len(table.columns)]
    for label in table.rows:
        if label == baseline:
            continue
        texts = []
        for column in table.columns:
            found = by_key.get((label, column))
            paired = _paired(found, by_key, baseline) if found is not None else {}
            texts.append(f"{statistics.fmean(paired.values()):+.2f} [{len(paired)}]"
                         if paired else MISSING)
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    lines.append("")
    return lines


def results_json(suite: Suite, cells: Sequence[Cell]) -> dict[str, Any]:
    """``results.json``: the numbers behind the table and plots (accuracies in %)."""
    return {
        "suite": suite.name,
        "suite-file": suite.source,
        "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "main-setting": {"num-server-rounds": suite.main_rounds, "seeds": list(suite.seeds)},
        "runs-total": len(suite.runs),
        "runs-finished": sum(len(c.runs) for c in cells),
        "cells": [
            {
                "label": c.label,
                "column": c.column,
                "reference": c.reference,
                "num-server-rounds": c.num_rounds,
                "seeds-planned": [s.seed for s in c.planned],
                "seeds-finished": [r.spec.seed for r in c.runs],
                "runs": [r.spec.name for r in c.runs],
                "final-test-accuracy": [r.final_accuracy for r in c.runs],
                "best-test-accuracy": [r.best_accuracy for r in c.runs],
                f"last-{LAST_EVALS}-mean": [r.recent_mean for r in c.runs],
                "anme-mean": [r.anme_mean for r in c.runs],
                "wall-s": [r.wall_s for r in c.runs],
                "mean": c.mean,
                "std": c.std,
                "marked": c.marked,
                "note": c.note,
                "from-suite": c.source,
            }
            for c in cells
        ],
    }


def write_report(suite: Suite, out_dir: Path | None = None) -> ReportFiles:
    """Write ``table.md``, ``results.json``, ``accuracy.png``, ``anme.png``, ``milestones.md``,
    ``accuracy-per-seed.png`` and (where runs recorded diagnostics) ``diagnostics.png``.

    Parameters
    ----------
    suite : Suite
        The suite whose finished runs are read.
    out_dir : Path, optional
        Where to write (default: the suite's results folder).

    Raises
    ------
    ModuleNotFoundError
        When matplotlib is missing; ``table.md`` and ``results.json`` are written first.
    """
    out = Path(out_dir) if out_dir is not None else suite.results_dir
    out.mkdir(parents=True, exist_ok=True)
    cells = collect(suite)
    table = out / "table.md"
    table.write_text(markdown_report(suite, cells))
    results = out / "results.json"
    results.write_text(json.dumps(results_json(suite, cells), indent=2))
    milestones = out / "milestones.md"
    milestones.write_text(milestones_markdown(cells))
    accuracy = plot_accuracy(suite, cells, out / "accuracy.png")
    anme = plot_anme(suite, cells, out / "anme.png")
    extra = plot_diagnostics(cells, out / "diagnostics.png")
    per_seed = plot_per_seed(cells, out / "accuracy-per-seed.png")
    cosine_text = cosine_markdown(cells)
    cosine_table = None
    if cosine_text is not None:
        cosine_table = out / "fedavg-cosine.md"
        cosine_table.write_text(cosine_text)
    cosine_plot = plot_cosines(cells, out / "fedavg-cosine.png")
    return ReportFiles(table=table, results=results, accuracy_plot=accuracy, anme_plot=anme,
                       milestones=milestones, diagnostics_plot=extra, per_seed_plot=per_seed,
                       cosine_table=cosine_table, cosine_plot=cosine_plot)
