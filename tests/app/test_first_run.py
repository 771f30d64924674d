"""README's first run, all its rounds, on the real Fashion-MNIST: the app's default
configuration with the README's 10 simulated nodes (the in-process engine runs the same
strategy, messages and ClientApp code as ``flwr run``). It must show what sharding buys, not
warn against itself or against an honest node, and reach the accuracy README quotes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fedshard_lab.engine import run_engine
from fedshard_lab.engine.run import app_run_config

ROOT = Path(__file__).resolve().parents[2]
FMNIST = Path("/usr/share/datasets/fashion-mnist")
README_NODES = 10  # README's --federation-config "num-supernodes=10 ..."


def _from_fedshard(record: logging.LogRecord) -> bool:
    """A line that fedshard's code logged (through its own loggers or Flower's ``log``)."""
    path = Path(record.pathname).resolve()
    return record.name.startswith("fedshard") or path.is_relative_to(ROOT / "fedshard")


@pytest.mark.skipif(not FMNIST.is_dir(), reason="needs `apt-get install dataset-fashion-mnist` "
                    "(.ci/run installs it)")
def test_the_default_run_saves_what_it_promises_and_warns_about_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = app_run_config(ROOT, {"results-dir": str(tmp_path), "data-dir": str(FMNIST),
                                "download": False})
    with caplog.at_level(logging.INFO):
        summary = run_engine(cfg, README_NODES)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and _from_fedshard(r)]
    assert warnings == []
    assert summary["status"] == "finished"
    # every default keep ratio receives at most (1 + r)/2 of the dense model's bytes
    clients = summary["sharding"]["clients"]
    assert {float(k[1:]) for k in clients} == set(cfg.mixture.ratios)
    for key, cost in clients.items():
        r = float(key[1:])
        assert cost["bytes-received-ratio"] <= (1 + r) / 2, (key, cost)
    # README quotes one machine's record (results/first-run/first-run.json: 77.2 %); the same
    # six rounds on another 2-core AMD EPYC with torch's default two threads reached 74.6 %
    # (another CPU or thread count rounds differently, and six rounds carry that far), so the
    # bound is that the run learned, well above chance (10 %), not the record's digits
    assert summary["final-test-accuracy"] >= 0.70
