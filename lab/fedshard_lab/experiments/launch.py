"""Launch ``flwr run`` simulations in isolation, and stop every process they start.

``flwr run`` (Flower 1.42) starts a detached local SuperLink that outlives it. This module gives
each launch its own ``FLWR_HOME`` and ports, runs the app with ``--stream``, and afterwards
terminates that SuperLink and all its descendants (SuperExec, the simulation process, Ray) by PID.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ENGINES", "SimulationRun", "free_port", "kill_tree", "launcher_for",
           "processes_matching", "processes_with_env", "run_engine_simulation", "run_simulation",
           "toml_value"]

#: How a suite's runs are executed: ``flwr run`` (Ray, the default), or fedshard's in-process
#: engines (:mod:`fedshard_lab.engine`: clients one after another, or batched).
ENGINES = ("flower", "sequential", "batched")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimulationRun:
    """Outcome of one ``flwr run``: exit code, combined output, wall time."""

    returncode: int
    output: str
    wall_s: float


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal (strings quoted, bools lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"run-config value {value!r}: expected bool, int, float or str")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def processes_matching(*needles: str) -> list[int]:
    """PIDs whose command line contains every one of ``needles``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmd for n in needles):
            pids.append(int(entry.name))
    return pids


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs whose environment has ``name=value`` (inherited by every descendant of a launch)."""
    needle = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env:
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    """Running or stopped, not gone and not a zombie (a zombie only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_tree(pid: int, *, grace_s: float = 5.0) -> None:
    """SIGTERM ``pid`` and all its descendants, SIGKILL what is left after ``grace_s``."""
    tree = _children()
    family, todo = [], [pid]
    while todo:
        p = todo.pop()
        family.append(p)
        todo.extend(tree.get(p, []))
    for p in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in family):
        time.sleep(0.1)
    for p in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_simulation(
    app_dir: Path,
    run_config: Mapping[str, Any],
    *,
    num_supernodes: int,
    flwr_home: Path | None = None,
    client_num_cpus: int = 1,
    timeout_s: float = 3600.0,
    on_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
    client_num_gpus: float = 0.0,
) -> SimulationRun:
    """``flwr run <app_dir> --stream`` with its own FLWR_HOME and ports; always cleans up.

    The run-config overrides are written to a TOML file next to ``flwr_home``. Each line of
    output is passed to ``on_line`` as it arrives. The local SuperLink started for this run,
    and everything under it, is stopped by PID before returning, also on error or timeout.
    ``client_num_gpus`` is Ray's GPU share per ClientApp (e.g. 0.25: four clients per GPU at
    once); with it > 0 each ClientApp sees its GPU as ``cuda:0``.
    """
    home = Path(flwr_home) if flwr_home else Path(tempfile.mkdtemp(prefix="fedshard-flwr-"))
    home.mkdir(parents=True, exist_ok=True)
    overrides = home / "run-config.toml"
    overrides.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
    http_port, control_port = free_port(), free_port()
    child_env = dict(os.environ)
    child_env.update({
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    })
    # `flwr run` starts `flower-superlink` by name: find it in this environment's bin/ even
    # when the environment is not activated (`/path/to/venv/bin/python -m ...`).
    bin_dir = str(Path(sys.executable).parent)
    child_env["PATH"] = os.pathsep.join([bin_dir, child_env.get("PATH", "")]).rstrip(os.pathsep)
    child_env.update(env or {})
    flwr = str(Path(sys.executable).with_name("flwr"))
    cmd = [flwr, "run", str(app_dir), "--stream", "--run-config", str(overrides),
           "--federation-config",
           f"num-supernodes={num_supernodes} client-resources-num-cpus={client_num_cpus} "
           f"client-resources-num-gpus={float(client_num_gpus)}"]
    logger.info("launching: %s (FLWR_HOME=%s, port %d)", " ".join(cmd), home, http_port)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)

    def stop_all() -> None:
        if proc.poll() is None:
            kill_tree(proc.pid)
        for pid in processes_matching("flower-superlink", str(home)):
            kill_tree(pid)
        # Anything else started for this launch (Ray workers re-parented to init, say) still
        # carries its FLWR_HOME in the environment.
        for pid in processes_with_env("FLWR_HOME", str(home)):
            kill_tree(pid)

    returncode, output = _follow(proc, stop_all, timeout_s, on_line, "flwr run")
    return SimulationRun(returncode, output, time.monotonic() - start)


def run_engine_simulation(
    app_dir: Path,
    run_config: Mapping[str, Any],
    *,
    num_supernodes: int,
    engine: str = "sequential",
    flwr_home: Path | None = None,
    client_num_cpus: int = 1,
    timeout_s: float = 3600.0,
    on_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
    client_num_gpus: float = 0.0,
) -> SimulationRun:
    """The run through fedshard's in-process engine: ``python -m fedshard_lab.engine`` in a
    process of its own (:mod:`fedshard_lab.engine`), the same strategy, Messages, results and
    checkpoints as :func:`run_simulation`, without the SuperLink and Ray.

    The arguments are :func:`run_simulation`'s; ``engine`` is ``"sequential"`` or
    ``"batched"``. ``flwr_home`` only holds the run-config file; ``client_num_cpus`` and
    ``client_num_gpus`` are Ray's and not used (the process trains where the run config's
    ``client-device`` says). The process and anything it started are stopped by PID on
    return, also on error or timeout.
    """
    if engine not in ENGINES[1:]:
        raise ValueError(f"engine={engine!r}: expected one of {', '.join(ENGINES[1:])} here "
                         "(run_simulation runs 'flower'); nothing was launched")
    home = Path(flwr_home) if flwr_home else Path(tempfile.mkdtemp(prefix="fedshard-engine-"))
    home.mkdir(parents=True, exist_ok=True)
    overrides = home / "run-config.toml"
    overrides.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
    cmd = [sys.executable, "-m", "fedshard_lab.engine", str(app_dir), "--num-nodes",
           str(num_supernodes), "--run-config", str(overrides), "--engine", engine]
    child_env = {**os.environ, "FEDSHARD_ENGINE_HOME": str(home), **(env or {})}
    logger.info("launching: %s", " ".join(cmd))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=child_env, cwd=str(app_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)

    def stop_all() -> None:
        if proc.poll() is None:
            kill_tree(proc.pid)
        for pid in processes_with_env("FEDSHARD_ENGINE_HOME", str(home)):
            kill_tree(pid)

    returncode, output = _follow(proc, stop_all, timeout_s, on_line, f"the {engine} engine")
    return SimulationRun(returncode, output, time.monotonic() - start)


def _follow(proc: subprocess.Popen[str], stop_all: Callable[[], None], timeout_s: float,
            on_line: Callable[[str], None] | None, what: str) -> tuple[int, str]:
    """``proc``'s exit status and output, read to its end (each line also to ``on_line``).

    A launch that hangs without printing must time out too: a watchdog calls ``stop_all``
    (which stops every process of the launch, closing the pipe and so ending the read) after
    ``timeout_s`` and a ``TimeoutError`` naming ``what`` is raised. ``stop_all`` runs at the
    end either way.
    """
    lines: list[str] = []
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        stop_all()

    watchdog = threading.Timer(timeout_s, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))
            if expired.is_set():
                break
        if expired.is_set():
            raise TimeoutError(f"{what} exceeded {timeout_s:.0f} s; its processes were stopped")
        returncode = proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        stop_all()
    return returncode, "".join(lines)


def launcher_for(engine: str) -> Callable[..., SimulationRun]:
    """The launcher of ``engine`` (:data:`ENGINES`): :func:`run_simulation` for
    ``"flower"``, :func:`run_engine_simulation` for the in-process engines.

    Raises
    ------
    ValueError
        For an engine not in :data:`ENGINES`.
    """
    if engine == "flower":
        return run_simulation
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {', '.join(ENGINES)}; nothing "
                         "was launched")
    return functools.partial(run_engine_simulation, engine=engine)
