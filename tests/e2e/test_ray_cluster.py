"""``flwr run`` on a real multi-node Ray cluster: docs/simulation.md's recipe, on one machine.

Two Ray nodes are started with ``ray start`` (a head and a worker, each with its own temp dir,
one CPU each), and ``flwr run`` joins them through ``RAY_ADDRESS``: Flower's Ray backend calls
``ray.init()`` only when Ray is not initialized yet, with no address, and ``ray.init()`` then
connects to the cluster named by ``RAY_ADDRESS``. Which node ran which ClientApp is read from
each node's own Ray worker logs (``<temp-dir>/session_*/logs/worker-*.err``): the nodes were
started with ``FLWR_LOG_LEVEL=DEBUG``, which Ray's workers inherit, and fedshard's ClientApp
logs the partition of every message it handles at DEBUG.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedshard_lab.experiments.launch import free_port, kill_tree, processes_matching, run_simulation

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
RAY = Path(sys.executable).with_name("ray")
LOCK = Path("/tmp/fedshard-flwr.lock")  # one `flwr run` on this machine at a time

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which(str(RAY)) is None,
                       reason=f"needs Ray's `ray` command next to {sys.executable} "
                       "(pip install 'flwr[simulation]')"),
    pytest.mark.skipif(not FMNIST.is_dir(), reason="needs `apt-get install "
                       "dataset-fashion-mnist` (.ci/run installs it)"),
]

# What a node's ClientApp logs at DEBUG for every message (fedshard.app.task.client_dataset).
CLIENT_LINE = re.compile(r"fedshard ClientApp: partition (\d+) of (\d+)")


def _ray_start(args: list[str], temp_dir: Path) -> None:
    """``FLWR_LOG_LEVEL=DEBUG ray start ...`` (the docs' commands, plus ports and a temp dir
    of this node's own, so that two nodes share one machine)."""
    env = dict(os.environ, FLWR_LOG_LEVEL="DEBUG", OMP_NUM_THREADS="1",
               RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(RAY), "start", *args, "--num-cpus=1", "--num-gpus=0",
           f"--temp-dir={temp_dir}", "--object-store-memory=100000000",
           f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


def _stop(temp_dirs: list[Path], port: int) -> None:
    """Stop this cluster's processes by PID (``ray stop`` would stop every Ray on the machine)."""
    for needle in [*(str(d) for d in temp_dirs), f":{port} "]:
        for pid in processes_matching(needle, "ray"):
            kill_tree(pid)


@pytest.fixture()
def ray_cluster() -> Iterator[tuple[str, list[Path]]]:
    """A head and one worker node on this machine; yields ``RAY_ADDRESS`` and the nodes'
    temp dirs (head first). Short paths: Ray's socket paths must stay under 108 bytes."""
    head = Path(tempfile.mkdtemp(prefix="fsray-h-", dir="/tmp"))
    worker = Path(tempfile.mkdtemp(prefix="fsray-w-", dir="/tmp"))
    port = free_port()
    try:
        _ray_start(["--head", f"--port={port}", "--include-dashboard=false",
                    f"--ray-client-server-port={free_port()}"], head)
        _ray_start([f"--address=127.0.0.1:{port}"], worker)
        yield f"127.0.0.1:{port}", [head, worker]
    finally:
        _stop([head, worker], port)
        shutil.rmtree(head, ignore_errors=True)
        shutil.rmtree(worker, ignore_errors=True)


def _partitions_logged(temp_dir: Path) -> set[int]:
    """Partitions whose messages a ClientApp on this Ray node handled (its worker logs)."""
    seen = set()
    for log in temp_dir.glob("session_*/logs/worker-*.err"):
        seen.update(int(m.group(1)) for m in CLIENT_LINE.finditer(log.read_text(errors="replace")))
    return seen


def test_flwr_run_spreads_clientapps_over_ray_nodes(
        ray_cluster: tuple[str, list[Path]], tmp_path: Path) -> None:
    address, (head, worker) = ray_cluster
    results = tmp_path / "results"
    LOCK.touch(exist_ok=True)
    with LOCK.open() as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as `flock /tmp/fedshard-flwr.lock flwr run ...`
        run = run_simulation(
            ROOT,
            {"num-server-rounds": 1, "num-partitions": 4, "fraction-train": 1.0,
             "min-available-nodes": 4, "model": "mlp", "model-width": 32,
             "keep-ratios": "0.5:1.0", "local-epochs": 1, "batch-size": 64,
             "test-max-examples": 500, "results-dir": str(results), "run-name": "ray-cluster"},
            num_supernodes=4, client_num_cpus=1, flwr_home=tmp_path / "flwr-home",
            timeout_s=600, env={"RAY_ADDRESS": address},
        )
    assert run.returncode == 0, run.output[-4000:]
    rows = [json.loads(line)
            for line in (results / "ray-cluster" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == 1 and rows[-1]["replies-used"] == 4, rows[-1]
    on_head, on_worker = _partitions_logged(head), _partitions_logged(worker)
    # every partition trained, on the cluster's two nodes (each has one CPU: one ClientApp at
    # a time each), and both of them ran ClientApps
    assert on_head | on_worker == {0, 1, 2, 3}, (on_head, on_worker)
    assert on_head and on_worker, (on_head, on_worker)
