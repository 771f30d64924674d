"""``python -m fedshard_lab.experiments {run,status,report} SUITE``.

``SUITE`` is a suite TOML file, or the name of one in ``./experiments/`` (``smoke`` for
``experiments/smoke.toml``). Exit codes: 0 done, 1 some run failed, 2 invalid suite or
nothing could start, 130 interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from fedshard_lab.experiments.launch import ENGINES
from fedshard_lab.experiments.report import write_report
from fedshard_lab.experiments.runner import (
    RunState,
    SelectionError,
    StaleRunsError,
    run_suite,
    suite_status,
)
from fedshard_lab.experiments.suite import Suite, SuiteError, load_suite
from fedshard_lab.experiments.tree import tree_state


def _say(line: str) -> None:
    print(line, flush=True)


def _quiet_stdout() -> None:
    """After a closed pipe (``status | head``): send further output, including the interpreter's
    final flush, to /dev/null instead of printing a traceback (Python's documented idiom)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _suite_path(text: str) -> Path:
    path = Path(text)
    if path.is_file():
        return path
    named = Path("experiments") / f"{text}.toml"
    if path.suffix == "" and named.is_file():
        return named
    raise FileNotFoundError(f"suite {text!r}: no such file (nor {named}); give the path of a "
                            "suite TOML file")


def _load(args: argparse.Namespace) -> Suite:
    return load_suite(_suite_path(args.suite), app_dir=args.app_dir, results_dir=args.results_dir)


def _status(suite: Suite) -> int:
    statuses = suite_status(suite)
    counts = Counter(s.state for s in statuses)
    left = sum(s.spec.num_rounds - (s.resume_round or 0) for s in statuses
               if s.state is not RunState.FINISHED)
    _say(f"[{suite.name}] {len(statuses)} run(s) in {suite.results_dir}: "
         + ", ".join(f"{counts[state]} {state.value}" for state in
                     (RunState.FINISHED, RunState.RESUMABLE, RunState.PARTIAL, RunState.STALE,
                      RunState.PENDING))
         + f"; {left} rounds to run")
    width = max((len(s.spec.title) for s in statuses), default=0)
    for s in statuses:
        _say(f"  {s.spec.index + 1:>3} {s.state.value:<9} {s.spec.title:<{width}}  {s.detail}")
    return 0


def _run(suite: Suite, args: argparse.Namespace) -> int:
    echo = (lambda line: _say(f"    flwr| {line}")) if args.verbose else None
    tree = tree_state(suite.app_dir)
    if tree.dirty and not args.allow_dirty:
        _say(f"[{suite.name}] {tree.refusal(suite.app_dir)}")
        return 2
    try:
        outcome = run_suite(suite, emit=_say, echo=echo, rerun_stale=args.rerun_stale,
                            restart_partial=args.restart_partial, fail_fast=args.fail_fast,
                            seeds=args.seed, labels=args.label,
                            uncommitted=tree.diff if tree.dirty else None)
    except KeyboardInterrupt:
        _say(f"[{suite.name}] interrupted; finished runs are kept, the interrupted one "
             "resumes from its last checkpoint on the next `run`")
        return 130
    return 0 if outcome.ok else 1


def _report(suite: Suite, args: argparse.Namespace) -> int:
    files = write_report(suite, args.out)
    for path in (files.table, files.results, files.milestones, files.accuracy_plot,
                 files.per_seed_plot, files.anme_plot, files.diagnostics_plot,
                 files.cosine_table, files.cosine_plot):
        if path is not None:
            _say(f"[{suite.name}] wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m fedshard_lab.experiments",
        description="Run, inspect and report fedshard experiment suites (experiments/*.toml).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "run": "run every unfinished run of the suite (finished ones are skipped)",
        "status": "list each run as finished, resumable, partial, stale or pending",
        "report": "write table.md, results.json, milestones.md, accuracy.png, anme.png, "
                  "accuracy-per-seed.png and (with diagnostics) diagnostics.png",
    }
    for name, text in commands.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("suite", help="suite TOML file, or NAME for experiments/NAME.toml")
        p.add_argument("--app-dir", type=Path, default=None,
                       help="Flower app directory (default: found above the suite file)")
        p.add_argument("--results-dir", type=Path, default=None,
                       help="override the suite's results-dir")
        if name == "run":
            p.add_argument("--rerun-stale", action="store_true",
                           help="delete and re-run finished runs whose settings differ from "
                           "the suite's")
            p.add_argument("--restart-partial", action="store_true",
                           help="start unfinished runs again from scratch instead of resuming "
                           "them from their checkpoint")
            p.add_argument("--allow-dirty", action="store_true",
                           help="run from a tree with uncommitted changes to tracked files "
                                "(refused otherwise); each run keeps the diff as "
                                "uncommitted.diff beside its record")
            p.add_argument("--fail-fast", action="store_true",
                           help="stop at the first failed run")
            p.add_argument("--seed", type=int, action="append", default=None, metavar="SEED",
                           help="only the runs with this seed (repeatable), e.g. --seed 0 "
                           "to finish one seed of every cell first; default: all")
            p.add_argument("--label", action="append", default=None, metavar="ROW",
                           help="only the runs of this row label (repeatable), e.g. "
                           "--label Collective; with --seed a run must match both")
            p.add_argument("-v", "--verbose", action="store_true",
                           help="also print flwr's output")
            p.add_argument("--engine", choices=ENGINES, default=None,
                           help="how the runs are executed: flower (flwr run), sequential or "
                           "batched (in process); default: the suite's [suite] engine, else "
                           "flower")
        if name == "report":
            p.add_argument("--out", type=Path, default=None,
                           help="write the report here (default: the suite's results-dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        suite = _load(args)
        if args.command == "status":
            return _status(suite)
        if args.command == "report":
            return _report(suite, args)
        if args.engine is not None:
            suite = dataclasses.replace(suite, engine=args.engine)
        return _run(suite, args)
    except BrokenPipeError:  # e.g. `status | head`: the reader has gone, so has our output
        _quiet_stdout()
        return 1
    except (SuiteError, SelectionError, StaleRunsError, FileNotFoundError,
            ModuleNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
