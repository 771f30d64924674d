"""README's first run, measured: ``flwr run . --federation-config "num-supernodes=10
client-resources-num-cpus=1" --stream`` with the app's default run config (only the results
folder added), on the Ray backend, as README's "Set up and run" command starts it.

Records the wall time of the run (not the install), every round's log line, the line on what
sharding bought, the final test accuracy, each WARNING line of the run's log, and the honest
nodes the spread bound named at WARNING (every node of this run is honest) beside those it
would have named when every node beyond 2κ times the round's median change was warned, with
the machine, torch and Flower versions and the date. Prints one JSON object; ``--out FILE``
also writes it.

Usage: ``python benchmarks/first_run.py --out results/first-run/first-run.json``; with
Flower's default federation (plain ``flwr run .``: 2 SuperNodes, 2 CPUs each):
``python benchmarks/first_run.py --nodes 2 --cpus 2 --out results/first-run/flower-defaults.json``;
the default of the previous release (the MLP 256 wide, 7 rounds, r = 0.2 / 0.4):
``python benchmarks/first_run.py --set model-width=256 --set num-server-rounds=7
--set "keep-ratios='0.2:0.6,0.4:0.4'" --out results/first-run/previous-default.json``
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import flwr  # noqa: E402
from machine import cpu_name, emit  # noqa: E402

from fedshard_lab.experiments.launch import run_simulation  # noqa: E402

NODES = 10  # README's num-supernodes
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _plain(line: str) -> str:
    """A log line without colours and Flower's level prefix (``INFO :      ``)."""
    return re.sub(r"^(INFO|WARNING|ERROR|DEBUG)\s*:\s*", "", _ANSI.sub("", line)).strip()


def measure(nodes: int = NODES, cpus: int = 1,
            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of README's first command (``nodes`` SuperNodes, ``cpus`` CPUs per
    ClientApp, ``overrides`` of the run config); its record."""
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fedshard-first-run-") as tmp:
        start = time.perf_counter()
        run = run_simulation(ROOT, {**(overrides or {}), "results-dir": f"{tmp}/results",
                                    "run-name": "first-run"},
                             num_supernodes=nodes, flwr_home=Path(tmp) / "flwr-home",
                             client_num_cpus=cpus, timeout_s=1800, on_line=lines.append)
        wall = time.perf_counter() - start
        summary_path = Path(tmp) / "results" / "first-run" / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    plain = [_ANSI.sub("", x) for x in lines]
    warnings = [_plain(x) for x in plain if x.lstrip().startswith("WARNING")]
    rounds = [_plain(x) for x in plain if re.match(r"^\S*\s*:?\s*round \d+/\d+ \|", _plain(x))]
    bought = next((i for i, x in enumerate(plain) if "what sharding bought" in x), None)
    named = {int(n) for w in warnings
             for n in re.findall(r"node (\d+) changed more than max-update-spread", w)}
    # the rule before evidence was asked for: every node beyond 2κ (κ = 2) was warned
    spread_info = [x for x in plain if "largest change over the median:" in x]
    beyond = {int(n) for x in spread_info
              for n, e in re.findall(r"(\d+): ([0-9.e+]+)x", x.split("median:", 1)[1])
              if float(e) > 4.0} | named
    # and every node with a term in another balance or sign (now INFO unless a whole layer)
    realigned = {int(n) for x in plain
                 for n in re.findall(r"node (\d+) returned terms in another sign", x)}
    return {
        "command": f"flwr run . --federation-config \"num-supernodes={nodes} "
                   f"client-resources-num-cpus={cpus}\" --stream (results-dir, run-name added)",
        "returncode": run.returncode,
        "status": summary.get("status"),
        "run-wall-s": round(wall, 1),
        "final-test-accuracy": summary.get("final-test-accuracy"),
        "round-lines": rounds,
        "sharding-bought": [_plain(plain[bought])] if bought is not None else [],
        "clients": (summary.get("sharding") or {}).get("clients"),
        "warnings": warnings,
        "honest-nodes-named-at-warning": len(named),
        "honest-nodes-beyond-2-kappa": len(beyond),
        "honest-nodes-realigned": len(realigned),
        "overrides": overrides or {},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--nodes", type=int, default=NODES,
                        help="SuperNodes (README: 10; Flower's default: 2)")
    parser.add_argument("--cpus", type=int, default=1,
                        help="CPUs per ClientApp (README: 1; Flower's default: 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a run-config override (TOML value), e.g. model-width=256")
    args = parser.parse_args()
    overrides = {k: tomllib.loads(f"v = {v}")["v"]
                 for k, _, v in (x.partition("=") for x in args.set)}
    record = {"machine": cpu_name(), "torch": torch.__version__, "flwr": flwr.__version__,
              "date": datetime.date.today().isoformat(),
              **measure(args.nodes, args.cpus, overrides)}
    emit(record, args.out)


if __name__ == "__main__":
    main()
