"""The deployment docs, run as written: docs/deployment.md's commands (TLS, SuperNode
authentication, four devices declaring keep ratios 0.25, 0.25, 0.5, 0.5) on 127.0.0.1.

The code blocks are read from the docs and run by bash, with ``$HOME`` a temporary folder and
the docs' fixed ports replaced by free ones; nothing else in them is changed. Checks: every
device is known by the public key it registered (no two share a key, a training seed or a
"posing as the other" warning), each keep ratio buys about what it says in bytes, no keep-ratio
group is a single node (no Top-n warning), and the docs' status commands tell the finished run
from a failed one (a second submission into the finished run's folder).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from deploy_cluster import LocalDeployment, docs_blocks, docs_commands

from fedshard import protocol as P
from fedshard.app.checkpoint import Checkpoint
from fedshard.sampling import Stream, stream_rng

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
DEVICES = 4

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not FMNIST.is_dir(), reason="needs `apt-get install dataset-fashion-mnist` "
                       "(.ci/run installs it)"),
]


def _pem_hex(openssh_public_key: Path) -> str:
    """A registered key as the ServerApp sees it: ``NodeInfo.public_key`` (PEM) as hex."""
    key = serialization.load_ssh_public_key(openssh_public_key.read_bytes())
    return key.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo).hex()


def _status_ok(dep: LocalDeployment, run_id: str, summary: Path) -> tuple[bool, bool]:
    """The docs' two status commands ("Did the run finish?"): (flwr list says completed,
    summary.json says finished)."""
    by_link, by_file = docs_blocks("## Did the run finish?")
    link = dep.shell(by_link.replace("<run-id>", run_id))
    file = dep.shell(by_file.replace("$D/results/deploy/summary.json", str(summary)))
    assert link.returncode in (0, 1), link.stdout
    return link.returncode == 0, file.returncode == 0


def test_the_docs_commands_deploy_four_devices_each_its_own(tmp_path: Path) -> None:
    with LocalDeployment(tmp_path / "deploy") as dep:
        dep.connection = "fedshard"  # the docs' connection name, written by step 3's block
        (certs,) = docs_blocks("## 1. Certificates and node keys (once, by the operator)")
        made = dep.shell(certs)
        assert made.returncode == 0, made.stdout
        (link,) = docs_blocks("## 2. SuperLink (TLS + SuperNode authentication)")
        dep.start_shell("superlink", link, superlink=True)
        (cli,) = docs_blocks("## 3. The `flwr` CLI's connection, and the invited nodes")
        invited = dep.shell(cli)
        assert invited.returncode == 0, invited.stdout + dep.tails()
        (nodes,) = docs_blocks("## 4. SuperNodes (one per device)")
        prefix, *commands = docs_commands(nodes)
        assert len(commands) == DEVICES, commands
        for i, command in enumerate(commands, start=1):
            dep.start_shell(f"node-{i}", f"{prefix}\n{command}")
        dep.wait_online(DEVICES)
        (run,) = docs_blocks("## 5. Run")
        done = dep.shell(run, cwd=ROOT, timeout_s=600)
        out = done.stdout
        assert done.returncode == 0, out[-6000:] + "\n" + dep.tails()
        (dep.root / "run-output.txt").write_text(out)  # the docs quote its end

        # Each device is known by the key it registered: four keys, four training seeds.
        deploy = dep.home / "fedshard-deploy"
        results = deploy / "results" / "deploy"
        registered = {_pem_hex(deploy / "keys" / f"node-{i}.pub")
                      for i in range(1, DEVICES + 1)}
        checkpoint = Checkpoint.load(results)
        assert checkpoint is not None and checkpoint.server_round == 2
        keys = {key for _, key in checkpoint.capabilities.values()}
        assert keys == registered
        ratios = sorted(r for r, _ in checkpoint.capabilities.values())
        assert ratios == [0.25, 0.25, 0.5, 0.5]
        seeds = {int(stream_rng(0, 1, Stream.TRAIN, P.Capabilities(r, k).stream)
                     .integers(2**31 - 1)) for r, k in checkpoint.capabilities.values()}
        assert len(seeds) == DEVICES
        assert "may be posing as the other" not in out, out[-6000:]
        assert "have a single sampled node" not in out, out[-6000:]  # two nodes per ratio

        # Each keep ratio buys about what it says: r < bytes received / dense < 1.3·r.
        rows = [json.loads(x) for x in (results / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1, 2]
        for row in rows[1:]:  # every device was sent its sub-model and answered
            assert row["nodes-sent"] == DEVICES and row["replies-missing"] == 0, row
            for r in (0.25, 0.5):
                assert r < row[f"bytes-sent-ratio-r{r:g}"] < 1.3 * r, row
        # The docs quote the run's last line, what sharding bought: the same bytes and FLOPs.
        (quoted,) = docs_blocks("## 5. Run", lang="text")
        plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
        assert quoted.strip().split(":", 1)[1].strip() in plain, plain[-3000:]

        # The docs' status commands: the run completed, and its summary says finished.
        run_id = re.findall(r"Successfully started run (\d+)", out)[-1]
        assert _status_ok(dep, run_id, results / "summary.json") == (True, True)

        # The same run submitted again (no resume): refused before it owns the folder, so
        # summary.json still says finished, and flwr list tells the failure.
        setup, *_, submit, _ = docs_commands(run)
        again = dep.shell(f"{setup}\n{submit}", cwd=ROOT, timeout_s=300)
        assert again.returncode == 0, again.stdout  # flwr run exits 0 all the same
        assert "ExistingResultsError" in again.stdout, again.stdout[-4000:]
        failed_id = re.findall(r"Successfully started run (\d+)", again.stdout)[-1]
        assert _status_ok(dep, failed_id, results / "summary.json") == (False, True)
    assert dep.leftovers() == []
