"""Every preset runs one round through the real ServerApp and ClientApp, on tiny data written
in each data set's real file format (the real data cannot be downloaded here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib
from flower_grid import InProcessGrid
from flwr.app import Context, RecordDict

from fedshard.app.config import RunConfig
from fedshard.data import clear_cache

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "presets").glob("*.toml"))


def _fake_data(dataset: str, root: Path) -> None:
    import fakedata  # tests/fakedata.py (on pytest's pythonpath)

    rng = np.random.default_rng(0)
    if dataset == "cifar10":
        fakedata.write_cifar10(root, n_per_batch=8, n_test=8, rng=rng)
    elif dataset == "cifar100":
        fakedata.write_cifar100(root, n_train=100, n_test=20, rng=rng)
    elif dataset == "tinyimagenet":
        fakedata.write_tinyimagenet(root, ["n0001", "n0002", "n0003"], 6, 6, rng)
    elif dataset == "shakespeare":
        text = "To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 3
        for split in ("train", "test"):
            (root / "shakespeare" / split).mkdir(parents=True)
            fakedata.write_leaf_json(root / "shakespeare" / split / "all.json",
                                     {"HAMLET": text, "OPHELIA": text[::-1], "POLONIUS": text})
    else:
        fakedata.write_fashion_mnist(root, 40, 10, rng)


def test_presets_exist() -> None:
    names = {p.stem for p in PRESETS}
    assert {"cifar10-resnet18", "cifar100-resnet18", "cifar100-cct", "tinyimagenet-cct",
            "shakespeare-gpt"} <= names


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_samples_ten_of_the_nodes_it_waits_for(preset: Path) -> None:
    """The paper samples 10 clients a round (Sec. 4.1). A preset waits for as many nodes as it
    has partitions, and Flower samples int(nodes × fraction-train) of them: 0.014 of 660
    nodes is 9."""
    config = tomllib.loads(preset.read_text())
    nodes = config["num-partitions"]
    assert config["min-available-nodes"] == nodes
    assert int(nodes * config["fraction-train"]) == 10
    commands = [line for line in preset.read_text().splitlines() if "num-supernodes=" in line]
    assert commands and all(f"num-supernodes={nodes}" in line for line in commands)


def test_shakespeare_preset_has_a_client_per_role_of_the_build() -> None:
    """The build's role count (docs/shakespeare-data.md, from its build.json) is the preset's
    node count: one more node than roles fails when that node reads its data, and a federation
    of fewer SuperNodes than min-available-nodes waits forever."""
    page = (ROOT / "docs" / "shakespeare-data.md").read_text(encoding="utf-8")
    roles = [line for line in page.splitlines() if line.startswith("| **roles kept (clients)**")]
    assert len(roles) == 1, roles
    count = int(roles[0].split("|")[2].strip(" *").replace(",", ""))
    config = tomllib.loads((ROOT / "presets" / "shakespeare-gpt.toml").read_text())
    assert config["num-partitions"] == count


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_runs_one_round(preset: Path, tmp_path: Path) -> None:
    import client_app
    import server_app

    run_config = tomllib.loads(preset.read_text())
    RunConfig.from_mapping(run_config)  # the preset itself is valid as written
    data = tmp_path / "data"
    data.mkdir()
    _fake_data(run_config["dataset"], data)
    run_config.update({
        "num-server-rounds": 1, "num-partitions": 2, "min-available-nodes": 2,
        "fraction-train": 1.0, "data-dir": str(data), "results-dir": str(tmp_path / "out"),
        "run-name": "p", "test-max-examples": 6, "batch-size": 4, "local-epochs": 1,
        "eval-every": 1,
    })
    clear_cache()
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": 2}
                                          for i in range(2)], run_config)
    server_app.app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                 run_config=run_config))
    metrics = (tmp_path / "out" / "p" / "metrics.jsonl").read_text()
    rows = [json.loads(x) for x in metrics.splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[1]["replies-used"] == 2, rows[1]
    assert np.isfinite(rows[1]["test-accuracy"])
    assert rows[1]["bytes-sent-ratio-r0.1"] < 0.5
    assert (tmp_path / "out" / "p" / "model.pt").is_file()
