"""A run's results directory: its file names, its exclusive lock, and owner-only files.

One run writes one directory, ``<results-dir>/<run-name>/``. Two processes writing it at once
would interleave their metrics and overwrite each other's checkpoints, so the writer holds an
exclusive :func:`fcntl.flock` on ``run.lock`` inside it for the run's lifetime
(:class:`RunLock`). The kernel drops the lock when the holder's file is closed, including when
the process exits or is killed, so a crashed run never leaves a stale lock behind; the PID, host
and start time written into the file only say *who* holds it.

A resumed run waits a while for the lock (:func:`wait_for_run_lock`): the ServerApp of the
launch before it may still be stopping (Flower's ``flwr-serverapp`` outlives a stopped
SuperLink by seconds), and a resume submitted at once would otherwise be refused.

The directory is created ``0700`` and every result file is written ``0600``
(:func:`write_private`, :func:`open_private_append`): run configs and models are the user's.
No file in it is opened through a symbolic link (:func:`open_private`): a link planted under
the name of a file fedshard writes (``checkpoint.pt.tmp``, ``run.lock``) would otherwise have
fedshard truncate or overwrite the link's target; it is refused with an error naming it, and
so is anything else that is not a regular file (a FIFO would block or fail the run). What
``run.lock`` says about its holder is escaped before it reaches a log line or an error.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import platform
import stat
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from fedshard.protocol.bounds import printable

__all__ = [
    "CHECKPOINT_NAME",
    "LOCK_NAME",
    "PREVIOUS_CHECKPOINT_NAME",
    "RESULT_FILES",
    "RESUME_LOCK_WAIT_S",
    "ExistingResultsError",
    "RunDirectoryError",
    "RunLock",
    "RunLockedError",
    "make_run_directory",
    "open_private",
    "open_private_append",
    "wait_for_run_lock",
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
#: Seconds a resumed run waits for another process to release ``run.lock`` before it gives up
#: with :class:`RunLockedError`: longer than a stopping ServerApp takes to exit (see the
#: deployment docs' measurements), short enough that a run really in progress is reported.
RESUME_LOCK_WAIT_S = 90.0


class RunDirectoryError(RuntimeError):
    """A run cannot use its results directory (base class)."""


class RunLockedError(RunDirectoryError):
    """Another run holds the lock on the results directory."""


class ExistingResultsError(RunDirectoryError):
    """A new run was started in a directory that already holds a run's results."""


def make_run_directory(directory: Path) -> None:
    """Create ``directory`` (and its parents) if needed and make it owner-only (``0700``).

    Raises
    ------
    RunDirectoryError
        If it cannot be created or written into (a read-only or virtual file system such as
        ``/proc``, a path through a file, no permission), naming it and what to do.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        usable = os.access(directory, os.W_OK | os.X_OK)
        problem = "" if usable else "it is not writable by this user"
    except OSError as err:
        problem = f"{type(err).__name__}: {err.strerror or err}"
    if problem:
        raise RunDirectoryError(
            f"Cannot create the run folder {directory} (results-dir {directory.parent}, "
            f"run-name {directory.name}): {problem}; expected a folder this user can create and "
            "write into. Nothing was started: set results-dir to such a folder (an absolute "
            "path, e.g. ~/fedshard-results), or create it with write permission first.")
    if directory.stat().st_mode & 0o077:
        try:
            os.chmod(directory, 0o700)
        except PermissionError:  # someone else's folder: writing into it fails soon enough
            logger.warning("Cannot make %s owner-only (not its owner); results written there "
                           "may be readable by others", directory)


def open_private(path: Path, flags: int) -> int:
    """``os.open(path, flags, 0o600)`` that does not follow a symbolic link at ``path`` and
    opens only a regular file.

    Raises
    ------
    RunDirectoryError
        If ``path`` is a symbolic link, naming it and its target, or another kind of file than
        a regular one (a FIFO, socket or device), naming it: nothing was opened, so nothing
        was written or truncated through it.
    """
    try:
        if path.is_symlink():  # O_NOFOLLOW, where the platform has it, also closes the race
            raise OSError(errno.ELOOP, "a symbolic link", str(path))
        # O_NONBLOCK: opening a FIFO must fail or return at once, never wait for a reader
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0),
                     0o600)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a FIFO opened write-only without a reader
            raise _not_regular(path, "a FIFO") from None
        if err.errno != errno.ELOOP and not path.is_symlink():
            raise
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise RunDirectoryError(
            f"{path} is a symbolic link (to {target}); expected a plain file that fedshard "
            "creates, so nothing was written through it. Remove the link (and find out who "
            "put it there: it would have had fedshard overwrite its target), then start the "
            "run again.") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "a device")
        raise _not_regular(path, kind)
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return fd


def _not_regular(path: Path, kind: str) -> RunDirectoryError:
    return RunDirectoryError(
        f"{path} is {kind}, not a regular file; expected a plain file that fedshard creates, "
        "so it was not opened and the run was not started. Remove it (and find out who put "
        "it there), then start the run again.")


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``path`` atomically (temporary file, then rename) with mode ``0600``; neither
    file is opened through a symbolic link (:func:`open_private`)."""
    tmp = path.with_name(path.name + ".tmp")
    raw = data.encode() if isinstance(data, str) else data
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fd, 0o600)  # a leftover .tmp keeps its old mode through O_CREAT
        fh.write(raw)
    os.replace(tmp, path)


def open_private_append(path: Path) -> IO[str]:
    """Open ``path`` for appending text, creating it with mode ``0600`` (not through a
    symbolic link: :func:`open_private`)."""
    fd = open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding="utf-8")


def _describe_holder(text: str) -> str:
    """Who holds the lock, from what ``run.lock`` says; escaped (:func:`printable`), since any
    process that can write the file chooses the text that reaches the log."""
    try:
        info = json.loads(text)
        described = f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        described = ("a process that has not written its pid/host yet" if not text.strip()
                     else f"unknown holder ({text.strip()[:80]!r})")
    return printable(described, 300)


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

    #: Seconds between two tries while :meth:`acquire` waits, and between two log lines.
    POLL_S = 0.25
    LOG_EVERY_S = 15.0

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock, at once or within ``wait_s`` seconds, or fail.

        While it waits it logs a WARNING at once and then every :attr:`LOG_EVERY_S` seconds:
        the folder, the holder (PID, host, start time) and how long it will still wait.

        Raises
        ------
        RunLockedError
            If another run (process or object) still holds it after ``wait_s`` seconds; the
            message names the holder (and how long this run waited).
        """
        import fcntl

        if self._fh is not None:
            return
        start = time.monotonic()
        logged: float | None = None
        while True:
            fd = open_private(self.path, os.O_RDWR | os.O_CREAT)  # it truncates: no link
            fh = os.fdopen(fd, "r+", encoding="utf-8")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _describe_holder(fh.read())
                fh.close()
            except BaseException:
                fh.close()
                raise
            waited = time.monotonic() - start
            if waited >= wait_s:
                err = self._refusal(holder)
                if wait_s > 0:
                    err.args = (f"{err} This run waited {waited:.0f} s for it.",)
                raise err from None
            if logged is None or waited - logged >= self.LOG_EVERY_S:
                logger.warning(
                    "%s is held by %s (lock file %s): waiting up to %.0f s more for it to be "
                    "released (a ServerApp of an earlier launch still stopping releases it "
                    "when its process ends).", self.directory, holder, self.path,
                    wait_s - waited)
                logged = waited
            time.sleep(min(self.POLL_S, max(0.0, wait_s - waited)))
        if logged is not None:
            logger.info("%s: the lock was released after %.1f s; this run goes on.",
                        self.directory, time.monotonic() - start)
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



def wait_for_run_lock(directory: Path, wait_s: float | None = None) -> None:
    """Return once no other process holds ``directory``'s ``run.lock`` (at once where the
    folder or its lock file does not exist), waiting up to ``wait_s`` seconds (default
    :data:`RESUME_LOCK_WAIT_S`) and logging who holds it (:meth:`RunLock.acquire`). The lock
    is not kept: the run's :class:`~fedshard.app.results.RunRecorder` takes it.

    Raises
    ------
    RunLockedError
        If the lock is still held after ``wait_s`` seconds, naming the holder.
    """
    if not (directory / LOCK_NAME).is_file():
        return
    lock = RunLock(directory)
    lock.acquire(wait_s=RESUME_LOCK_WAIT_S if wait_s is None else wait_s)
    lock.release()
