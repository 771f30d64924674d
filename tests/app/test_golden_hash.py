"""The server path gives the same model, bit for bit, as the code the hashes were pinned from,
on the machine they were pinned on.

Float rounding depends on the CPU model, its vector units, the BLAS and oneDNN kernels and the
library versions, so ``tests/golden_pins.json`` keeps hashes per machine fingerprint
(``golden_run.fingerprint``). Where this machine has pins the test holds the code to them;
where it has none it skips and names the two commands of the refactor proof
(``python tests/golden_run.py record`` before a change, ``check`` after it).

A change that claims to change nothing keeps the pins; a change meant to change the numbers
re-records them in its own commit and says why (with its own proof of equivalence).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import golden_run
import pytest
import torch

SCRIPT = Path(golden_run.__file__)
TEST = Path(__file__)


def _script(*args: str, pins: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"FEDSHARD_GOLDEN_PINS": str(pins)} if pins else {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_fixed_runs_give_the_pinned_models_bit_for_bit() -> None:
    fp = golden_run.fingerprint()
    pinned = golden_run.pinned_hashes(fp, golden_run.load_pins())
    if pinned is None:
        pytest.skip(golden_run.no_pins_reason(fp))
    out = _script()
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert golden_run.differences(got, pinned) == []
    assert set(got) == set(pinned)


def test_a_machine_without_pins_skips_and_names_the_commands(tmp_path: Path) -> None:
    """Another machine's pins (here: this fingerprint with another CPU) are never compared:
    the golden test skips, and its reason says how to record and check pins locally."""
    fp = golden_run.fingerprint()
    other = {**fp, "cpu": "Some Other CPU @ 3.0GHz"}
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps({golden_run.fingerprint_id(other): {
        "fingerprint": other, "recorded": "2026-01-01",
        "hashes": {name: "0" * 64 for name in golden_run.CONFIGS}}}))
    assert golden_run.pinned_hashes(fp, golden_run.load_pins(pins)) is None
    assert golden_run.pinned_hashes(other, golden_run.load_pins(pins)) is not None
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         f"{TEST}::test_fixed_runs_give_the_pinned_models_bit_for_bit"],
        capture_output=True, text=True, timeout=300, cwd=TEST.parents[2],
        env={**os.environ, "FEDSHARD_GOLDEN_PINS": str(pins)})
    assert out.returncode == 0, out.stdout[-3000:]
    assert "1 skipped" in out.stdout
    assert golden_run.RECORD in out.stdout and golden_run.CHECK in out.stdout
    # the check command says the same and fails (exit 2): there is nothing to compare with
    check = _script("check", "--only", "mlp-collective", pins=pins)
    assert check.returncode == 2 and golden_run.RECORD in check.stderr


def test_record_then_check_passes_and_a_one_ulp_change_fails(tmp_path: Path) -> None:
    """The proof on this machine: pins recorded, the same code checks OK, and a model one ulp
    away (one float32 of one tensor moved to its neighbour) is reported as different."""
    pins = tmp_path / "pins.json"
    assert _script("record", "--only", "mlp-collective", pins=pins).returncode == 0
    same = _script("check", "--only", "mlp-collective", pins=pins)
    assert same.returncode == 0 and "GOLDEN OK" in same.stdout, same.stdout + same.stderr[-2000:]
    off = _script("check", "--only", "mlp-collective", "--perturb-ulp", pins=pins)
    assert off.returncode == 1 and "DIFFERS mlp-collective" in off.stdout, off.stdout


def test_one_ulp_off_moves_exactly_one_float_by_one_ulp() -> None:
    state = {"b": torch.tensor([1.0, 2.0]), "a.weight": torch.tensor([[0.5, -3.0]]),
             "n": torch.tensor([7])}
    off = golden_run.one_ulp_off(state)
    diff = {k: (off[k] != state[k]).sum().item() for k in state}
    assert diff == {"a.weight": 1, "b": 0, "n": 0}
    assert off["a.weight"][0, 0].item() == torch.nextafter(
        torch.tensor(0.5), torch.tensor(1.0)).item()
    assert golden_run.state_hash(off) != golden_run.state_hash(state)
