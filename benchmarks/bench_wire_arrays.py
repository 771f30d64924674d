"""Flower ``Array`` ⇄ NumPy: fedshard's codec (:func:`fedshard.protocol.encode_array`,
:func:`~fedshard.protocol.decode_array`) against Flower's ``Array(x)`` / ``Array.numpy()``.

The arrays are the state dict of fedshard's ``mlp`` at width 200 (14 arrays: four weight
matrices up to 200 × 784, biases and LayerNorm vectors), what each node's train message and
reply carry in a FedAvg round of the engine benchmark. Each repeat times every way once, in
turn, over all 14 arrays; the medians over ``--repeats`` are printed (ms per state dict) with
their ratios, and the check that both ways give the same bytes and values. The last pair puts
the 14 encoded Arrays into an ``ArrayRecord``: Flower's ``ArrayRecord(dict)`` against
:func:`~fedshard.protocol.array_record` (the same record, each Array built once). Prints one
JSON object.

Usage: ``python benchmarks/bench_wire_arrays.py [--repeats 300]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flwr.app import Array, ArrayRecord  # noqa: E402
from machine import cpu_name  # noqa: E402

from fedshard.app.config import RunConfig  # noqa: E402
from fedshard.app.task import build_model  # noqa: E402
from fedshard.protocol import array_record, decode_array, encode_array  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(RunConfig.from_mapping({"model": "mlp", "model-width": 200,
                                                "dataset": "fashion-mnist"}))
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    wire = {k: Array(v) for k, v in state.items()}
    same = all((a.dtype, a.shape, a.stype, a.data) == (b.dtype, b.shape, b.stype, b.data)
               for a, b in ((encode_array(v), wire[k]) for k, v in state.items()))
    same = same and array_record(wire).object_id == ArrayRecord(dict(wire)).object_id
    same = same and all(np.array_equal(decode_array(a), a.numpy()) and
                        decode_array(a).dtype == a.numpy().dtype for a in wire.values())
    ways: dict[str, Callable[[], object]] = {
        "flower_encode": lambda: [Array(v) for v in state.values()],
        "fedshard_encode": lambda: [encode_array(v) for v in state.values()],
        "flower_decode": lambda: [a.numpy() for a in wire.values()],
        "fedshard_decode": lambda: [decode_array(a) for a in wire.values()],
        "flower_record": lambda: ArrayRecord(dict(wire)),
        "fedshard_record": lambda: array_record(wire),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - t0)
    ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    print(json.dumps({
        "device": cpu_name(), "numpy": np.__version__, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "arrays": len(state),
        "bytes": int(sum(v.nbytes for v in state.values())), "repeats": args.repeats,
        "ms_per_state_dict": ms,
        "encode_speedup": round(ms["flower_encode"] / ms["fedshard_encode"], 2),
        "decode_speedup": round(ms["flower_decode"] / ms["fedshard_decode"], 2),
        "record_speedup": round(ms["flower_record"] / ms["fedshard_record"], 2),
        "same_bytes_and_values": same,
    }))


if __name__ == "__main__":
    main()
