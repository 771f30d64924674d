"""Width slicing through fedshard's app: the run config, the real ClientApp over the in-process
grid, the engines (the batched engine trains narrow models one by one), the results folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fakedata
import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid

import client_app
from fedshard.app.config import ConfigError, RunConfig
from fedshard.app.run import build_strategy, run_server
from fedshard.app.task import build_model, width_family
from fedshard.server.width import WidthSlicing
from fedshard_lab.engine import run_engine

NODES = 4


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("width-run-data")
    fakedata.write_fashion_mnist(root, 120, 20, np.random.default_rng(6))
    return root


def _settings(data_dir: Path, out: Path, name: str, **changes: Any) -> dict[str, Any]:
    return {"dataset": "fashion-mnist", "data-dir": str(data_dir), "num-partitions": NODES,
            "min-available-nodes": NODES, "batch-size": 8, "num-server-rounds": 2, "seed": 3,
            "model": "mlp", "model-width": 16, "method": "heterofl",
            "keep-ratios": "0.25:0.5,0.5:0.5", "results-dir": str(out), "run-name": name,
            "test-max-examples": 20, "client-device": "cpu", "server-device": "cpu",
            **changes}


@pytest.mark.parametrize("method", ["heterofl", "fedrolex", "ordered-dropout"])
def test_the_clientapp_trains_each_method_and_the_engine_gives_the_same_model(
        method: str, data_dir: Path, tmp_path: Path) -> None:
    flower = _settings(data_dir, tmp_path, "flower", method=method,
                       **{"width-match": "keep-ratio"})
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": NODES}
                                          for i in range(NODES)], flower)
    run_server(grid, RunConfig.from_mapping(flower))
    for engine in ("sequential", "batched"):
        cfg = RunConfig.from_mapping(_settings(data_dir, tmp_path, engine, method=method,
                                               **{"width-match": "keep-ratio"}))
        assert run_engine(cfg, NODES, engine=engine)["rounds-completed"] == 2
        a = torch.load(tmp_path / "flower" / "model.pt", weights_only=True)
        b = torch.load(tmp_path / engine / "model.pt", weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), engine
    rows = [json.loads(line) for line in
            (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("replies-used")]
    assert len(trained) == 2 and all(r["replies-used"] == NODES for r in trained)
    # width-match = keep-ratio: 4 and 8 of 16 units
    assert trained[0]["width-ratio-r0.25"] == 0.25 and trained[0]["width-ratio-r0.5"] == 0.5
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert summary["status"] == "finished"
    # what a client computed: the narrow MLP's FLOPs, 784·w + 2·w² + 10·w multiply-adds
    clients = summary["sharding"]["clients"]
    for key, w in (("r0.25", 4), ("r0.5", 8)):
        assert clients[key]["forward-flops"] == 2 * (784 * w + 2 * w * w + 10 * w)
        assert clients[key]["bytes-received-ratio"] < 0.6


def test_build_strategy_picks_width_slicing_with_the_run_family(tmp_path: Path) -> None:
    cfg = RunConfig.from_mapping(_settings(tmp_path, tmp_path, "x", method="fedrolex",
                                           **{"width-match": "bytes", "od-widths": 4}))
    strategy = build_strategy(cfg, build_model(cfg))
    assert isinstance(strategy, WidthSlicing)
    assert strategy.slicing.width_match == "bytes" and strategy.slicing.od_widths == 4
    assert strategy.family.width == 16 and strategy.sharding.method == "fedrolex"
    resnet = width_family(RunConfig.from_mapping(_settings(
        tmp_path, tmp_path, "y", model="resnet18", **{"model-width": 8})))
    assert list(resnet.widths) == [2, 4, 6, 8]


@pytest.mark.parametrize("changes,match", [
    ({"model": "lenet"}, "method='heterofl' with model='lenet': width slicing is defined"),
    ({"init-keep-ratio": 0.5}, "init-keep-ratio=0.5 with method='heterofl'"),
    ({"aggregation": "median"}, "aggregation='median' with method='heterofl'"),
    ({"width-match": "widest"}, "width-match='widest'"),
    ({"diagnostics": True}, "diagnostics=true with method='heterofl'"),
])
def test_run_config_names_what_width_slicing_cannot_take(changes: dict[str, Any], match: str,
                                                        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_mapping(_settings(tmp_path, tmp_path, "z", **changes))


def test_the_char_gpt_narrows_by_heads_and_the_flops_match_is_the_pilots_small_model(
        tmp_path: Path) -> None:
    """The GPT's width family narrows the embedding width in multiples of its 3 heads (the
    MLP's 4x width follows); at r = 0.1 the FLOPs-matched width is the pilot's small model
    (21 of 48), counted independently from the two models' forward passes."""
    from fedshard.spectral.budget import forward_flops
    from fedshard.width import match_width

    root = tmp_path / "data"
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 3
    for split in ("train", "test"):
        (root / "shakespeare" / split).mkdir(parents=True)
        fakedata.write_leaf_json(root / "shakespeare" / split / "all.json",
                                 {"HAMLET": text, "OPHELIA": text[::-1], "POLONIUS": text})
    cfg = RunConfig.from_mapping(_settings(root, tmp_path, "gpt", dataset="shakespeare",
                                           model="chargpt", **{"model-width": 48,
                                                               "num-partitions": 3,
                                                               "min-available-nodes": 3}))
    family = width_family(cfg)
    assert list(family.widths) == list(range(3, 49, 3))
    narrow = family(21)
    shapes = {k: tuple(v.shape) for k, v in narrow.state_dict().items()}
    assert shapes["blocks.0.fc.weight"] == (84, 21) and shapes["blocks.0.attn.q.weight"] == (21, 21)
    assert shapes["lm_head.weight"][1] == 21 and shapes["wte.weight"][1] == 21
    model = build_model(cfg)
    tokens = torch.zeros(1, 80, dtype=torch.long)
    from fedshard.spectral import sharded_layer_names

    matched = match_width(family, 0.1, "flops", model=model, example_input=tokens,
                          sharded_layers=sharded_layer_names(model))
    assert matched.width == 21
    assert abs(forward_flops(narrow, tokens) / forward_flops(model, tokens)
               - matched.flops / matched.dense_flops) < 1e-12
