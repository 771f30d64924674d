"""The squared change of each dense entry, taken once: by the reply checks' update bound, in
the arrays' own precision, and read again by the spread rule only while the reply still holds
the array it was taken of. Checked against float64 norms taken by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedshard import protocol as P
from fedshard.server.robust import spread_replies
from fedshard.settings import ReplyPolicy
from fedshard.spectral.aggregate import squared_difference


@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's ``Message`` needs a run id (a ServerApp sets one)."""
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _exact(got: np.ndarray, sent: np.ndarray) -> float:
    d = got.astype(np.float64) - sent.astype(np.float64)
    return float(np.sum(d * d))


@pytest.mark.parametrize(("dtype", "rel"), [(np.float64, 1e-13), (np.float32, 1e-6),
                                            (np.float16, 1e-6)])
def test_the_squared_difference_is_float64s_to_the_arrays_precision(dtype: type,
                                                                    rel: float) -> None:
    """float64 arrays to 1e-13; float32 ones (taken in float32, summed pairwise) and float16
    ones (taken in float32) to 1e-6, over sizes up to a million entries."""
    rng = np.random.default_rng([61, 1])
    for size in (1, 7, 1000, 1_000_000):
        sent = rng.normal(size=size).astype(dtype)
        got = (sent + 0.01 * rng.normal(size=size)).astype(dtype)
        assert squared_difference(got, sent) == pytest.approx(_exact(got, sent), rel=rel)
    # squares beyond float32: inf (the caller takes them in float64)
    big = np.array([1e30, 0.0], dtype=np.float32)
    assert squared_difference(big, np.zeros(2, np.float32)) == math.inf


def _round(rng: np.random.Generator, scales: list[float]
           ) -> tuple[dict[int, P.SentShard], list[P.TrainReply], dict[str, np.ndarray]]:
    """One round of dense replies, each node's change scaled by ``scales[i]``, through the real
    packing and reply checks (every node is sent the same dense arrays)."""
    arrays = {"fc.weight": rng.normal(size=(8, 6)).astype(np.float32),
              "fc.bias": rng.normal(size=8).astype(np.float32)}
    record = ArrayRecord({k: P.encode_array(v) for k, v in arrays.items()})
    _, current = P.decode_shard(record)
    sent, accepted, norms = {}, [], {}
    for i, scale in enumerate(scales):
        node = 10 + i
        out, shard = P.encode_shard(record, {}, {}, 1.0, current)
        sent[node] = shard
        msg = Message(RecordDict({P.ARRAYS: out, P.CONFIG: ConfigRecord({P.SERVER_ROUND: 1})}),
                      dst_node_id=node, message_type=MessageType.TRAIN)
        msg.metadata.__dict__["_message_id"] = f"m{node}"
        state = {k: (v + scale * 0.05 * rng.normal(size=v.shape)).astype(v.dtype)
                 for k, v in arrays.items()}
        reply = P.train_reply(msg, state, 10, {})
        reply.metadata.__dict__["_src_node_id"] = node
        checked = P.check_train_reply(reply, shard, set(), node=node, server_round=1,
                                      sent_norms=norms)
        assert isinstance(checked, P.TrainReply), checked
        accepted.append(checked)
    return sent, accepted, arrays


def test_the_reply_checks_keep_each_dense_change_they_took_unless_they_clipped_it(
        task_identity: None) -> None:
    """An unclipped entry keeps (its array, ‖got − sent‖²), float64's to 1e-6; an entry the
    update bound clipped (a change of 1e4 times a typical one) keeps nothing."""
    rng = np.random.default_rng([61, 2])
    _, accepted, arrays = _round(rng, [1.0, 1.0, 1e4])
    for r in accepted[:2]:
        for key, value in r.values.items():
            held, change_sq = r.changes[key]
            assert held is value
            assert change_sq == pytest.approx(_exact(value, arrays[key]), rel=1e-6)
    assert accepted[2].clipped > 0 and "fc.weight" not in accepted[2].changes


def test_the_spread_rule_takes_a_change_again_where_the_array_was_replaced(
        task_identity: None) -> None:
    """A later stage that replaces a reply's array (here: one node's weight moved 50 times
    further after the checks) leaves a kept change that is no longer its: the spread rule
    takes the change of the array the reply holds. Its largest change over the median is
    the float64 one taken by hand, and that node is shrunk."""
    rng = np.random.default_rng([61, 3])
    sent, accepted, arrays = _round(rng, [1.0] * 5)
    first = accepted[0]
    moved = (arrays["fc.weight"] + 50 * (first.values["fc.weight"] - arrays["fc.weight"])
             ).astype(np.float32)
    accepted[0] = replace(first, values={**first.values, "fc.weight": moved})
    metrics: dict[str, float] = {}
    out = spread_replies(1, accepted, sent, {}, ReplyPolicy(max_update_spread=2.0), metrics)
    ratios = []
    for key in ("fc.weight", "fc.bias"):
        ref = max(_exact(arrays[key], np.zeros_like(arrays[key])),
                  0.1**2 * arrays[key].size)
        changes = [math.sqrt(_exact(r.values[key], arrays[key]) / ref) for r in accepted]
        ratios.append(max(changes) / float(np.median(changes)))
    assert metrics["update-spread-max"] == pytest.approx(max(ratios), rel=1e-6)
    assert out[0].values["fc.weight"] is not moved  # shrunk
