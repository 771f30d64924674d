"""Experiment suites: run many ``flwr run`` simulations, resume them, report the results.

- :mod:`~fedshard.experiments.suite` - the suite TOML file, validated up front (with
  :mod:`~fedshard.experiments.app`, :mod:`~fedshard.experiments.fields`,
  :mod:`~fedshard.experiments.tables` and :mod:`~fedshard.experiments.compare`).
- :mod:`~fedshard.experiments.runner` - runs a suite (skips finished runs, resumes interrupted
  ones from their checkpoint), with progress lines and an ETA
  (:mod:`~fedshard.experiments.progress`); Ctrl-C/SIGTERM stop the current simulation cleanly.
- :mod:`~fedshard.experiments.cells` - the finished runs' numbers, one cell per row and column.
- :mod:`~fedshard.experiments.report` - ``table.md``, ``accuracy.png``, ``anme.png``,
  ``results.json``.

Command line: ``python -m fedshard.experiments {run,status,report} SUITE``.
"""

from fedshard.experiments.cells import Cell, collect
from fedshard.experiments.report import ReportFiles, write_report
from fedshard.experiments.runner import (
    RunState,
    RunStatus,
    SelectionError,
    StaleRunsError,
    SuiteOutcome,
    run_status,
    run_suite,
    suite_status,
)
from fedshard.experiments.suite import (
    RunSpec,
    Suite,
    SuiteError,
    TableSpec,
    load_suite,
    parse_suite,
    run_name,
)

__all__ = [
    "Cell",
    "ReportFiles",
    "RunSpec",
    "RunState",
    "RunStatus",
    "SelectionError",
    "StaleRunsError",
    "Suite",
    "SuiteError",
    "SuiteOutcome",
    "TableSpec",
    "collect",
    "load_suite",
    "parse_suite",
    "run_name",
    "run_status",
    "run_suite",
    "suite_status",
    "write_report",
]
