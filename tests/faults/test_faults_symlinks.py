"""A link planted in the run folder under the name of a file fedshard writes there (a
checkpoint's temporary file, the lock, a results file's temporary) is refused with an error
naming it: fedshard never writes, truncates or locks through a link."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedshard.app.checkpoint import Checkpoint
from fedshard.app.results import RunRecorder
from fedshard.app.rundir import RunDirectoryError

CONFIG = {"method": "collective", "seed": 0}


def _plant(run: Path, name: str, tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("the operator's file\n")
    run.mkdir(exist_ok=True)
    (run / name).symlink_to(victim)
    return victim


@pytest.mark.parametrize("name", ["run.lock", "config.json.tmp", "metrics.jsonl.tmp"])
def test_a_link_planted_for_the_recorder_is_refused_and_its_target_kept(
    tmp_path: Path, name: str,
) -> None:
    run = tmp_path / "run"
    victim = _plant(run, name, tmp_path)
    with pytest.raises(RunDirectoryError, match=(
            rf"{run / name} is a symbolic link \(to {victim}\); expected a plain file that "
            r"fedshard creates, so nothing was written through it\. Remove the link")):
        RunRecorder(run, CONFIG, 3)
    assert victim.read_text() == "the operator's file\n"


@pytest.mark.parametrize("name", ["checkpoint.pt.tmp", "summary.json.tmp", "model.pt.tmp"])
def test_a_link_planted_during_the_run_is_refused_and_its_target_kept(
    tmp_path: Path, name: str,
) -> None:
    run = tmp_path / "run"
    recorder = RunRecorder(run, CONFIG, 3)
    victim = _plant(run, name, tmp_path)
    with pytest.raises(RunDirectoryError, match=rf"{run / name} is a symbolic link"):
        if name.startswith("checkpoint"):
            Checkpoint(1, {}, CONFIG).save(run)
        else:
            recorder.finish({})
    recorder.close()
    assert victim.read_text() == "the operator's file\n"
