"""Whole runs on real Fashion-MNIST (a small MLP, 3 nodes, 5 rounds): a node returning its
factors sign-flipped (``U, V -> -U, -V``: its ``UVᵀ`` unchanged, update ratio 2, within every
bound) used to take the run to chance accuracy, because the server averages ``U`` and ``V``
separately; factors times -1e3 were clipped but still compounded. The reference is the same
run without the attack."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from fakedata import write_idx
from fault_setup import run_app, scale_arrays

REAL = Path("/usr/share/datasets/fashion-mnist")
EXTRA = {"num-server-rounds": 5, "dirichlet-alpha": 100.0, "lr": 0.1, "eval-every": 5,
         "test-max-examples": 400}


def _subset(folder: Path, n_train: int, n_test: int) -> Path:
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        for kind in ("images-idx3", "labels-idx1"):
            name = f"{prefix}-{kind}-ubyte.gz"
            raw = gzip.decompress((REAL / name).read_bytes())
            shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(raw[3])]
            arr = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * raw[3]).reshape(shape)
            write_idx(folder / name, np.ascontiguousarray(arr[:n]))
    return folder


def _rows(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "out/run/metrics.jsonl").read_text().splitlines()[1:]]


needs_data = pytest.mark.skipif(not (REAL / "train-images-idx3-ubyte.gz").exists(),
                                reason=f"real Fashion-MNIST not at {REAL}")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    root = tmp_path_factory.mktemp("clean")
    data = _subset(root / "data", 900, 400)
    summary, _ = run_app(root, EXTRA, data=data)
    return data, float(summary["final-test-accuracy"])


@needs_data
def test_a_sign_flipping_node_no_longer_wrecks_the_run(clean, tmp_path: Path) -> None:
    data, acc_clean = clean
    flip = scale_arrays(-1.0, lambda k: k.endswith((".u", ".v")))
    summary, _ = run_app(tmp_path, EXTRA, data=data, tamper={1002: flip})
    assert acc_clean > 0.6  # the run learns
    # re-signing is exact: the attacked run is the clean run
    assert summary["final-test-accuracy"] == acc_clean, (summary["final-test-accuracy"],
                                                          acc_clean)
    assert all(r.get("re-signed-terms", 0) > 0 for r in _rows(tmp_path))  # counted each round


@needs_data
def test_factors_times_minus_1e3_stay_within_5_points(clean, tmp_path: Path) -> None:
    data, acc_clean = clean
    attack = scale_arrays(-1e3, lambda k: k.endswith((".u", ".v")))
    summary, _ = run_app(tmp_path, EXTRA, data=data, tamper={1002: attack})
    # a guard against a derailed run: at most 5 points below the clean run (on this
    # 5-round, 400-image run the attacked node, held to the median, ends 5 points above it)
    assert summary["final-test-accuracy"] > acc_clean - 0.05, (
        summary["final-test-accuracy"], acc_clean)
    assert all(r.get("clipped-update-spread", 0) >= 1 and r.get("re-signed-terms", 0) > 0
               for r in _rows(tmp_path))
