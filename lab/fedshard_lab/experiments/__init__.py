"""Experiment suites: run many ``flwr run`` simulations, resume them, report the results.

- :mod:`~fedshard_lab.experiments.suite` - the suite TOML file, validated up front (with
  :mod:`~fedshard_lab.experiments.app`, :mod:`~fedshard_lab.experiments.fields`,
  :mod:`~fedshard_lab.experiments.tables` and :mod:`~fedshard_lab.experiments.compare`).
- :mod:`~fedshard_lab.experiments.runner` - runs a suite (skips finished runs, resumes interrupted
  ones from their checkpoint), with progress lines and an ETA
  (:mod:`~fedshard_lab.experiments.progress`); Ctrl-C/SIGTERM stop the current simulation cleanly.
- :mod:`~fedshard_lab.experiments.cells` - the finished runs' numbers, one cell per row and column.
- :mod:`~fedshard_lab.experiments.report` - ``table.md``, ``accuracy.png``, ``anme.png``,
  ``results.json``.

Command line: ``python -m fedshard_lab.experiments {run,status,report} SUITE``.
"""

from fedshard_lab.experiments.cells import Cell, collect
from fedshard_lab.experiments.report import ReportFiles, write_report
from fedshard_lab.experiments.runner import (
    RunState,
    RunStatus,
    SelectionError,
    StaleRunsError,
    SuiteOutcome,
    run_status,
    run_suite,
    suite_status,
)
from fedshard_lab.experiments.suite import (
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
