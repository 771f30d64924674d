"""The report's tables: which rows (labels) and columns each shows, validated."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedshard_lab.experiments.fields import check_keys, read_field, read_strings

__all__ = ["TABLE_KEYS", "TableSpec", "parse_tables"]

#: Keys of a ``[[tables]]`` entry.
TABLE_KEYS = ("columns", "rows", "title")


@dataclass(frozen=True)
class TableSpec:
    """A results table: row labels and column labels, in display order."""

    title: str
    rows: tuple[str, ...]
    columns: tuple[str, ...]


def parse_tables(entries: Sequence[Mapping[str, Any]], *, name: str, rows: Sequence[str],
                 columns: Sequence[str], table_labels: Sequence[str], all_columns: Sequence[str],
                 problems: list[str]) -> tuple[TableSpec, ...]:
    """The main table (``rows`` x ``columns``) and the ``[[tables]]`` entries.

    ``table_labels`` are the rows that have a column (``[[runs]]`` and ``[[compare]]``
    entries), ``all_columns`` every column they use; a table naming anything else is a
    problem (appended to ``problems``).
    """
    for label in rows:
        if label not in table_labels:
            problems.append(f"[suite] rows names {label!r}, which no [[runs]] or [[compare]] "
                            f"entry with a column has; rows with columns: {list(table_labels)}")
    for column in columns:
        if column not in all_columns:
            problems.append(f"[suite] columns names {column!r}, which no [[runs]] or [[compare]] "
                            f"entry has; columns: {list(all_columns)}")
    tables = [TableSpec(f"{name}: final test accuracy (%)", tuple(rows), tuple(columns))]
    for j, table in enumerate(entries):
        where = f"tables[{j}]"
        check_keys(table, TABLE_KEYS, where, problems)
        title = read_field(table, "title", str, where, problems, required=True) or where
        shown_rows = read_strings(table.get("rows"), f"{where} rows", problems)
        if shown_rows is None:
            problems.append(f"{where}: missing `rows` (a list of row labels)")
            shown_rows = ()
        shown_columns = read_strings(table.get("columns"), f"{where} columns", problems)
        if shown_columns is None:
            shown_columns = tuple(all_columns)
        for label in shown_rows:
            if label not in table_labels:
                problems.append(f"{where} rows names {label!r}, which no [[runs]] or [[compare]] "
                                f"entry with a column has; rows with columns: "
                                f"{list(table_labels)}")
        for column in shown_columns:
            if column not in all_columns:
                problems.append(f"{where} columns names {column!r}, which no [[runs]] or "
                                f"[[compare]] entry has; columns: {list(all_columns)}")
        tables.append(TableSpec(title, shown_rows, shown_columns))
    return tuple(tables)
