"""One real ``flwr run .`` simulation (Ray backend) on Fashion-MNIST from the Debian package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedshard_lab.experiments.launch import processes_with_env, run_simulation

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(not FMNIST.is_dir(), reason="needs `apt-get install dataset-fashion-mnist` "
                    "(.ci/run installs it)")
def test_flwr_run_trains_and_cleans_up(tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    results = tmp_path / "results"
    run = run_simulation(
        ROOT,
        {"num-server-rounds": 2, "num-partitions": 3, "fraction-train": 1.0,
         "min-available-nodes": 3, "model": "mlp", "model-width": 64,
         "keep-ratios": "0.25:0.67,0.5:0.33", "method": "collective", "local-epochs": 1,
         "batch-size": 64, "lr": 0.05, "test-max-examples": 2000,
         "results-dir": str(results), "run-name": "e2e"},
        num_supernodes=3, flwr_home=home, timeout_s=600,
    )
    assert run.returncode == 0, run.output[-4000:]
    metrics = (results / "e2e" / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in metrics.splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    last = rows[-1]
    assert last["replies-used"] == 3
    assert last["test-accuracy"] > 0.4, last  # chance is 0.1
    # MLP 784-64-64-64-10 with LayerNorms: the two 64x64 layers are sharded (N = 64). A node
    # at ratio r gets n = ceil(64 r) terms per sharded layer: U, V (64 x n each), ω (n floats)
    # and indices (n int64) instead of W (64 x 64); everything else is dense.
    dense = 4 * (784 * 64 + 64 + 3 * 128 + 2 * (64 * 64 + 64) + 64 * 10 + 10)
    for r, n in ((0.25, 16), (0.5, 32)):
        sub = dense - 2 * (4 * 64 * 64 - 4 * (2 * 64 * n + n) - 8 * n)
        # measured from the real messages (npy headers add ~0.5 %)
        assert last[f"bytes-sent-ratio-r{r}"] == pytest.approx(sub / dense, abs=0.01), r
    assert (results / "e2e" / "model.pt").is_file()
    config = json.loads((results / "e2e" / "config.json").read_text())
    assert config["config"]["method"] == "collective"
    # nothing left running from this launch (SuperLink, SuperExec, simulation, Ray)
    assert processes_with_env("FLWR_HOME", str(home)) == []
