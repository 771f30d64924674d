"""Measure how long a run's ServerApp outlives a SIGTERM of its SuperLink (docs/deployment.md,
"Stopping, restarting and resuming").

Usage: python tests/deploy/measure_serverapp_exit.py [repeats] [--stream] [--diagnose]
[--wait S] [--out FILE]

Starts a SuperLink and two SuperNodes on 127.0.0.1 (:class:`deploy_cluster.LocalDeployment`),
submits a run of many short rounds, and once round 1 is recorded sends SIGTERM to the
SuperLink; then polls every 50 ms, for at most ``--wait`` seconds (180), until the SuperLink has
exited, until the ``flwr-serverapp`` process is gone and until the run folder's ``run.lock``
can be taken (a time missing from a repeat's line: not within the wait). With ``--stream`` a
``flwr log <run-id> --stream`` client is attached when the SuperLink is stopped. Prints one
line per repeat (seconds after the SIGTERM) and stops everything it started. With
``--diagnose`` a ServerApp still alive 30 s after the SIGTERM is sent SIGABRT, and the Python
stacks that ``PYTHONFAULTHANDLER=1`` makes it print (into the SuperLink's log, whose output it
inherited) are printed. ``--out`` also writes one JSON record of every repeat (with the
machine, torch and Flower versions, the date and the command) there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from deploy_cluster import BIN, LocalDeployment

from fedshard.app.checkpoint import Checkpoint
from fedshard.app.rundir import RunLock, RunLockedError
from fedshard.server.nodes import is_public_key
from fedshard_lab.experiments.launch import _alive, kill_tree, processes_with_env

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def _serverapps(dep: LocalDeployment) -> list[int]:
    pids = []
    for pid in processes_with_env("FEDSHARD_DEPLOY_ROOT", str(dep.root)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"flwr-serverapp" in cmd:
            pids.append(pid)
    return pids


def _lock_free(run: Path) -> bool:
    lock = RunLock(run)
    try:
        lock.acquire()
    except RunLockedError:
        return False
    lock.release()
    return True


def start_long_run(dep: LocalDeployment, results: Path) -> str:
    """A SuperLink and two SuperNodes of ``dep``, and a run of 50 short MLP rounds into
    ``results``/exit submitted to them; returns its run id once its round 1 is recorded."""
    dep.start_superlink()
    for i in range(2):
        dep.start_supernode(f"node-{i}", {"keep-ratio": 0.5, "data-dir": str(FMNIST),
                                          "partition-id": i, "num-partitions": 60})
    dep.wait_online(2)
    overrides = dep.root / "run-config.toml"
    overrides.write_text(
        'model = "mlp"\nmodel-width = 32\nnum-server-rounds = 50\nmin-available-nodes = 2\n'
        'num-partitions = 60\ntest-max-examples = 100\nbatch-size = 64\n'
        f'results-dir = "{results}"\nrun-name = "exit"\n')
    submit = dep.flwr("run", str(ROOT), dep.connection, "--run-config", str(overrides),
                      cwd=ROOT, timeout_s=120)
    run_id = re.findall(r"Successfully started run (\d+)", submit.stdout)[-1]
    metrics = results / "exit" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if metrics.is_file() and any(json.loads(x)["round"] >= 1
                                     for x in metrics.read_text().splitlines() if x.strip()):
            return run_id
        time.sleep(0.2)
    raise TimeoutError("round 1 was not recorded\n" + dep.tails())


def measure_once(root: Path, stream: bool, diagnose: bool = False,
                 wait_s: float = 180.0) -> dict[str, float]:
    results = root / "results"
    with LocalDeployment(root / "deploy") as dep:
        run_id = start_long_run(dep, results)
        metrics = results / "exit" / "metrics.jsonl"
        log = None
        if stream:
            log = subprocess.Popen([str(BIN / "flwr"), "log", run_id, dep.connection, "--stream"],
                                   env=dep.env(dep.cli_home), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
            time.sleep(3.0)
        apps = _serverapps(dep)
        assert len(apps) == 1, apps
        assert dep.link is not None
        t0 = time.monotonic()
        os.kill(dep.link.popen.pid, signal.SIGTERM)
        times: dict[str, float] = {}
        while time.monotonic() - t0 < wait_s and len(times) < 3:
            now = time.monotonic() - t0
            if diagnose and now > 30 and _alive(apps[0]):
                os.kill(apps[0], signal.SIGABRT)
                time.sleep(2.0)
                log_text = dep.link.output()
                print(log_text[log_text.find("Fatal Python error"):][:8000], flush=True)
                break
            if "superlink" not in times and dep.link.popen.poll() is not None:
                times["superlink"] = now
            if "serverapp" not in times and not _alive(apps[0]):
                times["serverapp"] = now
            if "lock" not in times and _lock_free(results / "exit"):
                times["lock"] = now
            time.sleep(0.05)
        if log is not None:
            kill_tree(log.pid, grace_s=1.0)
        rounds = max(json.loads(x)["round"] for x in metrics.read_text().splitlines())
        times["rounds-recorded"] = float(rounds)
        # without SuperNode authentication: is a node known by its self-made public key?
        checkpoint = Checkpoint.load(results / "exit")
        assert checkpoint is not None
        times["nodes-known-by-public-key"] = float(sum(
            is_public_key(key) for _, key in checkpoint.capabilities.values()))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repeats", nargs="?", type=int, default=3)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--wait", type=float, default=180.0,
                    help="seconds to watch after the SIGTERM")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    repeats, stream, diagnose = args.repeats, args.stream, args.diagnose
    if diagnose:
        os.environ["PYTHONFAULTHANDLER"] = "1"  # inherited by every process of the deployment
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, python {platform.python_version()}, stream={stream}")
    runs = []
    for i in range(repeats):
        with tempfile.TemporaryDirectory(prefix="serverapp-exit-") as tmp:
            times = measure_once(Path(tmp), stream, diagnose, args.wait)
        print(f"repeat {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
        runs.append(times)
    if args.out is not None:
        import flwr
        from machine import emit, provenance

        emit({**provenance(), "flwr": flwr.__version__, "stream": stream, "wait-s": args.wait,
              "after-sigterm-s": runs}, args.out)


if __name__ == "__main__":
    main()
