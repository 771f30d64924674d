"""The ClientApp's data: prepared once per process (not every round), the same examples as a
fresh read; and a deployed node that looks simulated is told what it took."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord
from flwr.common.logger import FLOWER_LOGGER as flwr_logger

from fedshard.app import task
from fedshard.app.config import RunConfig


@pytest.fixture()
def cfg(tmp_path: Path) -> RunConfig:
    import fakedata

    fakedata.write_fashion_mnist(tmp_path / "data", 60, 10, np.random.default_rng(1))
    task._DATASETS.clear()
    yield RunConfig.from_mapping({"data-dir": str(tmp_path / "data"), "num-partitions": 3,
                                  "model-width": 16, "results-dir": str(tmp_path / "out")})
    task._DATASETS.clear()


def _count_standardizations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from fedshard.data import images

    calls = [0]
    real = images.per_image_standardization

    def counted(x: torch.Tensor) -> torch.Tensor:  # counts images (one, or a batch)
        calls[0] += x.shape[0] if x.ndim == 4 else 1
        return real(x)

    monkeypatch.setattr(images, "per_image_standardization", counted)
    return calls


def test_each_partition_is_standardized_once_per_process(
        cfg: RunConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_standardizations(monkeypatch)
    first = task.client_dataset(cfg, 1, 3)
    n = len(first)
    for _ in range(3):  # three more rounds of the same node
        again = task.client_dataset(cfg, 1, 3)
        assert again.example_tensors()[0] is first.example_tensors()[0]
    assert calls[0] == n
    task.client_dataset(cfg, 2, 3)  # another partition is its own entry
    assert calls[0] > n


def test_kept_examples_are_the_standardized_images(cfg: RunConfig) -> None:
    from fedshard.data.loading import _image_split, _resolve, _split

    inputs, targets = task.client_dataset(cfg, 0, 3).example_tensors()
    folder = str(_resolve("fashion-mnist", "train", cfg.data_dir, False))
    raw = _image_split("fashion-mnist", folder, "train")
    part = _split("fashion-mnist", folder, 3, 1.0, 0.0, cfg.seed)[0]
    x = raw.images[part].astype(np.float64).reshape(len(part), -1)  # numpy, float64
    want = (x - x.mean(1, keepdims=True)) / np.maximum(x.std(1, keepdims=True),
                                                       1 / np.sqrt(x.shape[1]))
    np.testing.assert_allclose(inputs.reshape(len(part), -1).numpy(), want, atol=1e-5)
    np.testing.assert_array_equal(targets.numpy(), raw.labels[part])


def test_the_budget_env_var(cfg: RunConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_standardizations(monkeypatch)
    monkeypatch.setenv("FEDSHARD_CLIENT_DATA_CACHE_BYTES", "0")
    n = len(task.client_dataset(cfg, 0, 3))
    task.client_dataset(cfg, 0, 3)
    assert calls[0] == 2 * n and not task._DATASETS  # 0: prepared for every message
    monkeypatch.setenv("FEDSHARD_CLIENT_DATA_CACHE_BYTES", "lots")
    with pytest.raises(ValueError, match=r"FEDSHARD_CLIENT_DATA_CACHE_BYTES='lots': expected a "
                       r"whole number of bytes >= 0 .* handles no message until then"):
        task.client_dataset(cfg, 0, 3)


def test_least_recently_used_partition_goes_first(
        cfg: RunConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    one = task.client_dataset(cfg, 0, 3).nbytes
    monkeypatch.setattr(task, "CLIENT_DATA_CACHE_BYTES", 2 * one + one // 2)  # ~2 partitions
    task._DATASETS.clear()
    for pid in (0, 1, 0, 2):  # 1 is the least recently used when 2 arrives
        task.client_dataset(cfg, pid, 3)
    kept = sorted(key[5] for key in task._DATASETS)
    assert kept == [0, 2]


class _Lines:
    def __enter__(self) -> list[str]:
        self.lines: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore[method-assign]
        flwr_logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc: object) -> None:
        flwr_logger.removeHandler(self.handler)


def test_a_deployed_node_with_a_simulated_config_is_warned(cfg: RunConfig) -> None:
    task._WARNED.clear()
    node = {"partition-id": 1, "num-partitions": 3}
    deployed = ConfigRecord({task.RUNTIME_KEY: "deployment"})
    with _Lines() as lines:
        assert not task.warn_if_looks_simulated(
            cfg, node, ConfigRecord({task.RUNTIME_KEY: "simulation"}))
        assert not task.warn_if_looks_simulated(cfg, {**node, "keep-ratio": 0.3}, deployed)
        assert not task.warn_if_looks_simulated(cfg, node, ConfigRecord())
        assert task.warn_if_looks_simulated(cfg, node, deployed)
        assert not task.warn_if_looks_simulated(cfg, node, deployed)  # once
    assert len(lines) == 1
    # partition 1 of the default mixture 0.1:0.6,0.2:0.4 (the library's rule, by hand:
    # node_keep_ratio spreads the mixture over partition ids)
    from fedshard.client.keep_ratios import node_keep_ratio

    r = node_keep_ratio(node, cfg.mixture)
    assert f"took keep ratio r={r:g} from the run's simulated mixture keep-ratios=" \
           "'0.1:0.6,0.2:0.4' and trains partition 1 of 3 of fashion-mnist" in lines[0]


def test_grid_runtime_names_flowers_grids() -> None:
    from flower_grid import InProcessGrid
    from flwr.superlink.grid.http_grid import HttpGrid
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    assert task.grid_runtime(object.__new__(HttpGrid)) == "deployment"
    assert task.grid_runtime(object.__new__(InMemoryGrid)) == "simulation"
    assert task.grid_runtime(object.__new__(InProcessGrid)) is None


def test_the_server_tells_its_nodes_it_is_deployed(
        cfg: RunConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through run_server and the real ClientApp: on a SuperLink's grid, nodes with only
    partition-id/num-partitions warn (here the grid is told to count as a SuperLink's)."""
    from flower_grid import InProcessGrid

    import client_app
    from fedshard.app import run

    task._WARNED.clear()
    monkeypatch.setattr(run, "grid_runtime", lambda grid: "deployment")
    mapping: dict[str, Any] = {**cfg.as_dict(),
                               "num-server-rounds": 1, "min-available-nodes": 3,
                               "test-max-examples": 10, "run-name": "deployed"}
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": 3}
                                          for i in range(3)], mapping)
    with _Lines() as lines:
        run.run_server(grid, RunConfig.from_mapping(mapping))
    warned = [x for x in lines if "this SuperNode is deployed" in x]
    assert len(warned) == 3, lines
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(m.content["config"][task.RUNTIME_KEY] == "deployment" for m in train)
