"""Typed reads from a parsed TOML table that collect problems instead of raising.

Suite files are validated in one pass: every reader appends a message to ``problems`` (naming
the table, the key, the value found and what was expected) and returns ``None`` or an empty
value, so that the caller can go on and report every problem of the file at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["check_keys", "read_blocks", "read_field", "read_seeds", "read_strings", "read_table",
           "unique"]


def read_blocks(data: Mapping[str, Any], key: str, problems: list[str]) -> list[dict[str, Any]]:
    """``data[key]`` as a list of tables (``[[key]]`` blocks; ``[]`` when absent or not one)."""
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        problems.append(f"[[{key}]] must be an array of tables ([[{key}]] blocks)")
        return []
    return [dict(t) for t in value]


def check_keys(table: Mapping[str, Any], known: Sequence[str], where: str,
               problems: list[str]) -> None:
    """A problem for every key of ``table`` not in ``known``."""
    for key in table:
        if key not in known:
            problems.append(f"{where} unknown key {key!r}; known keys: {', '.join(known)}")


def read_table(data: Mapping[str, Any], key: str, problems: list[str]) -> dict[str, Any]:
    """``data[key]`` as a dict (``{}`` when absent or not a table)."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        problems.append(f"[{key}] must be a table, found {type(value).__name__} {value!r}")
        return {}
    return dict(value)


def read_field(table: Mapping[str, Any], key: str, kind: type, where: str, problems: list[str],
               *, required: bool = False) -> Any:
    """``table[key]`` if it is a ``kind`` (``float`` accepts ints; strings must be non-empty),
    else ``None``; a missing key is a problem only when ``required``."""
    if key not in table:
        if required:
            problems.append(f"{where}: missing {key!r} ({kind.__name__})")
        return None
    value = table[key]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        problems.append(f"{where} {key}={value!r}: expected {kind.__name__}")
        return None
    if kind is str and not value.strip():
        problems.append(f"{where} {key}={value!r}: expected a non-empty string")
        return None
    return value


def read_seeds(value: Any, where: str, problems: list[str]) -> tuple[int, ...]:
    """A non-empty list of distinct non-negative integers, as a tuple."""
    if (not isinstance(value, list) or not value
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value)):
        problems.append(f"{where}={value!r}: expected a non-empty list of non-negative integers")
        return ()
    if len(set(value)) != len(value):
        problems.append(f"{where}={value!r}: a seed is listed twice")
        return tuple(dict.fromkeys(value))
    return tuple(value)


def read_strings(value: Any, where: str, problems: list[str]) -> tuple[str, ...] | None:
    """A list of distinct strings as a tuple (``None`` when absent or invalid)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        problems.append(f"{where}={value!r}: expected a list of strings")
        return None
    if len(set(value)) != len(value):
        problems.append(f"{where}={value!r}: a name is listed twice")
    return tuple(dict.fromkeys(value))


def unique(items: Any) -> tuple[Any, ...]:
    """``items`` without repeats, in first-seen order."""
    return tuple(dict.fromkeys(items))
