"""The report's main plots: ``accuracy.png`` (test accuracy against round, one panel per
column of the main table, mean over seeds ± 1 std) and ``anme.png`` (ANME per strategy and
column); and the matplotlib helpers every report plot uses (:mod:`.diagnostics` too).

matplotlib is optional (``pip install 'fedshard[plots]'``): :func:`_matplotlib` says so
clearly when it is missing; ``table.md`` and ``results.json`` never need it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedshard_lab.experiments.suite import Suite

if TYPE_CHECKING:
    from fedshard_lab.experiments.cells import Cell

__all__ = ["plot_accuracy", "plot_anme"]


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ModuleNotFoundError(
            f"the report's plots need matplotlib, which cannot be imported ({err}); install "
            "it with `pip install 'fedshard[plots]'`. table.md and results.json do not need it."
        ) from err
    return matplotlib, Figure, FigureCanvasAgg


def _colors(labels: Sequence[str]) -> dict[str, Any]:
    """One colour per label: ten distinct hues first, then their light shades.

    ``tab20`` pairs each hue with its light shade (0/1, 2/3, ...); taken in that order, the
    6th and 7th labels (e.g. Unbiased and Collective) would be two shades of red.
    """
    matplotlib, _, _ = _matplotlib()
    cmap = matplotlib.colormaps["tab20"]
    order = list(range(0, 20, 2)) + list(range(1, 20, 2))  # dark hues, then light ones
    return {label: cmap(order[i % len(order)]) for i, label in enumerate(labels)}


#: Gap between a panel's bottom edge and the legend below it, in inches: room for the tick
#: labels and the x-axis label whatever the panel's height (a gap in axes units shrank with
#: the panel, and the legend covered the label).
LEGEND_GAP_IN = 0.55
#: The smallest panel height (inches) :func:`_fit_legends` leaves next to the legends.
MIN_PANEL_IN = 3.0


def _legend_below(ax: Any, **kwargs: Any) -> Any:
    """A legend centred below ``ax``, :data:`LEGEND_GAP_IN` under its bottom edge."""
    from matplotlib.transforms import ScaledTranslation

    below = ax.transAxes + ScaledTranslation(0.0, -LEGEND_GAP_IN, ax.figure.dpi_scale_trans)
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below,
                     **kwargs)


def _figure_legend(fig: Any, axes: Sequence[Any], **kwargs: Any) -> Any:
    """One legend below every panel, for the labels of all of them (each label once)."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    if not entries:
        return None
    return fig.legend(list(entries.values()), list(entries), loc="outside lower center",
                      **kwargs)


def _fit_legends(fig: Any, *, panels_across: int = 1) -> None:
    """Enlarge ``fig`` (never shrink it) until its legends fit.

    A legend wider than the room it has was cut off at the figure's edge or ran into the next
    panel's legend; a tall one squeezed the panels. Each legend needs its own width times
    ``panels_across`` (one legend under each of that many panels; 1 for a figure legend) and,
    with :data:`MIN_PANEL_IN` of panel, its own height plus the titles and labels.
    """
    fig.draw_without_rendering()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    legends += list(fig.legends)
    if not legends:
        return
    boxes = [legend.get_window_extent() for legend in legends]
    width_in = max(box.width for box in boxes) / fig.dpi
    height_in = max(box.height for box in boxes) / fig.dpi
    width, height = fig.get_size_inches()
    need_width = panels_across * (width_in + 0.3) + 0.4
    need_height = height_in + MIN_PANEL_IN + LEGEND_GAP_IN + 1.0  # titles, ticks
    if need_width > width or need_height > height:
        fig.set_size_inches(max(width, need_width), max(height, need_height))


def _wrapped(fig: Any, title: str) -> str:
    """``title`` broken into lines that fit ``fig``'s width (a long title was cut off at
    both edges of a one-panel figure)."""
    import textwrap

    return textwrap.fill(title, width=max(30, int(fig.get_size_inches()[0] * 11)))


def _mean_curve(cell: Cell) -> tuple[list[int], list[float], list[float] | None]:
    """Rounds evaluated in every seed, mean accuracy, and std (``None`` with one seed)."""
    per_seed = [dict(r.curve) for r in cell.runs]
    common = sorted(set.intersection(*(set(c) for c in per_seed))) if per_seed else []
    means = [statistics.fmean(c[r] for c in per_seed) for r in common]
    stds = ([statistics.stdev(c[r] for c in per_seed) for r in common]
            if len(per_seed) >= 2 else None)
    return common, means, stds


def _table_labels(suite: Suite) -> list[str]:
    return list(dict.fromkeys(label for t in suite.tables for label in t.rows))


def plot_accuracy(suite: Suite, cells: Sequence[Cell], path: Path) -> Path:
    """``accuracy.png``: test accuracy vs round, one panel per column of the main table."""
    _accuracy_figure(suite, cells).savefig(path, dpi=120)
    return path


def _accuracy_figure(suite: Suite, cells: Sequence[Cell]) -> Any:
    _, Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib.ticker import MaxNLocator

    by_key = {(c.label, c.column): c for c in cells}
    columns = list(suite.tables[0].columns) or ["(no columns)"]
    labels = _table_labels(suite)
    colors = _colors(labels + list(suite.reference_rows))
    fig = Figure(figsize=(4.8 * len(columns), 6.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(columns), squeeze=False, sharey=True)[0]
    for ax, column in zip(axes, columns, strict=True):
        drawn = 0
        lines = [(lb, "-") for lb in labels] + [(lb, "--") for lb in suite.reference_rows]
        for label, style in lines:
            cell = by_key.get((label, None if style == "--" else column))
            if cell is None or not cell.runs:
                continue
            rounds, mean, std = _mean_curve(cell)
            if not rounds:
                continue
            ax.plot(rounds, mean, style, color=colors[label], lw=1.5,
                    label=f"{label} ({len(cell.runs)} seed{'s' if len(cell.runs) > 1 else ''})")
            if std is not None:
                lo = [m - s for m, s in zip(mean, std, strict=True)]
                hi = [m + s for m, s in zip(mean, std, strict=True)]
                ax.fill_between(rounds, lo, hi, color=colors[label], alpha=0.2, lw=0)
            drawn += 1
        ax.set_title(column)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if drawn:
            # Below the panel: inside it, the legend hid the curves of the later rounds.
            _legend_below(ax, fontsize="x-small", ncols=2)
        else:
            ax.text(0.5, 0.5, "no finished runs", ha="center", va="center",
                    transform=ax.transAxes)
    axes[0].set_ylabel("test accuracy (%)")
    _fit_legends(fig, panels_across=len(columns))
    fig.suptitle(_wrapped(fig, f"{suite.name}: test accuracy (mean over seeds, ±1 std)"))
    return fig


def plot_anme(suite: Suite, cells: Sequence[Cell], path: Path) -> Path:
    """``anme.png``: ANME per strategy (bars) and column (groups), mean over rounds and seeds."""
    _anme_figure(suite, cells).savefig(path, dpi=120)
    return path


def _anme_figure(suite: Suite, cells: Sequence[Cell]) -> Any:
    _, Figure, FigureCanvasAgg = _matplotlib()
    by_key = {(c.label, c.column): c for c in cells}
    columns = list(suite.tables[0].columns)
    labels = _table_labels(suite)
    colors = _colors(labels + list(suite.reference_rows))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for j, column in enumerate(columns):
        for label in labels:
            cell = by_key.get((label, column))
            values = [r.anme_mean for r in cell.runs if r.anme_mean is not None] if cell else []
            if values:
                std = statistics.stdev(values) if len(values) >= 2 else 0.0
                series.setdefault(label, []).append((j, statistics.fmean(values), std))
    fig = Figure(figsize=(max(6.0, 2.4 * len(columns) + 2.0), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / max(len(series), 1)
    for k, (label, points) in enumerate(series.items()):
        xs = [j - 0.4 + width * (k + 0.5) for j, _, _ in points]
        bars = ax.bar(xs, [m for _, m, _ in points], width, yerr=[s for _, _, s in points],
                      color=colors[label], label=label, capsize=2)
        # Top-n's ANME is 0: label the bars so that an empty spot reads as 0, not as missing.
        # Vertical, so that neighbouring labels (e.g. two 0.00s) do not overlap.
        ax.bar_label(bars, fmt="%.2f", fontsize="x-small", padding=2, rotation=90)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_xlim(-0.5, len(columns) - 0.5)
    ax.set_ylabel("ANME (mean over rounds)")
    ax.set_ylim(0, 1.12)
    ax.grid(axis="y", alpha=0.3)
    if series:
        # Outside the axes: inside, it covered the bars of the last column.
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.text(0.5, 0.5, "no finished run reports ANME", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_title(f"{suite.name}: average normalized marginal entropy")
    return fig
