"""Rows from another suite in this suite's report: ``[[compare]]`` entries.

A suite often needs a baseline that another suite has already run with the same setup (the
Fashion-MNIST table's Top-n and Collective for ``beyond.toml``). Running it again costs hours;
copying its run folders would make them look like this suite's runs. A ``[[compare]]`` entry
names the other suite and one of its cells; the report reads that cell's finished runs from the
other suite's results folder and shows them as a row of its own (tables, milestones, plots,
``results.json``), labelled so that it cannot be taken for a run of this suite::

    [[compare]]
    suite = "fmnist-table"        # NAME (NAME.toml next to this file) or a path relative to it
    label = "Top-n"               # the row there
    column = "r = 0.1"            # the column there (and here); omit for a reference row
    as = "Top-n (table)"          # optional; default "Top-n [fmnist-table]"

The runner never runs them. The other suite is loaded and validated when this one is (its own
``[[compare]]`` entries are not followed), and a cell it does not have is an error naming the
cells it has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedshard_lab.experiments.fields import check_keys, read_field

if TYPE_CHECKING:
    from fedshard_lab.experiments.suite import RunSpec, Suite

__all__ = ["COMPARE_KEYS", "Comparison", "parse_comparisons", "suite_file"]

#: Keys of a ``[[compare]]`` entry.
COMPARE_KEYS = ("as", "column", "label", "suite")


@dataclass(frozen=True)
class Comparison:
    """A cell of another suite, shown in this suite's report and never run by it.

    Attributes
    ----------
    entry : int
        Index of the ``[[compare]]`` entry it comes from.
    label : str
        Its row label in this suite's report (``as``, default ``"<row> [<suite name>]"``).
    column : str or None
        Its column, the same here and there (``None``: a reference row).
    suite : str
        The other suite's name.
    row : str
        The row label in the other suite.
    runs : tuple of RunSpec
        The other suite's runs of that cell (their folders are in its results folder).
    """

    entry: int
    label: str
    column: str | None
    suite: str
    row: str
    runs: tuple[RunSpec, ...]


def suite_file(name: str, suite_dir: Path) -> Path:
    """The file a ``suite = ...`` value names: ``NAME`` (no ``/``, no ``.toml``) is
    ``<suite_dir>/NAME.toml``; anything else is a path, relative to ``suite_dir``."""
    if "/" not in name and not name.endswith(".toml"):
        return suite_dir / f"{name}.toml"
    path = Path(name).expanduser()
    return path if path.is_absolute() else suite_dir / path


def parse_comparisons(
    entries: Sequence[Mapping[str, Any]],
    *,
    suite_dir: Path,
    source: str,
    load: Callable[[Path], Suite],
    error: type[Exception],
    problems: list[str],
) -> tuple[Comparison, ...]:
    """Validate ``[[compare]]`` entries and resolve them against the suites they name.

    Parameters
    ----------
    entries : sequence of mapping
        The ``[[compare]]`` blocks (:func:`~fedshard_lab.experiments.fields.read_blocks`).
    suite_dir : Path
        Where relative ``suite`` values resolve (the comparing suite's folder).
    source : str
        The comparing suite's file (a suite may not compare with itself).
    load : callable
        Reads and validates another suite file without following its ``[[compare]]``.
    error : type
        The exception ``load`` raises for an invalid suite (its ``problems`` are quoted).
    problems : list of str
        Every problem found is appended here (nothing is raised).
    """
    loaded: dict[Path, Suite | None] = {}
    out: list[Comparison] = []
    for i, entry in enumerate(entries):
        where = f"compare[{i}]"
        check_keys(entry, COMPARE_KEYS, where, problems)
        before = len(problems)
        name = read_field(entry, "suite", str, where, problems, required=True)
        row = read_field(entry, "label", str, where, problems, required=True)
        column = read_field(entry, "column", str, where, problems)
        shown_as = read_field(entry, "as", str, where, problems)
        if len(problems) > before or name is None or row is None:
            continue
        path = suite_file(name, suite_dir).resolve()
        if not path.is_file():
            problems.append(f"{where}: suite {name!r} is {path}, which does not exist; expected "
                            f"NAME (for {suite_dir}/NAME.toml) or a suite file's path")
            continue
        if source and Path(source).resolve() == path:
            problems.append(f"{where}: compares the suite with itself; its own rows go in "
                            "[suite] rows or [[tables]]")
            continue
        if path not in loaded:
            try:
                loaded[path] = load(path)
            except error as err:
                found: Sequence[str] = getattr(err, "problems", [str(err)])
                problems.append(f"{where}: suite {path} is invalid ({len(found)} problem(s), "
                                f"first: {found[0] if found else err})")
                loaded[path] = None
        other = loaded[path]
        if other is None:
            continue
        runs = other.cell(row, column)
        if not runs:
            cells = sorted({(r.label, r.column or "(reference)") for r in other.runs})
            problems.append(f"{where}: suite {other.name!r} ({path}) has no row {row!r} in "
                            f"column {column!r}; its cells: "
                            + "; ".join(f"{lb} / {c}" for lb, c in cells))
            continue
        out.append(Comparison(entry=i, label=shown_as or f"{row} [{other.name}]",
                              column=column, suite=other.name, row=row, runs=runs))
    return tuple(out)
