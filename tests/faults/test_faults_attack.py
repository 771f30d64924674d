"""The 3-node test: one node sends its factors ×1e30 every round; the run
finishes, its replies are clipped with the reason in the metrics, and the final accuracy is
within a few points of the same run without that node (real Fashion-MNIST, a small MLP)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from fakedata import write_idx
from fault_setup import run_app, scale_arrays

REAL = Path("/usr/share/datasets/fashion-mnist")


def _idx(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes())
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _subset(folder: Path, n_train: int, n_test: int) -> Path:
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        for kind in ("images-idx3", "labels-idx1"):
            name = f"{prefix}-{kind}-ubyte.gz"
            write_idx(folder / name, np.ascontiguousarray(_idx(REAL / name)[:n]))
    return folder


@pytest.mark.skipif(not (REAL / "train-images-idx3-ubyte.gz").exists(),
                    reason=f"real Fashion-MNIST not at {REAL}")
def test_a_node_sending_1e30_factors_every_round_does_not_derail_the_run(
    tmp_path: Path,
) -> None:
    data = _subset(tmp_path / "data", 900, 400)
    extra = {"num-server-rounds": 5, "dirichlet-alpha": 100.0, "lr": 0.1, "eval-every": 5,
             "test-max-examples": 400}
    factors = scale_arrays(1e30, lambda k: k.endswith((".u", ".v")))
    attacked, _ = run_app(tmp_path / "a", extra, data=data, tamper={1002: factors})
    without, _ = run_app(tmp_path / "b", {**extra, "min-available-nodes": 2}, data=data,
                         silent={1002})
    rows = [json.loads(x) for x in
            (tmp_path / "a/out/run/metrics.jsonl").read_text().splitlines()[1:]]
    assert [r["clipped-update-norm"] for r in rows] == [1.0] * 5
    assert all(r["replies-used"] == 3.0 and r["update-ratio-max"] > 1e20 for r in rows)
    assert rows[-1]["rounds-trained"] == 5.0
    acc_a, acc_b = attacked["final-test-accuracy"], without["final-test-accuracy"]
    assert acc_b > 0.5  # the honest run learns
    assert abs(acc_a - acc_b) < 0.08, (acc_a, acc_b)
    print(f"final accuracy with the attacker {acc_a:.3f}, without {acc_b:.3f}")
