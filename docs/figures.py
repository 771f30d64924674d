"""Draw the documentation's figures from committed results and committed tables.

    python docs/figures.py                    # every figure, into docs/_static/
    python docs/figures.py accuracy paper     # some: accuracy, strategies, tail, paper, ...

Needs matplotlib (``pip install -e ".[plots]"``). No number is typed in here: each figure reads
its numbers from a committed file, and says which in its caption on the pages.

- ``accuracy-r0.1.png`` (README, Results, How sharding works): test accuracy against round at
  r = 0.1 for No sharding, Collective, Top-n and Top-n with a low-rank start, mean ± 1 std
  over the two seeds, drawn by the experiment report's own :func:`plot_accuracy` from the run
  folders of ``results/fmnist-table/`` and ``results/beyond/``.
- ``fmnist-r0.1.png`` (Results): which of the paper's strategies ends highest at r = 0.1:
  test accuracy against round of the five with two seeds in ``results/fmnist-table/``, and
  No sharding and r = 1 in black and grey, mean over the seeds (±1 std bands).
- ``untrained-energy.png`` (Results): why Top-n collapses: the energy share of the terms no
  client could draw, per round, for Top-n, Collective, the annealed Collective and the
  low-rank starts (``untrained-energy`` of the run folders in ``results/beyond/``).
- ``paper-vs-fedshard.png`` (Results): the paper's Table 1 at r = 0.1 next to fedshard's
  Fashion-MNIST table, from the table "The paper's Table 1 next to this one" in
  ``docs/results.md`` (its fedshard column is checked against
  ``results/fmnist-table/results.json``).
- ``performance.png`` (Performance): a client's step on a CPU against the dense step, by
  keep ratio (time, FLOPs, bytes, peak memory), from ``results/performance/client-step.json``.
- ``sharding.png`` (How sharding works): π and ω of each strategy for one illustrative
  spectrum, and one round's draw for ten clients, computed with :mod:`fedshard.sampling`.
- ``width-mlp.png`` and ``width-resnet.png`` (Spectral sharding or width slicing): the final
  test accuracy of every row of ``experiments/width-table.toml`` (one panel per budget) and of
  ``experiments/width-resnet.toml`` (with its compared spectral rows): each seed and the mean
  at full width, the width methods' narrow model at the width the nodes trained
  (``results/width-budget/narrow-eval.json``), and the dense model's mean.
- ``verdict.png`` (README, the front page, Which method for my devices): what to train for
  devices of unequal capacity: each federation's final test accuracy at full size of every
  row, mean ± 1 std and each seed, the small model and the whole model (which no weak device
  can run) marked, from ``results/mixed-capacity/table.json``.
- ``mixed-capacity.png`` (Which method for my devices): per mix of strong and weak devices,
  test accuracy against round of every row, and each final model's accuracy against the
  forward FLOPs of the model a device of each budget runs, from ``results/mixed-capacity/``
  (runs and ``table.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "docs" / "_static"
sys.path.insert(0, str(ROOT))  # the checkout's fedshard, installed or not

# Colours of the strategies, the same in every figure (tab10 order).
COLOURS = {
    "Top-n": "tab:blue",
    "Top-n + Scaled": "tab:cyan",
    "PriSM": "tab:green",
    "PriSM + Scaled": "tab:olive",
    "PriSM + Wallenius": "tab:purple",
    "PriSM + Wallenius + ClipLR": "tab:brown",
    "Unbiased": "tab:pink",
    "Collective": "tab:red",
}


# ---------------------------------------------------------------------------------- tables
def markdown_table(page: Path, first_header: str) -> list[list[str]]:
    """The rows (header row first) of the Markdown table in ``page`` whose first header cell
    is ``first_header``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if _cells(line)[:1] == [first_header]:
            rows = [_cells(line)]
            for row in lines[i + 2:]:  # skip the |---| line
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            return rows
    raise SystemExit(f"{page}: no Markdown table whose first header cell is {first_header!r}")


def _cells(line: str) -> list[str]:
    if not line.startswith("|"):
        return []
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


_NUMBER = re.compile(r"(\d+(?:\.\d+)?)(?:\s*[–-]\s*(\d+(?:\.\d+)?))?(?:\s*±\s*(\d+(?:\.\d+)?))?")


def number(cell: str) -> tuple[float, float, float | None] | None:
    """``(low, high, std)`` of a table cell: ``"4.83–4.84"``, ``"**0.277** (265 ms ...)"``,
    ``"82.59 ± 0.27"``, ``"73.1 †"``; ``None`` for an empty cell or one without a number."""
    found = _NUMBER.search(cell.replace("*", ""))
    if found is None:
        return None
    low = float(found.group(1))
    high = float(found.group(2)) if found.group(2) else low
    std = float(found.group(3)) if found.group(3) else None
    return low, high, std


# ---------------------------------------------------------------------------------- figures
def figure_accuracy(out: Path) -> Path:
    """README's figure, drawn by the experiment report's plot_accuracy."""
    from fedshard_lab.experiments import collect, load_suite
    from fedshard_lab.experiments.report import plot_accuracy
    from fedshard_lab.experiments.suite import TableSpec

    table = load_suite(ROOT / "experiments" / "fmnist-table.toml", app_dir=ROOT)
    beyond = load_suite(ROOT / "experiments" / "beyond.toml", app_dir=ROOT)
    from_table = {(c.label, c.column): c for c in collect(table)}
    from_beyond = {(c.label, c.column): c for c in collect(beyond)}
    chosen = {
        "Collective": from_table.get(("Collective", "r = 0.1")),
        "Top-n": from_table.get(("Top-n", "r = 0.1")),
        "Top-n, low-rank start (ρ = 0.1)": from_beyond.get(("Top-n, low-rank start", "r = 0.1")),
        "No sharding": from_table.get(("No sharding", None)),
    }
    for label, cell in chosen.items():
        if cell is None or len(cell.runs) != 2:
            found = "no finished run" if cell is None else f"{len(cell.runs)} finished run(s)"
            raise SystemExit(f"{label}: {found} in results/ where 2 seeds were committed; "
                             "`python -m fedshard_lab.experiments status fmnist-table` (and "
                             "beyond) says why")
    renamed = [dataclasses.replace(cell, label=label) for label, cell in chosen.items()
               if cell is not None]
    suite = dataclasses.replace(
        table, name="Fashion-MNIST, ResNet-18 (GroupNorm, width 16), 100 clients",
        tables=(TableSpec("r = 0.1", ("Collective", "Top-n", "Top-n, low-rank start (ρ = 0.1)"),
                          ("r = 0.1",)),),
        reference_rows=("No sharding",), comparisons=())
    return plot_accuracy(suite, renamed, out / "accuracy-r0.1.png")


def figure_width(out: Path) -> Path:
    """The width tables' accuracy curves (every run of width-table must be finished;
    width-resnet's finished runs are drawn, the legend counts their seeds)."""
    from fedshard_lab.experiments import collect, load_suite

    written = []
    for name, png, title in (
            ("width-table", "width-mlp.png", "Fashion-MNIST, MLP (width 256), 100 clients"),
            ("width-resnet", "width-resnet.png",
             "Fashion-MNIST, ResNet-18 (GroupNorm, width 16), 100 clients")):
        suite = load_suite(ROOT / "experiments" / f"{name}.toml", app_dir=ROOT)
        cells = collect(suite)
        short = [f"{c.label} / {c.column}: {len(c.runs)} of {len(suite.seeds)} seeds"
                 for c in cells if len(c.runs) != len(suite.seeds)]
        if short and name == "width-table":
            raise SystemExit(f"{name}: unfinished cells ({'; '.join(short[:5])}); "
                             f"`python -m fedshard_lab.experiments status {name}` says why")
        written.append(_final_dots(suite.name, cells, out / png, title))
    return written[0]


def _final_dots(name: str, cells: Sequence[Any], path: Path, title: str) -> Path:
    """Per column, each row's final test accuracy: one dot per seed and the mean (a bar), at
    full width and, for the width methods, at the width the nodes trained
    (``results/width-budget/narrow-eval.json``, ``benchmarks/width_eval.py``); the dense
    model's mean as a dashed line. Curves of rows that end within a point or two of each
    other cannot be told apart; their final values can."""
    from fedshard_lab.experiments.plots import _matplotlib

    narrow_path = ROOT / "results" / "width-budget" / "narrow-eval.json"
    narrow = json.loads(narrow_path.read_text())["runs"] if narrow_path.is_file() else {}
    columns = list(dict.fromkeys(c.column for c in cells if c.column is not None and c.runs))
    rows = list(dict.fromkeys(c.label for c in cells if c.column is not None and c.runs))
    reference = [c for c in cells if c.column is None and c.runs]
    _, Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(max(4.6 * len(columns), 8.5), 1.8 + 0.42 * len(rows)),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(columns), sharey=True, sharex=True, squeeze=False)[0]
    for ax, column in zip(axes, columns, strict=True):
        for y, label in enumerate(rows):
            cell = next((c for c in cells if (c.label, c.column) == (label, column)), None)
            if cell is None or not cell.runs:
                continue
            full = [r.final_accuracy for r in cell.runs]
            ax.plot(full, [y] * len(full), "o", mfc="none", mec="C0", ms=5)
            ax.plot([statistics.mean(full)] * 2, [y - 0.3, y + 0.3], color="C0", lw=2.5)
            trained = [100 * narrow[key]["test-accuracy-trained-width"] for r in cell.runs
                       if (key := f"{name}/{r.spec.name}") in narrow
                       and narrow[key]["trained-width"] != narrow[key]["full-width"]]
            if trained:
                ax.plot(trained, [y] * len(trained), "s", color="C3", ms=5)
                ax.plot([statistics.mean(trained)] * 2, [y - 0.3, y + 0.3], color="C3", lw=2.5)
        for cell in reference:
            ax.axvline(statistics.mean(r.final_accuracy for r in cell.runs), color="0.3",
                       ls="--", lw=1.2)
        ax.set_title(column, fontsize="medium")
        ax.set_xlabel("final test accuracy (%)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(rows)), rows, fontsize="small")
    axes[0].invert_yaxis()
    handles = [axes[0].plot([], [], "o", mfc="none", mec="C0")[0],
               axes[0].plot([], [], "s", color="C3")[0],
               axes[0].plot([], [], "--", color="0.3")[0]]
    labels = ["global model at full width: each seed, bar: mean",
              "the width the nodes trained (the width methods' narrow model)",
              " / ".join(f"{c.label} (mean)" for c in reference) or "reference"]
    fig.legend(handles, labels, loc="outside lower center", ncol=3 if len(columns) > 1 else 1,
               fontsize="small")
    fig.suptitle(f"{title}: final test accuracy", fontsize="medium")
    fig.savefig(path, dpi=100)
    return path


#: Line styles of the strategies: with the colours, each line reads apart from its
#: neighbours in grey print and for colour-blind readers too.
STYLES = {
    "Top-n": "-",
    "PriSM": "-.",
    "PriSM + Wallenius + ClipLR": (0, (5, 1.5, 1, 1.5, 1, 1.5)),
    "Unbiased": ":",
    "Collective": "-",
}
#: The references, in black and grey: never confused with a strategy's colour.
REFERENCE_STYLES = {"No sharding": ("black", "--"), "r = 1": ("0.45", (0, (1, 1.5)))}


def _seed_mean(curves: Sequence[Sequence[tuple[int, float]]]
               ) -> tuple[list[int], list[float], list[float]]:
    """Rounds present in every curve, the mean over the curves and their std (0 with one)."""
    per = [dict(c) for c in curves]
    rounds = sorted(set.intersection(*(set(c) for c in per)))
    means = [sum(c[r] for c in per) / len(per) for r in rounds]
    stds = [statistics.stdev(c[r] for c in per) if len(per) > 1 else 0.0 for r in rounds]
    return rounds, means, stds


def _two_seeds(cells: dict[tuple[str, str | None], Any], key: tuple[str, str | None],
               suite: str) -> Any:
    cell = cells.get(key)
    if cell is None or len(cell.runs) != 2:
        found = "no finished run" if cell is None else f"{len(cell.runs)} finished run(s)"
        raise SystemExit(f"{key[0]}: {found} in results/{suite}/ where 2 seeds were "
                         f"committed; `python -m fedshard_lab.experiments status {suite}` says why")
    return cell


def figure_strategies(out: Path) -> Path:
    """Which of the paper's strategies ends highest at r = 0.1: the five with two seeds in
    ``results/fmnist-table/`` and the two references, each line its own colour and style."""
    from fedshard_lab.experiments import collect, load_suite
    from fedshard_lab.experiments.plots import _matplotlib

    suite = load_suite(ROOT / "experiments" / "fmnist-table.toml", app_dir=ROOT)
    cells = {(c.label, c.column): c for c in collect(suite)}
    _, Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(8.0, 5.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, (colour, style) in REFERENCE_STYLES.items():
        cell = _two_seeds(cells, (label, None), "fmnist-table")
        rounds, mean, _ = _seed_mean([r.curve for r in cell.runs])
        ax.plot(rounds, mean, color=colour, ls=style, lw=1.6, label=f"{label} (reference)")
    for label, style in STYLES.items():
        cell = _two_seeds(cells, (label, "r = 0.1"), "fmnist-table")
        rounds, mean, std = _seed_mean([r.curve for r in cell.runs])
        ax.plot(rounds, mean, color=COLOURS[label], ls=style, lw=2.0, label=label)
        ax.fill_between(rounds, [m - s for m, s in zip(mean, std, strict=True)],
                        [m + s for m, s in zip(mean, std, strict=True)],
                        color=COLOURS[label], alpha=0.10, lw=0)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_xlim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small", ncols=2)
    ax.set_title("Fashion-MNIST, ResNet-18, r = 0.1: test accuracy per round\n"
                 "(mean over 2 seeds; band ±1 std)", fontsize="medium")
    path = out / "fmnist-r0.1.png"
    fig.savefig(path, dpi=110)
    return path


#: The runs of ``results/beyond/`` whose untrained energy tells why Top-n collapses.
TAIL_RUNS = {
    "Top-n": ("tab:blue", "-"),
    "Top-n, low-rank start 0.3": ("tab:cyan", "-."),
    "Anneal-Collective": ("tab:orange", "--"),
    "Collective": ("tab:red", "-"),
    "Top-n, low-rank start": ("tab:green", ":"),
}


def figure_tail(out: Path) -> Path:
    """How much of the sharded layers' energy lies in terms no client could draw, per round:
    the untrained tail Top-n keeps (``untrained-energy`` of the runs in ``results/beyond/``)."""
    from fedshard_lab.experiments import collect, load_suite
    from fedshard_lab.experiments.diagnostics import metric_curves
    from fedshard_lab.experiments.plots import _matplotlib

    suite = load_suite(ROOT / "experiments" / "beyond.toml", app_dir=ROOT)
    cells = {(c.label, c.column): c for c in collect(suite)}
    _, Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(8.0, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, (colour, style) in TAIL_RUNS.items():
        cell = _two_seeds(cells, (label, "r = 0.1"), "beyond")
        curves = [metric_curves(r.spec.directory, ["untrained-energy"]).get("untrained-energy")
                  for r in cell.runs]
        found = [c for c in curves if c]
        if len(found) != len(curves):
            raise SystemExit(f"{label}: a run in results/beyond/ has no untrained-energy")
        rounds, mean, _ = _seed_mean(found)
        name = {"Top-n, low-rank start": "Top-n, low-rank start (ρ = 0.1)",
                "Top-n, low-rank start 0.3": "Top-n, low-rank start (ρ = 0.3)"}.get(label, label)
        # markers: the ρ = 0.1 start's line lies on Collective's, both near 0
        marks = {"marker": "o", "ms": 4, "markevery": 10} if style == ":" else {}
        ax.plot(rounds, mean, color=colour, ls=style, lw=2.0, label=name, **marks)
    ax.set_xlabel("round")
    ax.set_ylabel("energy share of terms no client could draw")
    ax.set_xlim(0, 100)
    ax.set_ylim(-0.03, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", bbox_to_anchor=(1.0, 0.32), fontsize="small")
    ax.set_title("Fashion-MNIST, ResNet-18, r = 0.1: the untrained part of the sharded layers\n"
                 "(mean over 2 seeds)", fontsize="medium")
    path = out / "untrained-energy.png"
    fig.savefig(path, dpi=110)
    return path


PAPER_COLUMNS = ("CIFAR-10, ResNet-18", "TinyImageNet, CCT", "CIFAR-100, ResNet-18",
                 "CIFAR-100, CCT", "Shakespeare, GPT")


def figure_paper(out: Path) -> Path:
    """The paper's Table 1 at r = 0.1 next to fedshard's Fashion-MNIST table."""
    from fedshard_lab.experiments.plots import _matplotlib

    rows = markdown_table(ROOT / "docs" / "results.md", "r = 0.1 (final test accuracy, %)")
    header = rows[0]
    fed_col = len(header) - 1  # the last column is fedshard's
    _check_fedshard_column(rows, fed_col)
    _, Figure, FigureCanvasAgg = _matplotlib()
    panels = list(range(1, len(header)))
    fig = Figure(figsize=(13.5, 7.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, math.ceil(len(panels) / 2), squeeze=False).ravel()
    strategies = [r for r in rows[1:] if r[0] in COLOURS]
    references = [r for r in rows[1:] if r[0] not in COLOURS]
    for ax, col in zip(axes, panels, strict=False):
        ys = list(range(len(strategies)))[::-1]
        values = [number(r[col]) for r in strategies]
        for y, row, value in zip(ys, strategies, values, strict=True):
            if value is None:
                continue
            mean, std = value[0], value[2] or 0.0
            # points, not bars: the axis does not start at 0
            ax.errorbar(mean, y, xerr=std, fmt="o", color=COLOURS[row[0]], capsize=3, ms=6)
            one_seed = " †" if "†" in row[col] else ""
            ax.text(mean + std, y + 0.22, f" {mean:.1f}{one_seed}", va="bottom",
                    fontsize="x-small")
        for row, style in zip(references, ("--", ":"), strict=False):
            value = number(row[col])
            if value is not None:
                ax.axvline(value[0], color="0.3", ls=style, lw=1.2, label=row[0])
        drawn = [v[0] + (v[2] or 0.0) for v in values if v is not None]
        lows = [v[0] - (v[2] or 0.0) for v in values if v is not None]
        refs = [v[0] for v in (number(r[col]) for r in references) if v is not None]
        ax.set_xlim(max(0.0, min(lows) - 4), max(drawn + refs) + 5)
        ax.set_ylim(-0.7, len(strategies) - 0.2)
        ax.set_yticks(ys, [r[0] for r in strategies] if col in (1, 4) else [])
        ref_text = ", ".join(f"{r[0]} {number(r[col])[0]:.1f}"  # type: ignore[index]
                             for r in references if number(r[col]) is not None)
        ax.set_title(f"{header[col]}\n{ref_text}", fontsize="small")
        ax.set_xlabel("test accuracy (%)", fontsize="small")
        ax.grid(axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="small")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("Keep ratio r = 0.1: the paper's Table 1 (3 seeds, mean ± std) and fedshard's "
                 "Fashion-MNIST table (2 seeds; † 1 seed)")
    path = out / "paper-vs-fedshard.png"
    fig.savefig(path, dpi=110)
    return path


def _check_fedshard_column(rows: Sequence[Sequence[str]], col: int) -> None:
    """The page's fedshard column must be the committed report's numbers."""
    data = json.loads((ROOT / "results" / "fmnist-table" / "results.json").read_text())
    means = {(c["label"], c["column"]): c["mean"] for c in data["cells"]}
    for row in rows[1:]:
        key = (row[0], "r = 0.1") if row[0] in COLOURS else (row[0], None)
        value = number(row[col])
        if value is None or key not in means:
            continue
        if abs(value[0] - means[key]) > 0.051:
            raise SystemExit(f"docs/results.md says {row[0]} = {value[0]} but "
                             f"results/fmnist-table/results.json has {means[key]:.2f}")


def figure_performance(out: Path) -> Path:
    """The client step on a CPU against the dense one, by keep ratio, from its record."""
    from fedshard_lab.experiments.plots import _matplotlib

    record = json.loads((ROOT / "results" / "performance" / "client-step.json").read_text())
    keys = sorted((k.removeprefix("step_time_ratio_r") for k in record
                   if k.startswith("step_time_ratio_r")), key=float)
    ratios = [float(k) for k in keys]
    _, Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    series = {  # record key prefix -> legend label, style, colour
        "step_time_ratio_r": ("step time", "o-", "black"),
        "flop_ratio_r": ("FLOPs", "s--", "tab:orange"),
        "bytes_ratio_r": ("bytes received", "^:", "tab:green"),
        "rss_peak_ratio_r": ("peak memory (RSS)", "d-", "tab:purple"),
    }
    flops = [record["flop_ratio_r" + k] for k in keys]
    sent = [record["bytes_ratio_r" + k] for k in keys]
    if max(abs(a - b) for a, b in zip(flops, sent, strict=True)) < 0.02:
        # within 0.02 of each other at every r: one line, named for both (two would hide
        # one another)
        series.pop("bytes_ratio_r")
        series["flop_ratio_r"] = ("FLOPs and bytes received (within 0.02 of each other)",
                                  "s--", "tab:orange")
    for prefix, (label, style, colour) in series.items():
        values = [record[prefix + k] for k in keys]
        ax.plot(ratios, values, style, color=colour, label=label)
        for r, v in zip(ratios, values, strict=True):
            ax.annotate(f"{v:.2f}", (r, v), textcoords="offset points", xytext=(6, -10),
                        fontsize="x-small", color=colour)
    ax.axhline(1.0, color="0.3", ls="--", lw=1)
    ax.set_xlabel("keep ratio r")
    ax.set_ylabel("× the dense model")
    ax.set_xticks(ratios)
    ax.margins(x=0.08, y=0.08)
    setup = record["setup"]
    ax.set_title(f"One client step against the dense one: ResNet-18 width "
                 f"{setup['model'].split('=')[1].rstrip(')')}, batch {setup['input'][0]}\n"
                 f"{record['cores']}-core {record['cpu']}, {setup['threads']} torch "
                 f"thread(s), torch {record['torch']}, {record['date']}", fontsize="small")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")
    path = out / "performance.png"
    fig.savefig(path, dpi=110)
    return path


def figure_sharding(out: Path) -> Path:
    """π and ω of each strategy for one spectrum; one round's draw for ten clients."""
    import numpy as np

    from fedshard.sampling import draw_subsets, inclusion_probabilities
    from fedshard_lab.experiments.plots import _matplotlib

    num_terms, clients, keep = 40, 10, 0.2
    n = math.ceil(keep * num_terms)
    lam = np.arange(1, num_terms + 1, dtype=float) ** -0.7  # illustrative, decaying
    methods = {
        "Top-n": ("top-n", {}),
        "PriSM": ("prism", {}),
        "PriSM + Wallenius": ("prism-wallenius", {}),
        "Unbiased": ("unbiased", {}),
        "Collective": ("collective", {"num_clients": clients}),
    }
    found = {name: inclusion_probabilities(lam, n, method, **kw)
             for name, (method, kw) in methods.items()}
    _, Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(13.5, 6.4), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 4)
    ax_lam = fig.add_subplot(grid[0, 0])
    ax_pi = fig.add_subplot(grid[0, 1])
    ax_omega = fig.add_subplot(grid[0, 2:])
    terms = np.arange(1, num_terms + 1)
    ax_lam.bar(terms, lam, color="0.5")
    ax_lam.set_title(f"a layer's spectrum λ (N = {num_terms})", fontsize="small")
    ax_lam.set_xlabel("term i (largest λ first)")
    styles: dict[str, Any] = {"Top-n": "-", "PriSM": "-", "PriSM + Wallenius": ":",
                              "Unbiased": "-", "Collective": "-"}
    for name, (pi, omega) in found.items():
        ax_pi.plot(terms, pi, styles[name], color=COLOURS[name], lw=1.6, label=name)
        kept = pi > 0
        ax_omega.plot(terms[kept], omega[kept], styles[name], color=COLOURS[name], lw=1.6,
                      label=name)
    ax_pi.set_title(f"inclusion probability πᵢ (Σ πᵢ = n = {n})", fontsize="small")
    ax_pi.set_xlabel("term i")
    ax_pi.legend(fontsize="x-small", loc="upper right")
    ax_omega.set_yscale("log")
    ax_omega.axhline(clients, color="0.3", ls="--", lw=1)
    ax_omega.text(1, clients, f"C = {clients}", va="bottom", ha="left", fontsize="x-small")
    ax_omega.set_title("multiplier ωᵢ of a drawn term (Top-n, PriSM: 1; Unbiased, "
                       "PriSM + Wallenius: 1/πᵢ; Collective: C/(1 + πᵢ(C − 1)))",
                       fontsize="small")
    ax_omega.set_xlabel("term i")
    for ax in (ax_lam, ax_pi, ax_omega):
        ax.grid(alpha=0.3)
    draws: dict[str, str | None] = {"Top-n": "top-n", "PriSM": None, "Unbiased": "cps",
                                    "Collective": "cps"}
    rng = np.random.default_rng(0)
    for k, (name, design) in enumerate(draws.items()):
        ax = fig.add_subplot(grid[1, k])
        pi = found[name][0]
        if design is None:  # PriSM draws successively, ∝ λ^k
            from fedshard.sampling import default_prism_exponent, successive_sample

            weights = (lam / lam.max()) ** default_prism_exponent(n, num_terms)
            subsets = successive_sample(weights, n, clients, rng=rng)
        else:
            subsets = draw_subsets(pi, clients, design=design, rng=rng)
        held = np.zeros((clients, num_terms))
        for c, subset in enumerate(subsets):
            held[c, subset] = 1.0
        ax.imshow(held, aspect="auto", cmap="Greys", vmin=0, vmax=1.4,
                  extent=(0.5, num_terms + 0.5, clients + 0.5, 0.5), interpolation="nearest")
        ax.set_title(f"{name}: the terms of {clients} clients, one round", fontsize="small")
        ax.set_xlabel("term i")
        if k == 0:
            ax.set_ylabel("client")
    fig.suptitle(f"Which terms a client trains, and with what weight: one layer, keep ratio "
                 f"r = {keep} (n = ⌈rN⌉ = {n} of N = {num_terms} terms)\n"
                 f"an illustrative spectrum λᵢ = i^−0.7; Collective with C = {clients} clients "
                 "sharing r")
    path = out / "sharding.png"
    fig.savefig(path, dpi=110)
    return path


#: Rows of the mixed-capacity suite: (colour, line style, marker). Spectral rows in colour,
#: width rows in blues and greens with dashes, the baselines a team would try without any
#: method in black and grey.
MIXED_STYLES: dict[str, tuple[str, Any, str]] = {
    "Collective": ("tab:red", "-", "o"),
    "Unbiased": ("tab:pink", ":", "o"),
    "Top-n, low-rank start": ("tab:orange", "-.", "o"),
    "PriSM + Wallenius + ClipLR": ("tab:brown", (0, (5, 1.5, 1, 1.5)), "o"),
    "HeteroFL": ("tab:blue", "--", "s"),
    "FedRolex": ("tab:cyan", "--", "s"),
    "Ordered dropout": ("tab:green", "--", "s"),
    "Small model": ("black", "-", "^"),
    "Strong devices only": ("0.45", "-", "v"),
    "Strong devices only, 10 a round": ("0.3", "--", "v"),
    "Whole model, every node": ("0.7", (0, (1, 1.5)), "D"),
}
SPECTRAL_ROWS = ("Collective", "Unbiased", "Top-n, low-rank start", "PriSM + Wallenius + ClipLR",
                 "Strong devices only", "Strong devices only, 10 a round",
                 "Whole model, every node")


def _deployed_flops(table: dict[str, Any], label: str, budget: str, weakest: float) -> float:
    """Forward FLOPs per example of the model a device of ``budget`` runs for ``label``."""
    costs = table["costs"]
    if label == "Small model":  # one narrow model, the width of the weakest device's budget
        return float(costs["ratios"][f"{weakest:g}"]["width-same-flops"]["forward-flops"])
    if budget == "full":
        return float(costs["dense"]["forward-flops"])
    at = costs["ratios"][budget.removeprefix("r")]
    kind = "spectral" if label in SPECTRAL_ROWS else "width-same-flops"
    return float(at[kind]["forward-flops"])


def figure_verdict(out: Path) -> Path:
    """The headline: per federation, every row's final full-size test accuracy (mean ± 1 std,
    and each seed as a dot), best first; the small model in its own colour, the whole model
    trained by every node (a model no weak device can run) hatched
    (``results/mixed-capacity/table.json``, written by ``benchmarks/mixed_capacity.py``)."""
    from fedshard_lab.experiments.plots import _matplotlib

    table = json.loads((ROOT / "results" / "mixed-capacity" / "table.json").read_text())
    columns = list(table["statistics"])
    kinds = {"Small model": ("tab:green", "the small model, every node"),
             "Whole model, every node": ("0.8", "the whole model, every node (no weak device "
                                                "can run it)")}
    kinds.update({label: ("tab:blue", "spectral sharding") for label in
                  ("Collective", "Unbiased", "Top-n, low-rank start",
                   "PriSM + Wallenius + ClipLR")})
    kinds.update({label: ("tab:orange", "width slicing") for label in
                  ("HeteroFL", "FedRolex", "Ordered dropout")})
    kinds.update({label: ("tab:purple", "the whole model, strong devices only") for label in
                  ("Strong devices only", "Strong devices only, 10 a round")})
    sizes = [len(table["statistics"][c]["full"]) for c in columns]
    _, Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(8.5, 1.2 + 0.32 * sum(sizes) + 0.5 * len(columns)),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(columns), 1, sharex=True, height_ratios=sizes, squeeze=False)
    seen: dict[str, Any] = {}
    for ax, column in zip(axes[:, 0], columns, strict=True):
        rows = table["statistics"][column]["full"]
        order = sorted(rows, key=lambda label: rows[label]["mean"])
        for y, label in enumerate(order):
            entry = rows[label]
            colour, kind = kinds.get(label, ("0.5", "other"))
            bar = ax.barh(y, 100 * entry["mean"], xerr=100 * entry.get("std", 0.0),
                          color=colour, edgecolor="0.3", capsize=2, height=0.7,
                          hatch="//" if label == "Whole model, every node" else None)
            seen.setdefault(kind, bar)
            seeds = [100 * v for v in entry["seeds"].values()]
            ax.plot(seeds, [y] * len(seeds), "k.", ms=3)
        ax.set_yticks(range(len(order)), order, fontsize="small")
        ax.set_title(column, fontsize="medium", loc="left")
        ax.set_xlim(0, 100)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("final test accuracy at full size (%): mean ± 1 std over 3 seeds, "
                           "dots: each seed")
    fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncol=2,
               fontsize="small")
    fig.suptitle("Devices of unequal capacity: Fashion-MNIST, ResNet-18 (GroupNorm, width 16), "
                 "100 nodes, 60 rounds", fontsize="medium")
    path = out / "verdict.png"
    fig.savefig(path, dpi=100)
    return path


def figure_mixed_capacity(out: Path) -> Path:
    """Where spectral sharding pays: test accuracy per round of every row of each mix (full
    size, mean over the finished seeds), and each model's final accuracy against the forward
    FLOPs of the model a device of each budget runs (``results/mixed-capacity/table.json``,
    written by ``benchmarks/mixed_capacity.py``)."""
    from fedshard_lab.experiments import collect, load_suite
    from fedshard_lab.experiments.plots import _matplotlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mixed_capacity import SAME_RUN

    table_path = ROOT / "results" / "mixed-capacity" / "table.json"
    if not table_path.is_file():
        raise SystemExit(f"{table_path} is missing: write it with `python "
                         "benchmarks/mixed_capacity.py results/mixed-capacity --costs --out "
                         f"{table_path.relative_to(ROOT)}`")
    table = json.loads(table_path.read_text())
    suite = load_suite(ROOT / "experiments" / "mixed-capacity.toml", app_dir=ROOT)
    cells = [c for c in collect(suite) if c.runs]
    columns = list(dict.fromkeys(c.column for c in cells if c.column is not None))
    _, Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(5.0 * len(columns), 10.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(columns), squeeze=False)
    for k, column in enumerate(columns):
        ax = axes[0][k]
        # the reference row (every node trains the whole model) has no column: it is the
        # same runs in each; a cell that is another cell's runs (SAME_RUN) draws those
        shown = [c for c in cells if c.column in (column, None)]
        shown += [c for (_, col), (from_label, from_col) in SAME_RUN.items()
                  if col == column for c in cells
                  if (c.label, c.column) == (from_label, from_col)]
        for cell in shown:
            colour, style, _ = MIXED_STYLES[cell.label]
            rounds, mean, std = _seed_mean([r.curve for r in cell.runs])
            ax.plot(rounds, mean, color=colour, ls=style, lw=1.8, label=cell.label)
            ax.fill_between(rounds, [m - d for m, d in zip(mean, std, strict=True)],
                            [m + d for m, d in zip(mean, std, strict=True)], color=colour,
                            alpha=0.12, lw=0)
        ax.set_title(f"{column}: each row's global model", fontsize="medium")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(0, 80)
        ax.grid(alpha=0.3)
        ax = axes[1][k]
        budgets = table["statistics"].get(column, {})
        ratios = [float(b.removeprefix("r")) for b in budgets if b != "full"]
        weakest = min(ratios, default=1.0)
        for label, (colour, _, marker) in MIXED_STYLES.items():
            points = sorted((_deployed_flops(table, label, budget, weakest),
                             100 * entries[label]["mean"])
                            for budget, entries in budgets.items() if label in entries)
            if points:
                ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], color=colour,
                        marker=marker, lw=1.0, label=label)
        ax.set_xscale("log")
        ax.set_title(f"{column}: the model each device runs", fontsize="medium")
        ax.set_xlabel("forward MFLOPs per example of that model (log)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(0, 80)
        ax.grid(alpha=0.3)
    # one legend for every panel, outside them (the styles are the rows')
    handles: dict[str, Any] = {}
    for ax in axes.ravel():
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=4,
               fontsize="small")
    seeds = sorted({len(c.runs) for c in cells})
    fig.suptitle("Fashion-MNIST, ResNet-18 (GroupNorm, width 16), 100 nodes, "
                 f"{suite.runs[0].num_rounds} rounds: mean over {'/'.join(map(str, seeds))} "
                 "seeds, band: ± 1 std (top)", fontsize="medium")
    path = out / "mixed-capacity.png"
    fig.savefig(path, dpi=100)
    return path


FIGURES: dict[str, Callable[[Path], Path]] = {
    "accuracy": figure_accuracy,
    "strategies": figure_strategies,
    "tail": figure_tail,
    "paper": figure_paper,
    "performance": figure_performance,
    "sharding": figure_sharding,
    "width": figure_width,
    "mixed-capacity": figure_mixed_capacity,
    "verdict": figure_verdict,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", nargs="*", metavar="FIGURE",
                        help=f"which figures ({', '.join(FIGURES)}); default: all")
    parser.add_argument("--out", type=Path, default=STATIC,
                        help="where to write them (default: docs/_static)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.figures if name not in FIGURES]
    if unknown:
        parser.error(f"no figure {', '.join(map(repr, unknown))}; expected some of "
                     f"{', '.join(FIGURES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.figures or FIGURES:
        print(f"wrote {FIGURES[name](args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
