"""fedshard's own app lines reach the ServerApp's log (Flower's console handler), among them the
line that says a run resumes and how Flower's round numbers map to the run's."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fault_setup import run_app

from fedshard.logs import ToFlower


def _info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("fedshard") and r.levelno == logging.INFO]


def test_the_apps_info_lines_reach_flowers_console(tmp_path: Path, caplog) -> None:
    # no caplog.at_level: the root logger stays at WARNING, as in a ServerApp process
    run_app(tmp_path, {})
    folder = (tmp_path / "out" / "run").resolve()
    assert f"fedshard results -> {folder}" in _info_lines(caplog)
    assert any(isinstance(h, ToFlower) for h in logging.getLogger("fedshard").handlers)


_USER_PROJECT = """
import sys
sys.path[:0] = [{tests!r}]
from fault_setup import grid, one_round, strategy  # a strategy, a ClientApp, a grid: no app

one_round(strategy(), grid())
"""


def test_a_user_projects_log_shows_fedshards_lines_in_flowers_format(tmp_path: Path) -> None:
    # a project that configures no logging: fedshard's INFO and WARNING lines come out as
    # Flower's own do ("INFO :      ...", "WARNING :   ..."), none as a bare line
    script = tmp_path / "project.py"
    script.write_text(_USER_PROJECT.format(tests=str(Path(__file__).resolve().parents[1])))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = re.sub(r"\x1b\[[0-9;]*m", "", out.stderr + out.stdout).splitlines()
    info = [x for x in lines if "what a node receives and computes" in x]
    warning = [x for x in lines if "Sharding buys little" in x]
    assert info and all(re.match(r"INFO\s*:\s+Round 1, what a node", x) for x in info), info
    assert warning and all(x.startswith("WARNING") for x in warning), warning
    assert len(info) == 1 and len(warning) == 1  # each line once


def test_a_resumed_run_says_how_its_rounds_are_numbered(tmp_path: Path, caplog) -> None:
    import torch

    from fedshard.app.checkpoint import Checkpoint

    run_app(tmp_path, {"num-server-rounds": 3})
    folder = (tmp_path / "out" / "run").resolve()
    # roll the run back to its round-2 checkpoint (kept as the previous one) and resume it
    (folder / "checkpoint.pt").unlink()
    assert Checkpoint.load(folder, fallback=True).server_round == 2
    (folder / "summary.json").unlink(missing_ok=True)
    caplog.clear()
    run_app(tmp_path, {"num-server-rounds": 3, "resume": True})
    lines = [m for m in _info_lines(caplog) if m.startswith("Resuming")]
    assert lines == [f"Resuming {folder} after round 2 of 3: this launch runs rounds 3-3. "
                     "Flower's [ROUND k/1] lines count this launch's rounds (k = run round - 2); "
                     "fedshard's lines give the run's round."], _info_lines(caplog)
    assert torch.load(folder / "model.pt", weights_only=True)
