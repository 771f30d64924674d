"""A restart must not wipe a run: refusal, overwrite, resume, and owner-only files."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest

from fedshard.app.checkpoint import Checkpoint
from fedshard.app.results import ExistingResultsError, RunRecorder

CONFIG = {"method": "collective", "seed": 0}


def _finished_run(directory: Path, rounds: int = 3) -> None:
    """A run as run_server leaves it: rows 0..rounds, a checkpoint per round, model, summary."""
    recorder = RunRecorder(directory, CONFIG, rounds)
    for r in range(rounds + 1):
        recorder.record_round(r, {"test-accuracy": 0.1 * r})
        if r:
            Checkpoint(r, {}, CONFIG).save(directory)
    recorder.finish({})


def _rounds(directory: Path) -> list[int]:
    lines = (directory / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["round"] for x in lines]


def test_a_new_run_refuses_a_directory_with_results_and_changes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _finished_run(run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.name != "run.lock"}
    with pytest.raises(ExistingResultsError, match=(
        rf"{run} already holds a run's results \(metrics.jsonl with 4 row\(s\), checkpoint.pt, "
        r"checkpoint.prev.pt, model.pt, summary.json\)\. .*nothing was started: set resume=true"
        r" .* or overwrite=true .*another run-name"
    )):
        RunRecorder(run, CONFIG, 3)
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.name != "run.lock"}
    assert after == before
    # the refused recorder let go of the lock: a legitimate resume can take the directory
    RunRecorder(run, CONFIG, 3, resume_round=3).close()


@pytest.mark.parametrize("name", ["checkpoint.pt", "model.pt", "summary.json"])
def test_any_single_result_file_is_enough_to_refuse(tmp_path: Path, name: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / name).write_bytes(b"x")
    with pytest.raises(ExistingResultsError, match=rf"already holds a run's results \({name}\)"):
        RunRecorder(run, CONFIG, 3)


def test_without_a_checkpoint_resume_is_not_offered(tmp_path: Path) -> None:
    run = tmp_path / "run"
    recorder = RunRecorder(run, CONFIG, 3)
    recorder.record_round(0, {"test-accuracy": 0.1})  # crashed before round 1's checkpoint
    recorder.close()
    with pytest.raises(ExistingResultsError, match=(
        r"\(metrics.jsonl with 1 row\(s\)\).*it has no checkpoint to resume from; set "
        r"overwrite=true"
    )) as info:
        RunRecorder(run, CONFIG, 3)
    assert "resume=true" not in str(info.value)


def test_leftovers_that_are_not_results_do_not_block_a_new_run(tmp_path: Path) -> None:
    # the experiment runner writes runner.json and flwr-output.log before launching; a run
    # killed before its round 0 leaves config.json and an empty metrics.jsonl
    run = tmp_path / "run"
    run.mkdir()
    for name, text in (("runner.json", "{}"), ("flwr-output.log", "x\n"),
                       ("config.json", "{}"), ("metrics.jsonl", "")):
        (run / name).write_text(text)
    recorder = RunRecorder(run, CONFIG, 3)
    recorder.record_round(0, {})
    recorder.close()
    assert _rounds(run) == [0]
    assert (run / "runner.json").read_text() == "{}"


def test_overwrite_deletes_the_old_results_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    _finished_run(run)
    with caplog.at_level(logging.WARNING, logger="fedshard.app.results"):
        recorder = RunRecorder(run, {"seed": 1}, 2, overwrite=True)
    assert "overwrite=true: deleting the earlier run's metrics.jsonl with 4 row(s), " \
           "checkpoint.pt, checkpoint.prev.pt, model.pt, summary.json" in caplog.text
    names = {p.name for p in run.iterdir()}
    assert not names & {"checkpoint.pt", "checkpoint.prev.pt", "model.pt", "summary.json"}
    assert _rounds(run) == []
    assert json.loads((run / "config.json").read_text())["config"] == {"seed": 1}
    assert Checkpoint.load(run, fallback=True) is None  # nothing left to resume by mistake
    recorder.close()


def test_resume_keeps_the_rows_up_to_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    recorder = RunRecorder(run, CONFIG, 5)
    for r in range(4):
        recorder.record_round(r, {})
    recorder.close()  # "crash" after round 3's row, before its checkpoint
    with RunRecorder(run, CONFIG, 5, resume_round=2) as resumed:
        assert [r["round"] for r in resumed.rows] == [0, 1, 2]
    assert _rounds(run) == [0, 1, 2]


def test_resume_and_overwrite_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"resume_round=2 with overwrite=True: .*pick one"):
        RunRecorder(tmp_path / "run", CONFIG, 5, resume_round=2, overwrite=True)
    assert not (tmp_path / "run").exists()


def test_run_directory_and_files_are_owner_only(tmp_path: Path) -> None:
    run = tmp_path / "results" / "run"
    recorder = RunRecorder(run, CONFIG, 1)
    recorder.record_round(0, {})
    recorder.record_round(1, {})
    Checkpoint(1, {}, CONFIG).save(run)
    Checkpoint(1, {}, CONFIG).save(run)  # rotation: checkpoint.prev.pt
    recorder.finish({})
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    files = ("metrics.jsonl", "config.json", "summary.json", "model.pt", "checkpoint.pt",
             "checkpoint.prev.pt", "run.lock")
    assert {f: oct(stat.S_IMODE((run / f).stat().st_mode)) for f in files} == {
        f: oct(0o600) for f in files}


def test_an_existing_open_run_directory_is_made_owner_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)  # as the experiment runner's mkdir leaves it under umask 022
    RunRecorder(run, CONFIG, 1).close()
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
