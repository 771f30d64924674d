"""Two runs with one run-name at once: the second fails at once, naming the first."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fedshard.app.results import RunLockedError, RunRecorder
from fedshard.app.rundir import RunLock

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"seed": 0}

# A second process that records a run in argv[1] and waits for a line on stdin, then either
# finishes the run or (no line: the pipe closed) is killed by the test.
HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from fedshard.app.results import RunRecorder
    recorder = RunRecorder(Path(sys.argv[1]), {"seed": 0}, 1)
    recorder.record_round(0, {"test-accuracy": 0.5})
    print("recording", flush=True)
    if sys.stdin.readline().strip() == "finish":
        recorder.finish({})
        print("finished", flush=True)
        sys.stdin.readline()
""")


def _holder(run: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(ROOT)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "recording", "the holder process did not start"
    return proc


def test_a_second_process_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _holder(run)
    try:
        start = time.monotonic()
        with pytest.raises(RunLockedError, match=(
            rf"{run} is in use by another run \(pid {proc.pid} on host "
            rf"{platform.node()}, started .*\).*was not started.*another run-name"
        )):
            RunRecorder(run, CONFIG, 1, resume_round=0)
        assert time.monotonic() - start < 5  # non-blocking: no waiting for the other run
        # the refused run wrote nothing: the holder's row is intact
        assert [json.loads(x)["round"] for x in
                (run / "metrics.jsonl").read_text().splitlines()] == [0]
        info = json.loads((run / "run.lock").read_text())
        assert info["pid"] == proc.pid and info["host"] == platform.node()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _holder(run)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # the crash left results: resuming is how to go on, and the lock is free for it
    with RunRecorder(run, CONFIG, 1, resume_round=0) as recorder:
        assert [r["round"] for r in recorder.rows] == [0]
        info = json.loads((run / "run.lock").read_text())
        assert info["pid"] == os.getpid()


def test_finish_releases_the_lock_while_the_process_lives_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _holder(run)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("finish\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "finished"
        assert proc.poll() is None  # still running, no longer holding the run
        with RunLock(run) as lock:
            assert lock.held
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_two_recorders_in_one_process_conflict_until_close(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = RunRecorder(run, CONFIG, 1)
    with pytest.raises(RunLockedError, match=rf"pid {os.getpid()} on host"):
        RunRecorder(run, CONFIG, 1, overwrite=True)
    first.close()
    first.close()  # idempotent
    with RunRecorder(run, CONFIG, 1, overwrite=True), pytest.raises(
        RunLockedError, match="is in use by another run"
    ):
        RunLock(run).acquire()
    RunLock(run).acquire()  # released on leaving the with-block


def test_lock_file_is_emptied_on_release(tmp_path: Path) -> None:
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock.held
    assert (tmp_path / "run.lock").read_text() == ""


def test_a_forged_holder_in_run_lock_is_escaped_in_the_log_and_the_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import fcntl

    forged = {"pid": "1\n2026-01-01 ERROR flwr: the run was stopped by the operator",
              "host": "\x1b[2J\x1b[31mhost", "started": "now\r"}
    (tmp_path / "run.lock").write_text(json.dumps(forged))
    with open(tmp_path / "run.lock") as held:  # another open file: a holder of the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        caplog.set_level("WARNING", logger="fedshard")
        with pytest.raises(RunLockedError, match=(
                r"in use by another run \(pid 1\\n2026-01-01 ERROR flwr: the run was stopped "
                r"by the operator on host \\x1b\[2J\\x1b\[31mhost, started now\\r; lock file"
                )) as info:
            RunLock(tmp_path).acquire(wait_s=0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert any("is held by pid 1\\n2026-01-01 ERROR" in line for line in lines), lines
    for text in [*lines, str(info.value)]:
        assert "\n" not in text and "\r" not in text and "\x1b" not in text


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_as_run_lock_is_refused_naming_it(tmp_path: Path) -> None:
    from fedshard.app.rundir import RunDirectoryError

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "run.lock")
    for start in (lambda: RunLock(run).acquire(), lambda: RunRecorder(run, CONFIG, 1)):
        with pytest.raises(RunDirectoryError, match=(
                rf"^{run / 'run.lock'} is a FIFO, not a regular file; expected a plain file "
                "that fedshard creates, so it was not opened and the run was not started")):
            start()
    # a FIFO under a result file's name is refused as well, and nothing blocks on it
    os.mkfifo(run / "metrics.jsonl")
    from fedshard.app.rundir import open_private_append
    with pytest.raises(RunDirectoryError, match=rf"^{run / 'metrics.jsonl'} is a FIFO"):
        open_private_append(run / "metrics.jsonl")
