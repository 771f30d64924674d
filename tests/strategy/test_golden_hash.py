"""The server path gives the same model, bit for bit, as the code these hashes were taken from.

The hashes were taken at commit 554af70, before ``strategy.py`` was split into its parts
(issue: one concern per module on the server path). A change that claims to change nothing
must keep them; a change that is meant to change the numbers re-pins them in its own commit
and says why (with its own proof of equivalence to rounding).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GOLDEN = {
    "mlp-collective": "37be199bbafaba83840ebfeaac35741dfa8b310fed2da392acb68faee84c11cc",
    "resnet-unbiased-brewer": "be013ab345c18ef8a7e7f5f1752591a418218ae85918e5934e3a9d54b7372191",
    "mlp-prism-wallenius": "2032420dc865acbee7aab8683cc64295d160af046a245438c97d08714c816830",
}


def test_fixed_runs_give_the_pinned_models_bit_for_bit() -> None:
    script = Path(__file__).resolve().parents[1] / "golden_run.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == GOLDEN
