"""Only invited nodes: a SuperLink with TLS and SuperNode authentication.

The test makes its own CA and server certificate for 127.0.0.1, and ECDSA P-384 node keys. One
SuperLink (``--ssl-* --enable-supernode-auth``) serves the whole module; the key of ``node-a``
is registered with ``flwr supernode register``. Then: ``node-a`` trains a round; a node with an
unregistered key, and one with no key, are refused; a node without TLS, and one that does not
trust the SuperLink's certificate, never get an answer from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_cluster import LocalDeployment, make_node_key, make_tls_files

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
REFUSED_WITHIN_S = 60.0

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not FMNIST.is_dir(), reason="needs `apt-get install dataset-fashion-mnist` "
                       "(.ci/run installs it)"),
]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """TLS + SuperNode-auth SuperLink with one registered, connected SuperNode ``node-a``."""
    root = tmp_path_factory.mktemp("secure")
    tls = make_tls_files(root / "tls")
    with LocalDeployment(root / "deploy", tls=tls, supernode_auth=True) as dep:
        dep.start_superlink()
        private, public = make_node_key(root / "keys", "node-a")
        reg = dep.flwr("supernode", "register", str(public), dep.connection, "--format", "json")
        assert reg.returncode == 0, reg.stdout
        node_id = str(json.loads(reg.stdout[reg.stdout.index("{"):])["node-id"])
        dep.start_supernode("node-a", {"keep-ratio": 0.2, "data-dir": str(FMNIST),
                                       "partition-id": 0, "num-partitions": 30},
                            private_key=private)
        online = dep.wait_online(1)
        assert [n["node-id"] for n in online] == [node_id]
        yield dep
    assert dep.leftovers() == []


def _online_ids(dep: LocalDeployment) -> set[str]:
    return {n["node-id"] for n in dep.supernodes() if n.get("status") == "online"}


def test_registered_node_trains_over_tls(secure: LocalDeployment, tmp_path: Path) -> None:
    results = tmp_path / "results"
    run = secure.run_app(ROOT, {
        "model": "mlp", "model-width": 32, "num-server-rounds": 1, "fraction-train": 1.0,
        "min-available-nodes": 1, "num-partitions": 30, "test-max-examples": 200,
        "batch-size": 64, "round-timeout": 180.0, "keep-ratios": "0.5",
        "results-dir": str(results), "run-name": "auth",
    }, timeout_s=240)
    assert run.returncode == 0, run.stdout[-5000:] + "\n" + secure.tails()
    rows = [json.loads(line) for line in (results / "auth" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[1]["replies-used"] == 1 and rows[1]["nodes-sent"] == 1, rows[1]
    assert "bytes-sent-ratio-r0.2" in rows[1], rows[1]  # the node's own declared ratio
    (node_a,) = [n for n in secure.nodes if n.name == "node-a"]
    assert node_a.count("Receiving: train message") == 1, node_a.tail()
    assert node_a.count("Sending: train message") == 1, node_a.tail()


def test_unregistered_node_cannot_join(secure: LocalDeployment, tmp_path: Path) -> None:
    before = _online_ids(secure)
    private, _ = make_node_key(tmp_path, "intruder")  # public key never registered
    intruder = secure.start_supernode("intruder", {"keep-ratio": 0.2}, private_key=private)
    keyless = secure.start_supernode("keyless", {"keep-ratio": 0.2})  # would self-register
    assert intruder.wait(REFUSED_WITHIN_S) not in (None, 0), intruder.tail()
    assert keyless.wait(REFUSED_WITHIN_S) not in (None, 0), keyless.tail()
    # Both reached the SuperLink over TLS and were turned away by it.
    assert "[code: 2004] Failed to activate SuperNode" in intruder.output(), intruder.tail()
    assert "All SuperNodes must be registered via the CLI" in keyless.output(), keyless.tail()
    assert _online_ids(secure) == before
    assert len(secure.supernodes()) == 1  # nothing got registered on the way


def test_node_without_tls_cannot_connect(secure: LocalDeployment, tmp_path: Path) -> None:
    before = _online_ids(secure)
    retries = ["--max-retries", "2", "--max-wait-time", "20"]
    plain = secure.start_supernode("plaintext", {"keep-ratio": 0.2}, insecure=True, extra=retries)
    other_ca = make_tls_files(tmp_path / "other-ca")
    untrusting = secure.start_supernode("other-ca", {"keep-ratio": 0.2},
                                        root_certificates=other_ca.ca_cert, extra=retries)
    for node in (plain, untrusting):
        assert node.wait(REFUSED_WITHIN_S) not in (None, 0), node.tail()
        assert "Failed to initialize the connection to the SuperLink" in node.output(), node.tail()
        # No Flower API answer at all (a registration refusal would carry a "[code: ...]").
        assert "[code:" not in node.output(), node.tail()
    assert "CERTIFICATE_VERIFY_FAILED" in untrusting.output(), untrusting.tail()
    assert _online_ids(secure) == before
    assert len(secure.supernodes()) == 1
