"""A page that tells the reader how to install fedshard installs what its own commands then
run: every ``python -m fedshard_lab...`` of a page with a ``pip install -e`` in its code
blocks needs the page to install ``./lab`` too (``fedshard_lab`` is its own package, not part
of ``pip install -e .``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^\s*(```+|~~~+)")


def _code_lines(text: str) -> list[tuple[int, str]]:
    """Every line inside a fenced code block, with its line number."""
    out, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
            continue
        if inside:
            out.append((number, line))
    return out


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "examples").glob("*/README.md"))]
    return [p for p in pages if "pip install -e" in p.read_text(encoding="utf-8")]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_pages_install_covers_its_lab_commands(page: Path) -> None:
    lines = _code_lines(page.read_text(encoding="utf-8"))
    installs = [line for _, line in lines if "pip install" in line]
    if not installs:
        return
    lab = [(n, line) for n, line in lines if "fedshard_lab" in line and "pip install" not in line]
    installs_lab = any(re.search(r"-e\s+\S*\.?/?lab\b|\s\./lab\b", line) for line in installs)
    assert not lab or installs_lab, (
        f"{page.relative_to(ROOT)} installs with {installs} but runs fedshard_lab on line(s) "
        f"{[n for n, _ in lab]}: add -e ./lab to its install command")


def test_get_started_installs_the_lab() -> None:
    text = (ROOT / "docs" / "get-started.md").read_text(encoding="utf-8")
    assert "python -m fedshard_lab.engine" in text  # the page's in-process run
    assert all("-e ./lab" in line for _, line in _code_lines(text) if "pip install -e ." in line)
