"""The Flower app a suite runs: where it is, and its run-config defaults."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

__all__ = ["app_defaults", "find_app_dir"]


def find_app_dir(start: Path) -> Path:
    """The nearest directory at or above ``start`` whose ``pyproject.toml`` has ``[tool.flwr.app]``.

    Raises
    ------
    FileNotFoundError
        When there is none; pass the app directory explicitly then.
    """
    start = start.resolve()
    for candidate in [start, *start.parents]:
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file():
            try:
                data = tomllib.loads(pyproject.read_text())
            except (OSError, tomllib.TOMLDecodeError):
                continue
            if "app" in data.get("tool", {}).get("flwr", {}):
                return candidate
    raise FileNotFoundError(
        f"no pyproject.toml with [tool.flwr.app] at or above {start}; pass the Flower app "
        "directory explicitly (--app-dir)"
    )


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """The app's run-config defaults (``[tool.flwr.app.config]`` of its ``pyproject.toml``)."""
    pyproject = app_dir / "pyproject.toml"
    data = tomllib.loads(pyproject.read_text())
    config = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"{pyproject}: [tool.flwr.app.config] is not a table")
    return dict(config)
