"""Resuming over a damaged metrics.jsonl: a torn last line is dropped, other damage is named."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from fedshard.app.results import RunRecorder

CONFIG = {"seed": 0}


def _crashed_run(run: Path, rounds: int) -> Path:
    recorder = RunRecorder(run, CONFIG, 5)
    for r in range(rounds):
        recorder.record_round(r, {"test-accuracy": 0.1 * r})
    recorder.close()
    return run / "metrics.jsonl"


def test_a_torn_last_line_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = _crashed_run(tmp_path / "run", 4)
    with metrics.open("a") as fh:
        fh.write('{"round": 4, "test-acc')  # killed while appending round 4
    with caplog.at_level(logging.WARNING, logger="fedshard.app.results"):
        recorder = RunRecorder(tmp_path / "run", CONFIG, 5, resume_round=3)
    assert f"{metrics} line 5 is torn" in caplog.text
    assert [r["round"] for r in recorder.rows] == [0, 1, 2, 3]
    recorder.record_round(4, {"test-accuracy": 0.4})
    recorder.close()
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]  # every line parses
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]


def test_a_last_line_that_is_json_but_not_a_row_is_torn_too(tmp_path: Path) -> None:
    metrics = _crashed_run(tmp_path / "run", 2)
    with metrics.open("a") as fh:
        fh.write("12\n")  # a prefix of '12' ... that happens to be valid JSON
    with RunRecorder(tmp_path / "run", CONFIG, 5, resume_round=1) as recorder:
        assert [r["round"] for r in recorder.rows] == [0, 1]


def test_an_unparsable_line_before_the_last_is_an_error_naming_file_and_line(
    tmp_path: Path,
) -> None:
    metrics = _crashed_run(tmp_path / "run", 4)
    lines = metrics.read_text().splitlines()
    lines[1] = '{"round": 1, "te'
    metrics.write_text("\n".join(lines) + "\n")
    before = metrics.read_bytes()
    with pytest.raises(ValueError, match=(
        rf"{metrics} line 2: not valid JSON \(.*\); found '{{\"round\": 1, \"te'. Only the last "
        r"line can be torn by a crash.*the run was not resumed\. Repair or delete that line, or "
        r"start over with overwrite=true"
    )):
        RunRecorder(tmp_path / "run", CONFIG, 5, resume_round=3)
    assert metrics.read_bytes() == before  # nothing was rewritten
    # the refused recorder released the directory
    RunRecorder(tmp_path / "run", CONFIG, 5, overwrite=True).close()


def test_a_row_without_a_round_before_the_last_is_an_error(tmp_path: Path) -> None:
    metrics = _crashed_run(tmp_path / "run", 3)
    lines = metrics.read_text().splitlines()
    lines.insert(1, '{"wall-s": 1.0}')
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=(
        rf"{metrics} line 2: expected a JSON object with an integer 'round'"
    )):
        RunRecorder(tmp_path / "run", CONFIG, 5, resume_round=2)


def test_an_unreadable_config_json_does_not_stop_a_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _crashed_run(tmp_path / "run", 2)
    (tmp_path / "run" / "config.json").write_text('{"config": ')
    with caplog.at_level(logging.WARNING, logger="fedshard.app.results"):
        RunRecorder(tmp_path / "run", CONFIG, 5, resume_round=1).close()
    assert "config.json is unreadable" in caplog.text
    info = json.loads((tmp_path / "run" / "config.json").read_text())
    assert [r["after-round"] for r in info["resumed"]] == [1]
