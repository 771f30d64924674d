"""The documentation site builds with warnings as errors (broken references and images included)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    missing = [name for name in ("sphinx", "myst_parser", "furo")
               if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(f"Cannot build the docs: {', '.join(missing)} not installed; "
                    "install the test extra with pip install -e '.[test]'.")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-j", "1", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, (
        f"sphinx-build failed (exit {result.returncode}); its warnings:\n"
        f"{result.stderr}\n{result.stdout}")
    assert (tmp_path / "html" / "index.html").is_file()
