"""The end-of-run summary of what sharding bought, checked against independent counts: the
bytes of the real messages the grid carried, the element counts of the MLP's arrays, FLOPs
counted by hand, and a reference run's summary.json."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Message
from flwr.common.logger import FLOWER_LOGGER as flwr_logger

W = 32  # the MLP's width: layers 784-32-32-32-10, the two 32x32 layers sharded (N = 32)
RATIOS = {0.25: 8, 0.5: 16}  # keep ratio -> n = ceil(32 r) terms per sharded layer


def _array_bytes(msg: Message) -> int:
    """Serialized Array data in a message's ArrayRecords (what went over the wire)."""
    return sum(len(a.data) for rec in msg.content.array_records.values() for a in rec.values())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import fakedata
    from flower_grid import InProcessGrid

    import client_app
    from fedshard.app.config import RunConfig
    from fedshard.app.run import run_server

    root = tmp_path_factory.mktemp("savings")
    fakedata.write_fashion_mnist(root / "data", 120, 40, np.random.default_rng(0))
    out = root / "out"
    (out / "dense").mkdir(parents=True)
    (out / "dense" / "summary.json").write_text(json.dumps({"final-test-accuracy": 0.25}))
    cfg = {"dataset": "fashion-mnist", "data-dir": str(root / "data"), "model": "mlp",
           "model-width": W, "keep-ratios": "0.25:0.5,0.5:0.5", "num-server-rounds": 2,
           "num-partitions": 4, "min-available-nodes": 4, "fraction-train": 1.0,
           "batch-size": 8, "results-dir": str(out), "run-name": "sharded",
           "test-max-examples": 20, "seed": 5, "reference-run": "dense"}
    nodes = [{"partition-id": i, "num-partitions": 4} for i in range(4)]
    grid = InProcessGrid(client_app.app, nodes, cfg)
    replies: list[tuple[int, int]] = []  # (node, reply bytes)

    def record(node: int) -> Any:
        def keep(reply: Message) -> Message:
            replies.append((node, _array_bytes(reply)))
            return reply
        return keep

    for node in grid.contexts:
        grid.tamper[node] = record(node)
    with _captured() as lines:
        run_server(grid, RunConfig.from_mapping(cfg))
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    ratio_of = {m.metadata.dst_node_id: float(m.content["config"]["keep-ratio"]) for m in train}
    return {"summary": json.loads((out / "sharded" / "summary.json").read_text()),
            "metrics": [json.loads(x) for x in
                        (out / "sharded" / "metrics.jsonl").read_text().splitlines()],
            "train": train, "replies": replies, "ratio_of": ratio_of, "log": lines}


class _captured:
    """Flower's log lines while the block runs."""

    def __enter__(self) -> list[str]:
        self.lines: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore[method-assign]
        flwr_logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc: object) -> None:
        flwr_logger.removeHandler(self.handler)


def _dense_elements() -> int:
    # Linear(784, W) + 3 LayerNorm(W) (weight, bias) + 2 Linear(W, W) + Linear(W, 10)
    return 784 * W + W + 3 * 2 * W + 2 * (W * W + W) + W * 10 + 10


def test_bytes_per_client_equal_the_messages_sent_and_received(run: dict[str, Any]) -> None:
    clients = run["summary"]["sharding"]["clients"]
    assert set(clients) == {"r0.25", "r0.5"}
    for r in RATIOS:
        down = [_array_bytes(m) for m in run["train"]
                if run["ratio_of"][m.metadata.dst_node_id] == r]
        up = [b for node, b in run["replies"] if run["ratio_of"][node] == r]
        assert len(down) == 4 and len(up) == 4  # 2 nodes at each ratio, 2 rounds
        assert clients[f"r{r:g}"]["bytes-received"] == pytest.approx(np.mean(down), rel=1e-12)
        assert clients[f"r{r:g}"]["bytes-sent"] == pytest.approx(np.mean(up), rel=1e-12)


def test_bytes_match_the_arrays_counted_by_hand(run: dict[str, Any]) -> None:
    # every array travels as a .npy file: its raw bytes plus a 128-byte header (format 1.0,
    # padded to a multiple of 64) for these short shape descriptions
    header = 128
    dense = 4 * _dense_elements() + 14 * header  # 4 Linear (weight, bias) + 3 LayerNorm (2)
    sharding = run["summary"]["sharding"]
    assert sharding["dense"]["bytes"] == dense
    for r, n in RATIOS.items():
        # each sharded W (W x W float32) is replaced by U, V (W x n float32 each) and the
        # int64 indices (n); the server also sends ω (n float32), the node does not return it
        down = dense + 2 * (-4 * W * W + 4 * (2 * W * n + n) + 8 * n + 3 * header)
        up = dense + 2 * (-4 * W * W + 4 * (2 * W * n) + 8 * n + 2 * header)
        c = sharding["clients"][f"r{r:g}"]
        assert c["bytes-received"] == pytest.approx(down, rel=1e-12), r
        assert c["bytes-sent"] == pytest.approx(up, rel=1e-12), r
        assert c["bytes-received-ratio"] == pytest.approx(down / dense)
        assert c["bytes-sent-ratio"] == pytest.approx(up / dense)


def test_forward_flops_counted_by_hand(run: dict[str, Any]) -> None:
    sharding = run["summary"]["sharding"]
    dense = 2 * (784 * W + 2 * W * W + W * 10)  # 2 per multiply-add of each Linear
    assert sharding["dense"]["forward-flops"] == dense
    for r, n in RATIOS.items():
        # a sharded layer: x V (W -> n) then (U ω) (n -> W)
        sub = 2 * (784 * W + 2 * (W * n + n * W) + W * 10)
        c = sharding["clients"][f"r{r:g}"]
        assert c["forward-flops"] == sub, r
        assert c["forward-flops-ratio"] == pytest.approx(sub / dense)


def test_accuracy_against_the_reference_run(run: dict[str, Any]) -> None:
    ref = run["summary"]["sharding"]["reference"]
    final = [r["test-accuracy"] for r in run["metrics"] if "test-accuracy" in r][-1]
    assert ref["final-test-accuracy"] == 0.25
    assert ref["final-test-accuracy-here"] == final
    assert ref["accuracy-difference"] == pytest.approx(final - 0.25)
    assert ref["run"].endswith("/dense") and ref["problem"] is None


def test_the_summary_is_logged(run: dict[str, Any]) -> None:
    line = next(x for x in run["log"] if x.startswith("what sharding bought"))
    assert "r = 0.25: received" in line and "r = 0.5: received" in line
    assert "at r = 1" in line and "points" in line


def test_the_round_line_and_the_summary_name_one_direction_with_one_word(
        run: dict[str, Any]) -> None:
    """"received" is what a node received (server -> node), "sent" what it sent back, in the
    round lines as in the summary line: checked against the train messages the grid carried."""
    dense = run["summary"]["sharding"]["dense"]["bytes"]
    down = np.mean([_array_bytes(m) for m in run["train"]]) / dense  # every node, every round
    rounds = [x for x in run["log"] if x.startswith(("round 1/", "round 2/"))]  # trained
    assert len(rounds) == 2, run["log"]
    for line in rounds:
        found = re.search(r"\| nodes received ([0-9.]+)x dense \|", line)
        assert found, line
        assert float(found.group(1)) == pytest.approx(down, abs=5e-4), line
        assert " sent " not in line, line
    summary = next(x for x in run["log"] if x.startswith("what sharding bought"))
    for r in RATIOS:
        received = np.mean([_array_bytes(m) for m in run["train"]
                            if run["ratio_of"][m.metadata.dst_node_id] == r])
        assert f"r = {r:g}: received {received / 1e6:.3g} MB" in summary, (r, summary)


def test_an_unreadable_reference_is_named_not_fatal(tmp_path: Path) -> None:
    from fedshard.app.savings import reference_summary

    missing = reference_summary("nowhere", tmp_path)
    assert missing["final-test-accuracy"] is None
    assert "nowhere/summary.json cannot be read" in missing["problem"]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text('{"final-test-accuracy": null}')
    broken = reference_summary(str(tmp_path / "broken"), Path("/elsewhere"))
    assert "holds no final-test-accuracy (found None)" in broken["problem"]


def test_flops_of_a_convolution_by_hand() -> None:
    from fedshard.app.savings import forward_flops

    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 5))
    # conv: each of 4 x 6 x 6 outputs is 3 x 3 x 3 multiply-adds; then a 144 -> 5 Linear
    assert forward_flops(conv, torch.zeros(1, 3, 8, 8)) == 2 * (4 * 36 * 27 + 144 * 5)
    assert not math.isnan(forward_flops(conv, torch.zeros(1, 3, 8, 8)))


def test_a_resumed_run_may_name_another_reference_run_but_not_another_lr() -> None:
    from fedshard.app.checkpoint import RESUME_MAY_CHANGE, Checkpoint
    from fedshard.app.config import RunConfig

    saved = RunConfig().as_dict()
    ckpt = Checkpoint(server_round=2, arrays={}, config=saved)
    ckpt.check_config({**saved, "reference-run": "dense-r1"}, ignore=RESUME_MAY_CHANGE)
    with pytest.raises(ValueError, match=r"Cannot resume: .*lr"):
        ckpt.check_config({**saved, "lr": 0.5}, ignore=RESUME_MAY_CHANGE)
