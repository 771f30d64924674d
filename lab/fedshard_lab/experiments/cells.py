"""The numbers of a suite's finished runs, one :class:`Cell` per row label and column.

:func:`collect` reads every run folder of a suite (and of its ``[[compare]]`` rows) through
:func:`fedshard_lab.experiments.status.run_status`: only *finished* runs count; a stale one is
left out with a warning. The report (:mod:`fedshard_lab.experiments.report`), its plots and its
milestone tables (:mod:`.plots`, :mod:`.diagnostics`) all draw from these cells.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any

from fedshard_lab.experiments.diagnostics import metric_curves
from fedshard_lab.experiments.status import RunState, run_status
from fedshard_lab.experiments.suite import RunSpec, Suite

__all__ = ["LAST_EVALS", "Cell", "RunResult", "collect"]

logger = logging.getLogger(__name__)

LAST_EVALS = 5
"""How many of the last evaluations (rounds ≥ 1) the per-run "recent" mean averages."""


@dataclass(frozen=True)
class RunResult:
    """The numbers of one finished run (accuracies in %)."""

    spec: RunSpec
    final_accuracy: float
    best_accuracy: float | None
    wall_s: float | None
    curve: tuple[tuple[int, float], ...]  # (round, test accuracy %) where evaluated
    anme_mean: float | None  # mean over rounds ≥ 1 of "anme"; None where not reported

    @property
    def recent(self) -> tuple[tuple[int, float], ...]:
        """The last :data:`LAST_EVALS` evaluations after round 0, (round, accuracy %)."""
        return tuple((r, a) for r, a in self.curve if r >= 1)[-LAST_EVALS:]

    @property
    def recent_mean(self) -> float | None:
        """Mean accuracy (%) of :attr:`recent`; ``None`` when nothing was evaluated."""
        recent = self.recent
        return statistics.fmean(a for _, a in recent) if recent else None


@dataclass(frozen=True)
class Cell:
    """One table cell: a row label and column over the seeds that finished.

    ``mean``/``std`` are over ``runs`` (std: sample standard deviation, ``None`` with fewer
    than two seeds). ``marked``: fewer finished seeds than the suite's main setting, or a
    number of rounds other than the main setting's. ``source``: the other suite's name for a
    ``[[compare]]`` row (:mod:`fedshard_lab.experiments.compare`), ``None`` for this suite's own.
    """

    label: str
    column: str | None
    planned: tuple[RunSpec, ...]
    runs: tuple[RunResult, ...]
    num_rounds: int
    mean: float | None
    std: float | None
    marked: bool
    note: str
    source: str | None = None

    @property
    def reference(self) -> bool:
        """A run without a column (valid for every column, not ranked)."""
        return self.column is None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _run_result(spec: RunSpec, summary: dict[str, Any]) -> RunResult | None:
    final: Any = summary.get("final-test-accuracy")
    if not _finite(final):
        logger.warning("%s: finished without a test accuracy (eval-every=0?); left out",
                       spec.directory)
        return None
    curves = metric_curves(spec.directory, ["test-accuracy", "anme"])
    if "test-accuracy" not in curves:
        logger.warning("%s: no test accuracy in metrics.jsonl; no curve", spec.directory)
    curve = tuple(curves.get("test-accuracy", ()))
    anme = [value for r, value in curves.get("anme", ()) if r >= 1]
    best: Any = summary.get("best-test-accuracy")
    wall: Any = summary.get("wall-s")
    return RunResult(
        spec=spec,
        final_accuracy=100.0 * float(final),
        best_accuracy=100.0 * float(best) if _finite(best) else None,
        wall_s=float(wall) if _finite(wall) else None,
        curve=curve,
        anme_mean=sum(anme) / len(anme) if anme else None,
    )


def collect(suite: Suite) -> list[Cell]:
    """Every cell of ``suite`` (in run order of first appearance) from its finished runs, then
    its ``[[compare]]`` rows from the other suites' finished runs."""
    keys = list(dict.fromkeys((spec.label, spec.column) for spec in suite.runs))
    cells = [_cell(suite, label, column, suite.cell(label, column)) for label, column in keys]
    cells += [_cell(suite, c.label, c.column, c.runs, source=c.suite) for c in suite.comparisons]
    return cells


def _cell(suite: Suite, label: str, column: str | None, planned: tuple[RunSpec, ...],
          source: str | None = None) -> Cell:
    results = []
    for spec in planned:
        status = run_status(spec)
        if status.state is RunState.FINISHED and status.summary is not None:
            result = _run_result(spec, status.summary)
            if result is not None:
                results.append(result)
        elif status.state is RunState.STALE:
            logger.warning("%s is stale (%s); left out of the report", spec.directory,
                           status.detail)
    accs = [r.final_accuracy for r in results]
    rounds = planned[0].num_rounds
    notes = []
    if len(results) < len(suite.seeds):
        notes.append(f"{len(results)} seed{'s' if len(results) != 1 else ''}")
    if rounds != suite.main_rounds:
        notes.append(f"{rounds} rounds")
    return Cell(
        label=label, column=column, planned=planned, runs=tuple(results), num_rounds=rounds,
        mean=statistics.fmean(accs) if accs else None,
        std=statistics.stdev(accs) if len(accs) >= 2 else None,
        marked=bool(accs) and bool(notes), note=", ".join(notes), source=source,
    )
