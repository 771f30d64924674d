"""Safe by default (security review, finding 4, replies): an outsized ``num-examples`` is
clipped to a multiple of the round's median, a reply must answer this round's message, two
nodes sharing a key are named, bad evaluation metrics are counted, and a round that was never
configured says so."""

from __future__ import annotations

import logging

import pytest
from fault_setup import grid, initial, one_round, scale_arrays, set_metric, strategy
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fedshard import protocol as P
from fedshard.app.config import ConfigError, RunConfig


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    logging.getLogger("flwr").addHandler(caplog.handler)
    yield caplog
    logging.getLogger("flwr").removeHandler(caplog.handler)


def test_an_outsized_num_examples_is_weighted_as_the_median(flower_logs) -> None:
    g = grid()

    def zeroed_and_heavy(reply: Message) -> Message:
        scale_arrays(0.0)(reply)
        return set_metric("num-examples", 10**12)(reply)

    g.tamper[1000] = zeroed_and_heavy
    new, row = one_round(strategy(), g)
    assert row["clipped-num-examples"] == 1.0 and row["implausible-num-examples"] == 1.0
    # each node holds 24 examples; the zeroed node's update is out of line for the 48 it may
    # weigh at most, so it is held to the median, 24
    assert row["num-examples"] == 24 + 24 + 24 and row["update-spread-held"] == 1.0
    assert ("Round 1: node 1000 reports num-examples=1000000000000, more than 100 times the "
            "round's median 24, which is implausible; it is weighted as 48 "
            "(max-weight-ratio=2: no claim weighs more than 2 times the median, and the nodes "
            "above the median share 1 median(s) of extra weight).") \
        in flower_logs.text
    # the zeroed reply weighs 24/72 of the average, as a typical node, not all of it
    head = new["head.weight"].numpy()
    assert abs(head).max() > 1e-3


def test_equal_honest_sizes_are_never_clipped_and_the_ratio_is_a_run_config_key() -> None:
    _, row = one_round(strategy(), grid())
    assert "clipped-num-examples" not in row
    assert RunConfig.from_mapping({"max-weight-ratio": 4.0}).replies.max_weight_ratio == 4.0
    off = RunConfig.from_mapping({"max-weight-ratio": 0.0})
    assert off.replies.max_weight_ratio == 0.0  # 0: off
    with pytest.raises(ConfigError, match=r"max-weight-ratio=0\.5: expected 0 \(off\) or a "
                                          r"finite number ≥ 1"):
        RunConfig.from_mapping({"max-weight-ratio": 0.5})


def test_a_replayed_round_1_reply_is_dropped_as_stale(flower_logs) -> None:
    g = grid()
    kept: list[Message] = []

    def replay(reply: Message) -> Message:
        kept.append(reply)
        return kept[0]

    g.tamper[1000] = replay
    s = strategy(method="top-n")  # same terms every round: the indices echo cannot tell
    new, _ = one_round(s, g, 1)
    _, row = one_round(s, g, 2, new)
    assert row["dropped-stale-reply"] == 1.0 and row["replies-used"] == 2.0
    assert "Round 2: dropping the reply of node 1000 (stale-reply: it answers message" \
        in flower_logs.text


def test_round_1_content_in_a_fresh_round_2_reply_is_dropped_as_stale(flower_logs) -> None:
    g = grid()
    first: list[Message] = []

    def replay_content(reply: Message) -> Message:
        first.append(reply)
        return Message(first[0].content, reply_to=_instruction(g, reply))

    g.tamper[1000] = replay_content
    s = strategy(method="top-n")
    new, _ = one_round(s, g, 1)
    _, row = one_round(s, g, 2, new)
    assert row["dropped-stale-reply"] == 1.0
    assert "stale-reply: its content answers round 1, not round 2" in flower_logs.text


def _instruction(g, reply: Message) -> Message:
    return next(m for m in reversed(g.sent)
                if m.metadata.message_id == reply.metadata.reply_to_message_id)


def test_two_nodes_declaring_one_key_are_named_once(flower_logs) -> None:
    g = grid()
    g.contexts[1000].node_config["node-key"] = "n7"
    g.contexts[1002].node_config["node-key"] = "n7"
    s = strategy()
    one_round(s, g, 1)
    one_round(s, g, 2)
    hits = list({id(r): r.getMessage() for r in flower_logs.records  # (flwr + root handlers)
                 if "declare the same node-key" in r.getMessage()}.values())
    assert len(hits) == 1 and "Nodes 1000 and 1002 declare the same node-key 'n7'" in hits[0]
    assert "the same training seed" in hits[0]


def test_bad_eval_metrics_are_logged_and_counted(flower_logs) -> None:
    s = strategy(fraction_evaluate=1.0)
    reply = Message(RecordDict({P.METRICS: MetricRecord({
        "num-examples": 10, "eval-loss": float("nan"), "eval-accuracy": [0.5]})}),
        dst_node_id=0, message_type="evaluate")
    reply.metadata.__dict__["_src_node_id"] = 1000
    s.aggregate_evaluate(1, [reply])
    assert s.history[1]["ignored-eval-metrics"] == 2.0
    assert ("Round 1: node 1000 sent evaluation metrics that are not averaged (eval-loss=nan "
            "is not finite; eval-accuracy=[0.5] is not a scalar)") in flower_logs.text


def test_aggregating_a_round_never_configured_is_warned(flower_logs) -> None:
    s = strategy()
    assert s.aggregate_train(1, []) == (None, None)
    assert ("aggregate_train: round 1 was never configured (no configure_train for it; the "
            "last configured round is None); no reply is aggregated") in flower_logs.text
    msgs = list(s.configure_train(1, initial(), ConfigRecord(), grid()))
    assert msgs and s.aggregate_train(2, []) == (None, None)
    assert "round 2 was never configured (no configure_train for it; the last configured " \
        "round is 1)" in flower_logs.text


def test_a_claim_far_past_the_cap_weighs_as_one_just_past_it_and_is_warned(
        flower_logs) -> None:
    # honest nodes holding more data than most pass 2 x the median: one INFO line per round,
    # weighted as 2 x the median; a claim beyond 100 x the median is named in a WARNING, and
    # weighs the same: no threshold a claim can sit under for more pull
    for claim, level in ((24 * 50, logging.INFO), (24 * 99, logging.INFO),
                         (24 * 101, logging.WARNING)):
        flower_logs.clear()
        g = grid()
        g.tamper[1000] = set_metric("num-examples", claim)
        _, row = one_round(strategy(), g)
        assert row["clipped-num-examples"] == 1.0
        assert ("implausible-num-examples" in row) is (level == logging.WARNING)
        assert row["num-examples"] == 24 + 24 + 2 * 24
        lines = {(r.levelno, r.getMessage()) for r in flower_logs.records  # (seen twice)
                 if "max-weight-ratio=2" in r.getMessage()}
        assert [lvl for lvl, _ in lines] == [level], lines
        if level == logging.INFO:
            assert ("1 node(s) report num-examples above the round's median 24 (up to "
                    f"{claim // 24} times it; nodes 1000), weighted as 48: max-weight-ratio=2 "
                    "lets one node weigh up to 2 times the median, and the nodes above it share "
                    "1 median(s) of extra weight") in next(iter(lines))[1]
