"""What the benchmarks record about the machine they ran on (imported by the scripts here)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def command() -> str:
    """The command line this process was started with, as a committed record holds it: the
    script and every path argument inside the repository relative to it
    (``python benchmarks/bench_x.py --out results/x.json``), a path outside it as
    ``<outside the repository>/`` and its last two parts."""
    from fedshard.app.results import portable_command

    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return shlex.join(["python", *portable_command([str(script), *sys.argv[1:]])])


def provenance(device: str = "cpu") -> dict[str, Any]:
    """Where and when a record was measured: ``machine`` (the GPU's name on CUDA, else the
    CPU's model), ``cpu`` and its ``cores``, the ``torch`` and ``python`` versions, the
    ``date``, the ``command`` that ran and the machine's ``load-average`` (1, 5, 15 minutes)
    as it ended (the benchmark adds about its own threads; more than that: other processes
    shared the cores)."""
    import torch

    gpu = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else None
    return {"machine": gpu or cpu_name(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "command": command(),
            "load-average": [round(x, 2) for x in os.getloadavg()]}


def emit(record: dict[str, Any], out: Path | None = None) -> None:
    """Print ``record`` as one JSON object and, with ``out``, also write it there."""
    text = json.dumps(record, indent=1)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
