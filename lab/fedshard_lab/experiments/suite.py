"""Experiment suites: a TOML file of runs (row label × column label × seed), validated up front.

A suite is read once into a frozen :class:`Suite`; every run's full configuration is built and
validated through :class:`fedshard.app.config.RunConfig` before anything starts, and every problem
in the file is reported at once in a :class:`SuiteError`. The file format is described in
``docs/reproducing.md``::

    [suite]
    name = "fmnist-table"
    results-dir = "results/fmnist-table"   # relative to the app (repository) root
    num-supernodes = 100
    seeds = [0, 1]                          # the main setting's seeds

    [defaults]                              # run-config overrides shared by all runs
    model = "resnet18"

    [[runs]]
    label = "Top-n"                         # table row
    column = "r = 0.1"                      # table column; omit for a reference row (r = 1)
    method = "top-n"
    keep-ratios = "0.1"

    [[compare]]                             # a cell of another suite, shown and never run
    suite = "fmnist-table"                  # (fedshard_lab.experiments.compare)
    label = "Collective"
    column = "r = 0.1"
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedshard.app.config import ConfigError, ProblemsError, RunConfig
from fedshard_lab.experiments.app import app_defaults, find_app_dir
from fedshard_lab.experiments.compare import Comparison, parse_comparisons
from fedshard_lab.experiments.fields import (
    check_keys,
    read_blocks,
    read_field,
    read_seeds,
    read_strings,
    read_table,
    unique,
)
from fedshard_lab.experiments.launch import ENGINES
from fedshard_lab.experiments.tables import TableSpec, parse_tables

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

__all__ = [
    "RUNNER_KEYS",
    "RunSpec",
    "Suite",
    "SuiteError",
    "TableSpec",
    "app_defaults",
    "find_app_dir",
    "load_suite",
    "parse_suite",
    "run_name",
    "slug",
]

logger = logging.getLogger(__name__)

#: Run-config keys the runner sets for every run; a suite must not set them.
RUNNER_KEYS = ("num-partitions", "results-dir", "run-name", "seed")

_SUITE_KEYS = ("client-num-cpus", "client-num-gpus", "columns", "description", "engine", "name",
               "num-supernodes", "results-dir", "rows", "seeds", "timeout-s")
_ENTRY_KEYS = ("column", "label", "seeds")
_TOP_KEYS = ("compare", "defaults", "runs", "suite", "tables")


class SuiteError(ProblemsError):
    """Raised when a suite file is invalid; lists every problem at once."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        super().__init__(f"experiment suite {source}", problems, "no run was started")


@dataclass(frozen=True)
class RunSpec:
    """One ``flwr run`` of a suite: a row label, a column label and a seed.

    Attributes
    ----------
    index : int
        Position in the suite's execution order (0-based).
    entry : int
        Index of the ``[[runs]]`` entry it comes from.
    label, column : str, str or None
        Table row and column (``None``: a reference row such as r = 1, valid for every column).
    seed : int
        The run's ``seed`` (model init, data split, node and term sampling).
    name : str
        Run folder name inside the suite's results directory, derived from label, column and
        seed only, so that a later invocation finds it again.
    directory : Path
        Absolute run folder.
    overrides : dict
        What the suite file says for this run (``[defaults]`` updated by the entry).
    run_config : dict
        Exactly what is passed to ``flwr run``: ``overrides`` plus ``seed``, ``results-dir``,
        ``run-name`` and ``num-partitions``.
    config : RunConfig
        The validated configuration the apps will build from the app's defaults and
        ``run_config``.
    """

    index: int
    entry: int
    label: str
    column: str | None
    seed: int
    name: str
    directory: Path
    overrides: dict[str, Any] = field(compare=False)
    run_config: dict[str, Any] = field(compare=False)
    config: RunConfig

    @property
    def num_rounds(self) -> int:
        """The run's ``num-server-rounds``."""
        return self.config.num_server_rounds

    @property
    def title(self) -> str:
        """``"label / column / seed s"`` for progress lines."""
        where = f"{self.label} / {self.column}" if self.column is not None else self.label
        return f"{where} / seed {self.seed}"


@dataclass(frozen=True)
class Suite:
    """A validated experiment suite.

    Attributes
    ----------
    name : str
        The suite's name (titles of the report).
    source : str
        Where the suite came from (its file, for messages).
    app_dir : Path
        The Flower app passed to ``flwr run`` (the directory with ``pyproject.toml``).
    results_dir : Path
        Absolute folder holding one sub-folder per run, and the report.
    num_supernodes, client_num_cpus : int
        Simulated SuperNodes per run and CPUs Ray reserves per client.
    timeout_s : float
        Wall-clock limit of one run.
    seeds : tuple of int
        The main setting's seeds (default seeds of every entry).
    main_rounds : int
        The main setting's ``num-server-rounds`` (from ``[defaults]`` or the app's default).
    runs : tuple of RunSpec
        Every run, in execution order (entries in file order, seeds within an entry).
    tables : tuple of TableSpec
        The main table first, then the ``[[tables]]`` entries.
    reference_rows : tuple of str
        Labels of runs without a column (shown apart from the table, not ranked).
    client_num_gpus : float
        GPU share Ray reserves per simulated client (0: CPU only).
    comparisons : tuple of Comparison
        Cells of other suites shown in the report as rows of their own (never run here).
    engine : str
        How each run is executed (:data:`fedshard_lab.experiments.launch.ENGINES`): ``"flower"``
        (``flwr run``, the default), ``"sequential"`` or ``"batched"`` (fedshard's in-process
        engines, :mod:`fedshard_lab.engine`); not part of a run's settings.
    """

    name: str
    source: str
    app_dir: Path
    results_dir: Path
    num_supernodes: int
    client_num_cpus: int
    timeout_s: float
    seeds: tuple[int, ...]
    main_rounds: int
    runs: tuple[RunSpec, ...]
    tables: tuple[TableSpec, ...]
    reference_rows: tuple[str, ...]
    client_num_gpus: float = 0.0
    comparisons: tuple[Comparison, ...] = ()
    engine: str = "flower"

    def cell(self, label: str, column: str | None) -> tuple[RunSpec, ...]:
        """The runs (one per seed) of row ``label`` and column ``column``."""
        return tuple(r for r in self.runs if r.label == label and r.column == column)


def slug(text: str) -> str:
    """Lower-case ASCII letters and digits, runs of anything else replaced by ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def run_name(label: str, column: str | None, seed: int) -> str:
    """Folder name of a run: ``<label>__<column>__seed<seed>`` as slugs (see :func:`slug`)."""
    parts = [slug(label)] + ([slug(column)] if column is not None else []) + [f"seed{seed}"]
    return "__".join(parts)


def load_suite(
    path: Path | str,
    *,
    app_dir: Path | None = None,
    results_dir: Path | None = None,
    resolve_comparisons: bool = True,
) -> Suite:
    """Read and validate a suite file.

    Parameters
    ----------
    path : Path or str
        The suite's TOML file.
    app_dir : Path, optional
        The Flower app (default: found above ``path`` with :func:`find_app_dir`).
    results_dir : Path, optional
        Overrides ``[suite] results-dir`` (relative paths: to the current directory).
    resolve_comparisons : bool
        Load the suites its ``[[compare]]`` entries name and check their cells (``False``:
        leave the entries out; used for those suites themselves, so no chain is followed).

    Raises
    ------
    SuiteError
        Listing every problem of the file; nothing has been started.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise SuiteError(str(path), [f"not valid TOML: {err}"]) from None
    app = Path(app_dir).resolve() if app_dir is not None else find_app_dir(path.parent)
    return parse_suite(
        data, app_dir=app, source=str(path),
        results_dir=Path(results_dir).resolve() if results_dir is not None else None,
        suite_dir=path.parent, resolve_comparisons=resolve_comparisons,
    )


def parse_suite(
    data: Mapping[str, Any],
    *,
    app_dir: Path,
    source: str = "<suite>",
    results_dir: Path | None = None,
    defaults: Mapping[str, Any] | None = None,
    suite_dir: Path | None = None,
    resolve_comparisons: bool = True,
) -> Suite:
    """Validate a parsed suite (see :func:`load_suite`).

    ``defaults`` are the app's run-config defaults (read from ``app_dir`` when omitted); the
    runs' full configurations are those defaults updated by ``[defaults]`` and the entry.
    ``[[compare]]`` suites named by NAME or a relative path are looked up in ``suite_dir``
    (default: the app's ``experiments/`` folder).
    """
    app_dir = Path(app_dir).resolve()
    base = dict(app_defaults(app_dir) if defaults is None else defaults)
    problems: list[str] = []
    for key in data:
        if key not in _TOP_KEYS:
            problems.append(f"unknown table [{key}]; expected {', '.join(_TOP_KEYS)}")

    head = read_table(data, "suite", problems)
    check_keys(head, _SUITE_KEYS, "[suite]", problems)
    name = read_field(head, "name", str, "[suite]", problems, required=True) or "suite"
    results_text = read_field(head, "results-dir", str, "[suite]", problems, required=True) or ""
    num_supernodes = read_field(head, "num-supernodes", int, "[suite]", problems,
                                required=True) or 0
    if num_supernodes < 0 or (num_supernodes == 0 and "num-supernodes" in head):
        problems.append(f"[suite] num-supernodes={num_supernodes}: expected ≥ 1")
    client_num_cpus = read_field(head, "client-num-cpus", int, "[suite]", problems) or 1
    if client_num_cpus < 1:
        problems.append(f"[suite] client-num-cpus={client_num_cpus}: expected ≥ 1")
    client_num_gpus = float(read_field(head, "client-num-gpus", float, "[suite]", problems) or 0.0)
    if not (math.isfinite(client_num_gpus) and client_num_gpus >= 0):
        problems.append(f"[suite] client-num-gpus={client_num_gpus}: expected ≥ 0 (a share of "
                        "one GPU per client, e.g. 0.25)")
    timeout_s = float(read_field(head, "timeout-s", float, "[suite]", problems) or 4 * 3600.0)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        problems.append(f"[suite] timeout-s={timeout_s}: expected a positive number of seconds")
    engine = read_field(head, "engine", str, "[suite]", problems) or "flower"
    if engine not in ENGINES:
        problems.append(f"[suite] engine={engine!r}: expected one of {', '.join(ENGINES)}")
    seeds = read_seeds(head.get("seeds", [0]), "[suite] seeds", problems)
    row_order = read_strings(head.get("rows"), "[suite] rows", problems)
    column_order = read_strings(head.get("columns"), "[suite] columns", problems)

    shared = read_table(data, "defaults", problems)
    for key in RUNNER_KEYS:
        if key in shared:
            problems.append(f"[defaults] sets {key!r}: the runner sets {', '.join(RUNNER_KEYS)} "
                            "for every run; remove it")
    shared = {k: v for k, v in shared.items() if k not in RUNNER_KEYS}
    defaults_problems: set[str] = set()
    try:
        main = RunConfig.from_mapping({**base, **shared})
    except ConfigError as err:
        problems.extend(f"[defaults] {p}" for p in err.problems)
        defaults_problems = set(err.problems)
        main = None
    if main is not None and main.min_available_nodes > num_supernodes > 0:
        problems.append(f"[defaults] min-available-nodes={main.min_available_nodes} exceeds "
                        f"num-supernodes={num_supernodes}: no round would ever start")

    if results_dir is None:
        results_dir = Path(results_text).expanduser()
        if not results_dir.is_absolute():
            # relative: inside the app folder (an absolute path or ~/... is the user's own
            # choice; a relative one must not climb out with '..'; a link the user put in
            # the app folder is theirs, so '..' is resolved without following links)
            results_dir = Path(os.path.normpath(app_dir / results_dir))
            if results_text and not results_dir.is_relative_to(app_dir):
                problems.append(
                    f"[suite] results-dir={results_text!r} resolves to {results_dir}, outside "
                    f"the app folder {app_dir}; expected a folder inside it, or an absolute "
                    "path (or ~/...) if the results belong elsewhere")
    results_dir = results_dir.resolve()

    entries = read_blocks(data, "runs", problems)
    if not entries:
        problems.append("the suite has no [[runs]] entries")
    runs: list[RunSpec] = []
    names: dict[str, str] = {}
    cells: dict[tuple[str, str | None], int] = {}
    for i, entry in enumerate(entries):
        where = f"runs[{i}]"
        label = read_field(entry, "label", str, where, problems, required=True)
        column = read_field(entry, "column", str, where, problems)
        if label is not None:
            where = f"runs[{i}] ({label}" + (f" / {column})" if column is not None else ")")
            if not slug(label):
                problems.append(f"{where}: label {label!r} has no letters or digits to name "
                                "its run folders")
        if column is not None and not slug(column):
            problems.append(f"{where}: column {column!r} has no letters or digits to name its "
                            "run folders")
        entry_seeds = read_seeds(entry.get("seeds", list(seeds)), f"{where} seeds", problems)
        overrides = {k: v for k, v in entry.items() if k not in _ENTRY_KEYS}
        for key in RUNNER_KEYS:
            if key in overrides:
                problems.append(f"{where} sets {key!r}: the runner sets "
                                f"{', '.join(RUNNER_KEYS)} for every run; remove it")
                overrides.pop(key)
        if label is None:
            continue
        if (label, column) in cells:
            problems.append(f"{where}: row {label!r} and column {column!r} are already defined "
                            f"by runs[{cells[label, column]}]; give each cell one entry (its "
                            "seeds in `seeds`)")
            continue
        cells[label, column] = i
        merged = {**shared, **overrides}
        config = None
        try:
            config = RunConfig.from_mapping({**base, **merged})
        except ConfigError as err:
            # A problem inherited from [defaults] is reported once, there.
            problems.extend(f"{where}: {p}" for p in err.problems if p not in defaults_problems)
        if config is not None and config.min_available_nodes > num_supernodes > 0:
            problems.append(f"{where}: min-available-nodes={config.min_available_nodes} "
                            f"exceeds num-supernodes={num_supernodes}: no round would ever start")
        for seed in entry_seeds:
            rname = run_name(label, column, seed)
            if rname in names:
                problems.append(f"{where}: run name {rname!r} (seed {seed}) is also the name of "
                                f"a run of {names[rname]}; labels and columns must differ in "
                                "more than punctuation and case")
                continue
            names[rname] = where
            if config is None or main is None:
                continue
            run_config = {**merged, "seed": seed, "results-dir": str(results_dir),
                          "run-name": rname, "num-partitions": num_supernodes}
            runs.append(RunSpec(
                index=len(runs), entry=i, label=label, column=column, seed=seed, name=rname,
                directory=results_dir / rname, overrides=dict(merged), run_config=run_config,
                config=RunConfig.from_mapping({**base, **run_config}),
            ))

    comparisons: tuple[Comparison, ...] = ()
    if resolve_comparisons:
        comparisons = parse_comparisons(
            read_blocks(data, "compare", problems), suite_dir=suite_dir or app_dir / "experiments",
            source=source, error=SuiteError, problems=problems,
            load=lambda p: load_suite(p, app_dir=app_dir, resolve_comparisons=False))
    own_labels = {label for label, _ in cells}
    compared: dict[tuple[str, str | None], int] = {}
    for comp in comparisons:
        j = comp.entry
        if comp.label in own_labels:
            problems.append(f"compare[{j}]: label {comp.label!r} is a row of this suite's "
                            "[[runs]]; give the compared row another label (`as`)")
        elif (comp.label, comp.column) in compared:
            problems.append(f"compare[{j}]: row {comp.label!r} and column {comp.column!r} are "
                            f"already shown by compare[{compared[comp.label, comp.column]}]")
        else:
            compared[comp.label, comp.column] = j
    every = [*cells, *compared]
    labels = unique(label for label, _ in every)
    table_labels = unique(label for label, column in every if column is not None)
    reference = tuple(label for label in unique(lb for lb, c in every if c is None))
    for label in set(reference) & set(table_labels):
        problems.append(f"row {label!r} has runs both with and without a column; a reference "
                        "row (no column) applies to every column")
    columns = unique(column for _, column in every if column is not None)
    main_rows = row_order if row_order is not None else table_labels
    main_columns = column_order if column_order is not None else columns
    blocks = read_blocks(data, "tables", problems)
    if not resolve_comparisons:  # a compared suite, read for its runs: its own [[compare]]
        main_rows = tuple(r for r in main_rows if r in table_labels)  # rows: not followed
        blocks = []
    tables = parse_tables(blocks, name=name, rows=main_rows,
                          columns=main_columns, table_labels=table_labels,
                          all_columns=columns, problems=problems)
    shown = {label for t in tables for label in t.rows} | set(reference)
    for label in labels if resolve_comparisons else ():  # (a compared suite: its rows only)
        if label not in shown:
            logger.warning("suite %s: row %r is in no table (it still runs)", source, label)

    if problems:
        raise SuiteError(source, problems)
    assert main is not None
    return Suite(
        name=name, source=source, app_dir=app_dir, results_dir=results_dir,
        num_supernodes=num_supernodes, client_num_cpus=client_num_cpus, timeout_s=timeout_s,
        seeds=seeds, main_rounds=main.num_server_rounds, runs=tuple(runs), tables=tuple(tables),
        reference_rows=reference, client_num_gpus=client_num_gpus, comparisons=comparisons,
        engine=engine,
    )
