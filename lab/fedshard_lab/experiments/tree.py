"""The code state a suite's runs are launched from: the app folder's git commit and its
uncommitted changes, so that a record names code a reader can check out.

The runner refuses a tree with uncommitted changes to tracked files unless told
(``run --allow-dirty``); then each run it launches keeps the diff beside its record
(``uncommitted.diff``, named in ``runner.json``), so the code that ran can still be rebuilt.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DirtyTreeError", "TreeState", "tree_state"]


class DirtyTreeError(RuntimeError):
    """The app folder has uncommitted changes and the runner was not told to run them."""


@dataclass(frozen=True)
class TreeState:
    """``commit``: ``HEAD``'s hash (``None`` outside a git checkout); ``changed``: the
    tracked files that differ from it; ``diff``: ``git diff HEAD`` (empty when clean)."""

    commit: str | None
    changed: tuple[str, ...]
    diff: str

    @property
    def dirty(self) -> bool:
        return bool(self.changed)

    def refusal(self, folder: Path) -> DirtyTreeError:
        listed = ", ".join(self.changed[:10]) + (" …" if len(self.changed) > 10 else "")
        return DirtyTreeError(
            f"{folder} has uncommitted changes ({len(self.changed)} file(s): {listed}) at "
            f"commit {self.commit}: a run's record would name a commit that is not the code "
            "that ran. Commit them (or run from a worktree of a commit), or pass --allow-dirty "
            "to run them anyway (each run keeps the diff as uncommitted.diff beside its "
            "record). Nothing was started.")


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True,
                          timeout=30, check=True).stdout


def tree_state(folder: Path) -> TreeState:
    """The git state of ``folder`` (untracked files do not count: they are not part of a
    commit's code unless added)."""
    try:
        commit = _git(folder, "rev-parse", "HEAD").strip()
        changed = tuple(line[3:] for line in _git(
            folder, "status", "--porcelain", "--untracked-files=no").splitlines() if line)
        diff = _git(folder, "diff", "HEAD") if changed else ""
    except (OSError, subprocess.SubprocessError):
        return TreeState(None, (), "")
    return TreeState(commit, changed, diff)
