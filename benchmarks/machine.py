"""What the benchmarks record about the machine they ran on (imported by the scripts here)."""

from __future__ import annotations

import contextlib
import json
import platform
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def emit(record: dict[str, Any], out: Path | None = None) -> None:
    """Print ``record`` as one JSON object and, with ``out``, also write it there."""
    text = json.dumps(record, indent=1)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
