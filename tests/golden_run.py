"""A fixed short run through the real server path, hashed: the proof that a refactor changes
nothing (same config -> same model, bit for bit).

``run_server`` (the ServerApp's whole job) over the in-process grid of fedshard's own
ClientApps, on small fake Fashion-MNIST files written from a fixed seed, with one torch thread
(oneDNN's results can depend on the thread count) and torch's CPU kernels held to AVX2 (the
pins were taken on AVX2 machines; on an AMD EPYC with AVX-512, 2026-11-27, ATen's and oneDNN's
AVX-512 kernels rounded differently and all three hashes changed, with no code change; held
to AVX2 there, all three matched). Prints ``{"name": sha256, ...}``; the hash
is over the final ``model.pt`` (sorted keys, dtype, shape and raw bytes of every tensor).

Usage: python tests/golden_run.py [NAME ...]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

# Read by torch when it loads (before `import torch` below): ATen's vectorized CPU kernels and
# oneDNN's convolutions/matmuls use AVX2 code even on an AVX-512 CPU.
os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

CONFIGS: dict[str, dict[str, object]] = {
    # the config: 3 rounds of the MLP, Collective, 2 keep-ratio groups
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


def state_hash(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def run(name: str) -> str:
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
        state = torch.load(root / "out" / name / "model.pt", weights_only=True)
        return state_hash(state)


def main() -> None:
    torch.set_num_threads(1)
    names = sys.argv[1:] or list(CONFIGS)
    print(json.dumps({name: run(name) for name in names}))


if __name__ == "__main__":
    main()
