"""The FedAvg-cosine metric against an independent formula, and end to end: with method "none"
the strategy IS FedAvg, so the cosine must be 1 (same data order, same settings)."""

from __future__ import annotations

import numpy as np
import pytest

from fedshard.server.fedavg_cosine import fedavg_cosines


def test_cosine_matches_the_concatenated_vector_formula():
    rng = np.random.default_rng(0)
    old = {"a.weight": rng.normal(size=(4, 3)), "a.bias": rng.normal(size=4),
           "steps": np.arange(3)}  # an integer buffer: not part of the update vector
    new = {k: v + rng.normal(size=v.shape) if v.dtype.kind == "f" else v for k, v in old.items()}
    refs = [{k: v + rng.normal(size=v.shape) if v.dtype.kind == "f" else v
             for k, v in old.items()} for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    out = fedavg_cosines(old, new, refs, weights, ["a"])
    flat = lambda d: np.concatenate([d["a.weight"].ravel(), d["a.bias"].ravel()])  # noqa: E731
    mean = sum(w * flat(r) for w, r in zip(weights, refs, strict=True)) / sum(weights)
    da, db = flat(new) - flat(old), mean - flat(old)
    assert out["fedavg-cosine"] == pytest.approx(da @ db / np.linalg.norm(da) / np.linalg.norm(db),
                                                 rel=1e-12)
    dw = (new["a.weight"] - old["a.weight"]).ravel()
    mw = (sum(w * r["a.weight"] for w, r in zip(weights, refs, strict=True)) / 8.0
          - old["a.weight"]).ravel()
    assert out["fedavg-cosine-sharded"] == pytest.approx(
        dw @ mw / np.linalg.norm(dw) / np.linalg.norm(mw), rel=1e-12)
    # the same update gives 1, the opposite -1, no update NaN
    assert fedavg_cosines(old, new, [new], [1.0], [])["fedavg-cosine"] == pytest.approx(1.0)
    anti = {k: 2 * old[k] - new[k] if old[k].dtype.kind == "f" else old[k] for k in old}
    assert fedavg_cosines(old, new, [anti], [1.0], [])["fedavg-cosine"] == pytest.approx(-1.0)
    assert "fedavg-cosine" not in fedavg_cosines(old, old, [new], [1.0], [])  # no update
    # a finite but huge copy (1e300) overflows the norms: the metric stays finite in [-1, 1]
    # or is left out, never NaN or inf (history and checkpoint hold finite metrics only)
    huge = {k: v * 1e300 if v.dtype.kind == "f" else v for k, v in old.items()}
    with np.errstate(over="ignore", invalid="ignore"):
        out = fedavg_cosines(old, new, [huge], [1.0], ["a"])
    assert all(np.isfinite(v) and -1.0 <= v <= 1.0 for v in out.values())


def test_fedavg_itself_has_cosine_one_and_sharding_less(tmp_path):
    import json

    from fault_setup import run_app

    def read_metrics(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    # the plain averages (the spread bound off: it shrinks honest nodes' changes too, which
    # moves the aggregate off FedAvg's by design)
    run_app(tmp_path / "none", {"method": "none", "fedavg-cosine": True,
                                "max-update-spread": 0.0})
    rows = [r for r in read_metrics(tmp_path / "none" / "out" / "run") if r["round"] > 0]
    assert len(rows) == 2
    for row in rows:
        assert row["fedavg-cosine"] == pytest.approx(1.0, abs=1e-9)
        assert row["fedavg-references"] == 3.0
    run_app(tmp_path / "topn", {"method": "top-n", "fedavg-cosine": True, "keep-ratios": "0.25"})
    rows = [r for r in read_metrics(tmp_path / "topn" / "out" / "run") if r["round"] > 0]
    assert all(-1.0 < r["fedavg-cosine"] < 0.999 for r in rows)
