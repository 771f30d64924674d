"""The run's side jobs as the strategy's callbacks (fedshard.server.side_jobs,
fedshard.app.callbacks), each against something
independent: a hand-computed loss and accuracy, a hand-truncated weight with known singular
values, the checkpoint file read back, the event file read back by TensorBoard's own reader,
and the evaluation schedule and resumed round numbers written out by hand."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from torch import nn

from fedshard import SpectralSharding
from fedshard.app.callbacks import Checkpointing, MetricsLog
from fedshard.app.checkpoint import Checkpoint
from fedshard.app.results import RunRecorder
from fedshard.client.train.batches import TensorBatches
from fedshard.server.callbacks import RoundCallback, run_end
from fedshard.server.side_jobs import CentralEvaluation, TensorBoardLog

# Four examples of two features; a Linear(2, 3) with W = [[1, 0], [0, 1], [0, 0]], b = 0
# gives logits (x0, x1, 0): predictions 0, 1, 2, 0 against targets 0, 1, 1, 2 (2 of 4 right).
X = torch.tensor([[3.0, 0.0], [0.0, 2.0], [-1.0, -2.0], [1.0, 0.0]])
Y = torch.tensor([0, 1, 1, 2])


def _linear() -> nn.Linear:
    model = nn.Linear(2, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        model.bias.zero_()
    return model


def _hand_loss() -> float:
    """Mean cross-entropy of the four examples above, from the logits written out."""
    logits = [(3, 0, 0), (0, 2, 0), (-1, -2, 0), (1, 0, 0)]
    targets = [0, 1, 1, 2]
    return sum(math.log(sum(math.exp(v) for v in z)) - z[t]
               for z, t in zip(logits, targets, strict=True)) / 4


def _evaluation(model: nn.Module, **kw: object) -> CentralEvaluation:
    args: dict = {"eval_every": 1, "num_rounds": 3}
    args.update(kw)
    # batch size 3: the test set in two batches, so the sums over batches are checked too
    return CentralEvaluation(model, TensorBatches(X, Y, 3), **args)


class Probe(RoundCallback):
    """Records what it is called with; optionally adds metrics of its own."""

    def __init__(self, adds: Mapping[str, float] | None = None) -> None:
        self.adds = adds
        self.calls: list[tuple[int, dict[str, float]]] = []
        self.ended = 0

    def on_round(self, strategy: object, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        self.calls.append((server_round, dict(metrics)))
        return self.adds

    def on_end(self, strategy: object, arrays: object) -> None:
        self.ended += 1


def _strategy(num_rounds: int = 7) -> SpectralSharding:
    return SpectralSharding(sharded_layers=["hidden"], num_rounds=num_rounds)


def _after_round(strategy: SpectralSharding, callbacks: list[RoundCallback]) -> Any:
    """What the strategy's hooks do when the run's round is over (its ``end_round``), with
    these callbacks; returns what they added to the round's row (``None``: nothing)."""
    strategy.callbacks = list(callbacks)

    def end(server_round: int, arrays: ArrayRecord) -> dict[str, float] | None:
        before = dict(strategy.history.get(server_round, {}))
        strategy.end_round(server_round, arrays)
        after = strategy.history.get(server_round, {})
        return {k: v for k, v in after.items() if before.get(k) != v} or None

    return end


def test_central_evaluation_matches_the_hand_computed_loss_and_accuracy() -> None:
    model = _linear()
    arrays = ArrayRecord(model.state_dict())
    out = _evaluation(nn.Linear(2, 3)).on_round(None, 1, arrays, {})
    assert out is not None
    assert out["test-accuracy"] == 0.5
    assert out["test-loss"] == pytest.approx(_hand_loss(), rel=1e-6)
    assert out["test-examples"] == 4.0
    assert "test-accuracy-top-n" not in out  # no diagnostics asked for


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(2, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(torch.tanh(self.stem(x)))))


def test_top_n_diagnostics_equal_the_model_with_its_weight_truncated_by_hand() -> None:
    torch.manual_seed(0)
    model = Deep()
    # hidden = Q diag(4, 3, 2, 1) with Q = H/2 orthogonal (H the 4x4 Hadamard matrix): its
    # singular values are 4, 3, 2, 1, so the top ⌈0.5·4⌉ = 2 terms are Q diag(4, 3, 0, 0) and
    # the tail's energy share is (2² + 1²) / (4² + 3² + 2² + 1²) = 5/30.
    q = torch.tensor([[1.0, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2
    with torch.no_grad():
        model.hidden.weight.copy_(q @ torch.diag(torch.tensor([4.0, 3, 2, 1])))
    arrays = ArrayRecord(model.state_dict())
    out = _evaluation(Deep(), top_n_layers=["hidden"], top_n_ratio=0.5).on_round(
        None, 1, arrays, {})
    assert out is not None

    by_hand = Deep()
    by_hand.load_state_dict(model.state_dict())
    with torch.no_grad():
        by_hand.hidden.weight.copy_(q @ torch.diag(torch.tensor([4.0, 3, 0, 0])))
    reference = _evaluation(Deep()).on_round(None, 1, ArrayRecord(by_hand.state_dict()), {})
    untruncated = _evaluation(Deep()).on_round(None, 1, arrays, {})
    assert reference is not None and untruncated is not None
    assert out["tail-energy-top-n"] == pytest.approx(5 / 30, rel=1e-12)
    assert out["test-loss-top-n"] == pytest.approx(reference["test-loss"], rel=1e-5)
    assert out["test-accuracy-top-n"] == reference["test-accuracy"]
    # the untruncated metrics are the model's own, not the truncated one's
    assert out["test-loss"] == untruncated["test-loss"]
    assert out["test-loss"] != pytest.approx(out["test-loss-top-n"], rel=1e-3)


@pytest.mark.parametrize(("eval_every", "num_rounds", "due"), [
    (1, 3, [0, 1, 2, 3]),
    (2, 5, [0, 2, 4, 5]),
    (3, 7, [0, 3, 6, 7]),
    (3, 6, [0, 3, 6]),
    (10, 4, [0, 4]),
    (0, 4, []),  # never, not even the last round
])
def test_the_history_gets_test_metrics_exactly_on_the_due_rounds(eval_every, num_rounds, due):
    strategy = _strategy(num_rounds)
    probe = Probe()
    evaluate_fn = _after_round(strategy, [
        _evaluation(nn.Linear(2, 3), eval_every=eval_every, num_rounds=num_rounds), probe])
    arrays = ArrayRecord(_linear().state_dict())
    returned = {r: evaluate_fn(r, arrays) for r in range(num_rounds + 1)}
    assert [r for r, rec in returned.items() if rec is not None] == due
    for r in due:
        record = returned[r]
        assert record is not None
        # what the callbacks added goes to the round's row
        assert dict(record) == {"test-loss": pytest.approx(_hand_loss(), rel=1e-6),
                                "test-accuracy": 0.5, "test-examples": 4.0}
    # every round reaches the later callbacks, evaluated or not
    assert [r for r, _ in probe.calls] == list(range(num_rounds + 1))
    assert [r for r, m in probe.calls if "test-accuracy" in m] == due


def test_metrics_start_from_the_strategy_row_and_flow_in_order() -> None:
    strategy = _strategy()
    strategy.history[1] = {"train-loss": 0.25, "test-accuracy": 0.9}
    first, second = Probe({"extra": 1.0}), Probe()
    evaluate_fn = _after_round(strategy, [first, second])
    assert evaluate_fn(1, ArrayRecord(_linear().state_dict())) == {"extra": 1.0}
    assert first.calls == [(1, {"train-loss": 0.25, "test-accuracy": 0.9})]
    assert second.calls == [(1, {"train-loss": 0.25, "test-accuracy": 0.9, "extra": 1.0})]
    # what a callback returns is added to the round's row, beside what was there
    assert strategy.history[1] == {"train-loss": 0.25, "test-accuracy": 0.9, "extra": 1.0}
    # a round that nothing is said about leaves no row
    assert _after_round(strategy, [Probe()])(2, ArrayRecord(_linear().state_dict())) is None
    assert 2 not in strategy.history


def test_the_last_round_ends_the_run_once() -> None:
    strategy = _strategy(num_rounds=2)
    probe = Probe()
    evaluate_fn = _after_round(strategy, [probe])
    for r in (0, 1, 2):
        evaluate_fn(r, ArrayRecord(_linear().state_dict()))
    assert probe.ended == 1  # after round 2, the last


def test_callbacks_cannot_change_the_metrics_they_are_given() -> None:
    class Writer(RoundCallback):
        def on_round(self, strategy, server_round, arrays, metrics):
            metrics["x"] = 1.0  # type: ignore[index]

    with pytest.raises(TypeError, match="does not support item assignment"):
        _after_round(_strategy(), [Writer()])(1, ArrayRecord(_linear().state_dict()))


def test_end_reaches_every_callback_once() -> None:
    probes = [Probe(), Probe()]
    run_end(probes, _strategy(), ArrayRecord(_linear().state_dict()))
    assert [p.ended for p in probes] == [1, 1]


def test_metrics_log_writes_the_round_rows(tmp_path: Path) -> None:
    strategy = _strategy(num_rounds=2)
    strategy.history[1] = {"train-loss": 0.25}
    with RunRecorder(tmp_path / "run", {"seed": 1}, 2) as recorder:
        evaluate_fn = _after_round(strategy, [
            _evaluation(nn.Linear(2, 3), eval_every=2, num_rounds=2), MetricsLog(recorder)])
        arrays = ArrayRecord(_linear().state_dict())
        for r in range(3):
            evaluate_fn(r, arrays)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert rows[0]["test-accuracy"] == 0.5 and rows[0]["test-examples"] == 4.0
    assert rows[1]["train-loss"] == 0.25 and "test-accuracy" not in rows[1]
    assert rows[2]["test-loss"] == pytest.approx(_hand_loss(), rel=1e-6)


def test_checkpoint_is_read_back_as_written_and_round_zero_is_skipped(tmp_path: Path) -> None:
    strategy = _strategy()
    strategy.resume(0, {7: (0.5, "node-key")}, {1: {"train-loss": 0.25}})
    config = {"seed": 3, "resume": True, "overwrite": False, "model": "mlp"}
    evaluate_fn = _after_round(strategy, [Checkpointing(tmp_path, config)])
    model = _linear()
    arrays = ArrayRecord(model.state_dict())
    evaluate_fn(0, arrays)
    assert Checkpoint.load(tmp_path) is None  # the initial model is not checkpointed
    evaluate_fn(1, arrays)
    saved = Checkpoint.load(tmp_path)
    assert saved is not None
    assert saved.server_round == 1
    assert saved.config == {"seed": 3, "model": "mlp"}  # how this invocation started: left out
    assert saved.capabilities == {7: (0.5, "node-key")}
    assert saved.history == {1: {"train-loss": 0.25}}
    assert saved.arrays.keys() == {"weight", "bias"}
    np.testing.assert_array_equal(saved.arrays["weight"], [[1, 0], [0, 1], [0, 0]])
    np.testing.assert_array_equal(saved.arrays["bias"], [0, 0, 0])


def test_a_resumed_run_counts_on_and_skips_its_checkpointed_model(tmp_path: Path) -> None:
    from flwr.app import ConfigRecord

    from fedshard import Cohort

    def stopped_after(done: int, probe: Probe, jobs: list[RoundCallback]) -> SpectralSharding:
        # no training asked for: configure_train ends at round 0's callbacks
        strategy = SpectralSharding(sharded_layers=["hidden"], num_rounds=5,
                                    cohort=Cohort(fraction_train=0.0), callbacks=[probe, *jobs])
        if done:
            strategy.resume(done, {}, {1: {"train-loss": 0.5}, 2: {"train-loss": 0.4}})
        strategy.configure_train(1, arrays, ConfigRecord(), None)  # type: ignore[arg-type]
        return strategy

    arrays = ArrayRecord(_linear().state_dict())
    fresh = Probe()
    stopped_after(0, fresh, [])
    assert [r for r, _ in fresh.calls] == [0]  # a fresh run's round 0: the initial model
    probe = Probe()
    strategy = stopped_after(2, probe, [
        _evaluation(nn.Linear(2, 3), eval_every=2, num_rounds=5), Checkpointing(tmp_path, {})])
    # Flower's round 1 is the run's 3: no round 0, the checkpoint's model was recorded
    assert probe.calls == [] and Checkpoint.load(tmp_path) is None
    assert [strategy.run_rounds.of(k) for k in (1, 2, 3)] == [3, 4, 5]
    strategy.history[3] = {"train-loss": 0.3}  # what round 3's aggregation leaves
    evaluate_fn = _after_round(strategy, strategy.callbacks)
    returned = [evaluate_fn(r, arrays) for r in (3, 4, 5)]
    # of the run's rounds 3, 4, 5, rounds 4 and 5 (the last) are evaluated
    assert [r for r, _ in probe.calls] == [3, 4, 5]
    assert [rec is not None for rec in returned] == [False, True, True]
    assert probe.calls[0][1] == {"train-loss": 0.3}
    assert probe.ended == 1
    saved = Checkpoint.load(tmp_path)
    assert saved is not None and saved.server_round == 5


def test_checkpoint_comes_after_the_row_so_a_refused_model_is_still_recorded(
    tmp_path: Path,
) -> None:
    strategy = _strategy()
    model = _linear()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with RunRecorder(tmp_path / "run", {}, 7) as recorder:
        evaluate_fn = _after_round(strategy, [
            MetricsLog(recorder), Checkpointing(tmp_path / "run", {})])
        strategy.history[1] = {"train-loss": 0.25}
        with pytest.raises(ValueError, match=r"Round 1's model has non-finite values in "
                                             r"'weight' \(1 of 6\)"):
            evaluate_fn(1, ArrayRecord(model.state_dict()))
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in rows] == [1]
    assert Checkpoint.load(tmp_path / "run") is None


def test_tensorboard_callback_writes_what_tensorboard_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed here")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TensorBoardLog(tmp_path)
    evaluate_fn = _after_round(_strategy(), [
        Probe({"test-accuracy": 0.5, "test-loss": 1.5, "bad": float("nan")}), board])
    arrays = ArrayRecord(_linear().state_dict())
    for r in range(3):
        evaluate_fn(r, arrays)
    board.on_end(None, arrays)  # type: ignore[arg-type]
    board.close()  # again, as the app does after a run stopped early: nothing to do
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["test-accuracy", "test-loss"]  # NaN left out
    acc = events.Scalars("test-accuracy")
    assert [e.step for e in acc] == [0, 1, 2]
    assert [e.value for e in acc] == [0.5, 0.5, 0.5]


def test_the_run_composes_evaluation_record_tensorboard_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed here")
    import fakedata

    from fedshard.app.config import RunConfig
    from fedshard.app.run import build_strategy, side_jobs
    from fedshard.app.task import build_model

    fakedata.write_fashion_mnist(tmp_path / "data", 20, 12, np.random.default_rng(0))
    cfg = RunConfig.from_mapping({
        "dataset": "fashion-mnist", "data-dir": str(tmp_path / "data"), "model": "mlp",
        "model-width": 8, "keep-ratios": "0.25:0.5,0.5:0.5", "diagnostics": True,
        "tensorboard": True, "eval-every": 2, "num-server-rounds": 3, "test-max-examples": 10,
        "results-dir": str(tmp_path / "out"), "run-name": "run", "seed": 5})
    model = build_model(cfg)
    strategy = build_strategy(cfg, model)
    with RunRecorder(cfg.results_path, cfg.as_dict(), 3) as recorder:
        jobs = side_jobs(cfg, model, strategy.sharded_layers, recorder)
        run_end(jobs, strategy, ArrayRecord(model.state_dict()))
    assert [type(j) for j in jobs] == [CentralEvaluation, MetricsLog, TensorBoardLog,
                                       Checkpointing]
    evaluation, checkpointing = jobs[0], jobs[3]
    assert isinstance(evaluation, CentralEvaluation) and isinstance(checkpointing, Checkpointing)
    assert [evaluation.is_due(r) for r in range(4)] == [True, False, True, True]
    assert evaluation.top_n_layers == strategy.sharded_layers != ()
    assert evaluation.top_n_ratio == 0.5  # the largest keep ratio of the mix
    assert "resume" not in checkpointing.config and checkpointing.config["seed"] == 5


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch) -> None:
    import sys

    from fedshard.app.config import RunConfig

    # as if the package were absent: importing torch.utils.tensorboard then fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"'tensorboard' package is not installed; install it"):
        TensorBoardLog(tmp_path)
    assert RunConfig.from_mapping({"tensorboard": True}).tensorboard is True
