"""Identity from authentication, not declaration (security review, finding 2): the keep-ratio
table is matched against the public key Flower authenticated (``NodeInfo.public_key``, seen
by the ServerApp through ``Grid.get_nodes``), a declared ``node-key`` matches a table entry
only when the operator trusts declared names, and a claim of the full model is warned."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest
from fault_setup import client, initial, strategy
from flower_grid import InProcessGrid
from flwr.app import ConfigRecord
from flwr.proto.node_pb2 import NodeInfo
from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

from fedshard.app.config import ConfigError, RunConfig
from fedshard.settings import NodePolicy


class AuthenticatedGrid(InProcessGrid):
    """A grid whose nodes carry the public keys the SuperLink authenticated them with."""

    def __init__(self, node_configs: list[dict], keys: list[bytes]) -> None:
        super().__init__(client, node_configs)
        self.keys = dict(zip(self.contexts, keys, strict=True))

    def get_nodes(self) -> Iterable[NodeInfo]:
        return [NodeInfo(node_id=n, public_key=k) for n, k in self.keys.items()]


def _pem() -> bytes:
    return public_key_to_bytes(generate_key_pairs()[1])


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    logging.getLogger("flwr").addHandler(caplog.handler)
    yield caplog
    logging.getLogger("flwr").removeHandler(caplog.handler)


def _sent_ratios(s, g) -> dict[int, float]:
    msgs = list(s.configure_train(1, initial(), ConfigRecord(), g))
    return {m.metadata.dst_node_id: m.content["config"]["keep-ratio"] for m in msgs}


def test_a_node_declaring_another_nodes_public_key_is_refused(flower_logs) -> None:
    key_a, key_b = _pem(), _pem()
    g = AuthenticatedGrid([{"keep-ratio": 1.0},
                           {"keep-ratio": 1.0, "node-key": key_a.hex()}], [key_a, key_b])
    s = strategy(keep_ratio_table={key_a.hex(): 1.0, key_b.hex(): 0.1})
    assert _sent_ratios(s, g) == {1000: 1.0}
    assert ("Node 1001 gave no usable keep ratio (declared node-key "
            f"'{key_a.hex()[:24]}…' is another keep-ratio-table entry than the public key this "
            f"node authenticated with ({key_b.hex()[:24]}…); a node may not claim another's "
            "entry)") in flower_logs.text


def test_the_authenticated_public_key_binds_the_ratio_whatever_name_is_declared() -> None:
    key_a, key_b = _pem(), _pem()
    g = AuthenticatedGrid([{"keep-ratio": 1.0, "node-key": "a"},
                           {"keep-ratio": 0.1, "node-key": "b"}], [key_a, key_b])
    s = strategy(keep_ratio_table={key_a.hex(): 1.0, key_b.hex(): 0.1})
    assert _sent_ratios(s, g) == {1000: 1.0, 1001: 0.1}


def test_a_declared_name_matches_the_table_only_when_names_are_trusted(flower_logs) -> None:
    g = InProcessGrid(client, [{"keep-ratio": 1.0, "node-key": "trusted"}])
    assert _sent_ratios(strategy(keep_ratio_table={"trusted": 1.0}), g) == {}
    assert ("declared node-key 'trusted' is in the keep-ratio table, but declared names are "
            "not trusted (trust-declared-keys = false) and no public key of this node is "
            "listed") in flower_logs.text
    s = strategy(keep_ratio_table={"trusted": 1.0}, trust_declared_keys=True)
    assert _sent_ratios(s, g) == {1000: 1.0}


def test_a_public_key_entry_is_never_matched_by_declaration(flower_logs) -> None:
    key_a = _pem()
    g = InProcessGrid(client, [{"keep-ratio": 1.0, "node-key": key_a.hex()}])
    s = strategy(keep_ratio_table={key_a.hex(): 1.0}, trust_declared_keys=True)
    assert _sent_ratios(s, g) == {}
    assert "is a public key: only a node that authenticated with it" in flower_logs.text


def test_a_node_reusing_a_key_and_claiming_the_full_model_is_warned(flower_logs) -> None:
    g = AuthenticatedGrid([{"keep-ratio": 0.2, "node-key": "0"},
                           {"keep-ratio": 0.2, "node-key": "1"},
                           {"keep-ratio": 1.0, "node-key": "0"}], [_pem(), _pem(), _pem()])
    s = strategy()
    assert _sent_ratios(s, g)[1002] == 1.0  # allowed (no table), but not silently
    warnings = [r.getMessage() for r in flower_logs.records if r.levelname == "WARNING"]
    assert any("Node 1002 declares keep ratio 1, the largest this run allows "
               "(max-keep-ratio=1), and no keep-ratio-table binds it" in w for w in warnings)
    assert any("Nodes 1000 and 1002 declare the same node-key '0'" in w for w in warnings)
    list(s.configure_train(2, initial(), ConfigRecord(), g))
    assert len({id(r) for r in flower_logs.records  # (each record reaches two handlers)
                if "declare the same node-key" in r.getMessage()}) == 1


def test_no_full_model_warning_where_every_node_gets_the_dense_model(flower_logs) -> None:
    configs = [{"keep-ratio": 1.0, "node-key": "a"}, {"keep-ratio": 1.0, "node-key": "b"}]
    sharded = strategy()
    list(sharded.configure_train(1, initial(), ConfigRecord(), InProcessGrid(client, configs)))
    claim = "declares keep ratio 1, the largest this run allows"
    assert claim in flower_logs.text  # the check's premise: sharded runs warn
    flower_logs.clear()
    dense = strategy(method="none")
    msgs = list(dense.configure_train(1, initial(), ConfigRecord(),
                                      InProcessGrid(client, configs)))
    assert len(msgs) == 2
    assert claim not in flower_logs.text  # FedAvg: a declared ratio decides nothing


def test_trust_declared_keys_is_a_validated_run_config_key() -> None:
    assert RunConfig.from_mapping({"trust-declared-keys": True}).nodes.trust_declared_keys
    assert NodePolicy().trust_declared_keys is False
    with pytest.raises(ConfigError, match=r"trust-declared-keys='yes': expected bool"):
        RunConfig.from_mapping({"trust-declared-keys": "yes"})
    with pytest.raises(ValueError, match=r"trust_declared_keys=1: expected True or False"):
        NodePolicy(trust_declared_keys=1)  # type: ignore[arg-type]
