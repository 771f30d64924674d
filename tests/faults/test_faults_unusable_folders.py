"""A results folder that cannot be created or written, and a checkpoint whose arrays do not fit
the run's model, are refused before round 1 with an error naming them and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fault_setup import run_app

from fedshard.app.checkpoint import Checkpoint, CheckpointError
from fedshard.app.rundir import RunDirectoryError


@pytest.mark.parametrize("where", ["/proc", "a file"])
def test_an_unusable_results_dir_is_refused_before_round_1(tmp_path: Path, where: str) -> None:
    if where == "a file":
        (tmp_path / "file").write_text("x")
        where = str(tmp_path / "file")
    with pytest.raises(RunDirectoryError, match=(
            rf"Cannot create the run folder {where}/run \(results-dir {where}, run-name run\): "
            r".*; expected a folder this user can create and write into\. Nothing was started: "
            r"set results-dir to such a folder")):
        run_app(tmp_path, {"results-dir": where})


def test_a_checkpoint_of_another_model_width_is_refused_naming_the_arrays(
    tmp_path: Path,
) -> None:
    run_app(tmp_path, {"num-server-rounds": 2})
    run = tmp_path / "out/run"
    saved = Checkpoint.load(run)
    assert saved is not None
    # the same run config, but the arrays of a model of another width (as if the file had
    # been copied over from another run)
    other = {k: (torch.zeros(16, *v.shape[1:]) if v.ndim and v.shape[0] == 32 else
                 torch.from_numpy(v)).numpy() for k, v in saved.arrays.items()}
    Checkpoint(1, other, saved.config, saved.capabilities,
               {r: m for r, m in saved.history.items() if r <= 1}).save(run)
    with pytest.raises(CheckpointError, match=(
            rf"{run / 'checkpoint.pt'} holds arrays that do not fit this run's model: "
            r"net\.\d+\.weight: expected \(32, \d+\), found \(16, \d+\).*The run cannot resume "
            r"from it")):
        run_app(tmp_path, {"num-server-rounds": 2, "resume": True})
