"""Width slicing's replies under the reply bounds: one dishonest node (its update ×1000, a
``num-examples`` of 2⁵³) on a FedRolex window, and honest nodes of other widths and sizes.

Each round is built by the server's own code (:func:`~fedshard.server.width.slice_round`) and
its replies, real ``Message``s made here from what each node was sent, are checked and
aggregated by :meth:`~fedshard.server.rounds.RoundState.finish`; the references are the
per-element weighted means written out element by element.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from fedshard import protocol as P
from fedshard.server.metrics import mean_client_metrics
from fedshard.server.width import slice_round
from fedshard.settings import LocalTraining, ReplyPolicy, Slicing, robust_defaults
from fedshard.width.slicing import WidthFamily

KEEP = [0.8] + [0.5] * 6 + [0.8] * 3  # node 1000 is one of the four wide nodes
FULL = 10


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


FAMILY = WidthFamily(Net, FULL)
NODES = {1000 + i: P.Capabilities(r, str(i)) for i, r in enumerate(KEEP)}


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    """Messages are made outside a grid here: they need the run's identity (as the
    in-process grid sets it)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    logging.getLogger("flwr").addHandler(caplog.handler)
    yield caplog
    logging.getLogger("flwr").removeHandler(caplog.handler)


def _global() -> dict[str, np.ndarray]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return {k: v.numpy().copy() for k, v in FAMILY(FULL).state_dict().items()}


def _honest_update(node: int, key: str, index: tuple[np.ndarray, ...],
                   size: float) -> np.ndarray:
    """A node's update of ``key`` at its slice: a direction shared by every node plus one of
    its own (non-IID data), each drawn over the whole global entry, so that two nodes
    holding an element agree on its shared part; ``size`` scales it (more data, more steps)."""
    shape = _global()[key].shape
    tag = zlib.crc32(key.encode())
    shared = np.random.default_rng([11, tag]).normal(size=shape)
    own = np.random.default_rng([7, node, tag]).normal(size=shape)
    return (0.02 * size * (shared + own))[np.ix_(*index)]


Tamper = Callable[[int, dict[str, np.ndarray], dict[str, np.ndarray]], float | None]


def _round(examples: dict[int, int], size: dict[int, float] | None = None,
           tamper: Tamper | None = None, replies: ReplyPolicy | None = None,
           method: str = "fedrolex", server_round: int = 3,
           ) -> tuple[dict[str, np.ndarray], dict[str, float], dict]:
    """One round: each node returns what it was sent plus its honest update (``tamper`` may
    change a node's values in place and return another ``num-examples``). The new global
    model, the round's metrics and, per node, (sent, returned values, its slice, weight)."""
    arrays = ArrayRecord({k: Array(v) for k, v in _global().items()})
    widths = {r: FAMILY.width_for(r) for r in set(KEEP)}
    messages, state = slice_round(server_round, arrays, NODES, widths, ConfigRecord(),
                                  family=FAMILY, method=method,
                                  slicing=Slicing(width_match="keep-ratio"),
                                  training=LocalTraining(), lr=0.1,
                                  replies=replies or robust_defaults(), seed=0)
    out, seen = [], {}
    for msg in messages:
        node = msg.metadata.dst_node_id
        sent = {k: P.decode_array(a) for k, a in msg.content[P.ARRAYS].items()}
        index = state.index[node]
        values = {k: (s.astype(np.float64) + _honest_update(
            node, k, index[k], (size or {}).get(node, 1.0))).astype(s.dtype)
            for k, s in sent.items()}
        weight = float(examples[node])
        if tamper is not None:
            weight = tamper(node, sent, values) or weight
        seen[node] = (sent, dict(values), index, weight)
        content = RecordDict({P.ARRAYS: ArrayRecord({k: Array(v) for k, v in values.items()}),
                              P.METRICS: MetricRecord({P.NUM_EXAMPLES: int(weight)})})
        reply = Message(content, reply_to=msg)
        reply.metadata.__dict__["_src_node_id"] = node
        out.append(reply)
    new, _, metrics = state.finish(out, mean_client_metrics, P.NUM_EXAMPLES)
    assert new is not None
    return {k: P.decode_array(a) for k, a in new.items()}, metrics, seen


def _brute_mean(current: dict[str, np.ndarray],
                nodes: dict[int, tuple[dict[str, np.ndarray], float, dict]]
                ) -> dict[str, np.ndarray]:
    """Every element the weighted mean of the values of the nodes holding it, written out
    element by element (``nodes``: node -> (values, weight, slice))."""
    out = {}
    for key, now in current.items():
        num, den = np.zeros(now.shape), np.zeros(now.shape)
        for values, weight, index in nodes.values():
            for pos in np.ndindex(values[key].shape):
                at = tuple(int(ix[p]) for ix, p in zip(index[key], pos, strict=True))
                num[at] += weight * float(values[key][pos])
                den[at] += weight
        new = now.astype(np.float64).copy()
        new[den > 0] = num[den > 0] / den[den > 0]
        out[key] = new
    return out


def _rel(sent: np.ndarray, got: np.ndarray) -> float:
    """``‖got − sent‖ / max(‖sent‖, 0.1·√size)``, the change the bounds compare."""
    ref = max(np.linalg.norm(sent.astype(np.float64)), 0.1 * np.sqrt(sent.size))
    return float(np.linalg.norm(got.astype(np.float64) - sent) / ref)


def _times_1000_and_2_53(node: int, sent: dict, values: dict) -> float | None:
    if node != 1000:
        return None
    for k, s in sent.items():
        values[k] = (s.astype(np.float64) + 1000 * (values[k].astype(np.float64) - s)
                     ).astype(s.dtype)
    return float(2**53)


EQUAL = {n: 100 for n in NODES}


def test_the_windows_give_elements_held_by_all_ten_and_by_the_four_wide_nodes() -> None:
    # the setting of the tests below: FedRolex's round-3 windows of widths 5 and 8 of 10
    *_, seen = _round(EQUAL)
    rows = {n: set(index["a.weight"][0].tolist()) for n, (_, _, index, _) in seen.items()}
    assert rows[1001] == {3, 4, 5, 6, 7}
    assert rows[1000] == {3, 4, 5, 6, 7, 8, 9, 0}
    held = {c: sum(c in r for r in rows.values()) for c in range(FULL)}
    assert held == {0: 4, 1: 0, 2: 0, 3: 10, 4: 10, 5: 10, 6: 10, 7: 10, 8: 4, 9: 4}


def test_one_node_times_1000_with_2_53_examples_counts_as_a_typical_node(
        flower_logs: pytest.LogCaptureFixture) -> None:
    clean, _, _ = _round(EQUAL)
    got, row, seen = _round(EQUAL, tamper=_times_1000_and_2_53)
    current = _global()
    # the bound, against the round in which node 1000 is honest: on every entry the dishonest
    # node moves the aggregate by at most 0.15 of that round's own step, and by 0.05 on the
    # rows only the four wide nodes hold (the weight cap and the spread bound alone leave
    # 0.22 to 0.94 of it, and 0.75 on those rows)
    for key, now in current.items():
        step = np.linalg.norm(clean[key].astype(np.float64) - now)
        assert np.linalg.norm(got[key].astype(np.float64) - clean[key]) <= 0.15 * step, key
    wide = [8, 9, 0]
    rows = np.abs(clean["a.weight"].astype(np.float64) - current["a.weight"]).sum(axis=1)
    moved = np.abs(got["a.weight"].astype(np.float64) - clean["a.weight"]).sum(axis=1)
    assert moved[wide].sum() <= 0.05 * rows[wide].sum()
    # the reference written out: node 1000's change of each entry is its honest direction at
    # the round's median change (over the ten nodes), and it is weighted as the median, 100
    nodes = {n: (values, weight, index) for n, (_, values, index, weight) in seen.items()}
    nodes[1000] = (_held_to_the_median(seen, 1000), 100.0, seen[1000][2])
    want = _brute_mean(current, nodes)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert row["update-spread-held"] == 1.0 and row["implausible-num-examples"] == 1.0
    assert row["clipped-num-examples"] == 1.0 and row["update-spread-warned"] == 1.0
    text = flower_logs.text
    assert ("Round 3: node 1000 reports num-examples=9007199254740992, more than 100 times the "
            "round's median 100, which is implausible; it is weighted as 200 "
            "(max-weight-ratio=2: no claim weighs more than 2 times the median, and the nodes "
            "above the median share 1 median(s) of extra weight).") in text
    assert "Round 3: node 1000 changed more than max-update-spread=2 times the round's " \
        "median change (" in text
    assert ("further than the data it is weighted for explains (200 examples, the round's "
            "median 100; it reports 9007199254740992); it is aggregated as a typical node: "
            "each of its changes is shrunk to the round's median change and it is weighted as "
            "100 examples.") in text
    named = {n for r in flower_logs.records if r.levelno >= logging.WARNING
             for n in re.findall(r"node (\d+)", r.getMessage())}
    assert named == {"1000"}  # no honest node is named


def test_times_1000_alone_is_held_to_the_median_and_named_with_its_own_count(
        flower_logs: pytest.LogCaptureFixture) -> None:
    def scaled(node: int, sent: dict, values: dict) -> float | None:
        _times_1000_and_2_53(node, sent, values)
        return None  # its honest num-examples

    clean, _, _ = _round(EQUAL)
    got, row, _ = _round(EQUAL, tamper=scaled)
    for key, now in _global().items():
        step = np.linalg.norm(clean[key].astype(np.float64) - now)
        assert np.linalg.norm(got[key].astype(np.float64) - clean[key]) <= 0.15 * step, key
    assert row["update-spread-held"] == 1.0 and "implausible-num-examples" not in row
    assert ("further than the data it is weighted for explains (100 examples, the round's "
            "median 100; it reports 100); it is aggregated as a typical node") in flower_logs.text


def test_a_node_whose_count_explains_its_change_keeps_the_two_bounds_unheld() -> None:
    # what the rule does not hold: node 1000 reports twice the median's data and moves twice
    # as far, as an honest data-rich node does; it keeps its weight (200, at the cap) and its
    # change, shrunk only where beyond κ = 2 times the median, so it pulls on the average up
    # to four times as hard as a typical node
    def twice(node: int, sent: dict, values: dict) -> float | None:
        if node != 1000:
            return None
        for key, s in sent.items():
            values[key] = (s + 2.0 * (values[key].astype(np.float64) - s)).astype(s.dtype)
        return 200.0

    got, row, seen = _round(EQUAL, tamper=twice)
    assert "update-spread-held" not in row and "implausible-num-examples" not in row
    nodes = {n: (v, w, ix) for n, (_, v, ix, w) in seen.items()}
    sent, values, index, _ = seen[1000]
    bounded = {}
    for key, s in sent.items():
        median = float(np.median([_rel(seen[n][0][key], seen[n][1][key]) for n in seen]))
        scale = min(1.0, 2.0 * median / _rel(s, values[key]))
        bounded[key] = (s + scale * (values[key].astype(np.float64) - s)).astype(s.dtype)
    nodes[1000] = (bounded, 200.0, index)
    want = _brute_mean(_global(), nodes)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize(("sizes", "clipped"), [
    # above the median 100: 20 + 10 + 50 = 80 examples, within one median: FedAvg's weights
    ([60, 80, 100, 100, 120, 100, 100, 90, 110, 150], 0),
    # 10 + 20 + 50 + 90 = 170 above the median: the four share 100, each its excess x 100/170
    ([60, 80, 100, 100, 120, 150, 100, 90, 110, 190], 4),
])
def test_honest_nodes_of_other_widths_and_sizes_are_the_per_element_mean(
        flower_logs: pytest.LogCaptureFixture, sizes: list[int], clipped: int) -> None:
    # sizes within 2 x the median, each moving in proportion to its data: no update bound
    # acts; the weights are FedAvg's while the nodes above the median hold at most one median
    # more than it, else they share that one median (written out here)
    examples = dict(zip(NODES, sizes, strict=True))
    size = {n: e / 100 for n, e in examples.items()}
    got, row, seen = _round(examples, size)
    extra = sum(max(0, e - 100) for e in sizes)
    scale = min(1.0, 100 / extra)
    weight = {n: min(e, 100) + scale * max(0, e - 100) for n, e in examples.items()}
    want = _brute_mean(_global(), {n: (v, weight[n], ix) for n, (_, v, ix, _) in seen.items()})
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert row.get("clipped-num-examples", 0.0) == clipped
    for name in ("clipped-update-spread", "update-spread-held", "update-spread-warned",
                 "implausible-num-examples"):
        assert name not in row, name
    assert not [r for r in flower_logs.records if r.levelno >= logging.WARNING]


def _held_to_the_median(seen: dict, node: int) -> dict:
    """``node``'s reply held to the median, written out: each entry's change in its own
    direction at the round's median change of that entry (over every node)."""
    sent, values, _, _ = seen[node]
    held = {}
    for key, s in sent.items():
        median = float(np.median([_rel(seen[n][0][key], seen[n][1][key]) for n in seen]))
        d = values[key].astype(np.float64) - s
        ref = max(np.linalg.norm(s.astype(np.float64)), 0.1 * np.sqrt(s.size))
        held[key] = (s + d * min(1.0, median * ref / np.linalg.norm(d))).astype(s.dtype)
    return held


def test_a_claim_buys_no_allowance_beyond_the_weight_it_is_aggregated_with(
        flower_logs: pytest.LogCaptureFixture) -> None:
    # node 1009 claims 20 x the median's data and moves 10 x further on every entry. It is
    # weighted as 2 x the median (max-weight-ratio), and its update is judged against that
    # weight, not its claim: beyond 2κ x 2 on every entry, so it is held to the median, as
    # an attacker claiming 20 x or 99 x is; an honest node holding that much more data than
    # most and moving that much further is held too (the price of no claim buying pull)
    examples = {**EQUAL, 1009: 2000}
    got, row, seen = _round(examples, {1009: 10.0})
    assert row["update-spread-held"] == 1.0 and row["update-spread-warned"] == 1.0
    assert row["clipped-num-examples"] == 1.0 and "implausible-num-examples" not in row
    nodes = {n: (v, w, ix) for n, (_, v, ix, w) in seen.items()}
    nodes[1009] = (_held_to_the_median(seen, 1009), 100.0, seen[1009][2])
    want = _brute_mean(_global(), nodes)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    [line] = {r.getMessage() for r in flower_logs.records
              if r.levelno == logging.WARNING and "max-update-spread" in r.getMessage()}
    assert line.startswith("Round 3: node 1009 changed more than max-update-spread=2 times")
    assert ("further than the data it is weighted for explains (200 examples, the round's "
            "median 100; it reports 2000)") in line
    assert "raise max-update-spread" not in line  # the advice never loosens the bound


@pytest.mark.parametrize("claim", [190.0, 199.0, 200.0, 201.0, 2000.0, 9900.0, 10100.0])
def test_the_weight_and_the_hold_are_continuous_in_the_claim(claim: float) -> None:
    # a node moving 10 x further: whatever it claims above 2 x the median, it is weighted as
    # 2 x the median and held; no claim (99 x, 101 x the median) sits under a threshold
    got, row, seen = _round({**EQUAL, 1009: claim}, {1009: 10.0})
    assert row["update-spread-held"] == 1.0
    nodes = {n: (v, w, ix) for n, (_, v, ix, w) in seen.items()}
    nodes[1009] = (_held_to_the_median(seen, 1009), 100.0, seen[1009][2])
    want = _brute_mean(_global(), nodes)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
