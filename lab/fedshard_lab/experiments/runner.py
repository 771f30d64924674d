"""Run an experiment suite: one ``flwr run`` per run, resumable, with progress and an ETA.

What each run's folder holds decides what happens to it (:mod:`fedshard_lab.experiments.status`).
Finished runs are skipped. A *resumable* run (interrupted or failed, with a checkpoint of the
suite's settings) continues after its checkpoint's round (``resume=true``; every random stream
is derived from ``(seed, round, ...)``, so the result is the uninterrupted run's). A *partial*
run (no usable checkpoint, or ``restart_partial``) is deleted and starts again from scratch,
with the reason printed. A finished run whose settings differ from the suite's (the suite file
was edited) is *stale*: the runner refuses to start until it is removed or ``rerun_stale`` is
given, so that hours of results are never deleted silently.

Besides the recorder's files, each run folder gets ``runner.json`` (suite entry, the exact
run-config overrides, the wall time, exit code and status) and ``flwr-output.log`` (everything
``flwr run --stream`` printed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fedshard.app.config import ProblemsError
from fedshard.app.results import portable_path
from fedshard.app.rundir import RunLock, RunLockedError
from fedshard_lab.experiments.launch import SimulationRun, launcher_for
from fedshard_lab.experiments.progress import MetricsTail, Progress, format_duration
from fedshard_lab.experiments.status import (
    RunState,
    RunStatus,
    StaleRunsError,
    run_status,
    suite_status,
)
from fedshard_lab.experiments.suite import RunSpec, Suite

__all__ = [
    "Launcher",
    "RunState",
    "RunStatus",
    "SelectionError",
    "StaleRunsError",
    "SuiteLock",
    "SuiteOutcome",
    "format_duration",
    "run_status",
    "run_suite",
    "server_app_raised",
    "suite_status",
]

logger = logging.getLogger(__name__)


class Launcher(Protocol):
    """Runs one simulation for :func:`run_suite`
    (:func:`fedshard_lab.experiments.launch.run_simulation`)."""

    def __call__(
        self,
        app_dir: Path,
        run_config: Mapping[str, Any],
        *,
        num_supernodes: int,
        flwr_home: Path | None = ...,
        client_num_cpus: int = ...,
        timeout_s: float = ...,
        on_line: Callable[[str], None] | None = ...,
        client_num_gpus: float = ...,
    ) -> SimulationRun: ...


class SelectionError(ProblemsError):
    """Raised when ``run_suite``'s ``seeds``/``labels`` name what the suite does not have."""

    def __init__(self, suite_name: str, problems: list[str]) -> None:
        super().__init__(f"run selection for suite {suite_name!r}", problems,
                         "nothing was started")


@dataclass
class SuiteOutcome:
    """What one :func:`run_suite` call did (run names)."""

    finished: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no run failed."""
        return not self.failed


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _portable_settings(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run config as ``runner.json`` records it: ``results-dir`` relative to its checkout
    (the launch itself is given the absolute path the ServerApp needs)."""
    out = dict(run_config)
    if out.get("results-dir"):
        out["results-dir"] = portable_path(out["results-dir"])
    return out


# ---------------------------------------------------------------------- signals and locking
@contextlib.contextmanager
def _interrupts_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` once; later ones are ignored.

    The exception unwinds through the launcher, whose ``finally`` stops the simulation's
    processes; a second Ctrl-C must not cut that cleanup short.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal hit
        if hit:
            logger.warning("signal %d ignored: still stopping the run's processes", signum)
            return
        hit = True
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class SuiteLock(RunLock):
    """Exclusive lock on a suite's results folder: two runners would delete each other's
    runs (:class:`~fedshard.app.rundir.RunLock`'s flock, on ``.runner.lock``)."""

    lock_name = ".runner.lock"

    def _refusal(self, holder: str) -> RunLockedError:
        return RunLockedError(
            f"another runner ({holder}) is working in {self.directory}; wait for it or stop "
            "it first. Nothing was started."
        )


def _remove_run_folder(suite: Suite, spec: RunSpec) -> None:
    # Only ever a direct child of the suite's results folder, named by the suite.
    assert spec.directory.parent == suite.results_dir and spec.name, spec.directory
    shutil.rmtree(spec.directory)


# ---------------------------------------------------------------------- the runner
def run_suite(
    suite: Suite,
    *,
    launch: Launcher | None = None,
    emit: Callable[[str], None] | None = None,
    echo: Callable[[str], None] | None = None,
    rerun_stale: bool = False,
    restart_partial: bool = False,
    fail_fast: bool = False,
    seeds: Collection[int] | None = None,
    labels: Collection[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    uncommitted: str | None = None,
) -> SuiteOutcome:
    """Run every unfinished run of ``suite``, in order; skip finished ones.

    Parameters
    ----------
    suite : Suite
        A validated suite (:func:`fedshard_lab.experiments.load_suite`).
    launch : Launcher, optional
        Runs one simulation; by default the suite's engine's
        (:func:`fedshard_lab.experiments.launch.launcher_for`: ``flwr run`` for ``"flower"``, the
        in-process engine otherwise; tests inject a fake).
    emit : callable, optional
        Receives one progress line per event (run started/skipped/done/failed, each round);
        default: ``logger.info``.
    echo : callable, optional
        Receives every line ``flwr run`` prints (all of them also go to the run's
        ``flwr-output.log``).
    rerun_stale : bool
        Delete and re-run finished runs whose settings differ from the suite's, instead of
        raising :class:`StaleRunsError`.
    restart_partial : bool
        Delete unfinished runs and start them from scratch even when their checkpoint could
        continue them (e.g. after a change to the code that the settings do not show).
    fail_fast : bool
        Stop at the first failed run instead of going on with the next.
    seeds : collection of int, optional
        Only the runs with these seeds (e.g. ``{0}`` to finish one seed of every cell before
        the second); the other runs are left as they are and not counted. Default: all.
    labels : collection of str, optional
        Only the runs of these row labels (e.g. ``{"Collective"}``); combined with ``seeds``
        a run must match both. Default: all.
    clock : callable
        Monotonic seconds (injectable for tests).
    uncommitted : str, optional
        The diff of the app folder's uncommitted changes the runs are launched with
        (:func:`fedshard_lab.experiments.tree.tree_state`; the command line refuses them
        without ``--allow-dirty``): each launched run keeps it as ``uncommitted.diff`` and
        ``runner.json`` names it.

    Returns
    -------
    SuiteOutcome
        Runs finished now, skipped, and failed (with the reason).

    Raises
    ------
    StaleRunsError
        Before anything starts, when finished runs have other settings than the suite's.
    SelectionError
        When ``seeds`` or ``labels`` names a seed or label that no run of the suite has.
    KeyboardInterrupt
        On Ctrl-C or SIGTERM, after the current simulation's processes are stopped; the
        interrupted run resumes from its last checkpoint next time.
    """
    say = emit if emit is not None else logger.info
    launch = launch if launch is not None else launcher_for(suite.engine)
    selected = _selection(suite, seeds, labels)
    statuses = selected(suite_status(suite))
    stale = [s for s in statuses if s.state is RunState.STALE]
    if stale and not rerun_stale:
        raise StaleRunsError(stale)
    outcome = SuiteOutcome()
    suite.results_dir.mkdir(parents=True, exist_ok=True)
    with SuiteLock(suite.results_dir), _interrupts_raise():
        # Re-read inside the lock: another runner may have finished runs meanwhile.
        statuses = selected(suite_status(suite))
        if restart_partial:
            statuses = [RunStatus(s.spec, RunState.PARTIAL, f"{s.detail}; restart_partial")
                        if s.state is RunState.RESUMABLE else s for s in statuses]
        todo = {s.spec.name: s.spec.num_rounds - (s.resume_round or 0) for s in statuses
                if s.state is not RunState.FINISHED}
        progress = Progress(suite, todo, say, clock)
        pending = len(todo)
        resumable = sum(s.state is RunState.RESUMABLE for s in statuses)
        say(f"[{suite.name}] {len(statuses)} run(s): {len(statuses) - pending} finished, "
            f"{pending} to run ({resumable} of them resumed from a checkpoint) -> "
            f"{suite.results_dir}")
        for status in statuses:
            spec = status.spec
            if status.state is RunState.FINISHED:
                outcome.skipped.append(spec.name)
                say(f"{progress.prefix(spec)}: skipped, finished ({status.detail})")
                continue
            if status.state is RunState.STALE and not rerun_stale:  # appeared meanwhile
                raise StaleRunsError([status])
            if status.state in (RunState.PARTIAL, RunState.STALE):
                say(f"{progress.prefix(spec)}: deleting {status.state.value} run folder "
                    f"({status.detail}); starting again from scratch")
                _remove_run_folder(suite, spec)
            error = _launch_one(suite, spec, launch, progress, echo, status.resume_round,
                                uncommitted)
            if error is None:
                outcome.finished.append(spec.name)
                continue
            outcome.failed.append((spec.name, error))
            if fail_fast:
                break
        elapsed = format_duration(clock() - progress.start)
        say(f"[{suite.name}] done in {elapsed}: {len(outcome.finished)} run(s) finished now, "
            f"{len(outcome.skipped)} skipped, {len(outcome.failed)} failed")
        for name, error in outcome.failed:
            say(f"[{suite.name}] FAILED {name}: {error}")
    return outcome


def _selection(suite: Suite, seeds: Collection[int] | None, labels: Collection[str] | None
               ) -> Callable[[list[RunStatus]], list[RunStatus]]:
    """A filter keeping the statuses of runs with one of ``seeds`` and one of ``labels``
    (``None``: any)."""
    problems = []
    if seeds is not None:
        used_seeds = {spec.seed for spec in suite.runs}
        unknown_seeds = sorted(set(seeds) - used_seeds)
        if unknown_seeds:
            problems.append(f"seed(s) {unknown_seeds}: no run uses them (the suite's seeds: "
                            f"{sorted(used_seeds)})")
    if labels is not None:
        used_labels = list(dict.fromkeys(spec.label for spec in suite.runs))
        unknown_labels = [label for label in labels if label not in used_labels]
        if unknown_labels:
            problems.append(f"label(s) {unknown_labels}: not rows of the suite (its rows: "
                            f"{used_labels})")
    if problems:
        raise SelectionError(suite.name, problems)
    return lambda statuses: [
        s for s in statuses
        if (seeds is None or s.spec.seed in seeds) and (labels is None or s.spec.label in labels)
    ]


#: What Flower 1.42 logs when the ServerApp (or the simulation around it) raised; ``flwr run
#: --stream`` still exits 0 then (``flwr/simulation/app.py``).
_RAISED = re.compile(r"\b(Simulation|ServerApp) raised an exception")


def server_app_raised(output: str) -> str | None:
    """The line of ``flwr run``'s ``output`` saying the ServerApp raised, or ``None``."""
    return next((line.strip() for line in output.splitlines() if _RAISED.search(line)), None)


def _launch_one(suite: Suite, spec: RunSpec, launch: Launcher, progress: Progress,
                echo: Callable[[str], None] | None, resume_round: int | None,
                uncommitted: str | None = None) -> str | None:
    """Launch ``spec`` (with ``resume=true`` after ``resume_round``, if given); return
    ``None`` when it finished, else why not."""
    say = progress.emit
    spec.directory.mkdir(parents=True, exist_ok=True)
    earlier: list[Any] = []
    if resume_round is not None:
        try:
            old = dict(json.loads((spec.directory / "runner.json").read_text()))
            if old.get("status") == "running":  # its runner was killed before the record
                old["status"] = "killed"
                old["note"] = ("the launch ended without writing its record (its runner was "
                               "killed); the run resumed from its last checkpoint")
            before = old.pop("earlier-launches", [])
            earlier = [*(before if isinstance(before, list) else []), old]
        except (OSError, ValueError, TypeError) as err:
            logger.warning("%s: runner.json of the earlier launch is unreadable (%s); its "
                           "record is lost", spec.directory, err)
    run_config = dict(spec.run_config)
    if resume_round is not None:
        run_config["resume"] = True
    home = Path(tempfile.mkdtemp(prefix=f"fedshard-flwr-{spec.name[:40]}-"))
    record: dict[str, Any] = {
        "suite": suite.name, "suite-file": suite.source, "label": spec.label,
        "column": spec.column, "seed": spec.seed, "run-name": spec.name,
        "run-config": _portable_settings(spec.run_config),
        "num-supernodes": suite.num_supernodes, "client-num-cpus": suite.client_num_cpus,
        "client-num-gpus": suite.client_num_gpus, "app-dir": portable_path(suite.app_dir),
        "engine": suite.engine,
        # a folder of the system's temporary directory, deleted when the launch ends
        "flwr-home": home.name, "launched": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "running",
    }
    if resume_round is not None:
        record["resumed-after-round"] = resume_round
        record["earlier-launches"] = earlier
    if uncommitted is not None:
        diff = "uncommitted.diff" if resume_round is None else f"uncommitted-{len(earlier)}.diff"
        (spec.directory / diff).write_text(uncommitted)
        record["uncommitted-diff"] = diff
    _write_json(spec.directory / "runner.json", record)
    if resume_round is None:
        say(f"{progress.prefix(spec)}: starting ({spec.num_rounds} rounds) -> {spec.directory}")
    else:
        say(f"{progress.prefix(spec)}: resuming after round {resume_round} of "
            f"{spec.num_rounds} from its checkpoint -> {spec.directory}")
    tail = MetricsTail(spec.directory / "metrics.jsonl", skip_existing=resume_round is not None)
    rounds_s = 0.0
    done = resume_round or 0

    def follow() -> None:
        nonlocal rounds_s
        for row in tail.rows():
            r = int(row.get("round", 0))
            if r <= done and resume_round is not None:
                continue  # rows of the earlier launch(es)
            if r >= 1:
                rounds_s += float(row.get("round-s", 0.0))
            progress.round(spec, row)

    start = progress.clock()
    sim: SimulationRun | None = None
    error: str | None = None
    with (spec.directory / "flwr-output.log").open("w" if resume_round is None else "a") as log:
        if resume_round is not None:
            log.write(f"---- resumed after round {resume_round} "
                      f"({time.strftime('%Y-%m-%dT%H:%M:%S%z')}) ----\n")

        def on_line(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            if echo is not None:
                echo(line)
            follow()

        try:
            sim = launch(
                suite.app_dir, run_config, num_supernodes=suite.num_supernodes,
                flwr_home=home, client_num_cpus=suite.client_num_cpus,
                timeout_s=suite.timeout_s, on_line=on_line, client_num_gpus=suite.client_num_gpus,
            )
        except KeyboardInterrupt:
            record.update(status="interrupted", **{"wall-s": progress.clock() - start})
            _write_json(spec.directory / "runner.json", record)
            say(f"{progress.prefix(spec)}: interrupted; the run's processes are stopped and it "
                "will resume from its last checkpoint next time (--restart-partial: from "
                "scratch)")
            raise
        except Exception as err:  # a launcher failure (timeout, missing flwr) fails this run
            error = f"{type(err).__name__}: {err}"
        finally:
            follow()
            shutil.rmtree(home, ignore_errors=True)
    wall_s = sim.wall_s if sim is not None else progress.clock() - start
    progress.launched(spec, wall_s, rounds_s)
    status = run_status(spec)
    if error is None and sim is not None and sim.returncode != 0:
        error = f"flwr run exited with code {sim.returncode}"
    raised = server_app_raised(sim.output) if sim is not None else None
    if error is None and raised is not None:
        error = (f"the ServerApp raised (flwr run's output: {raised!r}) although flwr run "
                 "exited with code 0")
    if error is None and status.state is not RunState.FINISHED:
        error = f"flwr run returned but the run is {status.state.value}: {status.detail}"
    record.update({"wall-s": wall_s, "returncode": None if sim is None else sim.returncode,
                   "status": "finished" if error is None else "failed"})
    if error is not None and resume_round is not None:
        error += (f" (resumed after round {resume_round}; `run --restart-partial` starts it "
                  "from scratch)")
    if error is not None:
        record["error"] = error
    _write_json(spec.directory / "runner.json", record)
    if error is None:
        say(f"{progress.prefix(spec)}: done in {format_duration(wall_s)} ({status.detail}) | "
            f"suite ETA {progress.eta()}")
        return None
    say(f"{progress.prefix(spec)}: FAILED after {format_duration(wall_s)}: {error}; "
        f"output in {spec.directory / 'flwr-output.log'}, last lines:")
    lines = sim.output.splitlines()[-15:] if sim is not None else []
    for line in lines:
        say(f"    | {line}")
    return error
