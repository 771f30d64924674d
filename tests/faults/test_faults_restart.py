"""Through the real server path (``run_server`` in its own process): a restart without resume
and a second run on the same run-name leave the first run's results as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parents[1]


def _config(data: Path, out: Path, **kw: object) -> dict:
    cfg = {"dataset": "fashion-mnist", "data-dir": str(data), "model": "mlp", "model-width": 8,
           "num-server-rounds": 2, "num-partitions": 2, "min-available-nodes": 2,
           "fraction-train": 1.0, "keep-ratios": "0.5", "batch-size": 8,
           "results-dir": str(out), "run-name": "run", "test-max-examples": 10, "seed": 1}
    cfg.update(kw)
    return cfg


def _worker(cfg: dict, delay: float = 0.0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TESTS / "resume_worker.py"), json.dumps(cfg), "2", str(delay)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _finish(p: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = p.communicate(timeout=300)
    return p.returncode, err


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import fakedata

    root = tmp_path_factory.mktemp("fmnist")
    fakedata.write_fashion_mnist(root, 40, 10, np.random.default_rng(0))
    return root


def _snapshot(run: Path) -> dict[str, bytes]:
    names = ("metrics.jsonl", "checkpoint.pt", "checkpoint.prev.pt", "model.pt", "summary.json")
    return {n: (run / n).read_bytes() for n in names}


def test_a_restart_without_resume_refuses_and_keeps_the_run(data: Path, tmp_path: Path) -> None:
    code, err = _finish(_worker(_config(data, tmp_path)))
    assert code == 0, err
    run = tmp_path / "run"
    before = _snapshot(run)
    code, err = _finish(_worker(_config(data, tmp_path)))
    assert code != 0
    assert f"ExistingResultsError: {run} already holds a run's results (metrics.jsonl with 3 " \
           "row(s), checkpoint.pt, checkpoint.prev.pt, model.pt, summary.json)" in err
    assert _snapshot(run) == before  # today's code cut metrics.jsonl back to round 0 here


def test_overwrite_starts_the_run_again(data: Path, tmp_path: Path) -> None:
    code, err = _finish(_worker(_config(data, tmp_path, **{"num-server-rounds": 1})))
    assert code == 0, err
    code, err = _finish(_worker(_config(data, tmp_path, overwrite=True)))
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds-completed"] == 2


def test_a_second_run_on_the_same_run_name_fails_at_once(data: Path, tmp_path: Path) -> None:
    # the first run sleeps 60 s before each round's training: it is inside round 1 throughout
    first = _worker(_config(data, tmp_path), delay=60.0)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, err = _finish(_worker(_config(data, tmp_path)))
        assert first.poll() is None, "the first run ended before the second was refused"
        assert code != 0
        assert f"RunLockedError: {tmp_path / 'run'} is in use by another run (pid " \
               f"{first.pid} on host" in err
    finally:
        first.kill()
        first.wait(timeout=30)
    # only the first run's row 0: the second wrote nothing (today it cut the file and
    # appended its own round 0)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["round"] for r in rows] == [0]
