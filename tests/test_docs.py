"""The documentation site builds with warnings as errors (broken references and images
included), and its command-line reference names every option of the programs."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
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


CLI_PAGE = DOCS / "cli.md"


@pytest.mark.parametrize(("module", "argv"), [
    ("fedshard.experiments.__main__", ["--help"]),
    ("fedshard.experiments.__main__", ["run", "--help"]),
    ("fedshard.experiments.__main__", ["status", "--help"]),
    ("fedshard.experiments.__main__", ["report", "--help"]),
    ("fedshard.app.engine.__main__", ["--help"]),
])
def test_every_command_line_option_is_on_the_cli_page(
        module: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """docs/cli.md names every option and subcommand that the programs' --help lists."""
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    page = CLI_PAGE.read_text(encoding="utf-8")
    options = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", help_text))
    commands = re.search(r"\{([\w,]+)\}", help_text)
    names = options | (set(commands.group(1).split(",")) if commands else set())
    missing = sorted(name for name in names if f"`{name}" not in page and f" {name}" not in page)
    assert not missing, f"{module} {' '.join(argv)}: not on docs/cli.md: {missing}"
