"""examples/quickstart-pytorch/after: 2 rounds on 4 simulated nodes (in-process grid) at the
project's own lr, on local Fashion-MNIST; accuracy improves. And a flwr-datasets partitioner
over the same local files feeding dict samples to handle_train."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import adoption_diff
import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid
from flwr.app import Context, RecordDict

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart-pytorch" / "after"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not (FMNIST / "t10k-labels-idx1-ubyte.gz").exists(),
                                  reason=f"Fashion-MNIST idx files not in {FMNIST}")


def test_the_diffs_shown_are_the_real_change() -> None:
    """The adoption diff in the example's README, on the integration page and in the
    repository's README is before/ -> after/, line for line, and the count they give is it
    (a line replaced by one counts once: per difflib opcode, the longer side)."""
    changed, removed, added = adoption_diff.changes(EXAMPLE.parent / "before", EXAMPLE)
    pages = {"example README": (EXAMPLE.parent / "README.md").read_text(),
             "integration.md": (ROOT / "docs" / "integration.md").read_text(),
             "README.md": (ROOT / "README.md").read_text()}
    for name, text in pages.items():
        block = re.search(r"```diff\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
        lines = block.splitlines()
        assert {x[1:].strip() for x in lines if x.startswith("-")} == removed, name
        assert {x[1:].strip() for x in lines if x.startswith("+")} == added, name
    for name in ("example README", "integration.md", "README.md"):
        assert f"{changed} changed lines" in pages[name].replace("\n", " "), name
    assert changed <= 10  # the printed recipe: at most ten lines


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m.startswith("pytorchexample")]:
        monkeypatch.delitem(sys.modules, name)
    task = importlib.import_module("pytorchexample.task")
    monkeypatch.setattr(task, "MAX_EXAMPLES", 6000)
    monkeypatch.chdir(tmp_path)
    return task


@needs_fmnist
def test_after_example_trains_two_rounds_at_the_projects_lr(example) -> None:  # type: ignore[no-untyped-def]
    import tomllib

    client = importlib.import_module("pytorchexample.client_app")
    server = importlib.import_module("pytorchexample.server_app")
    run_config = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
        "config"]
    run_config["num-server-rounds"] = 2
    assert run_config["lr"] == 0.01  # the project's own learning rate, unchanged
    grid = InProcessGrid(client.app, [{"partition-id": i, "num-partitions": 4} for i in range(4)],
                         run_config=run_config)
    replies: list = []
    grid.tamper = dict.fromkeys(grid.contexts, lambda r: replies.append(r) or r)
    torch.manual_seed(0)
    initial = example.Net()
    torch.manual_seed(0)
    server.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                              run_config=run_config))
    # every node's own SGD applied the client rules it was handed (the nodes' receipts: the
    # optimizer that stepped the factors, at the project's lr, and how many steps)
    trained = [r for r in replies if r.metadata.message_type == "train"]
    assert trained and not any(r.has_error() for r in trained)
    sent = {m.content["config"]["lr"] for m in grid.sent if m.metadata.message_type == "train"}
    assert {r.content["config"]["trained-optimizer"] for r in trained} == {"SGD"}
    assert {r.content["config"]["trained-lr"] for r in trained} == sent
    assert all(r.content["config"]["trained-steps"] > 0 for r in trained)
    final = example.Net()
    final.load_state_dict(torch.load("final_model.pt"))
    test = example.load_centralized_dataset(2000)
    _, acc0 = example.test(initial, test, "cpu")
    _, acc2 = example.test(final, test, "cpu")
    assert acc2 > acc0 + 0.2, (acc0, acc2)


@needs_fmnist
def test_flwr_datasets_partitioner_over_local_files() -> None:
    datasets = pytest.importorskip("datasets", reason="flwr-datasets extra not installed")
    partitioner_mod = pytest.importorskip("flwr_datasets.partitioner",
                                          reason="flwr-datasets extra not installed")
    import gzip

    from flwr.app import ArrayRecord, ConfigRecord, Message
    from flwr.clientapp import ClientApp
    from torch import nn
    from torch.utils.data import DataLoader

    from fedshard import SpectralSharding, handle_query, handle_train
    from fedshard import protocol as P

    with gzip.open(FMNIST / "t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)[:400]
    with gzip.open(FMNIST / "t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)[:400]
    ds = datasets.Dataset.from_dict({"image": list(images), "label": labels.astype(np.int64)})
    part = partitioner_mod.IidPartitioner(num_partitions=4)
    part.dataset = ds

    def to_tensors(batch: dict) -> dict:
        batch["image"] = [torch.tensor(np.asarray(x), dtype=torch.float32)[None] / 255
                          for x in batch["image"]]
        return batch

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 16),
                             nn.ReLU(), nn.Linear(16, 10))

    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Context) -> Message:
        return handle_query(msg, 0.5)

    @app.train()
    def _t(msg: Message, context: Context) -> Message:
        p = part.load_partition(int(context.node_config["partition-id"]))
        loader = DataLoader(p.with_transform(to_tensors), batch_size=20, shuffle=True)
        return handle_train(msg, model(), loader)

    grid = InProcessGrid(app, [{"partition-id": i} for i in range(4)])
    s = SpectralSharding.from_model(model(), lr=0.01, fraction_evaluate=0.0)
    result = s.start(grid=grid, initial_arrays=ArrayRecord(model().state_dict()), num_rounds=1,
                     train_config=ConfigRecord())
    assert s.history[1]["replies-used"] == 4
    assert result.train_metrics_clientapp[1][P.NUM_EXAMPLES] == 400
