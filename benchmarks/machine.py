"""What the benchmarks record about the machine they ran on (imported by the scripts here)."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
