"""Where each run of a suite stands on disk: pending, partial, resumable, finished or stale.

A run is *finished* when its folder has ``summary.json`` (written last, atomically, by
:class:`fedshard.app.results.RunRecorder`) without ``"status": "failed"``, with
``rounds-completed`` equal to the run's
``num-server-rounds`` and a round that trained (``rounds-trained`` > 0 where it says), and its
``config.json`` shows the settings the suite asks for now; a
finished run with other settings is *stale*. A run that is not finished is *resumable* when its
server checkpoint (``fedshard.app.checkpoint``, the newest readable of the last two) was written
with the suite's settings (apart from :data:`fedshard.app.checkpoint.RESUME_MAY_CHANGE`) before
the last round, else *partial*. :func:`fedshard_lab.experiments.run_suite` acts on these states.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedshard.app.checkpoint import RESUME_MAY_CHANGE, Checkpoint, CheckpointError
from fedshard.app.config import RunConfig
from fedshard_lab.experiments.suite import RunSpec, Suite

__all__ = ["RunState", "RunStatus", "StaleRunsError", "run_status", "suite_status"]

#: Config keys that say where a run is stored or how it was launched, not how it trains (moving
#: a results folder does not make its runs stale, nor does finishing a run by resuming it).
_NOT_SETTINGS = ("results-dir", "run-name", "resume", "overwrite", "download")
#: What a run written before a key existed did, where that differs from the key's default now:
#: before factor alignment, the spread bound and the weight cap, replies were averaged plainly
#: with FedAvg's weights. A run without
#: any other key ran with that key's default.
BEFORE_THE_KEY: dict[str, Any] = {"align-factors": False, "max-update-spread": 0.0,
                                   "max-weight-ratio": 0.0}


class RunState(enum.Enum):
    """Where a run stands on disk."""

    PENDING = "pending"  # no folder yet
    PARTIAL = "partial"  # folder without a complete summary and no usable checkpoint: re-run
    RESUMABLE = "resumable"  # not finished, with a checkpoint of the suite's settings: resume
    FINISHED = "finished"  # complete, with the suite's settings: skipped
    STALE = "stale"  # complete, but with other settings than the suite's now


@dataclass(frozen=True)
class RunStatus:
    """A run's state, why, and its summary when it has one."""

    spec: RunSpec
    state: RunState
    detail: str
    summary: dict[str, Any] | None = None
    resume_round: int | None = None  # RESUMABLE: the checkpoint's round


class StaleRunsError(ValueError):
    """Finished runs whose settings differ from the suite's; nothing was started."""

    def __init__(self, stale: list[RunStatus]) -> None:
        self.stale = stale
        lines = "\n".join(f"  - {s.spec.directory}: {s.detail}" for s in stale)
        super().__init__(
            f"{len(stale)} finished run(s) used other settings than the suite asks for now; "
            f"no run was started. Delete them, restore the suite, or re-run them with "
            f"--rerun-stale (which deletes them):\n{lines}"
        )


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def run_status(spec: RunSpec) -> RunStatus:
    """Classify ``spec``'s folder as pending, partial, resumable, finished or stale (see the
    module doc)."""
    folder = spec.directory
    if not folder.exists():
        return RunStatus(spec, RunState.PENDING, "not started")
    try:
        summary = _read_json(folder / "summary.json")
    except FileNotFoundError:
        return _unfinished(spec, "no summary.json (interrupted or failed)")
    except (OSError, ValueError) as err:
        return _unfinished(spec, f"unreadable summary.json ({err})")
    try:
        used = _read_json(folder / "config.json")["config"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return RunStatus(spec, RunState.STALE, f"summary.json but no readable config.json "
                         f"({err}); cannot tell which settings it ran with", summary)
    done = summary.get("rounds-completed")
    if summary.get("status") == "failed":
        return _unfinished(spec, f"failed after {done} round(s): {summary.get('failure')}")
    if summary.get("rounds-trained") == 0:  # older summaries do not say: taken as trained
        return _unfinished(spec, f"no round trained ({done} rounds completed, the model is the "
                           "initial one: the ServerApp raised 'No round trained')")
    if done != used.get("num-server-rounds"):
        return _unfinished(spec, f"{done} of {used.get('num-server-rounds')} rounds completed")
    expected = spec.config.as_dict()
    # A key that a newer fedshard added is absent from older runs: they ran without it.
    defaults = {**RunConfig().as_dict(), **BEFORE_THE_KEY}
    diffs = [f"{k}={used.get(k, defaults.get(k))!r} (suite: {v!r})" for k, v in expected.items()
             if k not in _NOT_SETTINGS and used.get(k, defaults.get(k)) != v]
    if diffs:
        return RunStatus(spec, RunState.STALE, "finished with " + ", ".join(diffs), summary)
    acc = summary.get("final-test-accuracy")
    acc_text = f"final test acc {acc:.2%}, " if isinstance(acc, (int, float)) else ""
    return RunStatus(spec, RunState.FINISHED, f"{acc_text}{done} rounds", summary)


def _unfinished(spec: RunSpec, reason: str) -> RunStatus:
    """RESUMABLE when the folder's checkpoint can continue ``spec`` as the suite asks for it
    now, else PARTIAL; ``reason`` says why the run is not finished."""
    try:
        checkpoint = Checkpoint.load(spec.directory, fallback=True)
    except (CheckpointError, OSError) as err:  # OSError: e.g. a file it may not read
        return RunStatus(spec, RunState.PARTIAL, f"{reason}; its checkpoint is unusable ({err})")
    if checkpoint is None:
        return RunStatus(spec, RunState.PARTIAL, f"{reason}; no checkpoint")
    total = spec.num_rounds
    if checkpoint.server_round >= total:  # the app would only say "already finished"
        return RunStatus(spec, RunState.PARTIAL, f"{reason}; its checkpoint is of round "
                         f"{checkpoint.server_round} of {total} but the run wrote no summary")
    try:
        checkpoint.check_config(spec.config.as_dict(), ignore=RESUME_MAY_CHANGE)
    except ValueError as err:
        return RunStatus(spec, RunState.PARTIAL,
                         f"{reason}; its checkpoint was written with other settings ({err})")
    return RunStatus(spec, RunState.RESUMABLE, f"{reason}; checkpoint after round "
                     f"{checkpoint.server_round} of {total}", resume_round=checkpoint.server_round)


def suite_status(suite: Suite) -> list[RunStatus]:
    """:func:`run_status` of every run, in execution order."""
    return [run_status(spec) for spec in suite.runs]
