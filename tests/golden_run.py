"""Fixed short runs through the real server path, hashed: the proof that a refactor changes
nothing (same config -> same model, bit for bit, on the same machine).

``run_server`` (the ServerApp's whole job) over the in-process grid of fedshard's own
ClientApps, on small fake Fashion-MNIST files written from a fixed seed, with one torch thread
(oneDNN's results can depend on the thread count). The hash is over the final ``model.pt``
(sorted keys, dtype, shape and raw bytes of every tensor).

Float rounding depends on the machine: the CPU model and its vector units, the BLAS and oneDNN
kernels torch and numpy pick for it, their versions. So the hashes are pinned per machine
fingerprint (:func:`fingerprint`) in ``golden_pins.json`` beside this file; a machine without
pins has nothing to compare with and the test skips, naming the commands below.

Usage::

    python tests/golden_run.py record   # before a change: pin this machine's hashes
    python tests/golden_run.py check    # after it: exit 0 if every hash is the pinned one
    python tests/golden_run.py          # print {"name": sha256, ...}

``--only NAME`` (repeatable) limits any of them to some runs. ``FEDSHARD_GOLDEN_PINS`` names
another pins file (the tests use it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
from collections.abc import Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

PINS = Path(__file__).resolve().parent / "golden_pins.json"

RECORD = "python tests/golden_run.py record"
CHECK = "python tests/golden_run.py check"

CONFIGS: dict[str, dict[str, object]] = {
    # 3 rounds of the MLP, Collective, 2 keep-ratio groups
    "mlp-collective": {"model": "mlp", "model-width": 32, "method": "collective",
                       "keep-ratios": "0.25:0.5,0.5:0.5"},
    # convolutions, the other theorem, a design other than CPS
    "resnet-unbiased-brewer": {"model": "resnet18", "model-width": 4, "method": "unbiased",
                               "design": "brewer", "keep-ratios": "0.2:0.5,0.4:0.5"},
    # PriSM + Wallenius with ClipLR off and client-side evaluation on
    "mlp-prism-wallenius": {"model": "mlp", "model-width": 32, "method": "prism-wallenius",
                            "clip-lr": False, "fraction-evaluate": 1.0,
                            "keep-ratios": "0.25:0.5,0.5:0.5"},
}


# ---------------------------------------------------------------------------- the machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _numpy_blas() -> str:
    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"]  # type: ignore[attr-defined]
        return f"{blas.get('name')} {blas.get('version')}"
    except (AttributeError, KeyError, TypeError):
        return "unknown"


def fingerprint() -> dict[str, str]:
    """What decides this machine's float rounding in the golden runs: the CPU model, the vector
    code torch runs on it, the BLAS numpy (the server's SVD) and torch use, and the versions."""
    return {
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "torch-cpu-capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch-blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "numpy": np.__version__,
        "numpy-blas": _numpy_blas(),
        "openblas-coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
        "python": ".".join(platform.python_version_tuple()[:2]),
    }


def fingerprint_id(fp: Mapping[str, str]) -> str:
    """A short stable name of a fingerprint (the key of its pins)."""
    return hashlib.sha256(json.dumps(dict(fp), sort_keys=True).encode()).hexdigest()[:16]


def pins_path() -> Path:
    return Path(os.environ.get("FEDSHARD_GOLDEN_PINS", PINS))


def load_pins(path: Path | None = None) -> dict[str, Any]:
    """The pins file's entries (``{}`` if it does not exist)."""
    path = path or pins_path()
    return json.loads(path.read_text()) if path.is_file() else {}


def pinned_hashes(fp: Mapping[str, str], pins: Mapping[str, Any]) -> dict[str, str] | None:
    """The hashes pinned for exactly this fingerprint, or ``None``."""
    entry = pins.get(fingerprint_id(fp))
    if entry is None or entry.get("fingerprint") != dict(fp):
        return None
    return dict(entry["hashes"])


def no_pins_reason(fp: Mapping[str, str]) -> str:
    return (f"no golden hashes are pinned for this machine ({fp['cpu']}, torch "
            f"{fp['torch']} {fp['torch-cpu-capability']}, numpy {fp['numpy']}; fingerprint "
            f"{fingerprint_id(fp)} not in {pins_path().name}): float rounding differs between "
            f"machines, so there is nothing to compare with. To prove a refactor changes "
            f"nothing on this machine, run `{RECORD}` before the change and `{CHECK}` after it.")


def differences(got: Mapping[str, str], pinned: Mapping[str, str]) -> list[str]:
    """One line per run whose hash is not the pinned one (empty: all equal)."""
    return [f"{name}: {got.get(name)} != pinned {pinned[name]}"
            for name in sorted(pinned) if name in got and got[name] != pinned[name]]


# ---------------------------------------------------------------------------- the runs
def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def one_ulp_off(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the first float of its first floating tensor moved by one ulp."""
    out = {k: v.clone() for k, v in state.items()}
    key = next(k for k in sorted(out) if out[k].is_floating_point() and out[k].numel())
    flat = out[key].view(-1).numpy()
    flat[0] = np.nextafter(flat[0], np.inf, dtype=flat.dtype)
    return out


def run(name: str) -> dict[str, torch.Tensor]:
    """The final model of the golden run ``name``."""
    import fakedata
    from flower_grid import InProcessGrid

    import client_app
    from fedshard.app.config import RunConfig
    from fedshard.app.run import run_server

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fakedata.write_fashion_mnist(root / "data", 120, 40, np.random.default_rng(0))
        cfg = {"dataset": "fashion-mnist", "data-dir": str(root / "data"),
               "num-server-rounds": 3, "num-partitions": 4, "min-available-nodes": 4,
               "fraction-train": 1.0, "batch-size": 8, "results-dir": str(root / "out"),
               "run-name": name, "test-max-examples": 20, "seed": 5, **CONFIGS[name]}
        grid = InProcessGrid(client_app.app, [{"partition-id": i, "num-partitions": 4}
                                              for i in range(4)], cfg)
        run_server(grid, RunConfig.from_mapping(cfg))
        return torch.load(root / "out" / name / "model.pt", weights_only=True)


def hashes(names: Sequence[str], perturb: bool = False) -> dict[str, str]:
    """``{name: state_hash}`` of the golden runs; ``perturb``: of each model one ulp off."""
    torch.set_num_threads(1)
    return {name: state_hash(one_ulp_off(s) if perturb else s)
            for name, s in ((n, run(n)) for n in names)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", nargs="?", choices=("print", "record", "check"),
                        default="print")
    parser.add_argument("--only", action="append", choices=sorted(CONFIGS),
                        help="run only this config (repeatable)")
    parser.add_argument("--perturb-ulp", action="store_true",
                        help="hash each model with one float moved by one ulp (to see that "
                        "check fails on the smallest change)")
    args = parser.parse_args(argv)
    names = args.only or list(CONFIGS)
    fp = fingerprint()
    got = hashes(names, args.perturb_ulp)
    if args.action == "print":
        print(json.dumps(got))
        return 0
    path = pins_path()
    pins = load_pins(path)
    if args.action == "record":
        key = fingerprint_id(fp)
        old = pins.get(key, {}).get("hashes", {}) if pins.get(key, {}).get(
            "fingerprint") == fp else {}
        pins[key] = {"fingerprint": fp, "recorded": date.today().isoformat(),
                     "hashes": {**old, **got}}
        path.write_text(json.dumps(pins, indent=2, sort_keys=True) + "\n")
        print(f"pinned {len(got)} hash(es) for this machine ({key}) in {path}")
        return 0
    pinned = pinned_hashes(fp, pins)
    if pinned is None:
        print(no_pins_reason(fp), file=sys.stderr)
        return 2
    missing = sorted(set(names) - set(pinned))
    diff = differences(got, pinned)
    for line in diff:
        print(f"DIFFERS {line}")
    if missing:
        print(f"not pinned on this machine: {', '.join(missing)} (run `{RECORD}`)")
    if diff or missing:
        return 1
    print(f"GOLDEN OK: {len(got)} run(s) give the pinned models bit for bit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
