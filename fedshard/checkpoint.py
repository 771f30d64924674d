"""Per-round server checkpoints: everything needed to continue a run after a crash.

A checkpoint holds the global model after round ``k``, ``k`` itself, the strategy's capability
cache and metrics history, and the run config it belongs to. No random-number-generator state
is needed: every random stream of a run is derived from ``(seed, round, ...)``
(``numpy.random.default_rng([seed, round, tag, ...])``), so round ``k + 1`` draws the same
numbers whether or not the server was restarted in between.

The file is written to a temporary name and renamed over the previous one (atomic on POSIX),
so a crash at any moment leaves either the previous or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CHECKPOINT_NAME", "Checkpoint"]

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass
class Checkpoint:
    """State of a run after ``server_round`` completed rounds."""

    server_round: int
    arrays: dict[str, np.ndarray]
    config: dict[str, Any]
    capabilities: dict[int, tuple[float, str]] = field(default_factory=dict)
    history: dict[int, dict[str, float]] = field(default_factory=dict)

    def save(self, directory: Path) -> Path:
        """Write ``directory/checkpoint.pt`` atomically; returns its path."""
        path = directory / CHECKPOINT_NAME
        tmp = directory / (CHECKPOINT_NAME + ".tmp")
        payload = {
            "format": 1,
            "server-round": self.server_round,
            "arrays": {k: torch.from_numpy(np.ascontiguousarray(v))
                       for k, v in self.arrays.items()},
            "config": self.config,
            "capabilities": self.capabilities,
            "history": self.history,
        }
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: Path) -> Checkpoint | None:
        """The checkpoint in ``directory``, or ``None`` when there is none."""
        path = directory / CHECKPOINT_NAME
        if not path.is_file():
            return None
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != 1:
            raise ValueError(f"{path}: unknown checkpoint format {payload.get('format')!r}; "
                             "expected 1. Delete it or resume with the fedshard that wrote it.")
        return cls(
            server_round=int(payload["server-round"]),
            arrays={k: v.numpy() for k, v in payload["arrays"].items()},
            config=dict(payload["config"]),
            capabilities={int(k): (float(v[0]), str(v[1]))
                          for k, v in payload["capabilities"].items()},
            history={int(k): dict(v) for k, v in payload["history"].items()},
        )

    def check_config(self, config: Mapping[str, Any], *, ignore: tuple[str, ...] = ()) -> None:
        """Refuse to resume a run under a different configuration."""
        diff = sorted(k for k in set(config) | set(self.config)
                      if k not in ignore and config.get(k) != self.config.get(k))
        if diff:
            details = ", ".join(f"{k}: {self.config.get(k)!r} -> {config.get(k)!r}" for k in diff)
            raise ValueError(
                f"Cannot resume: the run config differs from the checkpoint's ({details}). "
                "Resume with the same config, or start a new run (another run-name)."
            )
