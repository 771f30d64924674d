"""Run an experiment suite: one ``flwr run`` per run, resumable, with progress and an ETA.

A run is *finished* when its folder has ``summary.json`` (written last, atomically, by
:class:`fedshard.results.RunRecorder`) with ``rounds-completed`` equal to the run's
``num-server-rounds``, and its ``config.json`` shows the settings the suite asks for now.
Finished runs are skipped; a run folder that exists but is not finished (interrupted, failed)
is deleted and the run starts again from scratch. A finished run whose settings differ from
the suite's (the suite file was edited) is *stale*: the runner refuses to start until it is
removed or ``rerun_stale`` is given, so that hours of results are never deleted silently.

Besides the recorder's files, each run folder gets ``runner.json`` (suite entry, the exact
run-config overrides, the wall time, exit code and status) and ``flwr-output.log`` (everything
``flwr run --stream`` printed).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fedshard.config import ProblemsError, RunConfig
from fedshard.experiments.suite import RunSpec, Suite
from fedshard.launch import SimulationRun, run_simulation

__all__ = [
    "Launcher",
    "RunState",
    "RunStatus",
    "SelectionError",
    "StaleRunsError",
    "SuiteOutcome",
    "format_duration",
    "run_status",
    "run_suite",
    "suite_status",
]

logger = logging.getLogger(__name__)

#: Config keys that name where a run is stored, not how it trains (moving a results folder
#: does not make its runs stale).
_LOCATION_KEYS = ("results-dir", "run-name")


class Launcher(Protocol):
    """Runs one simulation for :func:`run_suite` (:func:`fedshard.launch.run_simulation`)."""

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


class RunState(enum.Enum):
    """Where a run stands on disk."""

    PENDING = "pending"  # no folder yet
    PARTIAL = "partial"  # folder without a complete summary: re-run from scratch
    FINISHED = "finished"  # complete, with the suite's settings: skipped
    STALE = "stale"  # complete, but with other settings than the suite's now


@dataclass(frozen=True)
class RunStatus:
    """A run's state, why, and its summary when it has one."""

    spec: RunSpec
    state: RunState
    detail: str
    summary: dict[str, Any] | None = None


class SelectionError(ProblemsError):
    """Raised when ``run_suite``'s ``seeds``/``labels`` name what the suite does not have."""

    def __init__(self, suite_name: str, problems: list[str]) -> None:
        super().__init__(f"run selection for suite {suite_name!r}", problems,
                         "nothing was started")


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


def format_duration(seconds: float) -> str:
    """``"1h 02m"``, ``"4m 05s"`` or ``"12s"``."""
    s = round(max(seconds, 0.0))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def run_status(spec: RunSpec) -> RunStatus:
    """Classify ``spec``'s folder as pending, partial, finished or stale (see module doc)."""
    folder = spec.directory
    if not folder.exists():
        return RunStatus(spec, RunState.PENDING, "not started")
    try:
        summary = _read_json(folder / "summary.json")
    except FileNotFoundError:
        return RunStatus(spec, RunState.PARTIAL, "no summary.json (interrupted or failed)")
    except (OSError, ValueError) as err:
        return RunStatus(spec, RunState.PARTIAL, f"unreadable summary.json ({err})")
    try:
        used = _read_json(folder / "config.json")["config"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return RunStatus(spec, RunState.STALE, f"summary.json but no readable config.json "
                         f"({err}); cannot tell which settings it ran with", summary)
    done = summary.get("rounds-completed")
    if done != used.get("num-server-rounds"):
        return RunStatus(spec, RunState.PARTIAL,
                         f"{done} of {used.get('num-server-rounds')} rounds completed")
    expected = spec.config.as_dict()
    # A key that a newer fedshard added is absent from older runs: they ran with its default.
    defaults = RunConfig().as_dict()
    diffs = [f"{k}={used.get(k, defaults.get(k))!r} (suite: {v!r})" for k, v in expected.items()
             if k not in _LOCATION_KEYS and used.get(k, defaults.get(k)) != v]
    if diffs:
        return RunStatus(spec, RunState.STALE, "finished with " + ", ".join(diffs), summary)
    acc = summary.get("final-test-accuracy")
    acc_text = f"final test acc {acc:.2%}, " if isinstance(acc, (int, float)) else ""
    return RunStatus(spec, RunState.FINISHED, f"{acc_text}{done} rounds", summary)


def suite_status(suite: Suite) -> list[RunStatus]:
    """:func:`run_status` of every run, in execution order."""
    return [run_status(spec) for spec in suite.runs]


# ---------------------------------------------------------------------- progress and ETA
class _Progress:
    """Progress lines and the suite's ETA from the seconds per round measured so far."""

    def __init__(self, suite: Suite, statuses: list[RunStatus], emit: Callable[[str], None],
                 clock: Callable[[], float]) -> None:
        self.suite = suite
        self.emit = emit
        self.clock = clock
        self.start = clock()
        self.todo = {s.spec.name: s.spec.num_rounds for s in statuses
                     if s.state is not RunState.FINISHED}
        self.round_s: list[float] = []  # measured seconds of rounds >= 1 (round 0 = setup)
        self.overhead_s: list[float] = []  # per launch: wall time not spent in rounds

    def prefix(self, spec: RunSpec) -> str:
        return f"[{self.suite.name}] run {spec.index + 1}/{len(self.suite.runs)} {spec.title}"

    def eta(self) -> str:
        if not self.round_s:
            return "?"
        per_round = sum(self.round_s) / len(self.round_s)
        overhead = sum(self.overhead_s) / len(self.overhead_s) if self.overhead_s else 0.0
        # Every pending run pays the launch overhead; the current one has paid it already.
        launches = max(len(self.todo) - 1, 0)
        return format_duration(sum(self.todo.values()) * per_round + launches * overhead)

    def round(self, spec: RunSpec, row: Mapping[str, Any]) -> None:
        r = int(row.get("round", 0))
        parts = [f"{self.prefix(spec)}: round {r}/{spec.num_rounds}"]
        acc = row.get("test-accuracy")
        if isinstance(acc, (int, float)):
            parts.append(f"test acc {acc:.2%}")
        seconds = row.get("round-s")
        if r >= 1 and isinstance(seconds, (int, float)):
            self.round_s.append(float(seconds))
            self.todo[spec.name] = max(spec.num_rounds - r, 0)
            parts.append(f"{seconds:.1f} s/round")
        parts.append(f"suite ETA {self.eta()}")
        self.emit(" | ".join(parts))

    def launched(self, spec: RunSpec, wall_s: float, rounds_s: float) -> None:
        self.todo.pop(spec.name, None)
        self.overhead_s.append(max(wall_s - rounds_s, 0.0))


class _MetricsTail:
    """New complete lines of a growing ``metrics.jsonl``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def rows(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        if len(data) == 0 and self.offset > 0 and self.path.stat().st_size < self.offset:
            self.offset = 0  # the recorder truncated it (not expected within one launch)
            return self.rows()
        end = data.rfind(b"\n") + 1  # a line being written has no newline yet
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                logger.warning("%s: skipping unreadable line %r", self.path, line[:80])
        return rows


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


@contextlib.contextmanager
def _suite_lock(results_dir: Path) -> Iterator[None]:
    """Exclusive lock on the results folder: two runners would delete each other's runs."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / ".runner.lock"
    with path.open("a+") as fh:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock
            yield
            return
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            raise RuntimeError(
                f"another runner (pid {holder}) is working in {results_dir}; wait for it or "
                "stop it first. Nothing was started."
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_run_folder(suite: Suite, spec: RunSpec) -> None:
    # Only ever a direct child of the suite's results folder, named by the suite.
    assert spec.directory.parent == suite.results_dir and spec.name, spec.directory
    shutil.rmtree(spec.directory)


# ---------------------------------------------------------------------- the runner
def run_suite(
    suite: Suite,
    *,
    launch: Launcher = run_simulation,
    emit: Callable[[str], None] | None = None,
    echo: Callable[[str], None] | None = None,
    rerun_stale: bool = False,
    fail_fast: bool = False,
    seeds: Collection[int] | None = None,
    labels: Collection[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SuiteOutcome:
    """Run every unfinished run of ``suite``, in order; skip finished ones.

    Parameters
    ----------
    suite : Suite
        A validated suite (:func:`fedshard.experiments.load_suite`).
    launch : Launcher
        Runs one simulation; :func:`fedshard.launch.run_simulation` by default (tests inject
        a fake).
    emit : callable, optional
        Receives one progress line per event (run started/skipped/done/failed, each round);
        default: ``logger.info``.
    echo : callable, optional
        Receives every line ``flwr run`` prints (all of them also go to the run's
        ``flwr-output.log``).
    rerun_stale : bool
        Delete and re-run finished runs whose settings differ from the suite's, instead of
        raising :class:`StaleRunsError`.
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
        interrupted run's folder is re-run from scratch next time.
    """
    say = emit if emit is not None else logger.info
    selected = _selection(suite, seeds, labels)
    statuses = selected(suite_status(suite))
    stale = [s for s in statuses if s.state is RunState.STALE]
    if stale and not rerun_stale:
        raise StaleRunsError(stale)
    outcome = SuiteOutcome()
    with _suite_lock(suite.results_dir), _interrupts_raise():
        # Re-read inside the lock: another runner may have finished runs meanwhile.
        statuses = selected(suite_status(suite))
        progress = _Progress(suite, statuses, say, clock)
        pending = sum(s.state is not RunState.FINISHED for s in statuses)
        say(f"[{suite.name}] {len(statuses)} run(s): {len(statuses) - pending} finished, "
            f"{pending} to run -> {suite.results_dir}")
        for status in statuses:
            spec = status.spec
            if status.state is RunState.FINISHED:
                outcome.skipped.append(spec.name)
                say(f"{progress.prefix(spec)}: skipped, finished ({status.detail})")
                continue
            if status.state is RunState.STALE and not rerun_stale:  # appeared meanwhile
                raise StaleRunsError([status])
            if status.state is not RunState.PENDING:
                say(f"{progress.prefix(spec)}: deleting {status.state.value} run folder "
                    f"({status.detail}); starting again from scratch")
                _remove_run_folder(suite, spec)
            error = _launch_one(suite, spec, launch, progress, echo)
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


def _launch_one(suite: Suite, spec: RunSpec, launch: Launcher, progress: _Progress,
                echo: Callable[[str], None] | None) -> str | None:
    """Launch ``spec``; return ``None`` when it finished, else why not."""
    say = progress.emit
    spec.directory.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix=f"fedshard-flwr-{spec.name[:40]}-"))
    record: dict[str, Any] = {
        "suite": suite.name, "suite-file": suite.source, "label": spec.label,
        "column": spec.column, "seed": spec.seed, "run-name": spec.name,
        "run-config": spec.run_config, "num-supernodes": suite.num_supernodes,
        "client-num-cpus": suite.client_num_cpus,
        "client-num-gpus": suite.client_num_gpus, "app-dir": str(suite.app_dir),
        "flwr-home": str(home), "launched": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "running",
    }
    _write_json(spec.directory / "runner.json", record)
    say(f"{progress.prefix(spec)}: starting ({spec.num_rounds} rounds) -> {spec.directory}")
    tail = _MetricsTail(spec.directory / "metrics.jsonl")
    rounds_s = 0.0

    def follow() -> None:
        nonlocal rounds_s
        for row in tail.rows():
            if int(row.get("round", 0)) >= 1:
                rounds_s += float(row.get("round-s", 0.0))
            progress.round(spec, row)

    start = progress.clock()
    sim: SimulationRun | None = None
    error: str | None = None
    with (spec.directory / "flwr-output.log").open("w") as log:

        def on_line(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            if echo is not None:
                echo(line)
            follow()

        try:
            sim = launch(
                suite.app_dir, spec.run_config, num_supernodes=suite.num_supernodes,
                flwr_home=home, client_num_cpus=suite.client_num_cpus,
                timeout_s=suite.timeout_s, on_line=on_line, client_num_gpus=suite.client_num_gpus,
            )
        except KeyboardInterrupt:
            record.update(status="interrupted", **{"wall-s": progress.clock() - start})
            _write_json(spec.directory / "runner.json", record)
            say(f"{progress.prefix(spec)}: interrupted; the run's processes are stopped and it "
                "will start again from scratch next time")
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
    if error is None and status.state is not RunState.FINISHED:
        error = f"flwr run returned but the run is {status.state.value}: {status.detail}"
    record.update({"wall-s": wall_s, "returncode": None if sim is None else sim.returncode,
                   "status": "finished" if error is None else "failed"})
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
