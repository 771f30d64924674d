"""The integration page's snippets (docs/integration.md, "Use it in your own Flower project"),
the DP-SGD one too (with Opacus, the dp extra), run exactly as printed on simulated
nodes (node config: partition-id/num-partitions only; the keep ratio comes from the run config)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
from flower_grid import InProcessGrid
from flwr.app import Context, RecordDict
from torch import nn
from torch.utils.data import DataLoader, Dataset

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integration.md"


class Net(nn.Module):
    """A user's model: conv → conv → linear → linear (no normalization)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 5, stride=2)
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2)
        self.fc1 = nn.Linear(8 * 5 * 5, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class Dicts(Dataset):
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(20, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (20,), generator=g)

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"img": self.x[i], "label": self.y[i]}


def load_data(partition_id: int, num_partitions: int) -> tuple[DataLoader, DataLoader]:
    loader = DataLoader(Dicts(partition_id), batch_size=8, shuffle=False)
    return loader, loader


def snippets() -> dict[str, str]:
    section = PAGE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return {b.splitlines()[0].lstrip("# ").strip(): b for b in blocks}


@pytest.fixture
def task_module(monkeypatch: pytest.MonkeyPatch) -> None:
    task = types.ModuleType("task")
    task.Net, task.load_data = Net, load_data  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "task", task)


DP_CLIENT = "client_app.py, DP-SGD with Opacus"


def test_readme_has_the_four_snippets() -> None:
    assert set(snippets()) == {"server_app.py", "client_app.py",
                               "client_app.py, your own training loop", DP_CLIENT}


@pytest.mark.parametrize("client", ["client_app.py", "client_app.py, your own training loop",
                                    DP_CLIENT])
def test_integration_snippets_train_on_simulated_nodes(client: str, task_module: None) -> None:
    if client == DP_CLIENT:
        pytest.importorskip("opacus")  # the dp extra (in the test extra)
    server_ns: dict = {}
    client_ns: dict = {}
    exec(compile(snippets()["server_app.py"], "integration.md:server_app.py", "exec"), server_ns)
    exec(compile(snippets()[client], f"integration.md:{client}", "exec"), client_ns)
    run_config = {"num-server-rounds": 2, "keep-ratio": 0.5}
    grid = InProcessGrid(client_ns["app"],
                         [{"partition-id": i, "num-partitions": 4} for i in range(4)],
                         run_config=run_config)
    replies: list = []
    send = grid.send_and_receive

    def spy(messages, *, timeout=None):  # type: ignore[no-untyped-def]
        out = list(send(messages, timeout=timeout))
        replies.extend(out)
        return out

    grid.send_and_receive = spy  # type: ignore[method-assign]
    server_ns["main"](grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                    run_config=run_config))
    train = [m for m in replies if m.metadata.message_type == "train"]
    assert len(train) == 4  # 2 rounds x fraction 0.5 of 4 nodes, every query answered
    for reply in train + [m for m in replies if m.metadata.message_type == "query"]:
        assert not reply.has_error(), reply.error.reason
    assert all(any(k.endswith(".indices") for k in m.content["arrays"]) for m in train)
    private = [m.content["config"].get("trained-dp-sgd", False) for m in train]
    assert private == [client == DP_CLIENT] * len(train)
    if client == DP_CLIENT:
        assert {m.content["config"]["trained-noise-multiplier"] for m in train} == {1.1}


def test_keep_ratio_error_names_what_to_set(task_module: None) -> None:
    from fedshard import keep_ratio_of

    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(),
                  run_config={})
    with pytest.raises(ValueError, match=r"declares no keep ratio: expected 'keep-ratio' in its "
                                         r"node config"):
        keep_ratio_of(ctx)
    assert keep_ratio_of(ctx, default=0.3) == 0.3
    ctx.run_config["keep-ratio"] = 0.4
    assert keep_ratio_of(ctx, default=0.3) == 0.4
    ctx.node_config["keep-ratio"] = 0.2
    assert keep_ratio_of(ctx) == 0.2
    ctx.node_config["keep-ratio"] = 1.5
    with pytest.raises(ValueError, match=r"node config keep-ratio"):
        keep_ratio_of(ctx)
