"""The suite runner resumes an unfinished run from its server checkpoint when the checkpoint
was written with the suite's settings, and starts it from scratch otherwise (fake launcher,
real checkpoint files; the app's own resume is tested in tests/app/test_resume.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from runner_fakes import ROOT, FakeLauncher, make_suite, rows_for, save_checkpoint, write_run

from fedshard.app.checkpoint import CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME
from fedshard_lab.experiments import RunState, load_suite, run_suite, suite_status
from fedshard_lab.experiments.__main__ import main


def interrupted(tmp_path: Path, *, rounds: int = 4, at: int = 2):
    """A one-seed suite whose first run was interrupted during round ``at + 1``: rows and
    checkpoint up to round ``at``, as the app leaves them."""
    suite = make_suite(tmp_path, rounds=rounds, seeds=(0,))

    def stop(name: str, server_round: int) -> None:
        if server_round == at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_suite(suite, launch=FakeLauncher(during=stop, checkpoints=True),
                  emit=lambda _: None)
    return suite


def rounds_in(folder: Path) -> list[int]:
    return [json.loads(x)["round"] for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_an_interrupted_run_resumes_after_its_checkpoint(tmp_path: Path) -> None:
    suite = interrupted(tmp_path, rounds=4, at=2)
    spec = suite.runs[0]
    status = suite_status(suite)[0]
    assert status.state is RunState.RESUMABLE and status.resume_round == 2
    assert status.detail == "no summary.json (interrupted or failed); checkpoint after round 2 of 4"
    (spec.directory / "leftover.txt").write_text("kept: the folder is not deleted")

    launch = FakeLauncher(checkpoints=True)
    lines: list[str] = []
    outcome = run_suite(suite, launch=launch, emit=lines.append)

    assert outcome.finished == [spec.name, suite.runs[1].name]
    assert launch.calls[0]["run_config"] == {**spec.run_config, "resume": True}
    assert "resume" not in launch.calls[1]["run_config"]  # the other run starts normally
    assert (spec.directory / "leftover.txt").exists()
    assert rounds_in(spec.directory) == [0, 1, 2, 3, 4]
    assert "[t] 2 run(s): 0 finished, 2 to run (1 of them resumed from a checkpoint)" in lines[0]
    assert lines[1] == ("[t] run 1/2 Top-n / r = 0.25 / seed 0: resuming after round 2 of 4 "
                        f"from its checkpoint -> {spec.directory}")
    # progress only for the rounds run now; the ETA counts 1 + 4 rounds after round 3
    run1 = [line for line in lines if "Top-n" in line and ": round " in line]
    assert [re.search(r"round (\d)/4", line)[1] for line in run1] == ["3", "4"]  # type: ignore[index]
    assert run1[0].endswith("10.0 s/round | suite ETA 50s")
    record = json.loads((spec.directory / "runner.json").read_text())
    assert record["status"] == "finished" and record["resumed-after-round"] == 2
    assert record["run-config"] == spec.run_config
    assert [e["status"] for e in record["earlier-launches"]] == ["interrupted"]
    log = (spec.directory / "flwr-output.log").read_text().splitlines()
    assert log[:3] == ["INFO : round 0", "INFO : round 1", "INFO : round 2"]
    assert re.fullmatch(r"---- resumed after round 2 \(.*\) ----", log[3])
    assert log[4:] == ["INFO : resuming", "INFO : round 3", "INFO : round 4"]
    assert [s.state for s in suite_status(suite)] == [RunState.FINISHED] * 2


def test_a_row_written_after_the_checkpoint_is_reported_once(tmp_path: Path) -> None:
    """The app records a round's row before its checkpoint: a run stopped between the two
    leaves a row the resumed launch drops and writes again; its progress line comes once."""
    suite = interrupted(tmp_path, rounds=4, at=2)
    spec = suite.runs[0]
    stale = {**rows_for(4)[3], "test-accuracy": 0.999}  # round 3, never checkpointed
    with (spec.directory / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps(stale) + "\n")
    assert suite_status(suite)[0].resume_round == 2

    lines: list[str] = []
    run_suite(suite, launch=FakeLauncher(checkpoints=True), emit=lines.append)
    run1 = [line for line in lines if "Top-n" in line and ": round " in line]
    assert [re.search(r"round (\d)/4", line)[1] for line in run1] == ["3", "4"]  # type: ignore[index]
    assert "99.90%" not in "".join(run1)
    assert rounds_in(spec.directory) == [0, 1, 2, 3, 4]


def test_restart_partial_starts_a_resumable_run_from_scratch(tmp_path: Path) -> None:
    suite = interrupted(tmp_path)
    spec = suite.runs[0]
    (spec.directory / "leftover.txt").write_text("deleted")
    launch = FakeLauncher()
    lines: list[str] = []
    run_suite(suite, launch=launch, emit=lines.append, restart_partial=True)
    assert launch.calls[0]["run_config"] == spec.run_config
    assert not (spec.directory / "leftover.txt").exists()
    assert rounds_in(spec.directory) == [0, 1, 2, 3, 4]
    assert any(re.search(r"seed 0: deleting partial run folder \(.*checkpoint after round 2 of "
                         r"4; restart_partial\); starting again from scratch", line)
               for line in lines)


def test_a_checkpoint_of_other_settings_is_not_resumed(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, rounds=3, seeds=(0,))
    spec = suite.runs[0]
    config = spec.config.as_dict()
    write_run(spec.directory, {**config, "lr": 0.1}, rows_for(1), summary=False)
    save_checkpoint(spec.directory, {**config, "lr": 0.1}, 1)
    status = suite_status(suite)[0]
    assert status.state is RunState.PARTIAL and status.resume_round is None
    assert re.search(r"its checkpoint was written with other settings \(Cannot resume: .*lr: "
                     r"0\.1 -> 0\.05", status.detail), status.detail
    launch = FakeLauncher()
    run_suite(suite, launch=launch, emit=lambda _: None)
    assert "resume" not in launch.calls[0]["run_config"]
    assert rounds_in(spec.directory) == [0, 1, 2, 3]


def test_settings_that_may_change_on_resume_do_not_block_it(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, rounds=3, seeds=(0,))
    spec = suite.runs[0]
    config = spec.config.as_dict()
    write_run(spec.directory, config, rows_for(1), summary=False)
    save_checkpoint(spec.directory, {**config, "round-timeout": 5.0, "client-device": "cuda",
                                     "results-dir": "/moved/from/here", "run-name": "old"}, 1)
    assert suite_status(suite)[0].state is RunState.RESUMABLE


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_round(tmp_path: Path) -> None:
    suite = interrupted(tmp_path, rounds=4, at=2)
    folder = suite.runs[0].directory
    (folder / CHECKPOINT_NAME).write_bytes(b"torn")
    status = suite_status(suite)[0]
    assert status.state is RunState.RESUMABLE and status.resume_round == 1

    launch = FakeLauncher(checkpoints=True)
    lines: list[str] = []
    run_suite(suite, launch=launch, emit=lines.append)
    assert "resuming after round 1 of 4" in lines[1]
    assert rounds_in(folder) == [0, 1, 2, 3, 4]  # the earlier launch's round 2 is replaced

    (folder / CHECKPOINT_NAME).write_bytes(b"torn")
    (folder / PREVIOUS_CHECKPOINT_NAME).write_bytes(b"torn too")
    (folder / "summary.json").unlink()
    status = suite_status(suite)[0]
    assert status.state is RunState.PARTIAL
    assert "its checkpoint is unusable (Neither checkpoint in" in status.detail


def test_a_checkpoint_of_the_last_round_without_summary_starts_again(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, rounds=2, seeds=(0,))
    spec = suite.runs[0]
    write_run(spec.directory, spec.config.as_dict(), rows_for(2), summary=False)
    save_checkpoint(spec.directory, spec.config.as_dict(), 2)
    status = suite_status(suite)[0]
    assert status.state is RunState.PARTIAL
    assert status.detail.endswith("its checkpoint is of round 2 of 2 but the run wrote no "
                                  "summary")


def test_a_failed_resume_says_how_to_start_from_scratch(tmp_path: Path) -> None:
    suite = interrupted(tmp_path, rounds=4, at=2)
    name = suite.runs[0].name
    outcome = run_suite(suite, launch=FakeLauncher(fail=frozenset({name})),
                        emit=lambda _: None)
    assert outcome.failed[0] == (name, "flwr run exited with code 1 (resumed after round 2; "
                                 "`run --restart-partial` starts it from scratch)")
    # still resumable from the same checkpoint
    assert suite_status(suite)[0].resume_round == 2


def test_cli_status_counts_resumable_runs_and_their_rounds_left(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "res"
    suite_file = ROOT / "experiments" / "smoke.toml"
    spec = load_suite(suite_file, results_dir=results).runs[0]  # 2 rounds
    write_run(spec.directory, spec.config.as_dict(), rows_for(1), summary=False)
    save_checkpoint(spec.directory, spec.config.as_dict(), 1)
    assert main(["status", str(suite_file), "--results-dir", str(results)]) == 0
    out = capsys.readouterr().out
    assert f"[smoke] 2 run(s) in {results}: 0 finished, 1 resumable, 0 partial, 0 stale, " \
           "1 pending; 3 rounds to run" in out
    assert re.search(r"1 resumable\s+Top-n / r = 0.25 / seed 0\s+no summary.json \(interrupted "
                     r"or failed\); checkpoint after round 1 of 2", out)


def test_a_launch_killed_before_its_record_is_named_killed_when_resumed(tmp_path: Path) -> None:
    """A runner killed with SIGKILL leaves runner.json at "running"; the next launch records
    that launch as killed, not as running forever."""
    suite = interrupted(tmp_path, rounds=4, at=2)
    spec = suite.runs[0]
    record = json.loads((spec.directory / "runner.json").read_text())
    record["status"] = "running"  # what a SIGKILLed runner leaves
    (spec.directory / "runner.json").write_text(json.dumps(record))
    run_suite(suite, launch=FakeLauncher(checkpoints=True), emit=lambda _: None)
    (earlier,) = json.loads((spec.directory / "runner.json").read_text())["earlier-launches"]
    assert earlier["status"] == "killed"
    assert earlier["note"].startswith("the launch ended without writing its record")


def test_the_runner_keeps_the_uncommitted_diff_beside_each_record(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, rounds=1, seeds=(0,))
    run_suite(suite, launch=FakeLauncher(), emit=lambda _: None,
              uncommitted="diff --git a/x b/x\n")
    for spec in suite.runs:
        record = json.loads((spec.directory / "runner.json").read_text())
        assert record["uncommitted-diff"] == "uncommitted.diff"
        assert (spec.directory / "uncommitted.diff").read_text() == "diff --git a/x b/x\n"


def test_a_tree_with_uncommitted_changes_is_refused_unless_allowed(tmp_path: Path) -> None:
    import subprocess

    from fedshard_lab.experiments.tree import DirtyTreeError, TreeState, tree_state

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "a"], cwd=repo, check=True)
    clean = tree_state(repo)
    assert clean.commit and not clean.dirty and clean.diff == ""
    (repo / "new.txt").write_text("untracked files are not the commit's code")
    assert not tree_state(repo).dirty
    (repo / "a.py").write_text("x = 2\n")
    dirty = tree_state(repo)
    assert dirty.dirty and dirty.changed == ("a.py",) and "+x = 2" in dirty.diff
    with pytest.raises(DirtyTreeError, match=r"has uncommitted changes \(1 file\(s\): a.py\) at "
                       rf"commit {clean.commit}: .* or pass --allow-dirty"):
        raise dirty.refusal(repo)
    outside = tmp_path / "plain"
    outside.mkdir()
    assert tree_state(outside) == TreeState(None, (), "")  # no checkout: nothing to refuse
    # the command line: refused before anything starts, then run with --allow-dirty
    suite_file = tmp_path / "s.toml"
    suite_file.write_text((ROOT / "experiments" / "smoke.toml").read_text())
    assert main(["run", str(suite_file), "--app-dir", str(repo), "--results-dir",
                 str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
