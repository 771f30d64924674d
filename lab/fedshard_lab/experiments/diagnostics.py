"""Report sections beyond the main table: accuracy at milestone rounds, and the per-round
diagnostics (``diagnostics``/``fedavg-cosine`` runs) as curves.

- ``milestones.md`` - per finished run: test accuracy (%) at rounds 10 and 20 (where evaluated),
  at its last round, and the mean of its last :data:`~fedshard_lab.experiments.cells.LAST_EVALS`
  evaluations; then the same per cell (mean over seeds).
- ``accuracy-per-seed.png`` - test accuracy against round, one panel per seed, one line per
  cell: the seeds' own curves, which the mean over seeds of ``accuracy.png`` hides (with a
  skewed split the seed moves every strategy alike).
- ``diagnostics.png`` - one panel per diagnostic any run recorded (:data:`DIAGNOSTICS`), one
  line per run: the accuracy of the global model against the accuracy of its top-⌈rN⌉
  truncation, the energy share of the terms no client could draw, and the FedAvg cosine.
- ``fedavg-cosine.md`` and ``fedavg-cosine.png`` - for the runs with ``fedavg-cosine``: the
  cosine between the server's update and FedAvg's (same start, same clients, dense copies),
  over all parameters and over the sharded layers only (where the strategies differ), as
  means over blocks of :data:`COSINE_BLOCK` rounds and as curves (paper, Sec. 4.4).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "COSINES",
    "COSINE_BLOCK",
    "DIAGNOSTICS",
    "MILESTONES",
    "cosine_markdown",
    "metric_curves",
    "milestones_markdown",
    "plot_cosines",
    "plot_diagnostics",
    "plot_per_seed",
]

#: Rounds whose accuracy the milestone table reports (besides the last round).
MILESTONES = (10, 20)
#: Per-round metrics drawn by :func:`plot_diagnostics` (metric -> panel title).
DIAGNOSTICS = {
    "test-accuracy-top-n": "test accuracy of the top-⌈rN⌉ truncation (%)",
    "tail-energy-top-n": "energy share beyond the top ⌈rN⌉ terms",
    "untrained-energy": "energy share of terms no client could draw",
    "fedavg-cosine": "cos(strategy update, FedAvg update)",
}
_PERCENT = ("test-accuracy", "test-accuracy-top-n")
#: The FedAvg-cosine metrics (metric -> what it covers) of ``fedavg-cosine.md``/``.png``.
COSINES = {
    "fedavg-cosine": "all parameters",
    "fedavg-cosine-sharded": "sharded layers only",
}
#: Rounds per block of the means in ``fedavg-cosine.md``.
COSINE_BLOCK = 10


def metric_curves(directory: Path, metrics: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """``metric -> [(round, value), ...]`` from a run's ``metrics.jsonl`` (finite values only;
    accuracies in %). A missing or unreadable file gives no curves; a line that is not a JSON
    object, or whose round is not a number, is skipped."""
    try:
        lines = (Path(directory) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, list[tuple[int, float]]] = {m: [] for m in metrics}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        try:
            server_round = int(row.get("round", 0))
        except (TypeError, ValueError, OverflowError):
            continue  # a row without a usable round cannot be placed on a curve
        for m in metrics:
            value = row.get(m)
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                out[m].append((server_round, 100.0 * value if m in _PERCENT
                               else float(value)))
    return {m: c for m, c in out.items() if c}


def _at(curve: Sequence[tuple[int, float]], server_round: int) -> float | None:
    return next((a for r, a in curve if r == server_round), None)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def milestones_markdown(cells: Sequence[Any]) -> str:
    """The milestone tables (see the module) for report cells (``cells.Cell``)."""
    heads = [f"Round {r}" for r in MILESTONES]
    lines = ["# Accuracy at milestone rounds", "",
             "Test accuracy (%) at rounds " + ", ".join(map(str, MILESTONES)) + ", at the last "
             "round, and the mean of the last five evaluations (rounds ≥ 1).", "",
             "| Strategy | Column | Seed | " + " | ".join(heads) + " | Last round | Last 5 |",
             "|---|---|---|" + "---|" * (len(heads) + 2)]
    summary = []
    for cell in cells:
        per_seed = []
        for run in cell.runs:
            values = [_at(run.curve, r) for r in MILESTONES]
            last = run.curve[-1] if run.curve else None
            per_seed.append([*values, last[1] if last else None, run.recent_mean])
            last_text = f"{last[1]:.2f} (r{last[0]})" if last else "—"
            lines.append(f"| {cell.label} | {cell.column or '(reference)'} | {run.spec.seed} | "
                         + " | ".join(_pct(v) for v in values)
                         + f" | {last_text} | {_pct(run.recent_mean)} |")
        if per_seed:
            means = []
            for col in zip(*per_seed, strict=True):
                got = [v for v in col if v is not None]
                means.append(statistics.fmean(got) if len(got) == len(col) else None)
            summary.append(f"| {cell.label} | {cell.column or '(reference)'} | "
                           f"{len(per_seed)} | " + " | ".join(_pct(v) for v in means) + " |")
    lines += ["", "Mean over the seeds that finished (— where a seed lacks the round):", "",
              "| Strategy | Column | Seeds | " + " | ".join(heads) + " | Last round | Last 5 |",
              "|---|---|---|" + "---|" * (len(heads) + 2), *summary, ""]
    return "\n".join(lines)


def plot_diagnostics(cells: Sequence[Any], path: Path) -> Path | None:
    """``diagnostics.png`` (see the module), or ``None`` when no run recorded a diagnostic."""
    runs = [(cell, run) for cell in cells for run in cell.runs]
    curves = {id(run): metric_curves(run.spec.directory, ["test-accuracy", *DIAGNOSTICS])
              for _, run in runs}
    present = [m for m in DIAGNOSTICS if any(m in c for c in curves.values())]
    if not present:
        return None
    from fedshard_lab.experiments.plots import _colors, _figure_legend, _fit_legends, _matplotlib

    _, Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5.2 * len(present), 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(present), squeeze=False)[0]
    names = [f"{c.label} / {c.column or 'ref'}" for c, _ in runs]
    colors = _colors(list(dict.fromkeys(names)))
    styles = ["-", "--", ":", "-."]
    for ax, metric in zip(axes, present, strict=True):
        for (_cell, run), name in zip(runs, names, strict=True):
            curve = curves[id(run)].get(metric)
            if not curve:
                continue
            ax.plot([r for r, _ in curve], [v for _, v in curve],
                    styles[run.spec.seed % len(styles)], color=colors[name], lw=1.3,
                    label=f"{name}, seed {run.spec.seed}")
            if metric == "test-accuracy-top-n":  # the model itself, thin, for comparison
                full = curves[id(run)].get("test-accuracy", [])
                ax.plot([r for r, _ in full], [v for _, v in full], styles[run.spec.seed % 4],
                        color=colors[name], lw=0.6, alpha=0.6)
        ax.set_title(DIAGNOSTICS[metric], fontsize="small")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    # One legend for all panels, below them (the same runs in every panel; under each panel
    # the legends covered the x-axis labels)
    _figure_legend(fig, axes, fontsize="x-small", ncols=min(4, len(present) + 1))
    fig.suptitle("Diagnostics per round (thin lines in the first panel: the global model itself)")
    _fit_legends(fig)
    fig.savefig(path, dpi=120)
    return path


def plot_per_seed(cells: Sequence[Any], path: Path) -> Path | None:
    """``accuracy-per-seed.png`` (see the module), or ``None`` when no run finished."""
    runs = [(cell, run) for cell in cells for run in cell.runs if run.curve]
    if not runs:
        return None
    from fedshard_lab.experiments.plots import _colors, _figure_legend, _fit_legends, _matplotlib

    _, Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib.ticker import MaxNLocator

    seeds = sorted({run.spec.seed for _, run in runs})
    several_columns = len({cell.column for cell, _ in runs}) > 1
    names = [cell.label + (f" / {cell.column or 'ref'}" if several_columns else "")
             for cell, _ in runs]
    colors = _colors(list(dict.fromkeys(names)))
    fig = Figure(figsize=(5.6 * len(seeds), 6.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(seeds), squeeze=False, sharey=True)[0]
    for ax, seed in zip(axes, seeds, strict=True):
        for (_cell, run), name in zip(runs, names, strict=True):
            if run.spec.seed == seed:
                ax.plot([r for r, _ in run.curve], [a for _, a in run.curve], color=colors[name],
                        lw=1.3, label=name)
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    # One legend below the panels (a colour is one cell in every panel; one legend per panel
    # ran into the next one)
    _figure_legend(fig, axes, fontsize="x-small", ncols=max(2, min(3, len(seeds) + 1)))
    fig.suptitle("Test accuracy per seed (each seed is its own data split and initial model)")
    _fit_legends(fig)
    fig.savefig(path, dpi=120)
    return path


def _cosine_runs(cells: Sequence[Any]) -> list[tuple[Any, Any, dict[str, list[tuple[int, float]]]]]:
    found = []
    for cell in cells:
        for run in cell.runs:
            curves = metric_curves(run.spec.directory, list(COSINES))
            if curves:
                found.append((cell, run, curves))
    return found


def cosine_markdown(cells: Sequence[Any]) -> str | None:
    """``fedavg-cosine.md`` (see the module), or ``None`` when no run recorded the cosine."""
    found = _cosine_runs(cells)
    if not found:
        return None
    last = max(r for _, _, curves in found for c in curves.values() for r, _ in c)
    blocks = [(lo, min(lo + COSINE_BLOCK - 1, last)) for lo in range(1, last + 1, COSINE_BLOCK)]
    spans = [*blocks, (1, last)] if len(blocks) > 1 else blocks
    heads = [f"rounds {lo}–{hi}" for lo, hi in blocks]
    heads += ["all rounds"] * (len(spans) - len(blocks))
    lines = ["# FedAvg cosine", "",
             "Mean over the rounds of cos(server update, FedAvg update): the strategy's update "
             "against the one FedAvg would have made from the same global model with the same "
             "clients training dense copies (paper, Sec. 4.4). Higher: closer to FedAvg.", ""]
    for metric, what in COSINES.items():
        lines += [f"## {what} (`{metric}`)", "",
                  "| Strategy | Column | Seed | " + " | ".join(heads) + " |",
                  "|---|---|---|" + "---|" * len(heads)]
        for cell, run, curves in found:
            curve = curves.get(metric, [])
            means = []
            for lo, hi in spans:
                got = [v for r, v in curve if lo <= r <= hi]
                means.append(f"{statistics.fmean(got):.3f}" if got else "—")
            lines.append(f"| {cell.label} | {cell.column or '(reference)'} | {run.spec.seed} | "
                         + " | ".join(means) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_cosines(cells: Sequence[Any], path: Path) -> Path | None:
    """``fedavg-cosine.png`` (see the module), or ``None`` when no run recorded the cosine."""
    found = _cosine_runs(cells)
    if not found:
        return None
    from fedshard_lab.experiments.plots import _colors, _figure_legend, _fit_legends, _matplotlib

    _, Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(COSINES), squeeze=False, sharey=True)[0]
    names = [f"{cell.label}, seed {run.spec.seed}" for cell, run, _ in found]
    colors = _colors(list(dict.fromkeys(names)))
    for ax, (metric, what) in zip(axes, COSINES.items(), strict=True):
        for (_cell, _run, curves), name in zip(found, names, strict=True):
            curve = curves.get(metric, [])
            if curve:
                ax.plot([r for r, _ in curve], [v for _, v in curve], color=colors[name],
                        lw=1.3, label=name)
        ax.set_title(f"cos(strategy update, FedAvg update): {what}", fontsize="small")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    # below the panels: inside them the legend covered the first rounds' curves
    _figure_legend(fig, axes, fontsize="small", ncols=min(4, len(names)))
    fig.suptitle("Agreement of each round's server update with FedAvg's (same clients)")
    _fit_legends(fig)
    fig.savefig(path, dpi=120)
    return path
