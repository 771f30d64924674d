"""Committed records hold no path of the machine that wrote them: the writers store paths
relative to their checkout, and nothing under results/, docs/ or benchmarks/ names a
machine's folders."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from fedshard.app.results import RunRecorder, portable_command, portable_path
from fedshard_lab.portable_records import relativize_commands, relativize_folder

ROOT = Path(__file__).resolve().parents[1]

# home and work folders of the machines these records come from, and any temporary folder in a
# record (docs and scripts may tell a user to write to /tmp)
MACHINE = re.compile(r"(?<![\w.])/(work|root|home|Users)/[\w.-]")
TEMPORARY = re.compile(r"(?<![\w.])/tmp/[\w.-]")


def _tracked(*folders: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *folders], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [ROOT / name for name in out if not name.endswith((".png", ".pt", ".pdf"))]


def test_no_committed_file_holds_a_machine_path() -> None:
    try:
        files = _tracked("results", "docs", "benchmarks")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the committed files cannot be listed")
    assert len(files) > 100
    bad = []
    for path in files:
        text = path.read_text(errors="replace")
        for pattern in (MACHINE, *((TEMPORARY,) if path.parts[len(ROOT.parts)] == "results"
                                  else ())):
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{path.relative_to(ROOT)}:{line}: {text[m.start():m.start() + 60]}")
    assert bad == [], "\n".join(bad[:20])


def _git_tree(path: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


def test_portable_path_is_relative_to_its_work_tree(tmp_path: Path) -> None:
    tree = _git_tree(tmp_path / "repo")
    assert portable_path(tree / "results" / "suite") == "results/suite"
    assert portable_path(tree) == "."
    outside = tmp_path / "elsewhere"
    assert portable_path(outside) == str(outside)


def test_portable_command(tmp_path: Path) -> None:
    tree = _git_tree(tmp_path / "repo")
    args = ["bench.py", "--out", str(tree / "results" / "x.json"), f"--data={tree}/d",
            "--pfl-python", "/opt/venv-pfl/bin/python", "--rounds", "5"]
    assert portable_command(args) == [
        "bench.py", "--out", "results/x.json", "--data=d",
        "--pfl-python", "<outside the repository>/bin/python", "--rounds", "5"]


def test_run_config_json_stores_results_dir_relative_to_its_checkout(tmp_path: Path) -> None:
    tree = _git_tree(tmp_path / "repo")
    results = tree / "results" / "mine"
    config = {"results-dir": str(results), "run-name": "a", "seed": 3}
    RunRecorder(results / "a", config, 2).close()
    written = json.loads((results / "a" / "config.json").read_text())["config"]
    assert written == {**config, "results-dir": "results/mine"}
    assert str(tmp_path) not in (results / "a" / "config.json").read_text()


def test_old_records_are_rewritten_in_the_paths_only(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    run = repo / "results" / "suite" / "top-n__seed0"
    run.mkdir(parents=True)
    config = {"config": {"results-dir": "/work/elsewhere/results/x", "lr": 0.1, "seed": 0},
              "git-commit": "abc", "host": "vm"}
    (run / "config.json").write_text(json.dumps(config))
    earlier = {"status": "killed", "app-dir": "/work/wt", "flwr-home": "/tmp/fedshard-flwr-a-1",
               "run-config": {"results-dir": "/work/wt/results/x", "lr": 0.1}}
    runner = {"app-dir": "/work/wt", "flwr-home": "/tmp/fedshard-flwr-a-2", "wall-s": 12.5,
              "run-config": {"results-dir": "/work/wt/results/x", "lr": 0.1},
              "earlier-launches": [earlier]}
    (run / "runner.json").write_text(json.dumps(runner))
    written = relativize_folder(run, repo, today="2026-01-01")
    assert sorted(p.name for p in written) == ["config.json", "runner.json"]
    new_config = json.loads((run / "config.json").read_text())
    assert new_config["config"] == {"results-dir": "results/suite", "lr": 0.1, "seed": 0}
    assert new_config["git-commit"] == "abc" and "2026-01-01" in new_config["paths-rewritten"]
    new_runner = json.loads((run / "runner.json").read_text())
    assert (new_runner["app-dir"], new_runner["flwr-home"]) == (".", "fedshard-flwr-a-2")
    assert new_runner["run-config"] == {"results-dir": "results/suite", "lr": 0.1}
    assert new_runner["wall-s"] == 12.5
    old = new_runner["earlier-launches"][0]
    assert (old["app-dir"], old["flwr-home"], old["run-config"]["results-dir"]) == (
        ".", "fedshard-flwr-a-1", "results/suite")
    assert "/work/" not in (run / "runner.json").read_text()
    # a second pass finds nothing to do
    assert relativize_folder(run, repo) == []


def test_benchmark_commands_are_rewritten_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    record = {"ratio": 1.0625, "parts": [{"command": "python b.py --out /tmp/p/s0.json"}],
              "command": "flwr run . --federation-config \"num-supernodes=10\" --stream"}
    path.write_text(json.dumps(record, indent=1) + "\n")
    assert relativize_commands(path, today="2026-01-01")
    new = json.loads(path.read_text())
    assert new["parts"][0]["command"] == "python b.py --out '<outside the repository>/p/s0.json'"
    assert new["command"] == record["command"] and new["ratio"] == 1.0625
    assert not relativize_commands(path)
