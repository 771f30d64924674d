"""A deployed device's identity is its own: fedshard's ClientApp declares the node-key a device
gives, a simulated node's partition id, and never a deployed device's partition id; a device
with its own data needs no partition arguments. Three devices configured as the deployment
docs say (keep-ratio and data-dir, no partition) declare no shared key."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.config import parse_config_args
from flwr.proto.node_pb2 import NodeInfo
from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

import client_app
from fedshard import protocol as P
from fedshard.app.config import RunConfig
from fedshard.app.run import build_strategy
from fedshard.app.task import build_model, node_partition
from fedshard.protocol.capabilities import MAX_NODE_KEY
from fedshard.server.nodes import NodeDirectory

DOCS = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"


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
    cfg = RunConfig.from_mapping({"num-partitions": 10})  # the simulated federation's split
    assert node_partition(cfg, {"keep-ratio": 0.2, "data-dir": "/data"}) == (0, 1)
    assert node_partition(cfg, {"keep-ratio": 0.2, "partition-id": 2,
                                "num-partitions": 3}) == (2, 3)
    assert node_partition(cfg, {"partition-id": 4, "num-partitions": 10}) == (4, 10)
    with pytest.raises(ValueError, match="num-partitions=10, but this simulation has 4"):
        node_partition(cfg, {"partition-id": 1, "num-partitions": 4})


# ------------------------------------------------------------------ the server side of identity
class AuthenticatedGrid(InProcessGrid):
    """A grid whose nodes carry public keys, as a SuperLink reports them (``Grid.get_nodes``)."""

    def __init__(self, node_configs: list[dict[str, Any]], keys: list[bytes]) -> None:
        super().__init__(client_app.app, node_configs, run_config={})
        self.keys = dict(zip(self.contexts, keys, strict=True))

    def get_nodes(self) -> Iterable[NodeInfo]:
        return [NodeInfo(node_id=n, public_key=k) for n, k in self.keys.items()]


def _pem() -> bytes:
    return public_key_to_bytes(generate_key_pairs()[1])


def _docs_devices(data_dir: Path) -> list[dict[str, Any]]:
    """The node configs of docs/deployment.md's SuperNode commands (step 4), parsed as
    ``flower-supernode --node-config`` parses them, with the data folder moved to
    ``data_dir``."""
    text = DOCS.read_text()
    section = text[text.index("## 4. SuperNodes"):text.index("## 5. Run")]
    configs = [parse_config_args([c]) for c in re.findall(r'--node-config "([^"]+)"', section)]
    assert len(configs) >= 3, configs
    return [{**c, "data-dir": str(data_dir)} for c in configs]


def _train_seeds(grid: InProcessGrid) -> dict[int, int]:
    """Each node's training seed in round 1's train messages of fedshard's strategy."""
    cfg = RunConfig.from_mapping({"model": "mlp", "model-width": 16,
                                  "min-available-nodes": len(grid.contexts)})
    model = build_model(cfg)
    strategy = build_strategy(cfg, model)
    messages = strategy.configure_train(1, ArrayRecord(model.state_dict()), ConfigRecord(), grid)
    return {m.metadata.dst_node_id: P.TrainSettings.from_record(m.content[P.CONFIG]).train_seed
            for m in messages}


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> Any:
    logging.getLogger("flwr").addHandler(caplog.handler)
    yield caplog
    logging.getLogger("flwr").removeHandler(caplog.handler)


def test_a_keyless_device_is_known_by_the_public_key_it_authenticated_with(
        tmp_path: Path, flower_logs: pytest.LogCaptureFixture) -> None:
    devices = _docs_devices(tmp_path)
    keys = [_pem() for _ in devices]
    grid = AuthenticatedGrid(devices, keys)
    directory = NodeDirectory(seed=0, min_available_nodes=len(devices))
    directory.query(grid, sorted(grid.contexts))
    assert {n: c.key for n, c in directory.capabilities.items()} == \
        {n: k.hex() for n, k in zip(grid.contexts, keys, strict=True)}
    assert len({c.stream for c in directory.capabilities.values()}) == len(devices)
    seeds = _train_seeds(AuthenticatedGrid(devices, keys))
    assert len(seeds) == len(devices) and len(set(seeds.values())) == len(devices)
    assert "declare the same node-key" not in flower_logs.text


def test_a_declared_node_key_wins_over_the_public_key(tmp_path: Path) -> None:
    keys = [_pem(), _pem()]
    grid = AuthenticatedGrid([{"keep-ratio": 0.2, "node-key": "lab-7"}, {"keep-ratio": 0.2}],
                             keys)
    directory = NodeDirectory(seed=0, min_available_nodes=2)
    directory.query(grid, sorted(grid.contexts))
    assert sorted(c.key for c in directory.capabilities.values()) == sorted(["lab-7",
                                                                             keys[1].hex()])


def test_without_public_keys_a_keyless_device_is_its_node_id(
        tmp_path: Path, flower_logs: pytest.LogCaptureFixture) -> None:
    devices = _docs_devices(tmp_path)
    grid = InProcessGrid(client_app.app, devices, run_config={})  # get_nodes: no keys
    directory = NodeDirectory(seed=0, min_available_nodes=len(devices))
    directory.query(grid, sorted(grid.contexts))
    assert {n: c.key for n, c in directory.capabilities.items()} == \
        {n: str(n) for n in grid.contexts}
    assert len(set(_train_seeds(grid).values())) == len(devices)
    assert "declare the same node-key" not in flower_logs.text


def test_two_devices_declaring_one_name_are_warned(
        flower_logs: pytest.LogCaptureFixture) -> None:
    grid = AuthenticatedGrid([{"keep-ratio": 0.2, "node-key": "lab"},
                              {"keep-ratio": 0.2, "node-key": "lab"}], [_pem(), _pem()])
    directory = NodeDirectory(seed=0, min_available_nodes=2)
    directory.query(grid, sorted(grid.contexts))
    assert "Nodes 1000 and 1001 declare the same node-key 'lab'" in flower_logs.text
    assert len(set(_train_seeds(grid).values())) == 1  # what the warning is about


def test_a_public_key_longer_than_a_node_key_may_be_is_known_by_its_digest() -> None:
    huge = b"k" * 5000  # what an unauthenticated SuperNode's credentials could bring
    grid = AuthenticatedGrid([{"keep-ratio": 0.2}, {"keep-ratio": 0.2}], [huge, _pem()])
    directory = NodeDirectory(seed=0, min_available_nodes=2)
    directory.query(grid, sorted(grid.contexts))
    keys = {n: c.key for n, c in directory.capabilities.items()}
    assert keys[1000] == "sha256:" + hashlib.sha256(huge.hex().encode()).hexdigest()
    assert len(keys[1000]) <= MAX_NODE_KEY and keys[1001] == grid.keys[1001].hex()
