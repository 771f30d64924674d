"""One version, named the same in pyproject.toml, the package and the CHANGELOG; docs name
releases by version, never as "this release" or "the last"."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import fedshard

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_package_and_changelog_name_one_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert fedshard.__version__ == version
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$",
                          (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert releases, "CHANGELOG.md names no release ('## [X.Y.Z] - YYYY-MM-DD')"
    assert releases[0][0] == version, (
        f"pyproject.toml says {version}, the CHANGELOG's latest release is {releases[0][0]}")


def test_docs_name_releases_by_version() -> None:
    vague = re.compile(r"\b(this|the last|the previous|the next) release\b", re.I)
    bad = [f"{p.relative_to(ROOT)}: {m.group(0)!r}"
           for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
           for m in vague.finditer(p.read_text())]
    assert bad == []
