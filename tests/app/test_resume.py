"""Crash and resume: SIGKILL the server inside a round, resume, and get the same run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedshard.app.checkpoint import Checkpoint

TESTS = Path(__file__).resolve().parents[1]
TIMING = {"wall-s", "round-s", "svd-s", "sampling-s", "pack-s", "aggregate-s"}


def _config(data: Path, out: Path, **kw: object) -> dict:
    cfg = {"dataset": "fashion-mnist", "data-dir": str(data), "model": "mlp", "model-width": 16,
           "num-server-rounds": 4, "num-partitions": 3, "min-available-nodes": 3,
           "fraction-train": 0.67, "keep-ratios": "0.25:0.67,0.5:0.33", "batch-size": 8,
           "results-dir": str(out), "run-name": "run", "test-max-examples": 20, "seed": 3}
    cfg.update(kw)
    return cfg


def _worker(cfg: dict, delay: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(TESTS / "resume_worker.py"), json.dumps(cfg),
                             "3", str(delay)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING}
            for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import fakedata

    root = tmp_path_factory.mktemp("fmnist")
    fakedata.write_fashion_mnist(root, 90, 20, np.random.default_rng(0))
    return root


def test_sigkill_mid_round_then_resume_equals_uninterrupted_run(data: Path, tmp_path: Path) -> None:
    # reference: uninterrupted
    ref = tmp_path / "ref"
    p = _worker(_config(data, ref), 0.0)
    assert p.wait(timeout=300) == 0, p.stderr.read() if p.stderr else ""

    # crash: SIGKILL once round 1's checkpoint exists, i.e. while round 2 is in flight
    out = tmp_path / "crash"
    p = _worker(_config(data, out), 1.5)
    deadline = time.monotonic() + 300
    while Checkpoint.load(out / "run") is None:
        assert p.poll() is None, "worker ended before the first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    ckpt = Checkpoint.load(out / "run")
    assert ckpt is not None and ckpt.server_round < 4, "the kill came too late to test a resume"
    assert not (out / "run" / "summary.json").exists()

    # resume
    p = _worker(_config(data, out, resume=True), 0.0)
    assert p.wait(timeout=300) == 0, p.stderr.read() if p.stderr else ""

    got = torch.load(out / "run" / "model.pt", weights_only=True)
    want = torch.load(ref / "run" / "model.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in want:  # bitwise: every random stream is derived from (seed, round, ...)
        assert torch.equal(got[k], want[k]), k
    assert _rows(out) == _rows(ref)  # metrics too, timings aside
    config = json.loads((out / "run" / "config.json").read_text())
    assert config["resumed"][0]["after-round"] == ckpt.server_round


def test_resume_refuses_another_config(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    p = _worker(_config(data, out, **{"num-server-rounds": 1}), 0.0)
    assert p.wait(timeout=300) == 0
    p = _worker(_config(data, out, resume=True, **{"num-server-rounds": 2, "lr": 0.01}), 0.0)
    assert p.wait(timeout=300) != 0
    err = p.stderr.read() if p.stderr else ""
    assert "Cannot resume: the run config differs from the checkpoint's" in err
    assert "lr: 0.05 -> 0.01" in err


def test_resume_of_a_run_stopped_before_round_1_completed_starts_again_from_round_1(
        data: Path, tmp_path: Path) -> None:
    """A SuperLink stopped during round 1 leaves config.json and the round-0 row but no
    checkpoint: resume=true starts the run again from round 1 (it refused before, as if the
    folder held another run); a folder of other settings is still refused."""
    from flower_grid import InProcessGrid

    import client_app
    from fedshard.app.config import RunConfig
    from fedshard.app.results import ExistingResultsError, RunRecorder
    from fedshard.app.run import run_server

    cfg = _config(data, tmp_path, **{"num-server-rounds": 2})
    stopped = RunConfig.from_mapping(cfg)
    with RunRecorder(stopped.results_path, stopped.as_dict(), 2) as recorder:
        recorder.record_round(0, {"test-accuracy": 0.1})  # then the SuperLink stopped
    resumed = {**cfg, "resume": True}
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": 3}
                                          for i in range(3)], resumed)
    other = {**resumed, "seed": 9}  # not this folder's run: still refused, nothing changed
    with pytest.raises(ExistingResultsError, match="already holds a run's results"):
        run_server(grid, RunConfig.from_mapping(other))
    summary = run_server(grid, RunConfig.from_mapping(resumed))
    assert summary["status"] == "finished" and summary["rounds-completed"] == 2
    assert [r["round"] for r in _rows(tmp_path)] == [0, 1, 2]
