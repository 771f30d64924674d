"""What an orphaned ServerApp does when its SuperLink comes back (docs/deployment.md,
"Stopping, restarting and resuming").

Usage: python tests/deploy/measure_superlink_restart.py [repeats] [--out FILE]

Starts a SuperLink and two SuperNodes on 127.0.0.1 (:class:`deploy_cluster.LocalDeployment`),
submits a run of many short rounds and, once round 1 is recorded, sends SIGTERM to the
SuperLink. The run's ``flwr-serverapp`` outlives it (it retries its SuperLink with Flower's
back-off, at most 20 s apart). After ``--down`` seconds (default 10) the SuperLink is started
again with the same command, port and database; the script then polls every 50 ms until the
orphaned ServerApp has exited and the run folder's ``run.lock`` can be taken, and reports
whether the orphan recorded any round after the restart. Prints one line per repeat (seconds
after the restart) and stops everything it started; ``--out`` also writes one JSON record of
every repeat (with the machine, torch and Flower versions, the date and the command) there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from deploy_cluster import LocalDeployment
from measure_serverapp_exit import _lock_free, _serverapps, start_long_run

from fedshard_lab.experiments.launch import _alive


def _rounds(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return max((json.loads(x)["round"] for x in lines if x.strip()), default=-1)


def measure_once(root: Path, down_s: float) -> dict[str, float]:
    results = root / "results"
    with LocalDeployment(root / "deploy") as dep:
        start_long_run(dep, results)
        link = dep.link
        assert link is not None
        metrics = results / "exit" / "metrics.jsonl"
        apps = _serverapps(dep)
        assert len(apps) == 1, apps
        cmd = (dep.root / "superlink.cmd").read_text().split()
        os.kill(link.popen.pid, signal.SIGTERM)
        link.popen.wait(timeout=120)
        at_stop = _rounds(metrics)
        time.sleep(down_s)
        times: dict[str, float] = {"alive-before-restart": float(_alive(apps[0]))}
        dep.link = dep._start("superlink-again", cmd, link.port)
        dep._wait_listening(dep.link, 60.0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 240 and len(times) < 3:
            now = time.monotonic() - t0
            if "serverapp" not in times and not _alive(apps[0]):
                times["serverapp"] = now
            if "lock" not in times and _lock_free(results / "exit"):
                times["lock"] = now
            time.sleep(0.05)
        times["rounds-after-restart"] = float(_rounds(metrics) - at_stop)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repeats", nargs="?", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    repeats, down_s = args.repeats, 10.0
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, python {platform.python_version()}, down {down_s:g} s")
    runs = []
    for i in range(repeats):
        with tempfile.TemporaryDirectory(prefix="superlink-restart-") as tmp:
            times = measure_once(Path(tmp), down_s)
        print(f"repeat {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
        runs.append(times)
    if args.out is not None:
        import flwr
        from machine import emit, provenance

        emit({**provenance(), "flwr": flwr.__version__, "down-s": down_s,
              "after-restart-s": runs}, args.out)


if __name__ == "__main__":
    main()
