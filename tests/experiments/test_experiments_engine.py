"""The suite's engine: ``[suite] engine`` and ``run --engine`` pick how runs execute; the
in-process engines run a suite for real (no Flower process) and leave the run folders the
runner expects."""

from __future__ import annotations

import json
from pathlib import Path

import fakedata
import numpy as np
import pytest

from fedshard_lab.experiments import RunState, SuiteError, load_suite, parse_suite, suite_status
from fedshard_lab.experiments.__main__ import main
from fedshard_lab.experiments.launch import launcher_for, run_engine_simulation, run_simulation

ROOT = Path(__file__).resolve().parents[2]


def _suite_text(data_dir: Path, results: Path, engine: str | None) -> str:
    line = f'engine = "{engine}"\n' if engine else ""
    return (f'[suite]\nname = "e"\nresults-dir = "{results}"\nnum-supernodes = 3\n'
            f"seeds = [0]\n{line}"
            f'[defaults]\nmodel = "mlp"\nmodel-width = 16\nnum-server-rounds = 2\n'
            f'min-available-nodes = 3\ndataset = "fashion-mnist"\ndata-dir = "{data_dir}"\n'
            f'batch-size = 8\ntest-max-examples = 20\nclient-device = "cpu"\n'
            f'server-device = "cpu"\n'
            f'[[runs]]\nlabel = "Collective"\ncolumn = "r = 0.25"\nmethod = "collective"\n'
            f'keep-ratios = "0.25"\n')


def _data(engine: str | None) -> dict[str, object]:
    suite: dict[str, object] = {"name": "t", "results-dir": "results/t", "num-supernodes": 3}
    if engine is not None:
        suite["engine"] = engine
    return {"suite": suite, "runs": [{"label": "A", "method": "top-n", "keep-ratios": "0.5"}]}


def test_engine_defaults_to_flower_and_is_validated() -> None:
    assert parse_suite(_data(None), app_dir=ROOT).engine == "flower"
    assert parse_suite(_data("batched"), app_dir=ROOT).engine == "batched"
    with pytest.raises(SuiteError, match=r"\[suite\] engine='warp': expected one of flower, "
                       r"sequential, batched"):
        parse_suite(_data("warp"), app_dir=ROOT)


def test_launcher_for_each_engine() -> None:
    assert launcher_for("flower") is run_simulation
    seq = launcher_for("sequential")
    assert seq.func is run_engine_simulation and seq.keywords == {"engine": "sequential"}
    with pytest.raises(ValueError, match=r"engine='warp': expected one of flower"):
        launcher_for("warp")
    with pytest.raises(ValueError, match=r"engine='flower': expected one of sequential, "
                       r"batched here"):
        run_engine_simulation(ROOT, {}, num_supernodes=1, engine="flower")


def test_run_engine_override_runs_the_suite_in_process(tmp_path: Path) -> None:
    """A suite that names no engine, run with ``--engine sequential``: the runs finish in the
    engine's process, ``runner.json`` records the engine, a second ``run`` skips them."""
    fakedata.write_fashion_mnist(tmp_path / "data", 90, 20, np.random.default_rng(1))
    suite_file = tmp_path / "e.toml"
    suite_file.write_text(_suite_text(tmp_path / "data", tmp_path / "res", None))
    assert main(["run", str(suite_file), "--app-dir", str(ROOT), "--engine", "sequential",
                 "--allow-dirty"]) == 0
    record = json.loads((tmp_path / "res" / "collective__r-0-25__seed0" / "runner.json")
                        .read_text())
    assert record["engine"] == "sequential" and record["status"] == "finished"
    log = (tmp_path / "res" / "collective__r-0-25__seed0" / "flwr-output.log").read_text()
    assert "fedshard results ->" in log
    suite = load_suite(suite_file, app_dir=ROOT)
    assert suite.engine == "flower"
    assert [s.state for s in suite_status(suite)] == [RunState.FINISHED]
