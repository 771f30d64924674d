"""``benchmarks/bench_engine.py``'s GPU preset (CIFAR-10 shape, batched engine) runs on the CPU
at a tiny size: one JSON object with every figure, and the engines' float64 equality; its
``--against REV`` plans one process per run over each tree and refuses what it cannot run
(nothing timed here)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

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
    # ResNet-18's forward and layers are among those folding knows (tests/app/engine/test_folded.py)
    assert got["batched_step"] == {"collective": "folded"}
    assert set(got["s_per_round"]) == {"bare", "sequential", "batched"}
    assert all(v["collective"] > 0 for v in got["s_per_round"].values())
    assert got["engine_vs_bare"]["collective"] > 0
    assert got["speedup_batched_vs_sequential"]["collective"] > 0
    assert got["flower_vs_bare"] is None  # flwr run is not a path of this preset by default
    assert 0 <= got["max_rel_diff_float64"] <= 1e-10


def _bench_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_engine_under_test",
                                                  ROOT / "benchmarks" / "bench_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its `machine` module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_against_alternates_the_two_trees_in_separate_processes(tmp_path: Path) -> None:
    """``--against REV``: one process per run, each importing its own tree (``--code``), the
    side that goes first swapping every repeat; nothing is timed here."""
    bench = _bench_module()
    args = argparse.Namespace(preset="fmnist", device="cpu", rounds=3, methods="collective",
                              tiny=True, profile=True, repeats=3,
                              fmnist=Path("/data/fmnist"))
    old, new = tmp_path / "old", ROOT
    plan = bench.against_plan(args, {"against": old, "work-tree": new})
    assert [name for name, _ in plan] == ["against", "work-tree", "work-tree", "against",
                                          "against", "work-tree"]
    for name, cmd in plan:
        assert cmd[1].endswith("benchmarks/bench_engine.py")
        assert cmd[cmd.index("--code") + 1] == str(old if name == "against" else new)
        assert cmd[cmd.index("--paths") + 1] == "bare,sequential"
        assert cmd[cmd.index("--repeats") + 1] == "1"
        assert cmd[cmd.index("--equality-rounds") + 1] == "0"
        assert cmd[cmd.index("--methods") + 1] == "collective"
        assert cmd[cmd.index("--rounds") + 1] == "3"
        assert "--tiny" in cmd and "--profile" in cmd
    assert bench._code_tree(["x", "--code", str(old)]) == old.resolve()
    assert bench._code_tree(["x", f"--code={old}"]) == old.resolve()
    assert bench._code_tree(["x"]) == ROOT


def test_against_names_a_revision_git_does_not_know() -> None:
    bench = _bench_module()
    with pytest.raises(SystemExit, match=r"--against 'no-such-revision-xyz': not a commit of "
                       r".*nothing was run"):
        bench.resolve_revision("no-such-revision-xyz")
    assert len(bench.resolve_revision("HEAD")) == 40


def test_against_refuses_paths_and_too_few_rounds_before_running() -> None:
    for extra in (["--paths", "bare"], ["--rounds", "2", "--profile"]):
        out = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--against", "HEAD",
             "--tiny", *extra], capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert out.returncode != 0
        assert "--against runs the paths bare,sequential" in out.stderr
        assert "nothing was run" in out.stderr


def test_profile_parts_name_functions_that_exist() -> None:
    """Every part ``--profile`` reports is made of functions this tree has (a renamed
    function would silently report nothing); a part may also name where a function was in
    earlier revisions, for ``--against``."""
    bench = _bench_module()
    for part, functions in bench.PARTS.items():
        found = [spec for spec in functions if bench.resolve_function(spec) is not None]
        assert found, (part, functions)
        assert found[0] == functions[0], (part, "the first spec is this tree's", functions)
    assert bench.resolve_function("fedshard.client.shard:no_such_function") is None


def test_part_timer_times_the_outermost_call_only_while_active_and_undoes_itself() -> None:
    """:class:`PartTimer` times a part's function wherever a module imported it by name,
    nothing while inactive, and puts the original back."""
    import fedshard.protocol.arrays as arrays_module
    import fedshard.protocol.shards as shards_module

    bench = _bench_module()
    original = arrays_module.decode_array
    imported = shards_module.decode_array  # bound by name at import ("from ... import")
    assert imported is original
    timer = bench.PartTimer({"codec": ("fedshard.protocol.arrays:decode_array",),
                             "missing": ("fedshard.protocol.arrays:no_such_function",)})
    array = bench_array()
    with timer.installed():
        assert shards_module.decode_array is not original  # the by-name import is wrapped
        shards_module.decode_array(array)
        assert timer.seconds == {}  # inactive: not timed
        timer.active = True
        t0 = time.perf_counter()
        for _ in range(3):
            arrays_module.decode_array(array)
        elapsed = time.perf_counter() - t0
    assert arrays_module.decode_array is original and shards_module.decode_array is original
    assert 0 < timer.seconds["codec"] <= elapsed
    per_round = timer.per_round(2)
    assert per_round["missing"] is None
    assert per_round["codec"] == round(timer.seconds["codec"] / 2, 4)


def bench_array() -> Any:
    from flwr.app import Array

    return Array(np.arange(12, dtype=np.float32).reshape(3, 4))


def test_pfl_side_says_why_it_did_not_run(tmp_path: Path) -> None:
    """``--pfl-python``: without it, with a missing file, or with an interpreter where pfl is
    not importable, ``pfl`` is null and ``pfl_reason`` says why (nothing is timed here)."""
    bench = _bench_module()

    def args(**kw: Any) -> argparse.Namespace:
        base = {"preset": "fmnist", "device": "cpu", "pfl_python": None, "repeats": 1,
                "rounds": 3, "tiny": True, "cuda_graph": False}
        return argparse.Namespace(**{**base, **kw})

    assert bench.run_pfl(args()) == {"pfl": None, "pfl_reason": "no --pfl-python given"}
    missing = tmp_path / "python"
    got = bench.run_pfl(args(pfl_python=missing))
    assert got["pfl"] is None and got["pfl_reason"].endswith(f"{missing}: no such file")
    fake = tmp_path / "fake-python"  # an interpreter without pfl
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S -c 'import no_pfl_here' \"$@\"\n")
    fake.chmod(0o755)
    got = bench.run_pfl(args(pfl_python=fake))
    assert got["pfl"] is None
    assert "pfl[pytorch] is not importable there" in got["pfl_reason"]
    got = bench.run_pfl(args(preset="cifar10", pfl_python=Path(sys.executable)))
    assert got == {"pfl": None, "pfl_reason": "pfl's side runs the fmnist preset on a CPU only"}


def test_pfl_input_is_the_bare_loops_rounds(tmp_path: Path) -> None:
    """What ``pfl_fedavg.py`` reads: the same model, examples and recipe as the bare loop."""
    import numpy as np
    from fakedata import write_fashion_mnist

    from fedshard.app.config import RunConfig
    bench = _bench_module()
    write_fashion_mnist(tmp_path / "data", 80, 40, np.random.default_rng(0))
    a = argparse.Namespace(preset="fmnist", device="cpu", rounds=3, tiny=True,
                           cuda_graph=False)
    cfg = RunConfig.from_mapping({**bench._settings(a, tmp_path / "data", tmp_path / "out"),
                                  "method": "none", "keep-ratios": "1.0", "run-name": "p"})
    spec = bench.pfl_input(cfg, 2, 3)
    loop = bench.BareLoop(cfg, 2, "cpu")
    assert isinstance(spec["net"], torch.nn.Sequential)
    for got, want in zip(spec["net"].state_dict().values(), loop.model.state_dict().values(),
                         strict=True):
        assert torch.equal(got, want)
    assert len(spec["clients"]) == 2
    for (x, y), (bx, by) in zip(spec["clients"], loop.data, strict=True):
        assert torch.equal(x, bx) and torch.equal(y, by)
    assert torch.equal(spec["test"][0], loop.test[0])
    assert (spec["lr"], spec["momentum"], spec["weight_decay"], spec["batch"],
            spec["epochs"], spec["rounds"], spec["threads"]) == (
        cfg.training.base_lr, cfg.training.momentum, cfg.training.weight_decay,
        cfg.training.batch_size, cfg.training.local_epochs, 3, 1)
