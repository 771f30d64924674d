"""A keep ratio from a device's memory, on a capped device: a SuperNode (and the ClientApp
processes it starts) in a memory-capped cgroup (Linux cgroup v1, ``memory.limit_in_bytes``),
a SuperLink and ``flwr run`` outside it, on 127.0.0.1. The dense model's training in the
capped node fails for memory; the same model, sharded at the keep ratio the node chose from
``memory-mb``, trains its rounds and replies. Skipped, with the reason, where the machine has
no writable cgroup v1 memory controller (it needs root)."""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_cluster import LocalDeployment

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
CGROUP = Path("/sys/fs/cgroup/memory")
CAP_MB = 1800
#: ResNet-18 at width 128 on 28×28 images, batch 32: the dense model's training needs about
#: 2.1 GB in the ClientApp process, the sharded model's at r ≤ 0.3 in low-memory mode well
#: under 1.5 GB (torch and Flower themselves about 0.7 GB).
RUN = {"model": "resnet18", "model-width": 128, "batch-size": 32, "local-epochs": 1,
       "max-steps": 2, "num-server-rounds": 2, "fraction-train": 1.0,
       "min-available-nodes": 1, "num-partitions": 1000, "test-max-examples": 32,
       "eval-every": 0, "round-timeout": 120.0, "keep-ratios": "0.5"}

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not FMNIST.is_dir(), reason="needs `apt-get install dataset-fashion-mnist` "
                       "(.ci/run installs it)"),
]


@pytest.fixture
def capped() -> Iterator[Path]:
    if not (CGROUP / "cgroup.procs").exists():
        pytest.skip(f"no cgroup v1 memory controller at {CGROUP} (cgroup v2 or none): the "
                    "capped-device test needs memory.limit_in_bytes")
    group = CGROUP / f"fedshard-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(CAP_MB * 2**20))
    except OSError as err:
        pytest.skip(f"cannot create a capped cgroup under {CGROUP} ({err}): it needs root")
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (CGROUP / "cgroup.procs").write_text(pid)
        group.rmdir()


def _cap(group: Path, pid: int) -> None:
    """``pid`` and what it starts from now on run under the cap."""
    (group / "cgroup.procs").write_text(str(pid))


def _node_id(log: str) -> str:
    match = re.search(r"SuperNode ID: (\d+)", log)
    assert match, log[-2000:]
    return match.group(1)


def _wait_offline(dep: LocalDeployment, node_id: str, timeout_s: float = 120.0) -> None:
    """Until the SuperLink no longer counts the stopped node as online."""
    deadline = time.monotonic() + timeout_s
    while any(str(n.get("node-id")) == node_id and n.get("status") == "online"
              for n in dep.supernodes()):
        assert time.monotonic() < deadline, f"node {node_id} still online after {timeout_s} s"
        time.sleep(2.0)


def _resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_capped_supernode_trains_sharded_what_it_cannot_train_dense(
        tmp_path: Path, capped: Path) -> None:
    results = tmp_path / "results"
    with LocalDeployment(tmp_path / "deploy") as dep:
        dep.start_superlink()
        node = dep.start_supernode("dense-node", {"keep-ratio": 1.0, "data-dir": str(FMNIST),
                                                  "partition-id": 0})
        _cap(capped, node.popen.pid)
        dep.wait_online(1)
        # what the ClientApp process may use: the cap less the SuperNode process itself
        budget = int(CAP_MB - _resident_mb(node.popen.pid) - 50)
        dense = dep.run_app(ROOT, {**RUN, "method": "none", "results-dir": str(results),
                                   "run-name": "dense"}, timeout_s=400)
        # the ClientApp process was killed for memory: its reply never came, no round trained
        summary = json.loads((results / "dense" / "summary.json").read_text())
        assert summary["status"] == "failed" and not summary["rounds-trained"], summary
        assert "ClientApp stopped responding" in dense.stdout, dense.stdout[-3000:]
        assert int((capped / "memory.failcnt").read_text()) > 0  # the cap was reached
        dense_id = _node_id(node.output())
        node.popen.terminate()
        node.popen.wait(30)
        dep.nodes.remove(node)
        _wait_offline(dep, dense_id)

        # The same device, declaring its memory instead of a keep ratio.
        node = dep.start_supernode("memory-node", {"data-dir": str(FMNIST), "partition-id": 0,
                                                     "memory-mb": budget})
        _cap(capped, node.popen.pid)
        dep.wait_online(1)
        sharded = dep.run_app(ROOT, {**RUN, "method": "collective", "results-dir": str(results),
                                     "run-name": "memory"}, timeout_s=400)
        assert sharded.returncode == 0, sharded.stdout[-3000:] + dep.tails()
        summary = json.loads((results / "memory" / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["rounds-trained"] == 2, summary
        log = node.output()
        match = re.search(rf"memory-mb={budget}: keep ratio ([0-9.]+)", log)
        assert match, node.tail()
        chosen = float(match.group(1))
        assert 0 < chosen < 1
        assert f"keep ratio {chosen:g} chosen from memory-mb={budget}" in sharded.stdout
    (by_memory,) = summary["nodes-by-memory"]
    assert (by_memory["keep-ratio"], by_memory["memory-mb"]) == (chosen, budget), by_memory
    rows = [json.loads(r) for r in (results / "memory" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["replies-used"] == 1 for r in rows[1:]), rows
    assert all(f"bytes-sent-ratio-r{chosen:g}" in r for r in rows[1:]), rows
