"""The simulated nodes of an in-process engine: each node's identity, keep ratio and data,
prepared once for the whole run.

The Flower path builds a node's data set in its ClientApp for every message (the partition is
cached per process, its tensors are not); the engine reads each partition once, holds its
examples as two tensors on the training device and hands every round's training the same
tensors, batched and shuffled exactly as :func:`fedshard.client.train.batches.batches_for`
would batch the data set itself (so the numbers do not change).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from fedshard.app.config import RunConfig
from fedshard.app.task import declared_keep_ratio, node_partition
from fedshard.client.train.batches import TENSOR_BATCHES_MAX_BYTES, HasTensors

__all__ = ["DataSource", "SimulatedNode", "simulated_nodes"]

#: A node's training data by ``(partition-id, num-partitions)``; default
#: :func:`fedshard.app.task.client_dataset` of the run config.
DataSource = Callable[[int, int], Dataset[Any]]


@dataclass
class SimulatedNode:
    """One simulated node of an engine run.

    Attributes
    ----------
    node_id : int
        Its id on the engine's grid.
    node_config : dict
        What a simulated SuperNode's node config holds (``partition-id``, ``num-partitions``).
    keep_ratio : float or None
        Its declared keep ratio (:func:`fedshard.app.task.declared_keep_ratio`); ``None`` when
        the declaration failed (then ``keep_ratio_error`` says why, and its query reply is an
        error, as the ClientApp's would be).
    keep_ratio_error : str or None
        Why it declares none.
    data : Dataset or None
        Its training data, loaded on first use: a ``TensorDataset`` of ``(inputs, targets)`` on
        the training device when the data set gives its examples as tensors (fedshard's own
        data sets do), the data set itself otherwise.
    """

    node_id: int
    node_config: dict[str, Any]
    keep_ratio: float | None
    keep_ratio_error: str | None = None
    data: Dataset[Any] | None = None

    @property
    def partition_id(self) -> int:
        """The node's ``partition-id`` (its stable key)."""
        return int(self.node_config["partition-id"])

    def training_data(self, cfg: RunConfig, source: DataSource,
                      device: str | torch.device) -> Dataset[Any]:
        """The node's training data, read once and kept (see :attr:`data`)."""
        if self.data is None:
            pid, num = node_partition(cfg, self.node_config)
            self.data = _held(source(pid, num), device)
        return self.data


def _held(dataset: Dataset[Any], device: str | torch.device) -> Dataset[Any]:
    """``dataset``'s examples as a ``TensorDataset`` on ``device`` when it gives them as
    tensors and they fit :data:`TENSOR_BATCHES_MAX_BYTES` (the limit
    :func:`~fedshard.client.train.batches.batches_for` applies), else ``dataset``."""
    if not isinstance(dataset, HasTensors):
        return dataset
    inputs, targets = dataset.example_tensors()
    size = inputs.element_size() * inputs.nelement() + targets.element_size() * targets.nelement()
    if size > TENSOR_BATCHES_MAX_BYTES:
        return dataset
    return TensorDataset(inputs.to(device), targets.to(device))


def simulated_nodes(cfg: RunConfig, num_nodes: int, *,
                    first_node_id: int = 1) -> list[SimulatedNode]:
    """``num_nodes`` simulated nodes, partition ``i`` of ``num_nodes`` each.

    Raises
    ------
    ValueError
        If ``num_nodes`` is not a whole number ``≥ 1``.
    """
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r}: expected an int ≥ 1 (the number of "
                         "simulated nodes); no engine was built")
    nodes = []
    for i in range(num_nodes):
        config: dict[str, Any] = {"partition-id": i, "num-partitions": num_nodes}
        try:  # what the ClientApp checks before it answers the query
            node_partition(cfg, config)
            ratio: float | None = declared_keep_ratio(cfg, config)
            error = None
        except ValueError as err:
            ratio, error = None, str(err)
        nodes.append(SimulatedNode(first_node_id + i, config, ratio, error))
    return nodes
