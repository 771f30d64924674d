"""fedshard's own app lines reach the ServerApp's log (Flower's console handler), among them the
line that says a run resumes and how Flower's round numbers map to the run's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fault_setup import run_app


@pytest.fixture(autouse=True)
def _fresh_fedshard_logger():
    """Each test starts with the ``fedshard`` logger as an application would find it."""
    lib = logging.getLogger("fedshard")
    saved = (lib.level, list(lib.handlers))
    lib.setLevel(logging.NOTSET)
    lib.handlers.clear()
    yield
    lib.setLevel(saved[0])
    lib.handlers[:] = saved[1]


def _info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("fedshard") and r.levelno == logging.INFO]


def test_the_apps_info_lines_reach_flowers_console(tmp_path: Path, caplog) -> None:
    # no caplog.at_level: the root logger stays at WARNING, as in a ServerApp process
    run_app(tmp_path, {})
    folder = (tmp_path / "out" / "run").resolve()
    assert f"fedshard results -> {folder}" in _info_lines(caplog)
    flower = logging.getLogger("flwr").handlers
    assert flower and all(h in logging.getLogger("fedshard").handlers for h in flower)


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
