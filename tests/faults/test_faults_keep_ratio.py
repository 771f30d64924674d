"""Keep ratios: a deployed node must declare one; the operator caps them
and may bind nodes to theirs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fault_setup import grid, initial, one_round, strategy
from flwr.app import ConfigRecord

from fedshard.app.config import RunConfig
from fedshard.app.task import declared_keep_ratio
from fedshard.server.callbacks import NoRoundTrainedError
from fedshard.server.nodes import load_keep_ratio_table

CFG = RunConfig(keep_ratios="0.2:0.5,0.4:0.5")


def test_only_a_simulated_node_takes_the_mixtures_ratio() -> None:
    assert declared_keep_ratio(CFG, {"partition-id": 3, "num-partitions": 4}) == 0.4
    with pytest.raises(ValueError, match="This deployed node declares no keep-ratio"):
        declared_keep_ratio(CFG, {"partition-id": 3, "num-partitions": 4, "data-dir": "/d"})
    with pytest.raises(ValueError, match="This deployed node declares no keep-ratio"):
        declared_keep_ratio(CFG, {})
    assert declared_keep_ratio(CFG, {"keep-ratio": 0.3, "data-dir": "/d"}) == 0.3


def test_the_deployed_nodes_refusal_reaches_the_server_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from flower_grid import InProcessGrid

    import client_app

    # beside a node that declares its ratio, the refusing node is skipped and asked again
    g = InProcessGrid(client_app.app, [{"data-dir": "/nowhere", "partition-id": 0,
                                        "num-partitions": 1}, {"keep-ratio": 0.5}],
                      {"keep-ratios": "0.5"})
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        s = strategy()
        assert len(list(s.configure_train(1, initial(), ConfigRecord(), g))) == 1
        assert len(list(s.configure_train(2, initial(), ConfigRecord(), g))) == 1
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    assert "gave no usable keep ratio (error reply: ValueError('This deployed node declares no " \
        "keep-ratio" in caplog.text
    # (configure_train builds the train messages; it sends only the queries)
    assert [m.metadata.message_type for m in g.sent] == ["query", "query", "query"]
    # alone, it is a run that cannot train: the first round stops it, naming the error once
    caplog.clear()
    g = InProcessGrid(client_app.app, [{"data-dir": "/nowhere", "partition-id": 0,
                                        "num-partitions": 1}], {"keep-ratios": "0.5"})
    with caplog.at_level(logging.ERROR), pytest.raises(
            NoRoundTrainedError, match=r"(?s)in round 1 every one of the 1 connected nodes .*"
                                       r"This deployed node declares no keep-ratio.*"
                                       r"Likely fix: a deployed SuperNode declares its own "
                                       r"keep ratio: restart it with --node-config"):
        strategy().configure_train(1, initial(), ConfigRecord(), g)
    # the deployed node's fix, never the simulation's mix
    assert "ShardingClientApp(keep_ratios" not in caplog.text
    assert [m.metadata.message_type for m in g.sent] == ["query"]


def test_a_ratio_above_the_cap_is_clipped_to_it() -> None:
    g = grid(ratio=1.0)
    s = strategy(max_keep_ratio=0.5)
    msgs = list(s.configure_train(1, initial(), ConfigRecord(), g))
    assert {m.content["config"]["keep-ratio"] for m in msgs} == {0.5}
    assert {tuple(m.content["arrays"]["hidden.u"].shape) for m in msgs} == {(10, 5)}


def test_the_table_binds_nodes_to_their_ratio(tmp_path: Path) -> None:
    path = tmp_path / "ratios.toml"
    path.write_text('[keep-ratios]\n"a" = 0.5\n"b" = 0.25\n')
    table = load_keep_ratio_table(path)
    assert table == {"a": 0.5, "b": 0.25}
    g = grid(ratio=0.5)
    for node, key in zip(g.contexts, ["a", "b", "c"], strict=True):
        g.contexts[node].node_config["node-key"] = key
    s = strategy(keep_ratio_table=table, trust_declared_keys=True)  # names, not public keys
    _, metrics = one_round(s, g)
    # "b" declared 0.5 but is bound to 0.25; "c" is not listed: both refused
    assert set(s.capabilities) == {1000} and metrics["nodes-sent"] == 1.0


def test_a_bad_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('"a" = "half"\n')
    with pytest.raises(ValueError, match=r"expected '\"<node key>\" = <ratio>' entries"):
        load_keep_ratio_table(path)
    with pytest.raises(ValueError, match="keep-ratio table entry 'a'"):
        strategy(keep_ratio_table={"a": 1.5})
    with pytest.raises(ValueError, match=r"keep-ratio-table='/no/such\.toml': no such file"):
        RunConfig(keep_ratio_file="/no/such.toml")
