"""The in-process engines answer a round's messages as fedshard's ClientApp does over Flower.

Reference: the in-process grid of ``tests/flower_grid.py`` running the real ``client_app.app``
(each message deep-copied as if serialized, the app building its data for every message).
Both are driven by the same ``SpectralSharding`` strategy (``run_server``'s
``build_strategy``); in float64 every reply (arrays and metrics) and the final model agree to
1e-10 relative, for the sharding methods, mixed keep ratios and unequal client data sizes.
The batched engine computes the same numbers by another route (vmap over stacked
parameters, padded and masked batches), so its agreement is the test of its step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import fakedata
import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Message
from torch.utils.data import TensorDataset

import client_app
from fedshard.app import task
from fedshard.app.config import RunConfig
from fedshard.app.run import build_strategy
from fedshard.app.task import build_model, client_dataset
from fedshard_lab.engine import engine_grid

NODES = 4
TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine-data")
    fakedata.write_fashion_mnist(root, 200, 20, np.random.default_rng(3))
    return root


@pytest.fixture
def float64() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _config(data_dir: Path, tmp: Path, **extra: Any) -> RunConfig:
    return RunConfig.from_mapping({
        "dataset": "fashion-mnist", "data-dir": str(data_dir), "num-partitions": NODES,
        "min-available-nodes": NODES, "fraction-train": 1.0, "batch-size": 8, "seed": 7,
        "model": "mlp", "model-width": 16, "keep-ratios": "0.25:0.5,0.5:0.5",
        "results-dir": str(tmp), "run-name": "r", "test-max-examples": 20,
        "client-device": "cpu", "server-device": "cpu", **extra})


def _float64_data(cfg: RunConfig, pid: int, num: int) -> TensorDataset:
    """Node ``pid``'s partition in float64, cut to ``50 - 7·pid`` examples: unequal sizes,
    so clients have different numbers of batches and last batches of different sizes."""
    inputs, targets = client_dataset(cfg, pid, num).example_tensors()
    keep = len(inputs) - 7 * pid
    return TensorDataset(inputs[:keep].double(), targets[:keep])


class Recording:
    """Wraps a grid: keeps every train/evaluate reply by (round, partition id)."""

    def __init__(self, grid: Any, first_node_id: int) -> None:
        self.grid, self.first = grid, first_node_id
        self.replies: dict[tuple[int, str, int], Message] = {}
        self.calls: dict[str, int] = {}  # send_and_receive calls per message type: the round

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> list[Message]:
        sent = list(messages)
        replies = list(self.grid.send_and_receive(sent, timeout=timeout))
        kinds = {m.metadata.message_type for m in sent}
        for kind in kinds:
            self.calls[kind] = self.calls.get(kind, 0) + 1
        for reply in replies:
            kind = reply.metadata.message_type
            if kind in ("train", "evaluate"):
                node = reply.metadata.src_node_id - self.first
                key = (self.calls[kind], kind, node)
                assert key not in self.replies, key
                self.replies[key] = reply
        return replies


def _run(cfg: RunConfig, grid: Any, first: int, rounds: int) -> tuple[dict[str, np.ndarray],
                                                                       Recording]:
    model = build_model(cfg)
    strategy = build_strategy(cfg, model, "cpu")
    recording = Recording(grid, first)
    result = strategy.start(grid=recording, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=rounds, timeout=60, train_config=ConfigRecord())
    return {k: a.numpy() for k, a in result.arrays.items()}, recording


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)) if b.size else 0.0


def _flower_and_engine(cfg: RunConfig, engine: str, rounds: int,
                       monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    monkeypatch.setattr(client_app, "client_dataset", _float64_data)
    monkeypatch.setattr(task, "_TEMPLATES", {})  # the ClientApp's model, built in float64
    flower = _run(cfg, InProcessGrid(client_app.app, [
        {"partition-id": i, "num-partitions": NODES} for i in range(NODES)],
        cfg.as_dict(), first_node_id=1000), 1000, rounds)
    grid = engine_grid(cfg, NODES, engine=engine, device="cpu",
                       data=lambda pid, num: _float64_data(cfg, pid, num))
    ours = _run(cfg, grid, 1, rounds)
    return flower, ours


def _assert_same(flower: Any, ours: Any) -> float:
    (model_f, rec_f), (model_e, rec_e) = flower, ours
    assert model_f.keys() == model_e.keys()
    worst = max(_rel(model_e[k], model_f[k]) for k in model_f)
    assert rec_f.replies.keys() == rec_e.replies.keys() and rec_f.replies
    for key, ref in rec_f.replies.items():
        got = rec_e.replies[key]
        assert not ref.has_error() and not got.has_error(), (key, ref, got)
        for name, record in ref.content.array_records.items():
            other = got.content.array_records[name]
            assert record.keys() == other.keys(), key
            for k in record:
                assert other[k].numpy().dtype == record[k].numpy().dtype
                worst = max(worst, _rel(other[k].numpy(), record[k].numpy()))
        for name, metrics in ref.content.metric_records.items():
            other_m = got.content.metric_records[name]
            assert dict(other_m).keys() == dict(metrics).keys(), key
            for k, v in metrics.items():
                worst = max(worst, _rel(np.array(other_m[k]), np.array(v)))
    assert worst <= TOLERANCE, worst
    return worst


METHODS = ["top-n", "collective", "unbiased", "prism"]


def test_partitions_have_unequal_sizes(data_dir: Path, tmp_path: Path) -> None:
    cfg = _config(data_dir, tmp_path)
    sizes = [len(_float64_data(cfg, i, NODES)) for i in range(NODES)]
    assert sizes == [50, 43, 36, 29], sizes  # the batched engine pads and masks


@pytest.mark.parametrize("engine", ["sequential", "batched"])
@pytest.mark.parametrize("method", METHODS)
def test_one_round_equals_the_flower_path_in_float64(
        data_dir: Path, tmp_path: Path, float64: None, monkeypatch: pytest.MonkeyPatch,
        method: str, engine: str) -> None:
    cfg = _config(data_dir, tmp_path, method=method, **{"num-server-rounds": 1})
    _assert_same(*_flower_and_engine(cfg, engine, 1, monkeypatch))


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_three_rounds_with_evaluation_equal_the_flower_path_in_float64(
        data_dir: Path, tmp_path: Path, float64: None, monkeypatch: pytest.MonkeyPatch,
        engine: str) -> None:
    cfg = _config(data_dir, tmp_path, method="collective", **{
        "num-server-rounds": 3, "fraction-evaluate": 1.0, "local-epochs": 2,
        "weight-decay": 1e-3, "keep-ratios": "0.25:0.5,0.5:0.25,1.0:0.25"})
    _assert_same(*_flower_and_engine(cfg, engine, 3, monkeypatch))


@pytest.mark.parametrize("method", ["unbiased", "none"])
def test_resnet_three_rounds_batched_equal_the_flower_path_in_float64(
        data_dir: Path, tmp_path: Path, float64: None, monkeypatch: pytest.MonkeyPatch,
        method: str) -> None:
    cfg = _config(data_dir, tmp_path, method=method, model="resnet18", **{
        "model-width": 4, "num-server-rounds": 3, "keep-ratios": "0.2:0.5,0.4:0.5"})
    _assert_same(*_flower_and_engine(cfg, "batched", 3, monkeypatch))


def test_batched_engine_leaves_what_it_does_not_implement_to_the_handler(
        data_dir: Path, tmp_path: Path, float64: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``factor-step = "dense"`` is not in the vectorized step: those clients are trained
    one after another, and the numbers are still the Flower path's."""
    cfg = _config(data_dir, tmp_path, method="unbiased",
                  **{"num-server-rounds": 1, "factor-step": "dense"})
    _assert_same(*_flower_and_engine(cfg, "batched", 1, monkeypatch))
