"""``flwr run .`` as Flower's defaults give it: any number of simulated nodes trains (the data
split and the keep-ratio mix follow the node count), and a run whose nodes all fail the same
way stops after its first round with one ERROR line naming the fix."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import fakedata
import numpy as np
import pytest
from flower_grid import InProcessGrid

import client_app
from fedshard.app.config import RunConfig
from fedshard.app.run import run_server
from fedshard.app.task import node_partition
from fedshard.server.callbacks import StopRun
from fedshard_lab.engine.run import app_run_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("defaults-data")
    fakedata.write_fashion_mnist(root, 200, 40, np.random.default_rng(4))
    return root


def _flower_nodes(n: int) -> list[dict[str, Any]]:
    """The node configs Flower 1.42's simulation gives its ``n`` SuperNodes."""
    return [{"partition-id": i, "num-partitions": n} for i in range(n)]


def _small(data_dir: Path, out: Path, **changes: Any) -> dict[str, Any]:
    """Only what keeps the run small on fake data; every other key is the app's default."""
    return {"data-dir": str(data_dir), "num-server-rounds": 2, "test-max-examples": 40,
            "model-width": 32, "results-dir": str(out), **changes}


def test_the_apps_defaults_set_no_partition_count() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert config["config"]["num-partitions"] == 0  # one partition per simulated node


@pytest.mark.parametrize("nodes", [1, 2, 5])
def test_any_number_of_simulated_nodes_trains_with_the_defaults(
        nodes: int, data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = _small(data_dir, tmp_path)
    cfg = app_run_config(ROOT, settings)
    grid = InProcessGrid(client_app.app, _flower_nodes(nodes), cfg.as_dict())
    with caplog.at_level(logging.INFO):
        summary = run_server(grid, cfg)
    assert summary["status"] == "finished"
    trained = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(trained) == 2 * nodes  # every node, both rounds
    split = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Data:")]
    assert len(split) == 1
    assert (f"one partition per simulated node (num-partitions = 0 follows the simulation's "
            f"node count ({nodes} node(s) connected now))") in split[0]
    # each node trained on its own 1/nodes of the 200 examples (Flower's node config)
    for i in range(nodes):
        assert node_partition(cfg, _flower_nodes(nodes)[i]) == (i, nodes)


def test_an_explicit_partition_count_that_disagrees_stops_the_run_after_round_one(
        data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = _small(data_dir, tmp_path, **{"num-partitions": 10, "num-server-rounds": 7})
    cfg = app_run_config(ROOT, settings)
    grid = InProcessGrid(client_app.app, _flower_nodes(2), cfg.as_dict())
    with caplog.at_level(logging.INFO), pytest.raises(
            StopRun, match=r"No round trained: in round 1 every one of the 2 connected nodes "
                           r"answered the capability "
                           r"query with the same error"):
        run_server(grid, cfg)
    queries = [m for m in grid.sent if m.metadata.message_type == "query"]
    assert len(queries) == 2  # asked once, not again every round
    assert not [m for m in grid.sent if m.metadata.message_type == "train"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and "RUN FAILED after 0 round(s): the reason is the ERROR line " \
        "above" in errors[1]  # the error once, then where the run's files are
    assert errors[1].count("num-partitions") == 0
    assert "num-partitions=10, but this simulation has 2 nodes" in errors[0]
    assert re.search(r"Likely fix: .*Leave num-partitions out", errors[0])
    skipped = [r for r in caplog.records if "gave no usable keep ratio" in r.getMessage()]
    assert skipped == []  # the one ERROR line, not a warning per node


def test_nodes_failing_in_different_ways_are_asked_again(
        data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # one node's own bad keep ratio, the other fine: the run goes on with the good node
    settings = _small(data_dir, tmp_path)
    cfg = app_run_config(ROOT, settings)
    nodes = [{"partition-id": 0, "num-partitions": 2, "keep-ratio": 7.0},
             {"partition-id": 1, "num-partitions": 2, "keep-ratio": 0.2}]
    grid = InProcessGrid(client_app.app, nodes, cfg.as_dict())
    with caplog.at_level(logging.INFO):
        summary = run_server(grid, cfg)
    assert summary["status"] == "finished"
    queries = [m for m in grid.sent if m.metadata.message_type == "query"]
    assert len(queries) == 3  # the failing node is asked again in round 2
    assert sum("gave no usable keep ratio" in r.getMessage() for r in caplog.records) == 2


def test_a_partition_count_is_checked_where_it_enters() -> None:
    cfg = RunConfig()
    assert node_partition(cfg, {"partition-id": 3, "num-partitions": 4}) == (3, 4)
    explicit = RunConfig.from_mapping({"num-partitions": 4})
    assert node_partition(explicit, {"partition-id": 3, "num-partitions": 4}) == (3, 4)
    with pytest.raises(ValueError, match=r"run config num-partitions=4, but this simulation "
                                         r"has 2 nodes .*Leave num-partitions out"):
        node_partition(explicit, {"partition-id": 1, "num-partitions": 2})
    with pytest.raises(ValueError, match=r"partition-id=1 without num-partitions, and the run "
                                         r"config's num-partitions is 0"):
        node_partition(cfg, {"partition-id": 1, "data-dir": "/data"})
    assert node_partition(cfg, {"data-dir": "/data"}) == (0, 1)  # a device's own data
    with pytest.raises(Exception, match=r"num-partitions=-1: expected ≥ 1, or 0 for one "
                                        r"partition per simulated node"):
        RunConfig.from_mapping({"num-partitions": -1})
