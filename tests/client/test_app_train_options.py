"""The run config's training options reach the ClientApp's local training (``merge-terms``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fedshard.client.handlers
from fedshard.client.train.fast import conv_form
from fedshard.spectral import SpectralConv2d


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **extra: Any
         ) -> tuple[dict[str, torch.Tensor], list[tuple[bool, set[bool]]]]:
    import fakedata
    from flower_grid import InProcessGrid

    import client_app
    from fedshard.app.config import RunConfig
    from fedshard.app.run import run_server

    seen: list[tuple[bool, set[bool]]] = []
    from fedshard.client.train import train as inner  # not an earlier run's spy

    def spy(model: torch.nn.Module, loader: Any, cfg: Any) -> Any:
        result = inner(model, loader, cfg)
        flags = {conv_form(m)[1] for m in model.modules() if isinstance(m, SpectralConv2d)}
        seen.append((cfg.fast is not None and cfg.fast.merge_terms, flags))
        return result

    monkeypatch.setattr(fedshard.client.handlers, "train", spy)
    data = tmp_path / "data"
    if not data.exists():
        fakedata.write_fashion_mnist(data, 60, 20, np.random.default_rng(0))
    name = f"r{len(list(tmp_path.glob('out*')))}"
    cfg = {"dataset": "fashion-mnist", "data-dir": str(data), "model": "resnet18",
           "model-width": 4, "num-server-rounds": 1, "num-partitions": 2,
           "min-available-nodes": 2, "fraction-train": 1.0, "batch-size": 8,
           "keep-ratios": "0.5:1.0", "results-dir": str(tmp_path / f"out-{name}"),
           "run-name": name, "seed": 3, **extra}
    grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": 2}
                                          for i in range(2)], cfg)
    run_server(grid, RunConfig.from_mapping(cfg))
    state = torch.load(tmp_path / f"out-{name}" / name / "model.pt", weights_only=True)
    return state, seen


def test_merge_terms_reaches_every_clients_sharded_convolutions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    merged, seen_merged = _run(tmp_path, monkeypatch, **{"merge-terms": True})
    plain, seen_plain = _run(tmp_path, monkeypatch)
    assert seen_merged == [(True, {True})] * 2
    assert seen_plain == [(False, {False})] * 2
    # the same training up to float32 rounding: one round of 2 clients
    for key, value in plain.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-4, atol=1e-5, msg=key)
