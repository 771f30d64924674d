"""The options beyond the paper through run_server (the real ServerApp path, in-process grid, fake
Fashion-MNIST): low-rank start, diagnostics and the annealed schedule, checked against
independent quantities (rank, the schedule's formula, an untruncated model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_setup import run_app

from fedshard.sampling import anneal_exponent


def _rows(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "out" / "run" / "metrics.jsonl").read_text().split("\n")
            if x.strip()]


def test_low_rank_start_leaves_no_tail_and_diagnostics_see_it(tmp_path):
    base = {"model": "resnet18", "model-width": 4, "method": "top-n", "keep-ratios": "0.25",
            "diagnostics": True, "num-server-rounds": 1}
    run_app(tmp_path / "full", base)
    run_app(tmp_path / "low", {**base, "init-keep-ratio": 0.25})
    full, low = _rows(tmp_path / "full"), _rows(tmp_path / "low")
    # He init: most of each layer's energy lies beyond the top quarter of the terms
    assert full[0]["tail-energy-top-n"] > 0.4
    assert low[0]["tail-energy-top-n"] < 1e-10
    # the truncation of a rank-⌈rN⌉ model is the model: same accuracy at round 0
    assert low[0]["test-accuracy-top-n"] == low[0]["test-accuracy"]
    # Top-n leaves the tail untrained: its energy share is what the plan says
    assert full[1]["untrained-energy"] > 0.4 and low[1]["untrained-energy"] < 1e-10


def test_diagnostics_at_keep_ratio_one_equal_the_model_itself(tmp_path):
    run_app(tmp_path, {"model": "resnet18", "model-width": 4, "method": "top-n",
                       "keep-ratios": "1.0", "diagnostics": True, "num-server-rounds": 1})
    for row in _rows(tmp_path):
        assert row["test-accuracy-top-n"] == row["test-accuracy"]
        assert row["tail-energy-top-n"] == 0.0


def test_annealed_run_records_the_schedule(tmp_path):
    run_app(tmp_path, {"method": "anneal-collective", "anneal-exponent": 5.0,
                       "anneal-rounds": 2, "num-server-rounds": 3})
    rows = {r["round"]: r for r in _rows(tmp_path) if r["round"] > 0}
    for t in (1, 2, 3):
        assert rows[t]["anneal-exponent"] == pytest.approx(anneal_exponent(t, 5.0, 2))
    assert rows[1]["anneal-exponent"] == 5.0 and rows[3]["anneal-exponent"] == 1.0
    # γ = 5 explores less than γ = 1 (Theorem 2 itself), measured by the plan's ANME
    assert rows[1]["anme"] < rows[3]["anme"]


def test_with_a_rank_n_start_collective_and_its_annealing_train_exactly_top_n(tmp_path):
    """End to end, bit for bit: Theorem 2 gives the round-off tail of a rank-⌈rN⌉ start π = 0,
    so Collective and anneal-collective send Top-n's terms with ω = 1 every round."""
    import torch
    from golden_run import state_hash

    hashes = {}
    for method in ("top-n", "collective", "anneal-collective"):
        root = tmp_path / method
        run_app(root, {"model": "resnet18", "model-width": 4, "method": method,
                       "keep-ratios": "0.25", "init-keep-ratio": 0.25})
        hashes[method] = state_hash(torch.load(root / "out" / "run" / "model.pt",
                                               weights_only=True))
    assert len(set(hashes.values())) == 1, hashes
    # without the low-rank start they differ (the test can fail)
    run_app(tmp_path / "full", {"model": "resnet18", "model-width": 4, "method": "collective",
                                "keep-ratios": "0.25"})
    full = state_hash(torch.load(tmp_path / "full" / "out" / "run" / "model.pt",
                                 weights_only=True))
    assert full != hashes["top-n"]
