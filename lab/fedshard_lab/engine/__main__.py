"""``python -m fedshard_lab.engine [APP_DIR] --num-nodes N [--run-config ...] [--engine ...]``.

Runs a fedshard simulation in this process (:func:`fedshard_lab.engine.run_engine`) with the
app's run-config defaults and the overrides given as ``flwr run --run-config`` takes them (a
TOML file, or ``"key=value key=value"``). Exit codes: 0 done, 1 the run failed, 2 invalid
configuration (nothing was run).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from logging import ERROR
from pathlib import Path

from flwr.common.config import parse_config_args
from flwr.common.logger import log

from fedshard.app.config import ConfigError
from fedshard_lab.engine.run import ENGINES, app_run_config, run_engine


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m fedshard_lab.engine",
        description="Run a fedshard simulation in this process: the same strategy, messages, "
        "results and checkpoints as `flwr run`, the clients trained here.")
    parser.add_argument("app_dir", nargs="?", type=Path, default=Path("."),
                        help="the Flower app (folder of its pyproject.toml; default: .)")
    parser.add_argument("--num-nodes", type=int, required=True,
                        help="simulated nodes (flwr run's num-supernodes)")
    parser.add_argument("--run-config", action="append", default=None, metavar="CONFIG",
                        help="run-config overrides: a TOML file (e.g. a preset) or \"key=value "
                        "key=value\" (as flwr run --run-config); repeatable, a later one wins")
    parser.add_argument("--engine", choices=ENGINES, default="sequential",
                        help="sequential: clients one after another (fastest on a CPU); "
                        "batched: clients of equal sub-model shapes as one vectorized model "
                        "(for GPUs)")
    parser.add_argument("--device", default=None,
                        help="where the clients train (default: the run's client-device)")
    args = parser.parse_args(argv)
    try:
        overrides: dict[str, object] = {}
        for given in args.run_config or []:  # in order, a later one wins (a file, then k=v)
            overrides.update(parse_config_args([given]))
        cfg = app_run_config(args.app_dir, overrides)
        if args.num_nodes < 1:
            raise ValueError(f"--num-nodes={args.num_nodes}: expected ≥ 1")
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}; nothing was run", file=sys.stderr)
        return 2
    try:
        summary = run_engine(cfg, args.num_nodes, engine=args.engine, device=args.device)
    except Exception:
        log(ERROR, "the run failed (engine %s):\n%s", args.engine, traceback.format_exc())
        return 1
    print(json.dumps({"engine": args.engine, "results": str(cfg.results_path),
                      **{k: v for k, v in summary.items() if isinstance(v, (int, float, str))}}),
          flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
