"""Make committed run records hold no path of the machine that wrote them.

Records written before fedshard stored paths relative to their checkout hold absolute ones:
``config.json``'s ``config.results-dir`` and ``runner.json``'s ``app-dir``,
``run-config.results-dir`` and ``flwr-home`` (also inside ``earlier-launches``). This module
rewrites exactly those keys, in place, and nothing else::

    python -m fedshard_lab.portable_records results        # every run folder below results/

- ``results-dir`` becomes the folder the record now lies in, relative to the repository
  (``results/fmnist-table``): where a record was moved after its run (a worktree's results
  copied into this one), the original folder's name is not kept, since it was a path of that
  machine;
- ``app-dir`` becomes ``"."``: every app of these records was the root of a checkout of this
  repository (a value that is not an absolute path is left as it is);
- ``flwr-home``, a temporary folder deleted when its launch ended, becomes its name alone.

Each rewritten file gets a top-level ``"paths-rewritten"`` entry saying what was rewritten and
when, so that a reader can tell a rewritten record from one written so. Settings, metrics,
commits and every number are untouched; a file that holds none of these paths is not written.

Benchmark records (any other ``*.json``) get the same treatment for their ``"command"``
strings, at any depth: each absolute path argument becomes what
:func:`fedshard.app.results.portable_command` writes today (relative to the repository, or
``<outside the repository>/`` and its last two parts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from fedshard.app.results import portable_command

__all__ = ["main", "relativize_commands", "relativize_folder"]


def _absolute(value: Any) -> bool:
    return isinstance(value, str) and PurePosixPath(value).is_absolute()


def _launch(record: dict[str, Any], results_dir: str) -> list[str]:
    """Rewrite one launch's record in place; the keys it rewrote."""
    done: list[str] = []
    if _absolute(record.get("app-dir")):
        record["app-dir"] = "."
        done.append("app-dir")
    if _absolute(record.get("flwr-home")):
        record["flwr-home"] = PurePosixPath(record["flwr-home"]).name
        done.append("flwr-home")
    settings = record.get("run-config")
    if isinstance(settings, dict) and _absolute(settings.get("results-dir")):
        settings["results-dir"] = results_dir
        done.append("run-config.results-dir")
    return done


def _note(keys: list[str], today: str) -> str:
    return (f"{today}: {', '.join(sorted(set(keys)))} held absolute paths of the machine that "
            "wrote this record; `python -m fedshard_lab.portable_records` replaced them with "
            "paths relative to the repository (results-dir: where the record lies in it)")


def relativize_folder(folder: Path, repo: Path, *, today: str | None = None) -> list[Path]:
    """Rewrite the run records in ``folder`` (a run folder inside ``repo``); the files written."""
    today = today or datetime.date.today().isoformat()
    results_dir = folder.resolve().parent.relative_to(repo.resolve()).as_posix()
    written: list[Path] = []
    config_path = folder / "config.json"
    if config_path.is_file():
        data = json.loads(config_path.read_text())
        config = data.get("config")
        if isinstance(config, dict) and _absolute(config.get("results-dir")):
            config["results-dir"] = results_dir
            data["paths-rewritten"] = _note(["config.results-dir"], today)
            config_path.write_text(json.dumps(data, indent=2, sort_keys=True))
            written.append(config_path)
    runner_path = folder / "runner.json"
    if runner_path.is_file():
        data = json.loads(runner_path.read_text())
        keys = _launch(data, results_dir)
        for earlier in data.get("earlier-launches", []) or []:
            if isinstance(earlier, dict):
                keys += [f"earlier-launches.{k}" for k in _launch(earlier, results_dir)]
        if keys:
            data["paths-rewritten"] = _note(keys, today)
            runner_path.write_text(json.dumps(data, indent=2, sort_keys=True))
            written.append(runner_path)
    return written


def _commands(value: Any) -> bool:
    """Rewrite every ``"command"`` string below ``value`` in place; whether one changed."""
    changed = False
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "command" and isinstance(item, str):
                args = shlex.split(item)
                portable = portable_command(args)
                if portable != args:
                    value[key], changed = shlex.join(portable), True
            else:
                changed = _commands(item) or changed
    elif isinstance(value, list):
        for item in value:
            changed = _commands(item) or changed
    return changed


def relativize_commands(path: Path, *, today: str | None = None) -> bool:
    """Rewrite the ``"command"`` strings of the benchmark record ``path``; whether it was."""
    text = path.read_text()
    data = json.loads(text)
    if not _commands(data):
        return False
    if isinstance(data, dict):
        data["paths-rewritten"] = (
            f"{today or datetime.date.today().isoformat()}: the command's absolute path "
            "arguments were paths of the machine that wrote this record; "
            "`python -m fedshard_lab.portable_records` rewrote them")
    indent = 1 if text.startswith("{\n \"") else 2
    path.write_text(json.dumps(data, indent=indent) + ("\n" if text.endswith("\n") else ""))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedshard_lab.portable_records",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path,
                        help="folders searched for run folders (config.json / runner.json)")
    parser.add_argument("--repo", type=Path, default=Path.cwd(),
                        help="the repository the records lie in (default: the current folder)")
    args = parser.parse_args(argv)
    written: list[Path] = []
    for top in args.folders:
        runs = {p.parent for name in ("config.json", "runner.json") for p in top.rglob(name)}
        for folder in sorted(runs):
            written += relativize_folder(folder, args.repo)
        for path in sorted(top.rglob("*.json")):
            if path.name not in ("config.json", "runner.json") and relativize_commands(path):
                written.append(path)
    print(f"{len(written)} files rewritten")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
