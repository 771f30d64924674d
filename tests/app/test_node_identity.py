"""A deployed device's identity is its own: fedshard's ClientApp declares the node-key a device
gives, a simulated node's partition id, and never a deployed device's partition id; a device
with its own data needs no partition arguments. Three devices configured as the deployment
docs say (keep-ratio and data-dir, no partition) declare no shared key."""

from __future__ import annotations

from typing import Any

import pytest
from flower_grid import InProcessGrid

import client_app
from fedshard import protocol as P
from fedshard.app.config import RunConfig
from fedshard.app.task import node_partition


def _declared(node_configs: list[dict[str, Any]]) -> list[P.Capabilities]:
    grid = InProcessGrid(client_app.app, node_configs, run_config={})
    replies = grid.send_and_receive([P.query_message(n) for n in grid.contexts])
    out = []
    for reply in replies:
        caps, reason = P.read_capabilities(reply)
        assert caps is not None, reason
        out.append(caps)
    return out


def test_devices_following_the_docs_never_share_a_key(tmp_path: Any) -> None:
    devices = [{"keep-ratio": r, "data-dir": str(tmp_path / f"d{i}")}
               for i, r in enumerate((0.1, 0.2, 0.1))]
    keys = [c.key for c in _declared(devices)]
    assert len(set(keys)) == 3  # the server falls back on each node's own identity
    # devices that followed the earlier advice for their own data: all partition 0 of 1
    own = [{**d, "partition-id": 0, "num-partitions": 1} for d in devices]
    assert len({c.key for c in _declared(own)}) == 3
    # the documented one-machine trial: devices sharing one data set by partition
    shared = [{"keep-ratio": 0.1, "data-dir": str(tmp_path), "partition-id": i,
               "num-partitions": 3} for i in range(3)]
    assert len({c.key for c in _declared(shared)}) == 3
    # a device that names itself keeps that name at every launch; a simulated node is its
    # partition
    named = _declared([{"keep-ratio": 0.1, "node-key": "lab-7"},
                       {"partition-id": 4, "num-partitions": 10}])
    assert sorted(c.key for c in named) == ["4", "lab-7"]


def test_a_device_with_its_own_data_trains_all_of_it() -> None:
    cfg = RunConfig()  # num-partitions 10: the simulated federation's split
    assert node_partition(cfg, {"keep-ratio": 0.2, "data-dir": "/data"}) == (0, 1)
    assert node_partition(cfg, {"keep-ratio": 0.2, "partition-id": 2,
                                "num-partitions": 3}) == (2, 3)
    assert node_partition(cfg, {"partition-id": 4, "num-partitions": 10}) == (4, 10)
    with pytest.raises(ValueError, match="num-partitions=10, but this simulation has 4"):
        node_partition(cfg, {"partition-id": 1, "num-partitions": 4})
