"""A whole run through the in-process engine: ``run_engine`` and its command line give the
results folder the ServerApp writes over Flower, with the same model bit for bit
(sequential engine, float32) as ``run_server`` over the in-process grid of the real ClientApp."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import fakedata
import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid

import client_app
from fedshard.app.config import RunConfig
from fedshard.app.run import run_server
from fedshard.server.callbacks import StopRun
from fedshard_lab.engine import engine_grid, run_engine, simulated_nodes
from fedshard_lab.engine.__main__ import main

ROOT = Path(__file__).resolve().parents[3]
NODES = 4


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine-run-data")
    fakedata.write_fashion_mnist(root, 120, 20, np.random.default_rng(5))
    return root


def _settings(data_dir: Path, out: Path, name: str) -> dict[str, Any]:
    return {"dataset": "fashion-mnist", "data-dir": str(data_dir), "num-partitions": NODES,
            "min-available-nodes": NODES, "batch-size": 8, "num-server-rounds": 2, "seed": 3,
            "model": "mlp", "model-width": 16, "method": "collective",
            "keep-ratios": "0.25:0.5,0.5:0.5", "fraction-evaluate": 1.0,
            "results-dir": str(out), "run-name": name, "test-max-examples": 20,
            "client-device": "cpu", "server-device": "cpu"}


def _model(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "model.pt", weights_only=True)


def _rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_sequential_engine_writes_the_flower_paths_model_bit_for_bit(
        data_dir: Path, tmp_path: Path) -> None:
    flower = _settings(data_dir, tmp_path, "flower")
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": NODES}
                                          for i in range(NODES)], flower)
    run_server(grid, RunConfig.from_mapping(flower))
    summary = run_engine(RunConfig.from_mapping(_settings(data_dir, tmp_path, "engine")), NODES)
    assert summary["rounds-completed"] == 2
    ref, got = _model(tmp_path / "flower"), _model(tmp_path / "engine")
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    keys = ("round", "test-accuracy", "test-loss", "train-loss", "eval-loss", "replies-used")
    assert [{k: r.get(k) for k in keys} for r in _rows(tmp_path / "engine")] == [
        {k: r.get(k) for k in keys} for r in _rows(tmp_path / "flower")]
    assert (tmp_path / "engine" / "checkpoint.pt").is_file()


def test_command_line_runs_the_app_with_its_defaults_and_overrides(
        data_dir: Path, tmp_path: Path) -> None:
    overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in
                         _settings(data_dir, tmp_path, "cli").items())
    out = subprocess.run([sys.executable, "-m", "fedshard_lab.engine", str(ROOT), "--num-nodes",
                          str(NODES), "--engine", "batched", "--run-config", overrides],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["engine"] == "batched" and last["rounds-completed"] == 2
    assert len(_rows(tmp_path / "cli")) == 3 and (tmp_path / "cli" / "model.pt").is_file()


def test_command_line_refuses_a_bad_config_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([str(ROOT), "--num-nodes", "4", "--run-config", "no-such-key=1"])
    assert code == 2
    assert "unknown key 'no-such-key'" in capsys.readouterr().err
    assert main([str(tmp_path), "--num-nodes", "4"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_engine_and_node_count_are_checked(data_dir: Path, tmp_path: Path) -> None:
    cfg = RunConfig.from_mapping(_settings(data_dir, tmp_path, "x"))
    with pytest.raises(ValueError, match=r"engine='warp': expected one of sequential, batched"):
        engine_grid(cfg, NODES, engine="warp")
    with pytest.raises(ValueError, match=r"num_nodes=0: expected an int ≥ 1"):
        simulated_nodes(cfg, 0)


def test_a_node_count_other_than_num_partitions_gives_error_replies(
        data_dir: Path, tmp_path: Path) -> None:
    """As over Flower: each node refuses (its query reply is an error), and the run stops
    after its first round with that error."""
    cfg = RunConfig.from_mapping({**_settings(data_dir, tmp_path, "x"),
                                  "min-available-nodes": 2})
    nodes = simulated_nodes(cfg, 3)
    assert all(n.keep_ratio is None and "num-partitions=4" in str(n.keep_ratio_error)
               for n in nodes)
    with pytest.raises(StopRun, match=r"No round trained: in round 1 every one of the 3 "
                                      r"connected nodes answered "
                                      r"the capability query with the same error.*"
                                      r"num-partitions=4"):
        run_engine(cfg, 3)


def test_command_line_takes_a_preset_then_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``flwr run --run-config presets/...``: the preset's values over the app's defaults,
    and a later ``--run-config`` over the preset."""
    from fedshard_lab.engine import __main__ as cli

    seen: dict[str, Any] = {}

    def fake_run(cfg: RunConfig, num_nodes: int, **kw: Any) -> dict[str, Any]:
        seen.update(cfg=cfg, num_nodes=num_nodes, **kw)
        return {"rounds-completed": cfg.num_server_rounds}

    monkeypatch.setattr(cli, "run_engine", fake_run)
    code = main([str(ROOT), "--num-nodes", "100", "--engine", "batched", "--run-config",
                 str(ROOT / "presets" / "cifar10-resnet18.toml"), "--run-config",
                 "seed=2 num-server-rounds=3"])
    assert code == 0
    cfg = seen["cfg"]
    assert (cfg.model, cfg.model_width, cfg.dataset, cfg.training.local_epochs) == (
        "resnet18", 64, "cifar10", 2)  # the preset's
    assert (cfg.seed, cfg.num_server_rounds) == (2, 3)  # the later overrides
    assert seen["num_nodes"] == 100 and seen["engine"] == "batched"
