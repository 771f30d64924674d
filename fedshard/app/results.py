"""Where a run's results go: its config, per-round metrics (JSON lines), the final model.

Layout of ``<results-dir>/<run-name>/``::

    config.json     run config, seed, git commit, versions, start time
    metrics.jsonl   one JSON object per round (round 0 = the initial model's evaluation)
    model.pt        final global model (torch state_dict)
    summary.json    final accuracy, best accuracy, wall time, rounds completed, rounds trained,
                    what sharding bought (bytes, FLOPs; accuracy against an r = 1 run)
    checkpoint.pt, checkpoint.prev.pt   the last two rounds' checkpoints (fedshard.app.checkpoint)
    run.lock        held by the run writing the directory (fedshard.app.rundir)

A new run refuses a directory that already holds results unless it resumes or overwrites;
a second run on the same directory at the same time fails at once (see :class:`RunRecorder`).
The directory is owner-only (``0700``) and so are the files (``0600``). Every file is strict
JSON: a value that is not finite (NaN, ±inf) is never written (logged; a round's is left out
of its row and counted in ``non-finite-metrics``, elsewhere it is written as ``null``).
"""

from __future__ import annotations

import io
import json
import logging
import math
import platform
import subprocess
import time
from collections.abc import Mapping, Sequence
from logging import INFO
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from flwr.common.logger import log as flwr_log

from fedshard.app.rundir import (
    RESULT_FILES,
    ExistingResultsError,
    RunLock,
    RunLockedError,
    make_run_directory,
    open_private_append,
    write_private,
)
from fedshard.server.metrics import NON_FINITE, non_finite

__all__ = [
    "ExistingResultsError",
    "RunLockedError",
    "RunRecorder",
    "git_commit",
    "portable_command",
    "portable_path",
]

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


def portable_path(path: Path | str) -> str:
    """``path`` as a record that may be committed should hold it: relative to the git work tree
    that contains it (``"results/fmnist-table"``, ``"."`` for the tree itself), so that no
    committed file holds a path of the machine that wrote it; a path outside any work tree
    (the user's own folder) is returned as given."""
    absolute = Path(path).expanduser().absolute()
    for folder in (absolute, *absolute.parents):
        if (folder / ".git").exists():
            return absolute.relative_to(folder).as_posix() or "."
    return str(path)


def portable_command(args: Sequence[str]) -> list[str]:
    """A command line as a committed record should hold it: each argument that is an absolute
    path (also the value of ``--flag=/path``) relative to its git work tree, or, outside any,
    ``<outside the repository>/`` and its last two parts (``.../bin/python``)."""
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if not value.startswith("/"):
            out.append(arg)
            continue
        where = portable_path(value)
        if where.startswith("/"):
            where = "<outside the repository>/" + "/".join(Path(value).parts[-2:])
        out.append(f"{flag}{eq}{where}")
    return out


def _nulled(value: Any, where: str, bad: list[str]) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by ``None``, each one's
    place appended to ``bad``."""
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(f"{where}={value!r}")
        return None
    if isinstance(value, Mapping):
        return {k: _nulled(v, f"{where}.{k}" if where else str(k), bad) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nulled(v, f"{where}[{i}]", bad) for i, v in enumerate(value)]
    return value


def _strict_json(data: Any, what: Path | str, **options: Any) -> str:
    """``json.dumps(data, allow_nan=False, **options)`` with every NaN or ±inf written as
    ``null`` (logged, naming ``what`` and the values): ``NaN`` and ``Infinity`` are not JSON,
    and strict readers refuse the whole file."""
    bad: list[str] = []
    clean = _nulled(data, "", bad)
    if bad:
        logger.warning("%s: %s not finite; written as null (strict JSON).", what,
                       ", ".join(bad[:10]))
    return json.dumps(clean, allow_nan=False, **options)


def _finite_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A round's row without its non-finite values (logged; counted in ``non-finite-metrics``)."""
    bad = non_finite(row)
    if not bad:
        return dict(row)
    logger.warning("Round %s: %s %s not finite; left out of metrics.jsonl (counted in %s).",
                   row.get("round"), ", ".join(bad[:10]), "is" if len(bad) == 1 else "are",
                   NON_FINITE)
    out = {k: v for k, v in row.items() if not (isinstance(v, float) and not math.isfinite(v))}
    out[NON_FINITE] = float(out.get(NON_FINITE, 0.0)) + len(bad)
    return out


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` being resumed.

    A torn last line (the process died while appending it) is dropped with a warning; an
    unreadable line anywhere else means the file was damaged otherwise, and is an error.
    """
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    numbered = [(i, line) for i, line in enumerate(lines, start=1) if line.strip()]
    rows: list[dict[str, Any]] = []
    for k, (line_no, line) in enumerate(numbered):
        problem = None
        try:
            row = json.loads(line)
        except ValueError as err:
            problem = f"not valid JSON ({err})"
        else:
            if not isinstance(row, dict) or isinstance(row.get("round"), bool) or not isinstance(
                row.get("round"), int
            ):
                problem = "expected a JSON object with an integer 'round'"
        if problem is None:
            rows.append(row)
            continue
        if k == len(numbered) - 1:
            logger.warning("%s line %d is torn (%s): dropping it; its round is run again",
                           path, line_no, problem)
            break
        raise ValueError(
            f"{path} line {line_no}: {problem}; found {line[:80]!r}. Only the last line can be "
            "torn by a crash, so the file was damaged otherwise and the run was not resumed. "
            "Repair or delete that line, or start over with overwrite=true."
        )
    return rows


def _describe(directory: Path, present: list[str]) -> str:
    parts = []
    for name in present:
        if name == "metrics.jsonl":
            text = (directory / name).read_text(encoding="utf-8", errors="replace")
            parts.append(f"{name} with {sum(1 for x in text.splitlines() if x.strip())} row(s)")
        else:
            parts.append(name)
    return ", ".join(parts)


def _results_present(directory: Path) -> list[str]:
    """The names in :data:`~fedshard.app.rundir.RESULT_FILES` that hold results in ``directory``."""
    present = []
    for name in RESULT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name == "metrics.jsonl" and not path.read_text(errors="replace").strip():
            continue  # an empty metrics file records nothing
        present.append(name)
    return present


class RunRecorder:
    """Writes one run's results; every file is written atomically or appended line by line.

    Parameters
    ----------
    directory : Path
        Absolute run directory (``RunConfig.results_path``); created ``0700`` if needed.
    config : mapping
        The run config, recorded in ``config.json``.
    num_rounds : int
        Rounds of the run (for the log lines).
    resume_round : int or None
        Continue a run after this many completed rounds (its checkpoint's round): rows of
        later rounds, written before a crash, are dropped, a torn last row too. ``None``: a
        new run.
    overwrite : bool
        A new run may replace the results already in ``directory`` (they are deleted, and
        the log says so). Without it a new run refuses such a directory.

    Raises
    ------
    ValueError
        ``directory`` is relative, ``resume_round`` is given together with ``overwrite``, or
        the resumed ``metrics.jsonl`` is damaged before its last line.
    RunLockedError
        Another run holds ``directory`` (see :class:`~fedshard.app.rundir.RunLock`).
    ExistingResultsError
        A new run (``resume_round=None``) without ``overwrite`` in a directory that holds
        results (rows in ``metrics.jsonl``, a checkpoint, ``model.pt`` or ``summary.json``).

    Notes
    -----
    The recorder holds the run directory's lock from construction until :meth:`finish` or
    :meth:`close` (or the process ends); it is also a context manager that closes on exit.
    """

    def __init__(self, directory: Path, config: Mapping[str, Any], num_rounds: int,
                 *, resume_round: int | None = None, overwrite: bool = False) -> None:
        if not directory.is_absolute():
            raise ValueError(f"results directory {directory} must be absolute (Flower apps do not "
                             "run in your working directory)")
        if resume_round is not None and overwrite:
            raise ValueError(
                f"resume_round={resume_round} with overwrite=True: resuming keeps the results in "
                f"{directory}, overwriting deletes them; pick one. Nothing was changed."
            )
        self.directory = directory
        self.num_rounds = num_rounds
        make_run_directory(directory)
        self._lock = RunLock(directory)
        self._lock.acquire()
        try:
            self._start_files(config, resume_round, overwrite)
        except BaseException:
            self._lock.release()
            raise

    def _start_files(self, config: Mapping[str, Any], resume_round: int | None,
                     overwrite: bool) -> None:
        directory = self.directory
        self.metrics_path = directory / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        resumed: list[dict[str, Any]] = []
        if resume_round is None:
            present = _results_present(directory)
            if present and not overwrite:
                has_checkpoint = any(n.startswith("checkpoint") for n in present)
                ways = (
                    "set resume=true to continue that run from its checkpoint, or "
                    "overwrite=true to delete its results and start again"
                    if has_checkpoint else
                    "it has no checkpoint to resume from; set overwrite=true to delete its "
                    "results and start again"
                )
                raise ExistingResultsError(
                    f"{directory} already holds a run's results ({_describe(directory, present)})"
                    f". A new run there would overwrite them, so nothing was started: {ways}; or "
                    "give this run another run-name."
                )
            if present:
                logger.warning("overwrite=true: deleting the earlier run's %s in %s",
                               _describe(directory, present), directory)
                for name in present:
                    (directory / name).unlink()
        elif self.metrics_path.is_file():
            self.rows = [r for r in _read_rows(self.metrics_path) if r["round"] <= resume_round]
            try:
                old = json.loads((directory / "config.json").read_text())
                earlier = list(old.get("resumed", []))
            except (OSError, ValueError, AttributeError, TypeError) as err:
                logger.warning("%s is unreadable (%s); its record of earlier resumes is lost",
                               directory / "config.json", err)
                earlier = []
            resumed = [*earlier, {"after-round": resume_round,
                                  "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
        self.rows = [_finite_row(r) for r in self.rows]  # an older file may hold NaN
        write_private(self.metrics_path, "".join(json.dumps(r, sort_keys=True, allow_nan=False)
                                                 + "\n" for r in self.rows))
        # wall-s continues across a resume (time lost in the crash is not counted)
        self._start = time.time() - (float(self.rows[-1].get("wall-s", 0.0)) if self.rows
                                     else 0.0)
        self._last = time.time()
        info: dict[str, Any] = {
            # results-dir relative to its checkout: config.json files are committed as records
            "config": {**config, **({"results-dir": portable_path(config["results-dir"])}
                                    if config.get("results-dir") else {})},
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
        write_private(directory / "config.json",
                      _strict_json(info, directory / "config.json", indent=2, sort_keys=True))
        logger.info("fedshard results -> %s", directory)

    def close(self) -> None:
        """Release the run directory's lock (the files stay); safe to call twice."""
        self._lock.release()

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def record_round(self, server_round: int, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Append one round's metrics and log a one-line summary (``round``, ``wall-s`` and
        ``round-s`` are the recorder's: a metric of that name does not replace them). A value
        that is not finite is left out of the row, logged and counted in
        ``non-finite-metrics``: the file stays strict JSON."""
        now = time.time()
        row: dict[str, Any] = {k: float(v) for k, v in metrics.items()}
        # the recorder's own columns: no metric of that name may overwrite them
        row.update({"round": server_round, "wall-s": now - self._start,
                    "round-s": now - self._last})
        row = _finite_row(row)
        self._last = now
        self.rows.append(row)
        with open_private_append(self.metrics_path) as fh:
            fh.write(json.dumps(row, sort_keys=True, allow_nan=False) + "\n")
        # Flower's logger: the line shows in `flwr run --stream` and the SuperLink's run log.
        flwr_log(INFO, "%s", self.summary_line(row))
        return row

    def summary_line(self, row: Mapping[str, Any]) -> str:
        parts = [f"round {row['round']}/{self.num_rounds}"]
        for key, fmt in (("train-loss", "train loss {:.4f}"), ("test-loss", "test loss {:.4f}"),
                         ("test-accuracy", "test acc {:.2%}"), ("anme", "ANME {:.3f}"),
                         ("bytes-sent-ratio-mean", "nodes received {:.3f}x dense"),
                         ("replies-used", "replies {:.0f}")):
            value = row.get(key)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                parts.append(fmt.format(value))
        parts.append(f"{row['round-s']:.1f}s")
        return " | ".join(parts)

    def finish(self, state_dict: Mapping[str, torch.Tensor],
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Save the final model and a summary (with ``extra``'s entries added, e.g.
        ``"sharding"``: :func:`fedshard.server.savings.sharding_savings`), then release the run
        directory's lock."""
        buffer = io.BytesIO()
        torch.save(dict(state_dict), buffer)
        write_private(self.directory / "model.pt", buffer.getvalue())
        accs = [r["test-accuracy"] for r in self.rows if "test-accuracy" in r]
        # rounds whose aggregate changed the model (the strategy's count in each row; None
        # where no row says, e.g. rounds recorded without the strategy)
        trained = [r["rounds-trained"] for r in self.rows if "rounds-trained" in r]
        summary = {
            "rounds-completed": max((r["round"] for r in self.rows), default=0),
            "rounds-trained": int(max(trained)) if trained else None,
            "final-test-accuracy": accs[-1] if accs else None,
            "best-test-accuracy": max(accs) if accs else None,
            "wall-s": time.time() - self._start,
        }
        summary.update(extra or {})
        write_private(self.directory / "summary.json",
                      _strict_json(summary, self.directory / "summary.json", indent=2))
        self.close()
        return summary
