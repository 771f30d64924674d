"""``benchmarks/bench_engine.py``'s GPU preset (CIFAR-10 shape, batched engine) runs on the CPU
at a tiny size: one JSON object with every figure, and the engines' float64 equality."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_cifar10_preset_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    record = tmp_path / "engine.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--preset", "cifar10",
         "--device", "cpu", "--tiny", "--repeats", "1", "--rounds", "2",
         "--equality-examples", "8", "--out", str(record)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(record.read_text())  # what it printed, with where and when it ran
    assert got["machine"] and got["torch"] and got["date"]
    assert got["command"].startswith("python benchmarks/bench_engine.py --preset cifar10")
    assert got["engine"] == "batched" and got["preset"] == "cifar10"
    assert set(got["s_per_round"]) == {"bare", "sequential", "batched"}
    assert all(v["collective"] > 0 for v in got["s_per_round"].values())
    assert got["engine_vs_bare"]["collective"] > 0
    assert got["speedup_batched_vs_sequential"]["collective"] > 0
    assert got["flower_vs_bare"] is None  # flwr run is not a path of this preset by default
    assert 0 <= got["max_rel_diff_float64"] <= 1e-10
