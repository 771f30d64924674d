"""Federated-evaluation replies are bounded like training replies: ``num-examples`` within
``max-num-examples`` and weighted at most ``max-weight-ratio`` times the round's median, an
accuracy in [0, 1] and a finite loss ≥ 0; anything else is left out or dropped, logged and
counted, so one node cannot set the federation's evaluation."""

from __future__ import annotations

import logging

import pytest
from fault_setup import grid, strategy
from flwr.app import Message, MetricRecord, RecordDict

from fedshard import protocol as P


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    logging.getLogger("flwr").addHandler(caplog.handler)
    yield caplog
    logging.getLogger("flwr").removeHandler(caplog.handler)


@pytest.fixture(autouse=True)
def _run_identity() -> None:
    grid(1)  # a Message needs a run id: the in-process grid sets it


def _reply(node: int, num_examples: int, **metrics: float) -> Message:
    values = {P.NUM_EXAMPLES: num_examples, **{k.replace("_", "-"): v for k, v in metrics.items()}}
    reply = Message(RecordDict({P.METRICS: MetricRecord(values)}), dst_node_id=0,
                    message_type="evaluate")
    reply.metadata.__dict__["_src_node_id"] = node
    return reply


def test_one_node_with_2_53_examples_and_accuracy_minus_5_cannot_set_the_evaluation(
    flower_logs,
) -> None:
    s = strategy(fraction_evaluate=1.0)
    s.aggregate_evaluate(1, [_reply(1000, 10, eval_loss=1.0, eval_accuracy=0.5),
                             _reply(1001, 10, eval_loss=0.5, eval_accuracy=0.7),
                             _reply(1002, 2**53, eval_loss=2.0, eval_accuracy=-5.0)])
    row = s.history[1]
    # node 1002's claim, beyond 100 x the median (10), is named and weighs 2 x the median,
    # as any claim above the cap does; its accuracy is left out
    assert row["eval-accuracy"] == pytest.approx(0.6)
    assert row["eval-loss"] == pytest.approx((10 * 1.0 + 10 * 0.5 + 20 * 2.0) / 40)
    assert row["clipped-eval-num-examples"] == 1.0 and row["ignored-eval-metrics"] == 1.0
    assert "node 1002 reports num-examples=9007199254740992, more than 100 times the round's " \
        "median 10, which is implausible; it is weighted as 20 (max-weight-ratio=2: no claim " \
        "weighs more than 2 times the median, and the nodes above the median share 1 median(s) " \
        "of extra weight)." in flower_logs.text
    assert "eval-accuracy=-5.0 is outside [0, 1]" in flower_logs.text


@pytest.mark.parametrize(("name", "value", "reason"), [
    ("eval-accuracy", 1e300, "eval-accuracy=1e+300 is outside [0, 1]"),
    ("eval-accuracy", 1.5, "eval-accuracy=1.5 is outside [0, 1]"),
    ("eval-loss", -0.1, "eval-loss=-0.1 is negative (expected a loss ≥ 0)"),
])
def test_impossible_accuracies_and_losses_are_left_out_and_logged(
    flower_logs, name: str, value: float, reason: str,
) -> None:
    s = strategy(fraction_evaluate=1.0)
    honest = {"eval-loss": 0.5, "eval-accuracy": 0.25}
    out = s.aggregate_evaluate(1, [_reply(1000, 10, **{k.replace("-", "_"): v
                                                       for k, v in honest.items()}),
                                   _reply(1001, 10, **{name.replace("-", "_"): value})])
    row = s.history[1]
    assert row[name] == honest[name] and row["ignored-eval-metrics"] == 1.0
    assert out is not None and out[name] == honest[name]
    assert reason in flower_logs.text


def test_max_num_examples_drops_an_evaluation_reply_above_it(flower_logs) -> None:
    s = strategy(fraction_evaluate=1.0, max_num_examples=1000)
    s.aggregate_evaluate(1, [_reply(1000, 10, eval_accuracy=0.5),
                             _reply(1001, 2000, eval_accuracy=0.9)])
    row = s.history[1]
    assert row["eval-accuracy"] == 0.5 and row["eval-nodes"] == 1.0
    assert row["eval-dropped-bad-num-examples"] == 1.0
    assert "dropping the evaluation reply of node 1001 (bad-num-examples: num-examples 2000 " \
        "is outside [1, 1000])" in flower_logs.text


def test_a_second_evaluation_reply_of_one_node_is_dropped() -> None:
    s = strategy(fraction_evaluate=1.0)
    s.aggregate_evaluate(1, [_reply(1000, 10, eval_accuracy=0.5),
                             _reply(1000, 10, eval_accuracy=1.0),
                             _reply(1001, 10, eval_accuracy=0.7)])
    row = s.history[1]
    assert row["eval-nodes"] == 2.0 and row["eval-accuracy"] == pytest.approx(0.6)
    assert row["eval-dropped-duplicate"] == 1.0
