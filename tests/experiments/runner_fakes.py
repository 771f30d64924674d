"""A fake ``run_simulation`` and run folders written independently of fedshard's recorder, for
the suite runner's tests (no Flower process is started)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedshard.app.checkpoint import Checkpoint
from fedshard.app.config import RunConfig
from fedshard.app.rundir import write_private
from fedshard_lab.experiments import Suite, parse_suite
from fedshard_lab.experiments.launch import SimulationRun
from fedshard_lab.experiments.suite import app_defaults

ROOT = Path(__file__).resolve().parents[2]
APP_DEFAULTS = app_defaults(ROOT)


def make_suite(tmp_path: Path, *, rounds: int = 2, seeds: tuple[int, ...] = (0, 1)) -> Suite:
    data = {
        "suite": {"name": "t", "results-dir": str(tmp_path / "res"), "num-supernodes": 3,
                  "seeds": list(seeds)},
        "defaults": {"model": "mlp", "num-server-rounds": rounds, "min-available-nodes": 3},
        "runs": [
            {"label": "Top-n", "column": "r = 0.25", "method": "top-n", "keep-ratios": "0.25"},
            {"label": "Collective", "column": "r = 0.25", "method": "collective",
             "keep-ratios": "0.25"},
        ],
    }
    return parse_suite(data, app_dir=ROOT, source="t.toml")


def write_run(folder: Path, config: Mapping[str, Any], rows: list[dict[str, Any]], *,
              summary: bool = True) -> None:
    """A run folder as fedshard.app.results.RunRecorder documents it (written independently)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"config": dict(config)}))
    with (folder / "metrics.jsonl").open("a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    if summary:
        accs = [r["test-accuracy"] for r in rows if "test-accuracy" in r]
        (folder / "summary.json").write_text(json.dumps({
            "rounds-completed": max(r["round"] for r in rows),
            "final-test-accuracy": accs[-1], "best-test-accuracy": max(accs), "wall-s": 1.0}))


def rows_for(rounds: int, *, round_s: float = 10.0) -> list[dict[str, Any]]:
    return [{"round": r, "wall-s": round_s * r, "round-s": round_s if r else 0.5,
             "test-accuracy": 0.5 + 0.1 * r} for r in range(rounds + 1)]


class FakeLauncher:
    """Stands in for run_simulation: writes the run folder round by round, printing a line
    per round, and records what it was called with."""

    def __init__(self, *, returncode: int = 0, fail: frozenset[str] = frozenset(),
                 during: Callable[[str, int], None] | None = None, wall_s: float = 40.0,
                 checkpoints: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.returncode = returncode
        self.fail = fail
        self.during = during
        self.wall_s = wall_s
        self.checkpoints = checkpoints  # write a checkpoint after each round >= 1, as the app

    def __call__(self, app_dir: Path, run_config: Mapping[str, Any], *, num_supernodes: int,
                 flwr_home: Path | None = None, client_num_cpus: int = 1,
                 timeout_s: float = 3600.0,
                 on_line: Callable[[str], None] | None = None,
                 client_num_gpus: float = 0.0) -> SimulationRun:
        name = run_config["run-name"]
        self.calls.append({"app_dir": app_dir, "run_config": dict(run_config),
                           "num_supernodes": num_supernodes, "flwr_home": flwr_home,
                           "client_num_cpus": client_num_cpus, "timeout_s": timeout_s,
                           "client_num_gpus": client_num_gpus})
        assert on_line is not None
        folder = Path(run_config["results-dir"]) / name
        config = RunConfig.from_mapping({**APP_DEFAULTS, **run_config}).as_dict()
        rows = rows_for(int(run_config["num-server-rounds"]))
        if run_config.get("resume"):
            on_line("INFO : resuming")  # flwr prints before the app's recorder starts
            # as the app: continue after the checkpoint's round, dropping later rows
            checkpoint = Checkpoint.load(folder, fallback=True)
            assert checkpoint is not None
            kept = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
            write_private(folder / "metrics.jsonl", "".join(  # atomically, as the recorder
                json.dumps(r) + "\n" for r in kept if r["round"] <= checkpoint.server_round))
            rows = rows[checkpoint.server_round + 1:]
        write_run(folder, config, [], summary=False)
        for row in rows:
            if name in self.fail and row["round"] == max(1, rows[0]["round"]):
                on_line("Traceback: boom")
                return SimulationRun(1, "line a\nTraceback: boom\n", 3.0)
            write_run(folder, config, [row], summary=False)
            if self.checkpoints and row["round"] >= 1:
                save_checkpoint(folder, config, row["round"])
            on_line(f"INFO : round {row['round']}")
            if self.during is not None:
                self.during(name, row["round"])
        rows = rows_for(int(run_config["num-server-rounds"]))
        accs = [r["test-accuracy"] for r in rows]
        (folder / "summary.json").write_text(json.dumps({
            "rounds-completed": rows[-1]["round"], "final-test-accuracy": accs[-1],
            "best-test-accuracy": max(accs), "wall-s": self.wall_s}))
        return SimulationRun(self.returncode, "ok\n", self.wall_s)


def finish_directly(suite: Suite, index: int) -> None:
    spec = suite.runs[index]
    write_run(spec.directory, spec.config.as_dict(), rows_for(spec.num_rounds))




def save_checkpoint(folder: Path, config: Mapping[str, Any], server_round: int) -> None:
    """A checkpoint as the ServerApp writes it after ``server_round`` (its config without
    ``resume``/``overwrite``)."""
    used = {k: v for k, v in config.items() if k not in ("resume", "overwrite")}
    Checkpoint(server_round, {"w": np.full((2, 2), float(server_round))}, used).save(folder)
