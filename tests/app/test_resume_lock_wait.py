"""A resume waits for the run folder's lock: the ServerApp of the launch before it may still be
stopping (Flower's ``flwr-serverapp`` outlives its SuperLink by seconds) and holds
``run.lock``. A holder that lets go within the bound is waited for, and the wait is logged with
the holder's PID; one that holds on past it still refuses the resume, naming it."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fedshard.app import rundir
from fedshard.app.config import RunConfig
from fedshard.app.rundir import RunLockedError

ROOT = Path(__file__).resolve().parents[2]

# The earlier launch's ServerApp: it records the run's round 0, as a ServerApp stopped before
# round 1 completed has, holds the folder's lock for argv[3] seconds, then exits.
EARLIER_LAUNCH = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from fedshard.app.results import RunRecorder
    config = json.loads(sys.argv[4])
    recorder = RunRecorder(Path(sys.argv[1]), config, 2)
    recorder.record_round(0, {"test-accuracy": 0.1})
    print("holding", flush=True)
    time.sleep(float(sys.argv[3]))
""")


def _config(root: Path, data: Path) -> dict:
    return {"dataset": "fashion-mnist", "data-dir": str(data), "num-server-rounds": 2,
            "num-partitions": 3, "min-available-nodes": 3, "fraction-train": 1.0,
            "batch-size": 16, "results-dir": str(root / "out"), "run-name": "run",
            "test-max-examples": 30, "seed": 5, "model": "mlp", "model-width": 32,
            "keep-ratios": "0.5"}


def _earlier_launch(run: Path, config: dict, hold_s: float) -> subprocess.Popen[str]:
    # the folder's config.json must be the one this run writes: RunConfig's own dict
    as_written = RunConfig.from_mapping(config).as_dict()
    proc = subprocess.Popen([sys.executable, "-c", EARLIER_LAUNCH, str(run), str(ROOT),
                             str(hold_s), json.dumps(as_written)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "holding", "the earlier launch did not start"
    return proc


@pytest.fixture
def data(tmp_path: Path) -> Path:
    import fakedata

    root = tmp_path / "data"
    fakedata.write_fashion_mnist(root, 90, 30, np.random.default_rng(0))
    return root


@pytest.fixture
def fedshard_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="fedshard")
    return caplog


def test_a_resume_waits_for_the_earlier_launch_to_let_go(
        tmp_path: Path, data: Path, fedshard_logs: pytest.LogCaptureFixture) -> None:
    from fault_setup import run_app

    config = _config(tmp_path, data)
    run = tmp_path / "out" / "run"
    proc = _earlier_launch(run, config, hold_s=2.0)
    try:
        start = time.monotonic()
        summary, _ = run_app(tmp_path, {**config, "resume": True}, data=data)
        waited = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert summary["status"] == "finished" and summary["rounds-completed"] == 2
    assert waited > 1.0  # it did wait for the holder
    waits = [r.getMessage() for r in fedshard_logs.records if "waiting up to" in r.getMessage()]
    assert waits, fedshard_logs.text
    assert f"pid {proc.pid} on host {platform.node()}" in waits[0], waits[0]
    assert "a ServerApp of an earlier launch still stopping" in waits[0], waits[0]
    assert any("the lock was released after" in r.getMessage() for r in fedshard_logs.records)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]


def test_a_holder_past_the_bound_still_refuses_the_resume(
        tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fault_setup import run_app

    monkeypatch.setattr(rundir, "RESUME_LOCK_WAIT_S", 1.0)
    config = _config(tmp_path, data)
    run = tmp_path / "out" / "run"
    proc = _earlier_launch(run, config, hold_s=120.0)
    try:
        start = time.monotonic()
        with pytest.raises(RunLockedError, match=(
            rf"{run} is in use by another run \(pid {proc.pid} on host {platform.node()}, "
            r"started .*\).*was not started.* This run waited 1 s for it\."
        )):
            run_app(tmp_path, {**config, "resume": True}, data=data)
        assert 1.0 <= time.monotonic() - start < 30
        assert proc.poll() is None  # the holder was left alone
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # the refused resume touched nothing: the holder's row is still the only one
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] \
        == [0]


def test_a_new_run_still_fails_at_once(tmp_path: Path, data: Path) -> None:
    from fault_setup import run_app

    config = _config(tmp_path, data)
    proc = _earlier_launch(tmp_path / "out" / "run", config, hold_s=120.0)
    try:
        start = time.monotonic()
        with pytest.raises(RunLockedError, match=rf"pid {proc.pid} .*another run-name\.$"):
            run_app(tmp_path, config, data=data)
        assert time.monotonic() - start < 10  # no waiting without resume
    finally:
        proc.kill()
        proc.wait(timeout=30)
