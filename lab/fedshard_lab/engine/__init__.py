"""In-process simulation engines: a round's messages answered in this process, behind the same
strategy and the same Messages as ``flwr run`` (``docs/simulation.md``, "Engines").

``sequential`` trains the clients one after another with fedshard's handlers; ``batched``
trains the clients whose sub-models have the same shapes as one vectorized model
(:mod:`fedshard_lab.engine.batched`). Both run fedshard's own ClientApp recipe only: a
user-defined ClientApp, and deployment, go through ``flwr run``.
"""

from fedshard_lab.engine.clients import DataSource, SimulatedNode, simulated_nodes
from fedshard_lab.engine.grid import EngineGrid, SequentialTrainer, Trainer, TrainJob
from fedshard_lab.engine.run import ENGINES, app_run_config, engine_grid, run_engine

__all__ = [
    "ENGINES",
    "DataSource",
    "EngineGrid",
    "SequentialTrainer",
    "SimulatedNode",
    "TrainJob",
    "Trainer",
    "app_run_config",
    "engine_grid",
    "run_engine",
    "simulated_nodes",
]
