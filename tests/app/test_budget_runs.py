"""Mixed-capacity federations through fedshard's app: the devices below ``min-keep-ratio`` stay
idle (the whole model trained by the strong devices only), and ``eval-at-budgets`` evaluates the
model each smaller device would run (a truncated spectral model, a width slice), checked
against an SVD and a slice computed here by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import fakedata
import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid

import client_app
from fedshard.app.config import ConfigError, RunConfig
from fedshard.app.run import run_server
from fedshard.app.task import build_model, example_input
from fedshard.data import load_test_set
from fedshard.models import mlp
from fedshard.spectral import sharded_layer_names


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("budget-run-data")
    fakedata.write_fashion_mnist(root, 160, 40, np.random.default_rng(11))
    return root


def _settings(data_dir: Path, out: Path, name: str, nodes: int, **changes: Any) -> dict[str, Any]:
    return {"dataset": "fashion-mnist", "data-dir": str(data_dir), "num-partitions": nodes,
            "min-available-nodes": nodes, "batch-size": 8, "num-server-rounds": 2, "seed": 5,
            "model": "mlp", "model-width": 16, "results-dir": str(out), "run-name": name,
            "test-max-examples": 40, "client-device": "cpu", "server-device": "cpu",
            "eval-every": 1, **changes}


def _grid(settings: dict[str, Any], nodes: int) -> InProcessGrid:
    return InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": nodes}
                                          for i in range(nodes)], settings)


def _trained_partitions(grid: InProcessGrid) -> list[set[int]]:
    """The partition ids sent a train message, per train round (in order)."""
    rounds: dict[str, set[int]] = {}
    for msg in grid.sent:
        if msg.metadata.message_type == "train":
            node = grid.contexts[msg.metadata.dst_node_id]
            rounds.setdefault(msg.metadata.group_id, set()).add(
                int(node.node_config["partition-id"]))
    return list(rounds.values())


@pytest.mark.parametrize(("fraction", "per_round"), [(1.0, 3), (0.5, 1)])
def test_nodes_below_min_keep_ratio_never_train(data_dir: Path, tmp_path: Path,
                                                fraction: float, per_round: int,
                                                caplog: pytest.LogCaptureFixture) -> None:
    # 8 nodes: partitions 0-2 keep r = 1 (3 of 8 = 0.375), 3-7 keep r = 0.1
    settings = _settings(data_dir, tmp_path, f"strong-{fraction}", 8, method="none",
                         **{"keep-ratios": "1.0:0.375,0.1:0.625", "min-keep-ratio": 1.0,
                            "fraction-train": fraction})
    grid = _grid(settings, 8)
    run_server(grid, RunConfig.from_mapping(settings))
    rounds = _trained_partitions(grid)
    assert len(rounds) == 2
    # fraction-train is a share of the nodes that may train: ⌊0.5·3⌋ = 1, not ⌊0.5·8⌋ = 4
    assert all(len(r) == per_round and r <= {0, 1, 2} for r in rounds), rounds
    idle = [r.getMessage() for r in caplog.records if "stays idle" in r.getMessage()]
    assert len(idle) == 5 and all("below min-keep-ratio=1" in line for line in idle)


def test_every_node_training_when_no_floor_is_set(data_dir: Path, tmp_path: Path) -> None:
    settings = _settings(data_dir, tmp_path, "all", 8, method="none",
                         **{"keep-ratios": "1.0:0.375,0.1:0.625"})
    grid = _grid(settings, 8)
    run_server(grid, RunConfig.from_mapping(settings))
    assert _trained_partitions(grid) == [set(range(8))] * 2


def test_a_floor_above_the_cap_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"min-keep-ratio=0.5 with max-keep-ratio=0.25: "
                                          r"expected the smallest keep ratio that trains"):
        RunConfig.from_mapping({"min-keep-ratio": 0.5, "max-keep-ratio": 0.25})
    with pytest.raises(ConfigError, match=r"min-keep-ratio=1.5: expected a keep ratio in"):
        RunConfig.from_mapping({"min-keep-ratio": 1.5})


def _check(metrics: dict[str, Any], suffix: str, model: torch.nn.Module,
           cfg: RunConfig) -> None:
    """The row's test loss and accuracy equal ``model``'s, computed here by hand: cross-entropy
    and argmax over the whole test set in one batch."""
    test = load_test_set(cfg.dataset, data_dir=cfg.data_dir, max_examples=cfg.test_max_examples)
    x = torch.stack([test[i][0] for i in range(len(test))])
    y = torch.tensor([int(test[i][1]) for i in range(len(test))])
    model.eval()
    with torch.no_grad():
        logits = model(x).double()
    loss = float(torch.nn.functional.cross_entropy(logits, y))
    accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    assert metrics[f"test-accuracy{suffix}"] == pytest.approx(accuracy, abs=1e-9)
    assert metrics[f"test-loss{suffix}"] == pytest.approx(loss, rel=1e-5)


def _rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["collective", "none"])
def test_a_spectral_run_is_evaluated_at_the_top_terms_of_each_smaller_budget(
        data_dir: Path, tmp_path: Path, method: str) -> None:
    # without sharding too: a weak device runs the truncation of the default layers
    settings = _settings(data_dir, tmp_path, "spectral", 4, method=method,
                         **{"keep-ratios": "1.0:0.5,0.25:0.5", "eval-at-budgets": True})
    cfg = RunConfig.from_mapping(settings)
    run_server(_grid(settings, 4), cfg)
    last = _rows(tmp_path / "spectral")[-1]
    assert "test-accuracy-at-r1" not in last  # r = 1 is the global model itself
    state = torch.load(tmp_path / "spectral" / "model.pt", weights_only=True)
    model = build_model(cfg)
    layers = sharded_layer_names(model, example_input=example_input(cfg))
    assert layers  # the MLP's hidden layers
    for name in layers:  # the best rank-⌈N/4⌉ approximation, by numpy's SVD
        w = state[f"{name}.weight"].double().numpy()
        u, lam, vt = np.linalg.svd(w, full_matrices=False)
        n = math.ceil(0.25 * lam.size)
        state[f"{name}.weight"] = torch.from_numpy((u[:, :n] * lam[:n]) @ vt[:n]).float()
    model.load_state_dict(state)
    _check(last, "-at-r0.25", model, cfg)
    full = build_model(cfg)
    full.load_state_dict(torch.load(tmp_path / "spectral" / "model.pt", weights_only=True))
    _check(last, "", full, cfg)
    assert last["test-loss"] != pytest.approx(last["test-loss-at-r0.25"], rel=1e-5)


def test_a_width_run_is_evaluated_at_the_slice_each_smaller_budget_trains(
        data_dir: Path, tmp_path: Path) -> None:
    settings = _settings(data_dir, tmp_path, "width", 4, method="heterofl",
                         **{"keep-ratios": "1.0:0.5,0.25:0.5", "eval-at-budgets": True,
                            "width-match": "keep-ratio", "clip-lr": False})
    cfg = RunConfig.from_mapping(settings)
    run_server(_grid(settings, 4), cfg)
    last = _rows(tmp_path / "width")[-1]
    state = torch.load(tmp_path / "width" / "model.pt", weights_only=True)
    narrow = mlp(28 * 28, 10, width=4)  # r = 0.25 of 16 hidden units
    narrow.load_state_dict({k: v[tuple(slice(0, s) for s in narrow.state_dict()[k].shape)]
                            for k, v in state.items()})
    _check(last, "-at-r0.25", narrow, cfg)
