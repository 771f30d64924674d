"""The suite runner with a fake launcher: skip/re-run logic, stale runs, failures, progress,
interrupts (Ctrl-C, SIGTERM) and the run folder's bookkeeping. No Flower process is started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from runner_fakes import ROOT, FakeLauncher, finish_directly, make_suite, rows_for, write_run

from fedshard.app.config import RunConfig
from fedshard_lab.experiments import (
    RunState,
    SelectionError,
    StaleRunsError,
    load_suite,
    run_suite,
    suite_status,
)
from fedshard_lab.experiments import runner as runner_module
from fedshard_lab.experiments.__main__ import main
from fedshard_lab.experiments.launch import SimulationRun


def test_finished_runs_are_skipped_and_partial_ones_rerun_from_scratch(tmp_path: Path) -> None:
    suite = make_suite(tmp_path)
    finish_directly(suite, 0)
    partial = suite.runs[2].directory
    write_run(partial, suite.runs[2].config.as_dict(), rows_for(1), summary=False)
    (partial / "leftover.txt").write_text("from the interrupted attempt")
    assert [s.state for s in suite_status(suite)] == [
        RunState.FINISHED, RunState.PENDING, RunState.PARTIAL, RunState.PENDING]

    launch = FakeLauncher()
    lines: list[str] = []
    outcome = run_suite(suite, launch=launch, emit=lines.append)

    assert [c["run_config"]["run-name"] for c in launch.calls] == [
        "top-n__r-0-25__seed1", "collective__r-0-25__seed0", "collective__r-0-25__seed1"]
    assert outcome.skipped == ["top-n__r-0-25__seed0"]
    assert outcome.finished == [c["run_config"]["run-name"] for c in launch.calls]
    assert outcome.ok
    assert not (partial / "leftover.txt").exists()
    assert [s.state for s in suite_status(suite)] == [RunState.FINISHED] * 4
    call = launch.calls[0]
    assert call["app_dir"] == ROOT and call["num_supernodes"] == 3
    assert call["client_num_gpus"] == suite.client_num_gpus == 0.0
    assert call["run_config"] == suite.runs[1].run_config
    assert any(re.search(r"run 3/4 Collective / r = 0.25 / seed 0: deleting partial run folder "
                         r"\(no summary.json", line) for line in lines)

    # a second invocation launches nothing
    again = FakeLauncher()
    outcome = run_suite(suite, launch=again, emit=lines.append)
    assert again.calls == [] and len(outcome.skipped) == 4 and outcome.finished == []


def test_runner_json_records_overrides_wall_time_and_output(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))
    run_suite(suite, launch=FakeLauncher(wall_s=42.0), emit=lambda _: None)
    spec = suite.runs[0]
    record = json.loads((spec.directory / "runner.json").read_text())
    assert record["run-config"] == spec.run_config
    assert (record["label"], record["column"], record["seed"]) == ("Top-n", "r = 0.25", 0)
    assert record["wall-s"] == 42.0 and record["status"] == "finished"
    assert record["returncode"] == 0
    log = (spec.directory / "flwr-output.log").read_text().splitlines()
    assert log == ["INFO : round 0", "INFO : round 1", "INFO : round 2"]
    # the per-run FLWR_HOME is a fresh temporary folder, named by its name alone (records are
    # committed), removed afterwards
    assert record["flwr-home"].startswith("fedshard-flwr-") and "/" not in record["flwr-home"]
    assert not (Path(tempfile.gettempdir()) / record["flwr-home"]).exists()
    assert record["app-dir"] == "."  # the app is this checkout: stored relative to it


def test_records_hold_paths_relative_to_their_checkout(tmp_path: Path) -> None:
    """A suite whose results lie inside a git work tree records no absolute path: the
    launch gets the absolute results-dir the ServerApp needs, runner.json and the run's
    config.json say where it is relative to the checkout."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    suite = make_suite(tmp_path, seeds=(0,))
    launcher = FakeLauncher()
    run_suite(suite, launch=launcher, emit=lambda _: None)
    spec = suite.runs[0]
    assert spec.run_config["results-dir"] == str(tmp_path / "res")  # what the app is given
    record = json.loads((spec.directory / "runner.json").read_text())
    assert record["run-config"]["results-dir"] == "res"
    assert str(tmp_path) not in json.dumps(record)


def test_progress_lines_and_eta(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, rounds=3, seeds=(0,))
    lines: list[str] = []
    run_suite(suite, launch=FakeLauncher(wall_s=40.0), emit=lines.append)
    rounds = [line for line in lines if " | " in line and ": round " in line]
    assert rounds[0] == ("[t] run 1/2 Top-n / r = 0.25 / seed 0: round 0/3 | test acc 50.00% | "
                         "suite ETA ?")
    # after round 1 of run 1: 2 + 3 rounds left at 10 s each, launch overhead not known yet
    assert rounds[1] == ("[t] run 1/2 Top-n / r = 0.25 / seed 0: round 1/3 | test acc 60.00% | "
                         "10.0 s/round | suite ETA 50s")
    # run 1 took 40 s for 30 s of rounds: 10 s overhead per launch; after run 2's round 1 only
    # 2 rounds are left and no launch
    assert rounds[5] == ("[t] run 2/2 Collective / r = 0.25 / seed 0: round 1/3 | "
                         "test acc 60.00% | 10.0 s/round | suite ETA 20s")
    done = [line for line in lines if ": done in " in line]
    assert done[0] == ("[t] run 1/2 Top-n / r = 0.25 / seed 0: done in 40s "
                       "(final test acc 80.00%, 3 rounds) | suite ETA 30s")
    assert re.search(r"^\[t\] done in .*: 2 run\(s\) finished now, 0 skipped, 0 failed$",
                     lines[-1])


def test_failed_run_is_reported_and_the_next_one_still_runs(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))
    launch = FakeLauncher(fail=frozenset({"top-n__r-0-25__seed0"}))
    lines: list[str] = []
    outcome = run_suite(suite, launch=launch, emit=lines.append)
    assert not outcome.ok
    assert outcome.failed == [("top-n__r-0-25__seed0", "flwr run exited with code 1")]
    assert outcome.finished == ["collective__r-0-25__seed0"]
    assert "    | Traceback: boom" in lines
    record = json.loads((suite.runs[0].directory / "runner.json").read_text())
    assert record["status"] == "failed" and record["returncode"] == 1
    assert suite_status(suite)[0].state is RunState.PARTIAL
    # the next invocation re-runs only the failed one
    retry = FakeLauncher()
    assert run_suite(suite, launch=retry, emit=lambda _: None).ok
    assert [c["run_config"]["run-name"] for c in retry.calls] == ["top-n__r-0-25__seed0"]


def test_fail_fast_stops_at_the_first_failure(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))
    launch = FakeLauncher(fail=frozenset({"top-n__r-0-25__seed0"}))
    outcome = run_suite(suite, launch=launch, emit=lambda _: None, fail_fast=True)
    assert len(launch.calls) == 1 and outcome.finished == []


def test_zero_exit_without_summary_is_a_failure(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))

    def launch(app_dir: Path, run_config: Mapping[str, Any], **kwargs: Any) -> SimulationRun:
        return SimulationRun(0, "", 1.0)

    outcome = run_suite(suite, launch=launch, emit=lambda _: None)
    assert outcome.failed[0] == ("top-n__r-0-25__seed0",
                                 "flwr run returned but the run is partial: no summary.json "
                                 "(interrupted or failed); no checkpoint")


def test_stale_finished_runs_stop_the_suite_unless_asked(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))
    spec = suite.runs[1]
    write_run(spec.directory, {**spec.config.as_dict(), "lr": 0.1}, rows_for(spec.num_rounds))
    assert suite_status(suite)[1].state is RunState.STALE
    launch = FakeLauncher()
    with pytest.raises(StaleRunsError, match=r"(?s)no run was started.*collective__r-0-25__seed0: "
                       r"finished with lr=0.1 \(suite: 0.05\)"):
        run_suite(suite, launch=launch, emit=lambda _: None)
    assert launch.calls == []
    outcome = run_suite(suite, launch=launch, emit=lambda _: None, rerun_stale=True)
    assert outcome.finished == ["top-n__r-0-25__seed0", "collective__r-0-25__seed0"]
    assert suite_status(suite)[1].state is RunState.FINISHED


def test_moved_results_folder_is_not_stale(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))
    spec = suite.runs[0]
    write_run(spec.directory, {**spec.config.as_dict(), "results-dir": "/elsewhere",
                               "run-name": "old"}, rows_for(spec.num_rounds))
    assert suite_status(suite)[0].state is RunState.FINISHED


def test_changed_rounds_make_a_finished_run_stale_not_partial(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, rounds=3, seeds=(0,))
    spec = suite.runs[0]
    write_run(spec.directory, {**spec.config.as_dict(), "num-server-rounds": 2}, rows_for(2))
    status = suite_status(suite)[0]
    assert status.state is RunState.STALE
    assert "num-server-rounds=2 (suite: 3)" in status.detail


def test_keyboard_interrupt_reaches_the_launcher_and_marks_the_run(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))

    def interrupt(name: str, server_round: int) -> None:
        if server_round == 1:
            raise KeyboardInterrupt

    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        run_suite(suite, launch=FakeLauncher(during=interrupt), emit=lines.append)
    record = json.loads((suite.runs[0].directory / "runner.json").read_text())
    assert record["status"] == "interrupted"
    assert suite_status(suite)[0].state is RunState.PARTIAL
    assert re.search(r"seed 0: interrupted; the run's processes are stopped", lines[-1])


def test_sigterm_unwinds_through_the_launcher_and_restores_handlers(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))
    cleaned: list[str] = []
    before = signal.getsignal(signal.SIGTERM)

    def launch(app_dir: Path, run_config: Mapping[str, Any], **kwargs: Any) -> SimulationRun:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # interrupted at once by the handler
            raise AssertionError("SIGTERM did not interrupt the launcher")
        finally:
            # a second signal during cleanup is ignored, so cleanup runs to the end
            os.kill(os.getpid(), signal.SIGINT)
            cleaned.append(run_config["run-name"])

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        run_suite(suite, launch=launch, emit=lambda _: None)
    assert time.monotonic() - start < 5
    assert cleaned == ["top-n__r-0-25__seed0"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_runner_on_the_same_results_is_refused(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, seeds=(0,))
    launch = FakeLauncher()
    suite.results_dir.mkdir(parents=True, exist_ok=True)
    with runner_module.SuiteLock(suite.results_dir), pytest.raises(
        RuntimeError, match=rf"another runner \(pid {os.getpid()} on host .*\) is working in"
    ):
        run_suite(suite, launch=launch, emit=lambda _: None)
    assert launch.calls == []


def test_real_recorder_output_counts_as_finished(tmp_path: Path) -> None:
    from fedshard.app.results import RunRecorder

    suite = make_suite(tmp_path, seeds=(0,))
    spec = suite.runs[0]
    recorder = RunRecorder(spec.config.results_path, spec.config.as_dict(), spec.num_rounds)
    for r in range(spec.num_rounds):
        recorder.record_round(r, {"test-accuracy": 0.5})
        assert suite_status(suite)[0].state is RunState.PARTIAL
    recorder.record_round(spec.num_rounds, {"test-accuracy": 0.7})
    recorder.finish({})
    status = suite_status(suite)[0]
    assert status.state is RunState.FINISHED, status.detail
    assert status.detail == "final test acc 70.00%, 2 rounds"


def test_cli_status_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "res"
    suite_file = ROOT / "experiments" / "smoke.toml"
    smoke = load_suite(suite_file, results_dir=results)
    spec = smoke.runs[0]
    write_run(spec.directory, spec.config.as_dict(), rows_for(spec.num_rounds))
    assert main(["status", str(suite_file), "--results-dir", str(results)]) == 0
    out = capsys.readouterr().out
    assert f"[smoke] 2 run(s) in {results}: 1 finished, 0 resumable, 0 partial, 0 stale, " \
           "1 pending; 2 rounds to run" in out
    assert re.search(r"1 finished\s+Top-n / r = 0.25 / seed 0\s+final test acc 70.00%", out)
    assert re.search(r"2 pending\s+Collective / r = 0.25 / seed 0\s+not started", out)

    bad = tmp_path / "bad.toml"
    bad.write_text(suite_file.read_text().replace('model = "mlp"', 'model = "mlpp"'))
    assert main(["run", str(bad), "--app-dir", str(ROOT)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: Invalid experiment suite .*bad.toml \(1 problem\(s\)\); no run was "
                     r"started", err)
    assert "  - [defaults] model='mlpp': expected one of" in err
    assert main(["status", "no-such-suite"]) == 2
    assert "suite 'no-such-suite': no such file" in capsys.readouterr().err


def test_a_key_added_later_with_its_default_does_not_make_a_run_stale(tmp_path: Path) -> None:
    """Runs finished before fedshard gained a run-config key ran with that key's default."""
    from fedshard_lab.experiments.runner import RunState, run_status
    from fedshard_lab.experiments.suite import parse_suite

    suite = parse_suite(
        {"suite": {"name": "s", "num-supernodes": 3, "seeds": [0], "results-dir": "r"},
         "defaults": {"num-server-rounds": 2},
         "runs": [{"label": "Top-n", "column": "r = 0.1", "method": "top-n",
                   "keep-ratios": "0.1"}]},
        app_dir=Path(__file__).resolve().parents[2], results_dir=tmp_path)
    spec = suite.runs[0]
    spec.directory.mkdir(parents=True)
    used = spec.config.as_dict()
    del used["fedavg-cosine"]  # as written by a fedshard without the key
    (spec.directory / "config.json").write_text(json.dumps({"config": used}))
    (spec.directory / "summary.json").write_text(json.dumps(
        {"rounds-completed": 2, "final-test-accuracy": 0.5}))
    assert run_status(spec).state is RunState.FINISHED
    used["fedavg-cosine"] = True  # but another value is another run
    (spec.directory / "config.json").write_text(json.dumps({"config": used}))
    assert run_status(spec).state is RunState.STALE
    assert RunConfig().as_dict()["fedavg-cosine"] is False


def test_a_run_from_before_the_robust_aggregation_averaged_plainly(tmp_path: Path) -> None:
    """A run written before ``align-factors`` and ``max-update-spread`` existed averaged the
    replies plainly: it is stale for a suite on today's defaults, and finished for a suite that
    asks for the plain averages (as the committed suites do)."""
    from fedshard_lab.experiments.runner import RunState, run_status
    from fedshard_lab.experiments.suite import parse_suite

    def spec_for(defaults: dict[str, Any]) -> Any:
        suite = parse_suite(
            {"suite": {"name": "s", "num-supernodes": 3, "seeds": [0], "results-dir": "r"},
             "defaults": {"num-server-rounds": 2, **defaults},
             "runs": [{"label": "Top-n", "column": "r = 0.1", "method": "top-n",
                       "keep-ratios": "0.1"}]},
            app_dir=Path(__file__).resolve().parents[2], results_dir=tmp_path)
        return suite.runs[0]

    plain = spec_for({"align-factors": False, "max-update-spread": 0.0})
    used = plain.config.as_dict()
    del used["align-factors"], used["max-update-spread"]  # an older fedshard's config.json
    plain.directory.mkdir(parents=True)
    (plain.directory / "config.json").write_text(json.dumps({"config": used}))
    (plain.directory / "summary.json").write_text(json.dumps(
        {"rounds-completed": 2, "final-test-accuracy": 0.5}))
    assert run_status(plain).state is RunState.FINISHED
    today = run_status(spec_for({}))
    assert today.state is RunState.STALE
    assert "align-factors=False (suite: True)" in today.detail
    kappa = RunConfig().as_dict()["max-update-spread"]
    assert f"max-update-spread=0.0 (suite: {kappa!r})" in today.detail


def test_seed_filter_runs_one_seed_of_every_cell_and_leaves_the_rest(tmp_path: Path) -> None:
    suite = make_suite(tmp_path)  # Top-n s0, Top-n s1, Collective s0, Collective s1
    launch = FakeLauncher()
    lines: list[str] = []
    outcome = run_suite(suite, launch=launch, emit=lines.append, seeds={1})
    assert [c["run_config"]["seed"] for c in launch.calls] == [1, 1]
    assert outcome.finished == [suite.runs[1].name, suite.runs[3].name]
    assert outcome.skipped == []
    states = [s.state for s in suite_status(suite)]
    assert states == [RunState.PENDING, RunState.FINISHED, RunState.PENDING, RunState.FINISHED]
    assert "[t] 2 run(s): 0 finished, 2 to run" in lines[0]
    assert any(line.startswith("[t] run 4/4 Collective / r = 0.25 / seed 1") for line in lines)

    with pytest.raises(SelectionError, match=r"Invalid run selection for suite 't' \(1 "
                       r"problem\(s\)\); nothing was started:\n  - seed\(s\) \[7\]: no run "
                       r"uses them \(the suite's seeds: \[0, 1\]\)"):
        run_suite(suite, launch=launch, emit=lambda _: None, seeds={0, 7})
    assert len(launch.calls) == 2
    smoke = str(ROOT / "experiments" / "smoke.toml")
    assert main(["run", smoke, "--app-dir", str(ROOT), "--allow-dirty", "--results-dir",
                 str(tmp_path / "cli"),
                 "--seed", "9"]) == 2


def test_label_filter_combines_with_the_seed_filter(tmp_path: Path) -> None:
    suite = make_suite(tmp_path)  # Top-n s0, Top-n s1, Collective s0, Collective s1
    launch = FakeLauncher()
    outcome = run_suite(suite, launch=launch, emit=lambda _: None, seeds={1},
                        labels={"Collective"})
    assert outcome.finished == [suite.runs[3].name]
    outcome = run_suite(suite, launch=launch, emit=lambda _: None, labels=["Top-n"])
    assert outcome.finished == [suite.runs[0].name, suite.runs[1].name]
    assert [s.state for s in suite_status(suite)] == [RunState.FINISHED, RunState.FINISHED,
                                                      RunState.PENDING, RunState.FINISHED]
    with pytest.raises(SelectionError, match=r"\(2 problem\(s\)\); nothing was started:\n"
                       r"  - seed\(s\) \[5\]: no run .*\n  - label\(s\) \['Top-k'\]: not "
                       r"rows of the suite \(its rows: \['Top-n', 'Collective'\]\)"):
        run_suite(suite, launch=launch, emit=lambda _: None, seeds={5}, labels={"Top-k"})
    assert len(launch.calls) == 3


def test_status_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    import subprocess
    import sys

    command = (f"{sys.executable} -m fedshard_lab.experiments status "
               f"{ROOT / 'experiments' / 'fmnist-table.toml'} --results-dir {tmp_path} | head -1")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.stdout.startswith("[fmnist-table] 36 run(s)"), done.stdout
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    # `head -1` may read everything before it exits, and then nothing breaks. A reader that
    # closes the pipe before Python has started makes the very first write fail, every time.
    command = (f"{sys.executable} -m fedshard_lab.experiments status "
               f"{ROOT / 'experiments' / 'fmnist-table.toml'} --results-dir {tmp_path} "
               "| (exec 0<&-; sleep 3)")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 1, (done.returncode, done.stderr)
