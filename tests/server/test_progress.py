"""Is the run learning (fedshard.server.progress): the gradient share a node's step can follow
against the dimension of the tangent space counted by brute force; the first round's slow-start
message (INFO, a WARNING in a short run) and the dense factor step's with multipliers above 1;
the WARNING of an evaluation accuracy that falls round after round."""

from __future__ import annotations

import itertools
import logging
import types
from typing import Any

import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import TensorDataset

from fedshard import (
    Cohort,
    LocalTraining,
    NodePolicy,
    Sharding,
    SpectralSharding,
    handle_query,
    handle_train,
)
from fedshard.protocol import Receipt
from fedshard.server import (
    FallingAccuracy,
    RoundCallback,
    SlowStart,
    SpreadShrinksHonestNodes,
    StopWhenUntrained,
    TrainingReceipts,
    default_callbacks,
)
from fedshard.server.progress import gradient_share, is_evaluation_accuracy


# ---------------------------------------------------------------------------- the share
@pytest.mark.parametrize(("m", "k", "n"), [(4, 3, 1), (4, 3, 2), (5, 6, 3), (3, 3, 3)])
def test_gradient_share_is_the_tangent_spaces_dimension_over_the_weights(m: int, k: int,
                                                                          n: int) -> None:
    """The trace of the projection G -> P_U G + G P_V - P_U G P_V on m x k matrices, built
    column by column from the standard basis, is the tangent space's dimension; over m k it
    is the share of an isotropic gradient the step can follow."""
    rng = np.random.default_rng([m, k, n])
    u = np.linalg.qr(rng.standard_normal((m, n)))[0]
    v = np.linalg.qr(rng.standard_normal((k, n)))[0]
    pu, pv = u @ u.T, v @ v.T
    trace = 0.0
    for i, j in itertools.product(range(m), range(k)):
        basis = np.zeros((m, k))
        basis[i, j] = 1.0
        trace += (pu @ basis + basis @ pv - pu @ basis @ pv)[i, j]
    assert gradient_share(m, k, n) == pytest.approx(trace / (m * k), abs=1e-12)
    assert gradient_share(m, k, min(m, k)) == 1.0 or n < min(m, k)


# ---------------------------------------------------------------------------- the first round
def net(hidden_scale: float = 1.0) -> nn.Module:
    """The test model; ``hidden_scale`` scales the sharded layer's initial weight (small
    singular values: the paper's factor step, whose change of W scales with them, moves it
    far less than a dense step would)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(),
                              nn.Linear(12, 3))
    with torch.no_grad():
        model[2].weight.mul_(hidden_scale)
    return model


def round_1(keep: float, num_rounds: int | None, lr: float = 0.001, nodes: int = 2,
            hidden_scale: float = 10.0, **training: Any) -> SpectralSharding:
    """Round 1 through the strategy's hooks (as a loop of one's own drives them), nodes
    training with fedshard's loop at ``lr``; the strategy's run has ``num_rounds`` rounds."""
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: object) -> Message:
        return handle_query(msg, keep)

    @app.train()
    def _t(msg: Message, context: object) -> Message:
        g = torch.Generator().manual_seed(5)
        data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,),
                                                                           generator=g))
        return handle_train(msg, net(hidden_scale), data)

    s = SpectralSharding(sharded_layers=["2"], sharding=Sharding(method="collective"),
                         training=LocalTraining(lr=lr, lr_schedule="constant", **training),
                         num_rounds=num_rounds,
                         cohort=Cohort(min_train_nodes=nodes, min_available_nodes=nodes,
                                       fraction_evaluate=0.0),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    grid = InProcessGrid(app, [{}] * nodes)
    initial = ArrayRecord(net(hidden_scale).state_dict())
    messages = list(s.configure_train(1, initial, ConfigRecord(), grid))
    arrays, _ = s.aggregate_train(1, grid.send_and_receive(messages))
    assert arrays is not None  # (no evaluation on the nodes: aggregate_train ends round 1)
    return s


def _said(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and text in r.getMessage()]


def test_a_short_run_at_a_small_keep_ratio_is_warned_at_round_1(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedshard")
    s = round_1(keep=0.25, num_rounds=3)
    # the run's lr diagnosis, which FallingAccuracy keeps to
    assert [c.small_start for c in s.callbacks if isinstance(c, SlowStart)] == [True]
    (said,) = _said(caplog, logging.WARNING, "its step can follow")
    share = gradient_share(12, 16, 3)  # layer "2": (12, 16), N = 12, n = 3
    assert said.startswith(f"Round 1: a node at keep ratio r = 0.25 trains 3 of 12 terms of 2: "
                           f"its step can follow at most {100 * share:.0f} % of a sharded "
                           "layer's gradient")
    assert "Round 1 moved the sharded layers' weights by at most " in said
    # the evidence: the sharded layer moved less than half as far as the dense layers
    assert "% of their norm (2), the dense layers' by " in said
    assert "(median of 2): a small step, the slow start of training. With 3 rounds the " \
           "first rounds are most of this run." in said
    assert "raise the lr" in said and "A project's own small learning rate" in said


def test_a_run_of_unknown_length_is_warned_as_a_short_one(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedshard")
    round_1(keep=0.25, num_rounds=None)
    (said,) = _said(caplog, logging.WARNING, "its step can follow")
    assert "The strategy does not know the run's length (pass num_rounds)" in said


def test_sharded_layers_moving_as_far_as_the_dense_ones_are_no_slow_start(
        caplog: pytest.LogCaptureFixture) -> None:
    # the sharded layer at its usual scale: at lr 1e-3 it moves as far as the model's dense
    # layers (their median), so the sub-model is not slower than the dense model: no warning,
    # and the INFO line says the lr is small for the whole model
    caplog.set_level(logging.INFO, logger="fedshard")
    s = round_1(keep=0.25, num_rounds=3, hidden_scale=1.0)
    assert not _said(caplog, logging.WARNING, "its step can follow")
    (told,) = _said(caplog, logging.INFO, "its step can follow")
    assert "the dense layers' by " in told
    assert "no smaller than the dense layers' (the lr is small for the whole model" in told
    assert "raise the lr" not in told
    assert [c.small_start for c in s.callbacks if isinstance(c, SlowStart)] == [True]


def test_a_long_run_a_large_keep_ratio_or_a_large_step_is_told_at_info(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedshard")
    round_1(keep=0.25, num_rounds=50)
    round_1(keep=0.75, num_rounds=3)
    round_1(keep=0.25, num_rounds=3, lr=0.5, local_epochs=10)  # moves the weights > 10 %
    assert not _said(caplog, logging.WARNING, "its step can follow")
    told = _said(caplog, logging.INFO, "its step can follow")
    assert len(told) == 3 and "a small step" not in told[2] and "(median of 2)." in told[2]


def test_the_dense_factor_step_with_multipliers_above_1_is_warned(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedshard")
    round_1(keep=0.25, num_rounds=50, nodes=3, factor_step="dense")
    (said,) = _said(caplog, logging.WARNING, "factor_step='dense' with multipliers")
    assert "along term i they move 1/ω_i of that" in said
    assert "keep the paper's step (factor_step='plain', the default)" in said
    round_1(keep=0.25, num_rounds=50, nodes=3)  # the paper's step: nothing to say
    assert len(_said(caplog, logging.WARNING, "factor_step='dense' with multipliers")) == 1


def test_slow_start_and_falling_accuracy_are_default_callbacks() -> None:
    kinds = [type(c) for c in default_callbacks()]
    assert SlowStart in kinds and FallingAccuracy in kinds


# ---------------------------------------------------------------------------- falling accuracy
def run_rounds(values: list[float | None], callbacks: list[Any] | None = None,
               key: str = "test-accuracy") -> SpectralSharding:
    """Rounds 0, 1, ... whose evaluation (a callback before the others, as
    ``CentralEvaluation``) reports ``values`` (None: no evaluation)."""

    class Evaluation(RoundCallback):
        def on_round(self, strategy: Any, server_round: int, arrays: ArrayRecord,
                     metrics: Any) -> Any:
            return None if values[server_round] is None else {key: values[server_round]}

    if callbacks is None:  # (no round aggregates here: the stop of an untrained run is left out)
        callbacks = [c for c in default_callbacks() if not isinstance(c, StopWhenUntrained)]
    s = SpectralSharding(sharded_layers=["2"], num_rounds=len(values) - 1,
                         callbacks=[Evaluation(), *callbacks])
    for server_round in range(len(values)):
        s.history[server_round] = {"replies-used": 4.0, "replies-dropped": 0.0}
        s.end_round(server_round, ArrayRecord(net().state_dict()))
    return s


def test_an_accuracy_falling_two_rounds_in_a_row_is_warned_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fedshard")
    run_rounds([0.10, 0.150, 0.123, 0.107, 0.101])
    (said,) = _said(caplog, logging.WARNING, "has fallen")
    assert said.startswith("Round 3: test-accuracy has fallen 2 evaluations in a row, 0.150 → "
                           "0.123 → 0.107 (rounds 1-3), while those rounds aggregated their "
                           "replies as usual (used: 4, 4; dropped: 0)")
    assert "Likely causes: an lr too large" in said


def test_rises_small_dips_and_training_accuracy_do_not_count(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="fedshard")
    run_rounds([0.10, 0.30, 0.25, 0.35, 0.30, 0.40])  # never two falls in a row
    run_rounds([0.50, 0.499, 0.498, 0.497])  # below min_drop
    run_rounds([0.5, 0.4, 0.3], key="train-accuracy")
    run_rounds([0.5, None, 0.4, None, 0.3])  # evaluated every other round: two falls
    said = _said(caplog, logging.WARNING, "has fallen")
    assert len(said) == 1 and said[0].startswith("Round 4: test-accuracy has fallen 2 "
                                                 "evaluations in a row, 0.500 → 0.400 → 0.300 "
                                                 "(rounds 0-4)")
    assert is_evaluation_accuracy("client/eval_acc") and is_evaluation_accuracy("accuracy")
    assert not is_evaluation_accuracy("client/train-accuracy")
    assert not is_evaluation_accuracy("backlog-accesses")


def test_under_dp_sgd_the_warning_names_its_noise(caplog: pytest.LogCaptureFixture) -> None:
    receipts = TrainingReceipts()
    receipts.totals["dp-sgd"] = 12
    receipts.dp_settings.add((1.1, 1.0))
    caplog.set_level(logging.WARNING, logger="fedshard")
    run_rounds([0.10, 0.150, 0.123, 0.107], callbacks=[receipts, FallingAccuracy()])
    (said,) = _said(caplog, logging.WARNING, "has fallen")
    assert "The nodes' receipts say 12 node replies trained with DP-SGD, noise multiplier " \
           "1.1: DP-SGD's noise" in said
    assert Receipt("SGD", 0.1, 3, False, False, True, 1.1, 1.0).dp_sgd


def test_falling_accuracy_checks_its_settings() -> None:
    with pytest.raises(ValueError, match=r"FallingAccuracy\(patience=0, min_drop=0.005\): "
                                         r"expected an integer patience ≥ 1"):
        FallingAccuracy(patience=0)


def test_after_a_small_first_step_a_falling_accuracy_never_calls_the_lr_too_large(
        caplog: pytest.LogCaptureFixture) -> None:
    """One lr diagnosis per run: round 1's small step said the lr is small (raise it), so a
    later fall names other causes, never "an lr too large"."""
    start = SlowStart()
    start.small_start = True  # what round 1's on_round sets after a small step
    caplog.set_level(logging.WARNING, logger="fedshard")
    run_rounds([0.10, 0.150, 0.123, 0.107], callbacks=[start, FallingAccuracy()])
    (said,) = _said(caplog, logging.WARNING, "has fallen")
    assert "lr too large" not in said
    assert "Round 1 was a small step (the lr is small, not too large)" in said


# ---------------------------------------------------------------------------- honest shrinks
class _Strategy:
    """What the callback reads of a strategy: its ReplyPolicy's κ."""

    def __init__(self) -> None:
        self.replies = types.SimpleNamespace(max_update_spread=2.0)


class _State:
    def __init__(self) -> None:
        self.accepted = [object()]


def _feed(callback: SpreadShrinksHonestNodes, rows: list[dict[str, float]]) -> None:
    for i, row in enumerate(rows, start=1):
        callback.on_aggregate(_Strategy(), i, row, _State())  # type: ignore[arg-type]


def test_a_bound_that_keeps_shrinking_unnamed_nodes_is_warned_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fedshard")
    shrunk, clean, named = ({"clipped-update-spread": 2.0}, {},
                            {"clipped-update-spread": 5.0, "update-spread-warned": 1.0})
    _feed(SpreadShrinksHonestNodes(), [shrunk, clean, shrunk, shrunk, shrunk, shrunk])
    (said,) = _said(caplog, logging.WARNING, "did not name as out of line")
    assert said.startswith("Round 4: the spread bound (max-update-spread=2) shrank updates of "
                           "nodes it did not name as out of line in 3 of the 4 rounds so far")
    assert "raise max-update-spread" not in said
    caplog.clear()
    # rounds in which a node was named (evidence of an attack) do not count; rare shrinks
    # (fewer than half of the rounds) are left to the INFO lines
    _feed(SpreadShrinksHonestNodes(), [named, named, named, named, shrunk, clean, clean])
    _feed(SpreadShrinksHonestNodes(), [shrunk, clean, clean, shrunk, clean, clean, shrunk])
    assert not _said(caplog, logging.WARNING, "did not name as out of line")
    with pytest.raises(ValueError, match="min_rounds=0: expected at least 1"):
        SpreadShrinksHonestNodes(min_rounds=0)
