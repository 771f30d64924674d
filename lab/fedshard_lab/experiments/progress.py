"""Progress of a running suite: one line per round and the suite's ETA.

:class:`Progress` turns the rows a run appends to its ``metrics.jsonl`` (read as they grow by
:class:`MetricsTail`) into progress lines, and estimates the time left from the seconds per
round and per launch measured so far. Used by :func:`fedshard_lab.experiments.run_suite`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedshard_lab.experiments.suite import RunSpec, Suite

__all__ = ["MetricsTail", "Progress", "format_duration"]

logger = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    """``"1h 02m"``, ``"4m 05s"`` or ``"12s"``."""
    s = round(max(seconds, 0.0))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


class Progress:
    """Progress lines and the suite's ETA from the seconds per round measured so far.

    Parameters
    ----------
    suite : Suite
        The suite being run (its name and run count go into every line).
    todo : mapping of str to int
        Rounds still to run, per run name (a resumed run counts only the rounds after its
        checkpoint).
    emit : callable
        Receives each line.
    clock : callable
        Monotonic seconds.
    """

    def __init__(self, suite: Suite, todo: Mapping[str, int], emit: Callable[[str], None],
                 clock: Callable[[], float]) -> None:
        self.suite = suite
        self.emit = emit
        self.clock = clock
        self.start = clock()
        self.todo = dict(todo)
        self.round_s: list[float] = []  # measured seconds of rounds >= 1 (round 0 = setup)
        self.overhead_s: list[float] = []  # per launch: wall time not spent in rounds

    def prefix(self, spec: RunSpec) -> str:
        return f"[{self.suite.name}] run {spec.index + 1}/{len(self.suite.runs)} {spec.title}"

    def eta(self) -> str:
        if not self.round_s:
            return "?"
        per_round = sum(self.round_s) / len(self.round_s)
        overhead = sum(self.overhead_s) / len(self.overhead_s) if self.overhead_s else 0.0
        # Every pending run pays the launch overhead; the current one has paid it already.
        launches = max(len(self.todo) - 1, 0)
        return format_duration(sum(self.todo.values()) * per_round + launches * overhead)

    def round(self, spec: RunSpec, row: Mapping[str, Any]) -> None:
        r = int(row.get("round", 0))
        parts = [f"{self.prefix(spec)}: round {r}/{spec.num_rounds}"]
        acc = row.get("test-accuracy")
        if isinstance(acc, (int, float)):
            parts.append(f"test acc {acc:.2%}")
        seconds = row.get("round-s")
        if r >= 1 and isinstance(seconds, (int, float)):
            self.round_s.append(float(seconds))
            self.todo[spec.name] = max(spec.num_rounds - r, 0)
            parts.append(f"{seconds:.1f} s/round")
        parts.append(f"suite ETA {self.eta()}")
        self.emit(" | ".join(parts))

    def launched(self, spec: RunSpec, wall_s: float, rounds_s: float) -> None:
        self.todo.pop(spec.name, None)
        self.overhead_s.append(max(wall_s - rounds_s, 0.0))


class MetricsTail:
    """New complete lines of a growing ``metrics.jsonl``.

    ``skip_existing``: what the file holds now is not new (a resumed run's earlier launches).
    The recorder rewrites the file atomically when it starts (a new inode: a resumed run
    drops the rows after its checkpoint), so a new inode (or a shorter file) means reading
    from the start again; the caller skips the rows it has seen by their round.
    """

    def __init__(self, path: Path, *, skip_existing: bool = False) -> None:
        self.path = path
        self.offset = 0
        self.inode: int | None = None
        if skip_existing:
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                self.offset, self.inode = st.st_size, st.st_ino

    def rows(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                st = os.fstat(fh.fileno())
                if st.st_ino != self.inode or st.st_size < self.offset:
                    # replaced, truncated in place, or first seen: read it from the start
                    self.offset, self.inode = 0, st.st_ino
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line being written has no newline yet
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                logger.warning("%s: skipping unreadable line %r", self.path, line[:80])
        return rows
