"""``benchmarks/bench_batched_kernels.py`` runs on the CPU at a tiny size and counts what the
batched engine's step runs: the convolutions and GroupNorms it counts are the sub-model's
layers, and one GroupNorm layer's backward has no batching rule in the installed torch (what
docs/performance.md says; nothing timed here)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_batched_kernels.py"


def _module(monkeypatch) -> ModuleType:  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling modules
    spec = importlib.util.spec_from_file_location("bench_batched_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_runs_tiny_on_the_cpu_and_says_where(tmp_path: Path) -> None:
    record = tmp_path / "kernels.json"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--clients", "3", "--width", "4", "--batch", "2",
         "--repeats", "1", "--out", str(record)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(record.read_text())
    assert got["machine"] and got["torch"] and got["date"]
    assert got["command"].startswith("python benchmarks/bench_batched_kernels.py")
    assert got["shape"]["clients"] == 3
    # folded, the three clients take fewer kernels than under vmap
    assert got["kernels_per_step"]["folded"] < got["kernels_per_step"]["batched"]
    # vmap folds the clients into one grouped convolution per convolution
    assert set(got["convolutions_by_groups"]["batched"]) == {"3"}
    assert set(got["convolutions_by_groups"]["clients"]) == {"1"}
    assert got["convolutions_by_groups"]["batched"]["3"] * 3 == \
        got["convolutions_by_groups"]["clients"]["1"]
    assert all(v > 0 for v in got["ms_per_step"].values())


def test_the_counts_follow_the_models_layers(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The counted operations against the sub-model's modules: one client's forward and
    backward run one convolution and one convolution backward per convolution of the model
    (two per sharded convolution: its k×k and its 1×1), one GroupNorm forward and backward per
    GroupNorm; the batched step runs each convolution once for all the clients."""
    import argparse

    from fedshard.spectral.conv import SpectralConv2d
    bench = _module(monkeypatch)
    args = argparse.Namespace(width=4, keep_ratio=0.1, clients=3, batch=2)
    s = bench.setup(args, torch.device("cpu"))
    modules = list(s["model"].modules())
    convs = sum(2 if isinstance(m, SpectralConv2d) else isinstance(m, torch.nn.Conv2d)
                for m in modules)
    norms = sum(isinstance(m, torch.nn.GroupNorm) for m in modules)
    one = bench.count_ops(bench.client_steps(s)).ops
    batched = bench.count_ops(bench.batched_step(s))
    assert one["convolution"] == one["convolution_backward"] == 3 * convs
    assert one["native_group_norm"] == one["native_group_norm_backward"] == 3 * norms
    assert batched.ops["convolution"] == convs and batched.conv_groups == {3: convs}
    assert batched.ops["native_group_norm"] == norms
    assert "native_group_norm_backward" not in batched.ops  # no batching rule: decomposed


def test_group_norms_backward_has_no_batching_rule(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What the page says of the installed torch: vmap runs GroupNorm's backward as
    elementwise operations and reductions, so a layer takes more kernels batched than alone."""
    bench = _module(monkeypatch)
    got = bench.group_norm_kernels(4)
    assert got["one_client"] == 4  # forward, the loss's sum and seed, the fused backward
    assert got["batched"] > 2 * got["one_client"]
