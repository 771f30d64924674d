"""``experiments/smoke.toml`` for real: SIGTERM mid-run, resume, skip, report.

Real ``flwr run`` simulations (two runs of 2 rounds, 3 SuperNodes, plus one interrupted run),
about 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from fedshard_lab.experiments import RunState, load_suite, run_suite, suite_status, write_report
from fedshard_lab.experiments.launch import SimulationRun, processes_with_env, run_simulation

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not FMNIST.is_dir(), reason="needs `apt-get install "
                       "dataset-fashion-mnist` (.ci/run installs it)"),
]


def flwr_home(record: dict) -> str:
    """The launch's FLWR_HOME: runner.json names it inside the system's temporary folder."""
    return str(Path(tempfile.gettempdir()) / record["flwr-home"])


def _interrupt_cli_after_first_round(results: Path) -> tuple[int, list[str]]:
    """Start the CLI on the smoke suite, SIGTERM it once run 1 reports round 1."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedshard_lab.experiments", "run", "experiments/smoke.toml",
         "--allow-dirty", "--results-dir", str(results)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=5):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if re.search(r"run 1/2 .*: round 1/2", line):
                os.kill(proc.pid, signal.SIGTERM)
                break
        else:
            raise AssertionError("no round within 300 s:\n" + "\n".join(lines))
        out, _ = proc.communicate(timeout=120)
        lines += out.splitlines()
        return proc.returncode, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_smoke_suite_interrupt_resume_skip_report(tmp_path: Path) -> None:
    results = tmp_path / "smoke"
    suite = load_suite(ROOT / "experiments" / "smoke.toml", results_dir=results)
    first, second = suite.runs

    # 1. SIGTERM during the first run: exit code 130, no process of that launch left behind.
    code, lines = _interrupt_cli_after_first_round(results)
    text = "\n".join(lines)
    assert code == 130, text
    assert "interrupted; the run's processes are stopped" in text
    record = json.loads((first.directory / "runner.json").read_text())
    assert record["status"] == "interrupted"
    assert processes_with_env("FLWR_HOME", flwr_home(record)) == []
    # Stopped in round 2. The server writes round 1's metrics row, then its checkpoint: the
    # run resumes after round 1, or (if the signal won that race, which is rare) starts again
    # from scratch.
    first_state, second_state = (s.state for s in suite_status(suite))
    assert second_state is RunState.PENDING
    assert first_state in (RunState.PARTIAL, RunState.RESUMABLE)

    # 2. Again: the interrupted run runs to its end, then the second one runs.
    launched: list[str] = []

    def launch(app_dir: Path, run_config: Mapping[str, Any], **kwargs: Any) -> SimulationRun:
        launched.append(run_config["run-name"])
        return run_simulation(app_dir, run_config, **kwargs)

    progress: list[str] = []
    outcome = run_suite(suite, launch=launch, emit=progress.append)
    assert outcome.ok, "\n".join(progress)
    assert launched == [first.name, second.name]
    restarted = "deleting partial run folder" if first_state is RunState.PARTIAL else \
        "resuming after round 1 of 2"
    assert any(restarted in line for line in progress), "\n".join(progress)
    if first_state is RunState.RESUMABLE:
        record = json.loads((first.directory / "runner.json").read_text())
        assert record["resumed-after-round"] == 1
        assert [e["status"] for e in record["earlier-launches"]] == ["interrupted"]
        config = json.loads((first.directory / "config.json").read_text())
        assert config["resumed"][0]["after-round"] == 1  # the app did resume
    assert any(re.search(r"run 2/2 Collective / r = 0.25 / seed 0: round 2/2 \| test acc "
                         r"\d+\.\d\d% \| \d+\.\d s/round \| suite ETA", line) for line in progress)
    for spec in suite.runs:
        record = json.loads((spec.directory / "runner.json").read_text())
        assert record["status"] == "finished" and record["wall-s"] > 0
        assert record["run-config"] == spec.run_config
        assert processes_with_env("FLWR_HOME", flwr_home(record)) == []
        rows = [json.loads(x) for x in (spec.directory / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1, 2]

    # 3. Again: both runs are skipped, nothing is launched.
    launched.clear()
    outcome = run_suite(suite, launch=launch, emit=progress.append)
    assert launched == [] and outcome.skipped == [first.name, second.name]

    # 4. Report.
    files = write_report(suite)
    table = files.table.read_text()
    for label in ("Top-n", "Collective"):
        assert re.search(rf"\| {label} \| (\*\*)?\d+\.\d\d(\*\*)? \|", table), table
    data = json.loads(files.results.read_text())
    accs = [c["final-test-accuracy"][0] for c in data["cells"]]
    assert all(10.0 < a <= 100.0 for a in accs), accs  # above chance after 2 rounds
    for png in (files.accuracy_plot, files.anme_plot):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
