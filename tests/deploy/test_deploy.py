"""Deployment on 127.0.0.1: a SuperLink, three SuperNodes declaring their keep ratio in
``--node-config``, ``flwr run . <connection>``; every started process is stopped by PID.

The sub-model each node received is checked against sizes computed here from the model's layer
shapes and the paper's n = ⌈r·N⌉, not against numbers produced by fedshard.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from deploy_cluster import LocalDeployment

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
KEEP_RATIOS = (0.1, 0.2, 0.4)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not FMNIST.is_dir(), reason="needs `apt-get install dataset-fashion-mnist` "
                       "(.ci/run installs it)"),
]

# MLP 784→32→32→32→10 with LayerNorm after each hidden Linear (model="mlp", model-width=32):
# Linear weight/bias and LayerNorm weight/bias shapes in state_dict order. The two 32×32 Linear
# layers in the middle are sharded (all affine layers but the first and the last), N = 32.
WIDTH = 32
DENSE_SHAPES = [
    (WIDTH, 784), (WIDTH,), (WIDTH,), (WIDTH,),
    (WIDTH, WIDTH), (WIDTH,), (WIDTH,), (WIDTH,),
    (WIDTH, WIDTH), (WIDTH,), (WIDTH,), (WIDTH,),
    (10, WIDTH), (10,),
]
NUM_SHARDED, N = 2, WIDTH


def npy_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """Size of an array on the wire: Flower's ``Array`` carries ``np.save`` bytes."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype=dtype), allow_pickle=False)
    return len(buf.getvalue())


def expected_sent_bytes(keep_ratio: float) -> int:
    """Bytes of one node's train ``ArrayRecord`` for keep ratio r: every dense entry, and per
    sharded layer U (32, n), V (32, n), ω (n,) float32 and the indices (n,) int64 instead of
    its 32×32 weight."""
    n = math.ceil(keep_ratio * N)
    dense = sum(npy_bytes(s, "float32") for s in DENSE_SHAPES)
    factors = 2 * npy_bytes((WIDTH, n), "float32") + npy_bytes((n,), "float32") \
        + npy_bytes((n,), "int64")
    return dense - NUM_SHARDED * npy_bytes((WIDTH, WIDTH), "float32") + NUM_SHARDED * factors


def expected_returned_bytes(keep_ratio: float) -> int:
    """Bytes a node sends back (``np.save`` bytes, as for the sent records): the same entries
    without ω."""
    n = math.ceil(keep_ratio * N)
    return expected_sent_bytes(keep_ratio) - NUM_SHARDED * npy_bytes((n,), "float32")


def test_expected_sizes_follow_the_keep_ratio() -> None:
    # n = ⌈r·32⌉ = 4, 7, 13: each extra term costs 2·(32+32)·4 + 2·(4+8) bytes over both layers
    sizes = [expected_sent_bytes(r) for r in KEEP_RATIOS]
    assert sizes[1] - sizes[0] == 3 * (2 * 2 * WIDTH * 4 + 2 * 12)
    assert sizes[2] - sizes[1] == 6 * (2 * 2 * WIDTH * 4 + 2 * 12)
    assert sizes[0] < sizes[1] < sizes[2] < sum(npy_bytes(s, "float32") for s in DENSE_SHAPES)


def test_three_supernodes_train_the_submodel_of_their_declared_keep_ratio(tmp_path: Path) -> None:
    results = tmp_path / "results"
    with LocalDeployment(tmp_path / "deploy") as dep:
        dep.start_superlink()
        for i, ratio in enumerate(KEEP_RATIOS):
            dep.start_supernode(f"node-{i}", {
                "keep-ratio": ratio,
                "data-dir": str(FMNIST),
                "partition-id": i,
                "num-partitions": 30,  # 2 000 examples per node: a fast round
            })
        online = {n["node-id"] for n in dep.wait_online(3)}
        run = dep.run_app(ROOT, {
            "model": "mlp", "model-width": WIDTH, "num-server-rounds": 2, "fraction-train": 1.0,
            "min-available-nodes": 3, "num-partitions": 30, "test-max-examples": 200,
            "batch-size": 64, "round-timeout": 180.0,
            # The simulation fallback mixture holds none of the deployed ratios: a node that
            # ignored its --node-config would show up as r = 0.5.
            "keep-ratios": "0.5",
            "results-dir": str(results), "run-name": "deploy",
        }, timeout_s=300)
        logs = dep.tails()
        assert run.returncode == 0, run.stdout[-5000:] + "\n" + logs

        # Each SuperNode answered one capability query and trained in both rounds, without error.
        node_ids = set()
        for node in dep.nodes:
            out = node.output()
            assert node.count("Receiving: query message") == 1, node.tail()
            assert node.count("Receiving: train message") == 2, node.tail()
            assert node.count("Sending: train message") == 2, node.tail()
            assert "Traceback" not in out and "ERROR" not in out, node.tail()
            match = re.search(r"SuperNode ID: (\d+)", out)
            assert match, node.tail()
            node_ids.add(match.group(1))
        assert node_ids == online
    # Everything started for the deployment is gone, also what its processes started.
    assert dep.leftovers() == []
    assert all(p.popen.poll() is not None for p in [dep.link, *dep.nodes] if p is not None)

    rows = [json.loads(line) for line in (results / "deploy" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    dense = sum(npy_bytes(s, "float32") for s in DENSE_SHAPES)
    for row in rows[1:]:
        assert row["nodes-sent"] == 3 and row["replies-used"] == 3, row
        assert row["replies-dropped"] == 0 and row["replies-missing"] == 0, row
        assert row["dense-bytes"] == dense, row
        # One node per keep ratio, so each group's mean is that node's sub-model.
        groups = sorted(k for k in row if k.startswith("bytes-sent-ratio-r"))
        assert groups == [f"bytes-sent-ratio-r{r:g}" for r in KEEP_RATIOS], row
        for r in KEEP_RATIOS:
            sent = row[f"bytes-sent-ratio-r{r:g}"] * row["dense-bytes"]
            assert sent == pytest.approx(expected_sent_bytes(r), abs=0.5), (r, row)
        # What came back has the shapes that were sent (else the reply would be dropped).
        returned = np.mean([expected_returned_bytes(r) for r in KEEP_RATIOS])
        assert row["bytes-received-mean"] == pytest.approx(returned, abs=0.5), row
        assert row["num-examples"] > 0 and math.isfinite(row["train-loss"]), row
    # The aggregated model changed (accuracy after two tiny rounds is too noisy to test here).
    assert rows[2]["test-loss"] != rows[0]["test-loss"], rows


def test_every_process_is_stopped_when_the_test_fails(tmp_path: Path) -> None:
    seen: list[int] = []
    with pytest.raises(RuntimeError, match="simulated failure"), \
            LocalDeployment(tmp_path / "deploy") as dep:
        dep.start_superlink()
        dep.start_supernode("node-0", {"keep-ratio": 0.2})
        dep.wait_online(1)
        seen = dep.leftovers()
        # SuperLink + its SuperExec, SuperNode + its SuperExec, all found by environment
        assert len(seen) >= 4, dep.tails()
        assert {p.popen.pid for p in [dep.link, *dep.nodes] if p is not None} <= set(seen)
        raise RuntimeError("simulated failure")
    assert dep.leftovers() == []
    assert not [pid for pid in seen if _alive(pid)]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_node_without_keep_ratio_logs_exit_code_800_and_is_skipped(tmp_path: Path) -> None:
    """A deployed node whose config lacks ``keep-ratio`` (docs/deployment.md, "A node's log
    says Exit Code: 800"): its ClientApp refuses the server's query, Flower's task process
    exits with 800 while the SuperNode keeps running, and the ServerApp skips the node (with
    the reason) and trains with the others."""
    results = tmp_path / "results"
    with LocalDeployment(tmp_path / "deploy") as dep:
        dep.start_superlink()
        for i, config in enumerate([{"keep-ratio": 0.5}, {"keep-ratio": 0.5}, {}]):
            dep.start_supernode(f"node-{i}", {**config, "data-dir": str(FMNIST),
                                              "partition-id": i, "num-partitions": 60})
        dep.wait_online(3)
        run = dep.run_app(ROOT, {
            "model": "mlp", "model-width": WIDTH, "num-server-rounds": 1,
            "min-available-nodes": 2, "num-partitions": 60, "test-max-examples": 100,
            "batch-size": 64, "results-dir": str(results), "run-name": "no-ratio",
        }, timeout_s=300)
        out = run.stdout
        assert run.returncode == 0, out[-5000:] + "\n" + dep.tails()
        bad = dep.nodes[2]
        assert "Exit Code: 800" in bad.tail(20000), bad.tail()
        assert "keep-ratio" in bad.tail(20000), bad.tail()
        assert bad.popen.poll() is None, bad.tail()  # the SuperNode itself keeps running
        assert "gave no usable keep ratio (error reply" in out, out[-5000:]
    assert dep.leftovers() == []
    rows = [json.loads(x) for x in (results / "no-ratio" / "metrics.jsonl").read_text()
            .splitlines()]
    assert rows[-1]["round"] == 1 and rows[-1]["replies-used"] == 2, rows[-1]
