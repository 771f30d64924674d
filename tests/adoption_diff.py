"""What adopting fedshard changes in an example project: its ``before/`` tree against the
adopted one, line by line (shared by the example tests)."""

from __future__ import annotations

import difflib
from pathlib import Path


def python_files(tree: Path) -> dict[str, list[str]]:
    """Each Python file under ``tree`` (relative path -> its lines), caches left out."""
    return {str(p.relative_to(tree)): p.read_text().splitlines()
            for p in sorted(tree.rglob("*.py")) if "__pycache__" not in p.parts}


def changes(before_tree: Path, after_tree: Path) -> tuple[int, set[str], set[str]]:
    """Lines changed from ``before_tree`` to ``after_tree`` (a line replaced by one counts
    once: per difflib opcode, the longer side), and the removed and added lines themselves."""
    before, after = python_files(before_tree), python_files(after_tree)
    assert before.keys() == after.keys(), "the adoption adds or removes no Python file"
    changed, removed, added = 0, set(), set()
    for name in before:
        a, b = before[name], after[name]
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes():
            if tag != "equal":
                changed += max(i2 - i1, j2 - j1)
                removed.update(line.strip() for line in a[i1:i2])
                added.update(line.strip() for line in b[j1:j2])
    return changed, removed, added
