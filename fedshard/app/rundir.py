"""A run's results directory: its file names, its exclusive lock, and owner-only files.

One run writes one directory, ``<results-dir>/<run-name>/``. Two processes writing it at once
would interleave their metrics and overwrite each other's checkpoints, so the writer holds an
exclusive :func:`fcntl.flock` on ``run.lock`` inside it for the run's lifetime
(:class:`RunLock`). The kernel drops the lock when the holder's file is closed, including when
the process exits or is killed, so a crashed run never leaves a stale lock behind; the PID, host
and start time written into the file only say *who* holds it.

The directory is created ``0700`` and every result file is written ``0600``
(:func:`write_private`, :func:`open_private_append`): run configs and models are the user's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = [
    "CHECKPOINT_NAME",
    "LOCK_NAME",
    "PREVIOUS_CHECKPOINT_NAME",
    "RESULT_FILES",
    "ExistingResultsError",
    "RunDirectoryError",
    "RunLock",
    "RunLockedError",
    "make_run_directory",
    "open_private_append",
    "write_private",
]

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_CHECKPOINT_NAME = "checkpoint.prev.pt"
LOCK_NAME = "run.lock"
#: Files that hold a run's results: a new run refuses a directory holding any of them (unless
#: it resumes or overwrites). ``config.json`` alone is not a result: it is written first.
RESULT_FILES = ("metrics.jsonl", CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME, "model.pt",
                "summary.json")


class RunDirectoryError(RuntimeError):
    """A run cannot use its results directory (base class)."""


class RunLockedError(RunDirectoryError):
    """Another run holds the lock on the results directory."""


class ExistingResultsError(RunDirectoryError):
    """A new run was started in a directory that already holds a run's results."""


def make_run_directory(directory: Path) -> None:
    """Create ``directory`` (and its parents) if needed and make it owner-only (``0700``)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if directory.stat().st_mode & 0o077:
        try:
            os.chmod(directory, 0o700)
        except PermissionError:  # someone else's folder: writing into it fails soon enough
            logger.warning("Cannot make %s owner-only (not its owner); results written there "
                           "may be readable by others", directory)


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``path`` atomically (temporary file, then rename) with mode ``0600``."""
    tmp = path.with_name(path.name + ".tmp")
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fd, 0o600)  # a leftover .tmp keeps its old mode through O_CREAT
        fh.write(raw)
    os.replace(tmp, path)


def open_private_append(path: Path) -> IO[str]:
    """Open ``path`` for appending text, creating it with mode ``0600``."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8")


def _describe_holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid/host yet" if not text.strip() else (
            f"unknown holder ({text.strip()[:80]!r})")


class RunLock:
    """Exclusive, non-blocking lock on a run directory (``flock`` on ``<directory>/run.lock``).

    Parameters
    ----------
    directory : Path
        The run directory; it must exist.

    Notes
    -----
    ``flock`` locks belong to an open file description: a second :class:`RunLock` on the same
    directory conflicts even inside the same process, and the lock goes away when the file is
    closed (:meth:`release`, garbage collection, process exit or crash). The file descriptor
    is not inherited by ``exec``'d child processes.

    Examples
    --------
    >>> with RunLock(directory):          # doctest: +SKIP
    ...     write_results(directory)
    """

    #: The lock file's name inside the directory.
    lock_name = LOCK_NAME

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / self.lock_name
        self._fh: IO[str] | None = None

    def _refusal(self, holder: str) -> RunLockedError:
        """The error when ``holder`` (described) has the lock; subclasses say what is refused."""
        return RunLockedError(
            f"{self.directory} is in use by another run ({holder}; lock file {self.path}). "
            "Two runs writing one directory would interleave their metrics, so this run "
            "was not started. Wait for the other run to end or stop it, or give this run "
            "another run-name."
        )

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fh is not None

    def acquire(self) -> None:
        """Take the lock at once or fail.

        Raises
        ------
        RunLockedError
            If another run (process or object) holds it; the message names the holder.
        """
        import fcntl

        if self._fh is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fh = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fh.read())
            fh.close()
            raise self._refusal(holder) from None
        except BaseException:
            fh.close()
            raise
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "host": platform.node(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        """Give the lock up (nothing happens when it is not held)."""
        fh, self._fh = self._fh, None
        if fh is None:
            return
        with contextlib.suppress(OSError):
            fh.seek(0)
            fh.truncate()  # the next reader must not name a holder that is gone
        fh.close()  # closing the last descriptor releases the flock

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

