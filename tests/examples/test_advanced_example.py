"""examples/advanced-pytorch: a Flower project with its own FedAvg subclass (own ``start()``,
lr halving in ``configure_train``), a personal classification head in ``context.state`` and
flwr-datasets Dirichlet partitions, adopted in at most 13 changed lines of Python (5 of them
hand the project's own SGD to the client rules: its ``train()`` builds the optimizer).

``after/`` runs on 10 simulated nodes (in-process grid, the first 3000 training and test
examples of local Fashion-MNIST, 3 rounds) at the project's own lr 0.1; the checks are
independent of fedshard's code: the global model is re-evaluated from the files the project
saved, the lr is the one the project's own ``train`` was called with, the heads are compared
with what the server sent.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import adoption_diff
import numpy as np
import pytest
import tomllib
import torch
from flower_grid import InProcessGrid
from flwr.app import Context, RecordDict

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "advanced-pytorch"
RECIPES = ROOT / "docs" / "integration-recipes.md"  # the page that shows the example's diff
FMNIST = Path("/usr/share/datasets/fashion-mnist")
MAX_CHANGED_LINES = 13
HEAD = "classification-head"


def changes() -> tuple[int, set[str], set[str]]:
    return adoption_diff.changes(EXAMPLE / "before", EXAMPLE / "after")


def shown_diffs() -> dict[str, str]:
    """The diff blocks of the example's README and of its section of the integration pages
    (docs/integration-recipes.md, "More worked examples")."""
    readme = (EXAMPLE / "README.md").read_text()
    page = RECIPES.read_text()
    section = page[page.index("advanced-pytorch"):]
    return {"README": re.search(r"```diff\n(.*?)```", readme, re.S).group(1),  # type: ignore[union-attr]
            "docs": re.search(r"```diff\n(.*?)```", section, re.S).group(1)}  # type: ignore[union-attr]


def test_adoption_changes_at_most_ten_lines_through_the_public_api() -> None:
    changed, removed, added = changes()
    assert 0 < changed <= MAX_CHANGED_LINES, changed
    fedshard_imports = [line for line in added if "fedshard" in line and "import" in line]
    assert fedshard_imports and all(line.startswith("from fedshard import ") for line in
                                    fedshard_imports), fedshard_imports
    for name, block in shown_diffs().items():  # the diff shown is the real one, line for line
        lines = block.splitlines()
        assert {x[1:].strip() for x in lines if x.startswith("-")} == removed, name
        assert {x[1:].strip() for x in lines if x.startswith("+")} == added, name
    page = RECIPES.read_text()
    for text in ((EXAMPLE / "README.md").read_text(), page[page.index("advanced-pytorch"):]):
        assert f"{changed} changed lines" in text  # the number the docs give


@pytest.fixture
def project(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """after/'s package, freshly imported, on the first 3000 examples of each split."""
    if not (FMNIST / "t10k-labels-idx1-ubyte.gz").exists():
        pytest.skip(f"Fashion-MNIST idx files not in {FMNIST}")
    pytest.importorskip("flwr_datasets", reason="flwr-datasets extra not installed")
    monkeypatch.syspath_prepend(str(EXAMPLE / "after"))
    for name in [m for m in sys.modules if m.split(".")[0] == "advanced_pytorch"]:
        monkeypatch.delitem(sys.modules, name)
    task = importlib.import_module("advanced_pytorch.task")
    monkeypatch.setattr(task, "MAX_EXAMPLES", 3000)
    monkeypatch.chdir(tmp_path)
    return task


def test_after_example_trains_at_its_own_lr_with_its_start_schedule_and_personal_heads(
        project, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    task = project
    client = importlib.import_module("advanced_pytorch.client_app")
    server = importlib.import_module("advanced_pytorch.server_app")
    strategy = importlib.import_module("advanced_pytorch.strategy")
    run_config = tomllib.loads((EXAMPLE / "after" / "pyproject.toml").read_text())[
        "tool"]["flwr"]["app"]["config"]
    assert run_config["lr"] == 0.1  # the project's own learning rate, unchanged
    run_config["num-server-rounds"] = 3
    # the project halves the lr at round 5; round 2 here, to see it in 3 rounds
    monkeypatch.setattr(strategy.CustomFedAvg, "lr_decay_round", 2)

    calls: list[dict] = []  # what the project's own train() was given and left
    real_train = client.train_fn

    def spy(net, trainloader, epochs, lr, device, attach=None):  # type: ignore[no-untyped-def]
        entry = net.head.weight.detach().clone()
        loss = real_train(net, trainloader, epochs, lr, device, attach)
        calls.append({"lr": lr, "entry": entry, "exit": net.head.weight.detach().clone(),
                      "attach": attach})
        return loss

    monkeypatch.setattr(client, "train_fn", spy)
    grid = InProcessGrid(client.app, [{"partition-id": i, "num-partitions": 10}
                                      for i in range(10)], run_config=run_config)
    torch.manual_seed(0)
    server.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                              run_config=run_config))

    # start() saved the results and the best model, in the project's own output folder
    (out,) = (tmp_path / "outputs").glob("*/*")
    results = json.loads((out / "results.json").read_text())
    acc = {r["round"]: r["evaluate_metrics_serverapp"]["accuracy"] for r in results}
    assert sorted(acc) == [0, 1, 2, 3]
    assert acc[3] > 0.25 and acc[3] > acc[0] + 0.15, acc  # chance is 0.1
    best = task.Net()
    best.load_state_dict(torch.load(out / "best_model.pt"))
    _, best_acc = task.test(best, task.load_centralized_dataset(), "cpu")
    assert best_acc == pytest.approx(max(acc[r] for r in (1, 2, 3)))
    assert (out / "final_model.pt").exists()

    # the lr halving reached the nodes' own train(): 0.1 in round 1, 0.05 from round 2
    train_msgs = [m for m in grid.sent if m.metadata.message_type == "train"]
    sent = [(m.content["config"]["server-round"], m.content["config"]["lr"]) for m in train_msgs]
    assert {lr for r, lr in sent if r == 1} == {0.1}
    assert {lr for r, lr in sent if r > 1} == {0.05}
    assert sorted(c["lr"] for c in calls) == sorted(lr for _, lr in sent)

    # the heads stay personal: a node trains from its own head, never the averaged one
    nodes = [m.metadata.dst_node_id for m in train_msgs]
    assert len(calls) == len(nodes)  # every sampled node trained
    # ... with its own shard's client rules handed the project's SGD (one rule set each)
    owners = [getattr(c["attach"], "__self__", None) for c in calls]
    assert all(type(o).__name__ == "ClientRules" and o.report().steps > 0 for o in owners)
    assert len({id(o) for o in owners}) == len(owners)
    again = [i for i, n in enumerate(nodes) if n in nodes[:i]]
    assert again, "no node was sampled twice; the check needs one"
    for i in again:
        last = max(j for j in range(i) if nodes[j] == nodes[i])
        sent_head = torch.as_tensor(train_msgs[i].content["arrays"]["head.weight"].numpy())
        assert torch.equal(calls[i]["entry"], calls[last]["exit"])
        assert not torch.equal(calls[i]["entry"], sent_head)
    for node, context in grid.contexts.items():
        if node in nodes:  # the head it keeps is the one it trained last
            last = max(j for j, n in enumerate(nodes) if n == node)
            kept = context.state[HEAD].to_torch_state_dict()["weight"]
            assert torch.equal(kept, calls[last]["exit"])
        else:
            assert HEAD not in context.state.array_records
    heads = [np.asarray(c.state[HEAD].to_torch_state_dict()["weight"])
             for c in grid.contexts.values() if HEAD in c.state.array_records]
    assert len(heads) >= 2 and not np.allclose(heads[0], heads[1])


def test_after_example_that_trains_nothing_stops_with_an_error(project) -> None:  # type: ignore[no-untyped-def]
    """The project's own start() never calls SpectralSharding.start(); given num_rounds, the
    strategy still ends a run in which no node ever trained with an error, at its last round
    (without it, this 2-round run would finish and save an empty final model)."""
    client = importlib.import_module("advanced_pytorch.client_app")
    server = importlib.import_module("advanced_pytorch.server_app")
    run_config = tomllib.loads((EXAMPLE / "after" / "pyproject.toml").read_text())[
        "tool"]["flwr"]["app"]["config"]
    run_config["num-server-rounds"] = 2
    grid = InProcessGrid(client.app, [{"partition-id": i, "num-partitions": 10}
                                      for i in range(10)], run_config=run_config)
    grid.silent = set(grid.contexts)  # they answer the keep-ratio query, never a train message
    with pytest.raises(RuntimeError, match=r"No round trained: none of the 2 round\(s\)"):
        server.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                  run_config=run_config))
    assert not list(Path("outputs").glob("*/*/final_model.pt"))
