"""Where a run's results go: its config, per-round metrics (JSON lines), the final model.

Layout of ``<results-dir>/<run-name>/``::

    config.json     run config, seed, git commit, versions, start time
    metrics.jsonl   one JSON object per round (round 0 = the initial model's evaluation)
    model.pt        final global model (torch state_dict)
    summary.json    final accuracy, best accuracy, wall time, rounds completed
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import subprocess
import time
from collections.abc import Mapping
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.common.logger import log as flwr_log

__all__ = ["RunRecorder", "git_commit"]

logger = logging.getLogger(__name__)


def git_commit(path: Path | None = None) -> str:
    """Commit of the fedshard checkout (``"unknown"`` when not run from a git checkout)."""
    where = path or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunRecorder:
    """Writes one run's results; every file is written atomically or appended line by line."""

    def __init__(self, directory: Path, config: Mapping[str, Any], num_rounds: int,
                 *, resume_round: int | None = None) -> None:
        """Start recording a run, or continue one after ``resume_round`` completed rounds
        (rows of later rounds, written before a crash, are dropped)."""
        if not directory.is_absolute():
            raise ValueError(f"results directory {directory} must be absolute (Flower apps do not "
                             "run in your working directory)")
        self.directory = directory
        self.num_rounds = num_rounds
        self.directory.mkdir(parents=True, exist_ok=True)
        self.metrics_path = directory / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        resumed: list[dict[str, Any]] = []
        if resume_round is not None and self.metrics_path.is_file():
            rows = [json.loads(x) for x in self.metrics_path.read_text().splitlines() if x]
            self.rows = [r for r in rows if r["round"] <= resume_round]
            old = json.loads((directory / "config.json").read_text())
            resumed = [*old.get("resumed", []), {"after-round": resume_round,
                                                 "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
        _atomic_write(self.metrics_path,
                      "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.rows))
        # wall-s continues across a resume (time lost in the crash is not counted)
        self._start = time.time() - (self.rows[-1]["wall-s"] if self.rows else 0.0)
        self._last = time.time()
        info: dict[str, Any] = {
            "config": dict(config),
            "git-commit": git_commit(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "host": platform.node(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self._start)),
        }
        if resumed:
            info["resumed"] = resumed
        try:
            import flwr

            info["flwr"] = flwr.__version__
        except ImportError:  # pragma: no cover - flwr is a dependency
            pass
        _atomic_write(directory / "config.json", json.dumps(info, indent=2, sort_keys=True))
        logger.info("fedshard results -> %s", directory)

    def record_round(self, server_round: int, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Append one round's metrics and log a one-line summary."""
        now = time.time()
        row: dict[str, Any] = {"round": server_round, "wall-s": now - self._start,
                               "round-s": now - self._last}
        row.update({k: float(v) for k, v in metrics.items()})
        self._last = now
        self.rows.append(row)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
        # Flower's logger: the line shows in `flwr run --stream` and the SuperLink's run log.
        flwr_log(INFO, "%s", self.summary_line(row))
        return row

    def summary_line(self, row: Mapping[str, Any]) -> str:
        parts = [f"round {row['round']}/{self.num_rounds}"]
        for key, fmt in (("train-loss", "train loss {:.4f}"), ("test-loss", "test loss {:.4f}"),
                         ("test-accuracy", "test acc {:.2%}"), ("anme", "ANME {:.3f}"),
                         ("bytes-sent-ratio-mean", "sent {:.3f}x dense"),
                         ("replies-used", "replies {:.0f}")):
            value = row.get(key)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                parts.append(fmt.format(value))
        parts.append(f"{row['round-s']:.1f}s")
        return " | ".join(parts)

    def finish(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Save the final model and a summary."""
        tmp = self.directory / "model.pt.tmp"
        torch.save(dict(state_dict), tmp)
        os.replace(tmp, self.directory / "model.pt")
        accs = [r["test-accuracy"] for r in self.rows if "test-accuracy" in r]
        summary = {
            "rounds-completed": max((r["round"] for r in self.rows), default=0),
            "final-test-accuracy": accs[-1] if accs else None,
            "best-test-accuracy": max(accs) if accs else None,
            "wall-s": time.time() - self._start,
        }
        _atomic_write(self.directory / "summary.json", json.dumps(summary, indent=2))
        return summary
