"""Run a whole simulation in this process: :func:`run_engine`.

The run is :func:`fedshard.app.run.run_server`'s, the ServerApp's whole job (strategy, rounds,
central evaluation, results, checkpoints, resume), driven over an :class:`EngineGrid` of
``num_nodes`` simulated nodes instead of ``flwr run``'s SuperLink and Ray workers.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedshard.app.config import RunConfig
from fedshard.app.run import run_server
from fedshard.app.task import build_model, resolve_device
from fedshard_lab.engine.clients import DataSource, simulated_nodes
from fedshard_lab.engine.grid import EngineGrid, SequentialTrainer, Trainer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

__all__ = ["ENGINES", "app_run_config", "engine_grid", "run_engine"]

#: The in-process engines: clients one after another, or batched per sub-model shape.
ENGINES = ("sequential", "batched")


def engine_grid(cfg: RunConfig, num_nodes: int, *, engine: str = "sequential",
                device: str | None = None, data: DataSource | None = None) -> EngineGrid:
    """The grid of ``num_nodes`` simulated nodes that ``engine`` trains.

    Parameters
    ----------
    cfg : RunConfig
        The run.
    num_nodes : int
        Simulated nodes (partition ``i`` of ``num_nodes`` each; ``num-partitions`` must be
        equal, as for ``flwr run``'s ``num-supernodes``).
    engine : {"sequential", "batched"}
        ``"sequential"``: each client with fedshard's handler, one after another.
        ``"batched"``: the clients of a round whose sub-models have the same shapes as one
        vectorized model (:mod:`fedshard_lab.engine.batched`).
    device : str, optional
        Where the nodes train (default: the run's ``client-device``).
    data : DataSource, optional
        A node's training data by ``(partition-id, num-partitions)`` (default: the run's).

    Raises
    ------
    ValueError
        For an unknown ``engine`` or a bad ``num_nodes``.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: expected one of {', '.join(ENGINES)} (or "
                         "'flower' through the experiment runner); nothing was run")
    dev = device or resolve_device(cfg.client_device)
    model = build_model(cfg)
    trainer: Trainer
    if engine == "batched":
        from fedshard_lab.engine.batched import BatchedTrainer

        trainer = BatchedTrainer(model, cfg, dev)
    else:
        trainer = SequentialTrainer(model, cfg, dev)
    return EngineGrid(cfg, simulated_nodes(cfg, num_nodes), model, trainer=trainer, device=dev,
                      data=data)


def run_engine(cfg: RunConfig, num_nodes: int, *, engine: str = "sequential",
               device: str | None = None, server_device: str | None = None,
               data: DataSource | None = None) -> dict[str, Any]:
    """Run the simulation ``cfg`` describes in this process; returns the run's summary
    (what :func:`fedshard.app.run.run_server` returns). See :func:`engine_grid`;
    ``server_device`` overrides ``server-device``."""
    grid = engine_grid(cfg, num_nodes, engine=engine, device=device, data=data)
    return run_server(grid, cfg, device=server_device)


def app_run_config(app_dir: Path | str, overrides: Mapping[str, Any]) -> RunConfig:
    """The app's run-config defaults (``[tool.flwr.app.config]`` of ``app_dir``'s
    ``pyproject.toml``) updated by ``overrides``, validated: what ``flwr run`` hands the
    ServerApp.

    Raises
    ------
    FileNotFoundError
        If ``app_dir`` has no ``pyproject.toml``.
    fedshard.app.config.ConfigError
        Listing every problem of the merged configuration.
    """
    pyproject = Path(app_dir) / "pyproject.toml"
    if not pyproject.is_file():
        raise FileNotFoundError(f"{pyproject}: no such file; give the Flower app's folder "
                                "(the one whose pyproject.toml has [tool.flwr.app.config])")
    data = tomllib.loads(pyproject.read_text())
    defaults = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    return RunConfig.from_mapping({**defaults, **overrides})
