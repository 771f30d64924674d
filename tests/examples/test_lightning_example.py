"""examples/lightning-pytorch: a Flower project whose model, loop and optimizer belong to PyTorch
Lightning (a ``LightningModule`` autoencoder that owns its Adam, trained by ``Trainer.fit``),
adopted in at most 10 changed lines of Python.

``after/`` runs 2 rounds on 4 simulated nodes (in-process grid, two nodes at r = 0.25 and two
at r = 0.5, 1000 local Fashion-MNIST examples per partition). The checks are independent of
fedshard's own accounting: the bytes are counted from the train messages the strategy sent,
ClipLR's work from the replies the nodes sent, the training from the reconstruction error of
the model the project saved, computed here with plain torch.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from pathlib import Path

import adoption_diff
import pytest
import tomllib
import torch
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, Context, Message, RecordDict
from torch.optim.optimizer import register_optimizer_step_pre_hook

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning-pytorch"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
PACKAGE = "pytorchlightning_example"
MAX_CHANGED_LINES = 10
NOT_APPLIED = "The client rules were not applied"


def changes() -> tuple[int, set[str], set[str]]:
    return adoption_diff.changes(EXAMPLE / "before", EXAMPLE / "after")


def test_adoption_changes_at_most_ten_lines_through_the_public_api() -> None:
    changed, removed, added = changes()
    assert 0 < changed <= MAX_CHANGED_LINES, changed
    fedshard_imports = [line for line in added if "fedshard" in line and "import" in line]
    assert fedshard_imports and all(line.startswith("from fedshard import ") for line in
                                    fedshard_imports), fedshard_imports
    # the Lightning parts are untouched: the module and its Adam (task.py), the Trainer; the
    # one line that names the optimizer wraps the module's own configure_optimizers
    before = adoption_diff.python_files(EXAMPLE / "before")
    after = adoption_diff.python_files(EXAMPLE / "after")
    assert before["pytorchlightning_example/task.py"] == after["pytorchlightning_example/task.py"]
    assert not any("lightning" in line.lower() or "Trainer" in line or "optim" in line
                   for line in removed)
    assert [line for line in added if "lightning" in line.lower() or "Trainer" in line
            or "optim" in line] == ["model.configure_optimizers = "
                                    "shard.rules.attaching(model.configure_optimizers)"]
    readme = (EXAMPLE / "README.md").read_text()
    block = re.search(r"```diff\n(.*?)```", readme, re.S).group(1)  # type: ignore[union-attr]
    lines = block.splitlines()  # the diff shown is the real one, line for line
    assert {x[1:].strip() for x in lines if x.startswith("-")} == removed
    assert {x[1:].strip() for x in lines if x.startswith("+")} == added
    assert f"{changed} changed lines" in readme  # the number the README gives


@pytest.fixture
def project(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """after/'s package, freshly imported, on the first 1000 examples of each partition."""
    if not (FMNIST / "t10k-labels-idx1-ubyte.gz").exists():
        pytest.skip(f"Fashion-MNIST idx files not in {FMNIST}")
    pytest.importorskip("lightning", reason="lightning (the test extra) not installed")
    monkeypatch.syspath_prepend(str(EXAMPLE / "after"))
    for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
        monkeypatch.delitem(sys.modules, name)
    task = importlib.import_module(f"{PACKAGE}.task")
    monkeypatch.setattr(task, "MAX_EXAMPLES", 1000)
    monkeypatch.chdir(tmp_path)
    return task


def array_bytes(record: ArrayRecord) -> int:
    return sum(len(array.data) for array in record.values())


@torch.no_grad()
def reconstruction_error(model: torch.nn.Module, loader) -> float:  # type: ignore[no-untyped-def]
    """Mean squared error per pixel over the loader, by hand (not the project's own loss)."""
    model.eval()
    total, count = 0.0, 0
    for images, _ in loader:
        x = images.flatten(1)
        x_hat = model.decoder(model.encoder(x))
        total += float(((x_hat - x) ** 2).sum())
        count += x.numel()
    return total / count


def test_after_example_shards_lightnings_adam_run_and_trains(
        project, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    task = project
    client = importlib.import_module(f"{PACKAGE}.client_app")
    server = importlib.import_module(f"{PACKAGE}.server_app")
    run_config = tomllib.loads((EXAMPLE / "after" / "pyproject.toml").read_text())[
        "tool"]["flwr"]["app"]["config"]
    assert run_config["keep-ratios"] == "0.25:0.5,0.5:0.5"
    run_config.update({"num-server-rounds": 2, "fraction-train": 1.0})  # every node, each round
    grid = InProcessGrid(client.app, [{"partition-id": i, "num-partitions": 4}
                                      for i in range(4)], run_config=run_config)
    replies: list[Message] = []

    def keep(reply: Message) -> Message:
        replies.append(reply)
        return reply

    grid.tamper = dict.fromkeys(grid.contexts, keep)
    steps: list[tuple[str, int, float]] = []  # every optimizer step: class, tensors, lr
    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: steps.append(
        (type(opt).__name__,  # the trainable tensors it holds (ω, frozen, is held, not trained)
         sum(p.requires_grad for g in opt.param_groups for p in g["params"]),
         opt.param_groups[0]["lr"])))
    torch.manual_seed(0)
    initial = task.LitAutoEncoder()
    torch.manual_seed(0)  # the server's global model starts from the same weights
    try:
        with caplog.at_level(logging.INFO):
            server.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                      run_config=run_config))
    finally:
        hook.remove()

    # (1) what each keep ratio receives: the train messages' arrays against the dense model's
    dense = array_bytes(ArrayRecord(initial.state_dict()))
    train_msgs = [m for m in grid.sent if m.metadata.message_type == "train"]
    received: dict[float, list[float]] = {}
    for m in train_msgs:
        ratio = m.content["config"]["keep-ratio"]
        received.setdefault(ratio, []).append(array_bytes(m.content["arrays"]) / dense)
    assert sorted(received) == [0.25, 0.5] and all(len(v) == 4 for v in received.values())
    for r, shares in received.items():  # two nodes a round, two rounds
        assert max(shares) <= (1 + r) / 2, (r, shares)
    assert max(received[0.25]) < 0.3 and max(received[0.5]) < 0.6, received
    # a clean run: no warning (what sharding saves, the lr, the client rules, the replies)
    # but the one the README explains: Unbiased's ω > 1 in a model without normalization
    warned = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING
              and "has no normalization layer" not in rec.getMessage()]
    assert not warned, warned

    # (2) the only optimizer was the module's own Adam, built by Lightning at the module's lr,
    # the lr the server sent, and it stepped the sub-model (10 trainable tensors: u, v, bias of
    # the 2 sharded layers, weight and bias of the 2 dense ones; the dense model has 8); ClipLR
    # acted on every node under it, and no round went without the client rules
    per_fit = -(-600 // 32)  # 600 training examples a node (60 % of 1000), batches of 32
    assert steps == [("Adam", 10, 1e-3)] * (8 * per_fit), sorted(set(steps))
    assert {m.content["config"]["lr"] for m in train_msgs} == {1e-3}
    assert len(replies) == 8 and not any(r.has_error() for r in replies)
    terms = [r.content["metrics"]["clip-lr-terms"] for r in replies]
    assert all(t > 0 for t in terms), terms
    assert not [w for w in warned if NOT_APPLIED in w]
    # the nodes' receipts say the same as the hook saw
    assert {(r.content["config"]["trained-optimizer"], r.content["config"]["trained-steps"])
            for r in replies} == {("Adam", per_fit)}

    # (3) the model trains: the reconstruction error of the saved model against round 0's
    final = task.LitAutoEncoder()
    final.load_state_dict(torch.load("final_model.pt"))
    test = task.load_centralized_dataset(2000)
    before, after = reconstruction_error(initial, test), reconstruction_error(final, test)
    assert after < 0.6 * before, (before, after)
