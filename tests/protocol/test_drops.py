"""A dropped reply is a typed Drop: its reason from a fixed set (the round's
``dropped-<reason>`` metric), its details apart; nothing parses a string."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedshard import protocol as P


def _sent() -> P.SentShard:
    return P.SentShard(1.0, {}, {"w": ((2, 2), np.dtype(np.float32))}, 0,
                       values={"w": np.zeros((2, 2), np.float32)})


@pytest.fixture(autouse=True)
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's ``Message`` needs a run id (a ServerApp sets one)."""
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def test_each_wire_problem_is_its_own_reason_with_the_details_apart() -> None:
    sent = _sent()
    ok = Message(RecordDict({P.ARRAYS: ArrayRecord({"w": Array(np.ones((2, 2), np.float32))}),
                             P.METRICS: MetricRecord({P.NUM_EXAMPLES: 3})}), dst_node_id=0,
                 message_type="train")
    cases = {
        P.DropReason.BAD_SHAPE: {"w": np.ones((3, 2), np.float32)},
        P.DropReason.BAD_DTYPE: {"w": np.ones((2, 2), np.float64)},
        P.DropReason.NON_FINITE: {"w": np.full((2, 2), np.nan, np.float32)},
        P.DropReason.BAD_KEYS: {"x": np.ones((2, 2), np.float32)},
    }
    for reason, arrays in cases.items():
        msg = Message(RecordDict({P.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                                  P.METRICS: MetricRecord({P.NUM_EXAMPLES: 3})}),
                      dst_node_id=0, message_type="train")
        got = P.check_train_reply(msg, sent, set(), node=msg.metadata.src_node_id)
        assert isinstance(got, P.Drop) and got.reason is reason, got
        assert str(got).startswith(f"{reason.value}: ") and got.detail in str(got)
    bad = Message(RecordDict({P.ARRAYS: ArrayRecord({"w": Array(np.ones((2, 2), np.float32))}),
                              P.METRICS: MetricRecord({P.NUM_EXAMPLES: 0})}),
                  dst_node_id=0, message_type="train")
    drop = P.check_train_reply(bad, sent, set(), node=bad.metadata.src_node_id)
    assert isinstance(drop, P.Drop) and drop.reason is P.DropReason.BAD_NUM_EXAMPLES
    fine = P.check_train_reply(ok, sent, set(), node=ok.metadata.src_node_id)
    assert isinstance(fine, P.TrainReply) and fine.weight == 3
    # the metric names are the reasons' values, one per reason
    assert len({r.value for r in P.DropReason}) == len(P.DropReason)
    assert P.DropReason("bad-shape") is P.DropReason.BAD_SHAPE
