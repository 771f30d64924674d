"""Runs and files (security review, finding 5): a model too big for the machine is refused
before round 1, a full disk is named as such, a suite cannot write outside its app folder by a
relative path, a run whose ServerApp raised is a failed run, and ``summary.json`` says how many
rounds trained."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from fault_setup import run_app

from fedshard.app import checkpoint as ckpt
from fedshard.app.checkpoint import Checkpoint
from fedshard.app.config import ConfigError, RunConfig
from fedshard_lab.experiments import SuiteError, parse_suite, run_suite
from fedshard_lab.experiments.launch import SimulationRun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from runner_fakes import ROOT, FakeLauncher, make_suite  # the runner tests' fakes


@pytest.mark.parametrize("model", ["mlp", "resnet18"])
def test_a_model_width_that_cannot_fit_in_memory_is_refused(model: str) -> None:
    with pytest.raises(ConfigError, match=(
        rf"model-width=10000000: the {model} model would have [\d,]+ parameters "
        r"\([\d.,]+ GB as float32\), more than this machine's [\d.,]+ GB of memory")):
        RunConfig(model=model, model_width=10**7)
    RunConfig(model=model, model_width=16)  # the defaults fit


def _checkpoint(r: int) -> Checkpoint:
    return Checkpoint(r, {"w": np.full((3, 3), float(r), dtype=np.float32)}, {"seed": 0})


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4352 vs 4246"),
])
def test_a_full_disk_during_a_checkpoint_is_named_and_the_previous_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception,
) -> None:
    _checkpoint(1).save(tmp_path)
    before = (tmp_path / "checkpoint.pt").read_bytes()

    def full(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(OSError, match=(
        rf"The disk holding {tmp_path} is full \(or the write failed\) while writing round "
        rf"2's checkpoint \(.*\); the partial file was removed and the previous checkpoint "
        rf"{tmp_path / 'checkpoint.pt'} \(round 1\) is kept\. Free some space, then resume")
    ) as info:
        _checkpoint(2).save(tmp_path)
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert not (tmp_path / "checkpoint.pt.tmp").exists()


def test_a_suite_results_dir_that_escapes_the_app_folder_is_refused(tmp_path: Path) -> None:
    data = {"suite": {"name": "t", "results-dir": "../../../../../etc", "num-supernodes": 3},
            "defaults": {"model": "mlp", "min-available-nodes": 3},
            "runs": [{"label": "Top-n", "column": "r", "method": "top-n"}]}
    with pytest.raises(SuiteError, match=(
        r"\[suite\] results-dir='../../../../../etc' resolves to /etc, outside the app folder "
        rf"{ROOT}; expected a folder inside it, or an absolute path")):
        parse_suite(data, app_dir=ROOT, source="t.toml")
    data["suite"]["results-dir"] = str(tmp_path / "res")  # an absolute path is the user's
    assert parse_suite(data, app_dir=ROOT, source="t.toml").results_dir == tmp_path / "res"


class ServerAppRaised(FakeLauncher):
    """``flwr run`` exits 0 although the ServerApp raised after writing its results."""

    def __call__(self, *args: object, **kwargs: object) -> SimulationRun:
        run = super().__call__(*args, **kwargs)
        text = ("ERROR :   Simulation raised an exception\nTraceback (most recent call last):\n"
                "RuntimeError: No round trained\n")
        return SimulationRun(0, run.output + text, run.wall_s)


def test_a_run_whose_serverapp_raised_is_reported_failed(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))
    outcome = run_suite(suite, launch=ServerAppRaised(), emit=lambda s: None)
    assert [name for name, _ in outcome.failed] == [s.name for s in suite.runs]
    assert all("the ServerApp raised (flwr run's output: 'ERROR :   Simulation raised an "
               "exception')" in why for _, why in outcome.failed)
    record = json.loads((suite.runs[0].directory / "runner.json").read_text())
    assert record["status"] == "failed"


def test_summary_says_how_many_rounds_trained(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="No round trained"):
        run_app(tmp_path, {}, silent={1000, 1001, 1002})
    summary = json.loads((tmp_path / "out/run/summary.json").read_text())
    assert summary["rounds-completed"] == 2 and summary["rounds-trained"] == 0


def test_a_summary_with_no_round_trained_is_not_a_finished_run(tmp_path: Path) -> None:
    from fedshard_lab.experiments.status import RunState, run_status

    suite = make_suite(tmp_path, seeds=(0,))
    run_suite(suite, launch=FakeLauncher(), emit=lambda s: None)
    spec = suite.runs[0]
    assert run_status(spec).state is RunState.FINISHED
    summary = json.loads((spec.directory / "summary.json").read_text())
    (spec.directory / "summary.json").write_text(json.dumps({**summary, "rounds-trained": 0}))
    status = run_status(spec)
    assert status.state is not RunState.FINISHED
    assert "no round trained" in status.detail
