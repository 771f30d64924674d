"""What the paper-scale Shakespeare preset costs on this machine, next to the reduced suite.

Runs one round of ``presets/shakespeare-gpt.toml`` (10 of 672 roles, two local epochs each,
the sequential in-process engine) and one round of ``experiments/shakespeare-reduced.toml``'s
setting (the same, at most 20 local steps per client) in this process, on the data of
``python -m fedshard_lab.shakespeare_build`` (``--data-dir``), and times the central
evaluation on test windows. Times are this process's CPU seconds (``time.process_time``) with
one torch thread, so other jobs on the machine inflate them little; the training data is read
before the clock starts.

From the measured seconds per local step and the role sizes it projects a whole run of the
preset: ``1500 × 10 × 2 × mean ⌈n/10⌉`` steps (a round samples 10 roles uniformly, role
``i`` holding ``n`` training windows) plus a central evaluation of the whole test set every
``eval-every`` rounds. Prints one JSON object.

    python benchmarks/shakespeare_scale.py --data-dir ~/.cache/fedshard/data
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import tomllib
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import cpu_name  # noqa: E402

from fedshard.app.task import build_model, client_dataset  # noqa: E402
from fedshard.data import load_test_set  # noqa: E402
from fedshard_lab.engine.run import app_run_config, run_engine  # noqa: E402


def one_round(overrides: dict[str, object], num_nodes: int, out: Path) -> dict[str, float]:
    """CPU seconds of one round of ``overrides`` (after the data is read) and its steps."""
    cfg = app_run_config(ROOT, {**overrides, "num-server-rounds": 1, "eval-every": 1,
                                "test-max-examples": 500, "results-dir": str(out),
                                "run-name": f"r{len(list(out.iterdir()))}"})
    client_dataset(cfg, 0, num_nodes)  # read and cache the LEAF files before timing
    t0 = time.process_time()
    run_engine(cfg, num_nodes)
    cpu = time.process_time() - t0
    rows = [json.loads(x) for x in (cfg.results_path / "metrics.jsonl").read_text().splitlines()]
    examples, clients = rows[-1]["num-examples"], rows[-1]["nodes-sampled"]
    if cfg.training.max_steps:
        steps = clients * cfg.training.max_steps  # every role holds > 70 batches
    else:  # ⌈n/batch⌉ per epoch, ≈ n/batch + 1/2
        steps = cfg.training.local_epochs * (examples / cfg.training.batch_size + clients * 0.5)
    return {"cpu-s": cpu, "examples": examples, "steps": steps, "cpu-s-per-step": cpu / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True, help="the build's output folder")
    parser.add_argument("--eval-windows", type=int, default=5000,
                        help="test windows timed for the central evaluation")
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = tomllib.loads((ROOT / "presets" / "shakespeare-gpt.toml").read_text())
    preset["data-dir"] = args.data_dir
    suite = tomllib.loads((ROOT / "experiments" / "shakespeare-reduced.toml").read_text())
    reduced = {**suite["defaults"], "method": "collective", "data-dir": args.data_dir,
               "num-partitions": suite["suite"]["num-supernodes"]}
    nodes = int(preset["num-partitions"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        full = one_round(preset, nodes, out)
        small = one_round(reduced, nodes, out)
        cfg = app_run_config(ROOT, {**preset, "results-dir": str(out)})
        sizes = np.array([len(client_dataset(cfg, i, nodes)) for i in range(nodes)])
    batch, epochs = int(preset["batch-size"]), int(preset["local-epochs"])
    steps_per_round = 10 * epochs * float(np.mean(np.ceil(sizes / batch)))

    test = load_test_set("shakespeare", data_dir=args.data_dir, max_examples=None)
    n_test = len(test)
    model = build_model(cfg).eval()
    xs = torch.stack([test[i][0] for i in range(min(args.eval_windows, n_test))])
    t0 = time.process_time()
    with torch.no_grad():
        for k in range(0, len(xs), 256):
            model(xs[k:k + 256])
    eval_per_window = (time.process_time() - t0) / len(xs)

    rounds, every = int(preset["num-server-rounds"]), int(preset["eval-every"])
    train_h = rounds * steps_per_round * full["cpu-s-per-step"] / 3600
    eval_h = (rounds // every + 1) * n_test * eval_per_window / 3600
    print(json.dumps({
        "benchmark": "shakespeare_scale",
        "machine": cpu_name(), "torch": torch.__version__, "python": platform.python_version(),
        "date": date.today().isoformat(), "torch-threads": 1,
        "roles": nodes, "train-windows-per-role": {
            "mean": float(sizes.mean()), "median": float(np.median(sizes)),
            "min": int(sizes.min()), "max": int(sizes.max())},
        "preset-round": full, "reduced-round": small,
        "preset-vs-reduced-cpu-per-round": full["cpu-s"] / small["cpu-s"],
        "expected-steps-per-preset-round": steps_per_round,
        "test-windows": n_test, "eval-cpu-s-per-1000-windows": 1000 * eval_per_window,
        "projected-preset-run-cpu-hours": {"train": train_h, "eval": eval_h,
                                           "total": train_h + eval_h},
        "projected-preset-run-days": (train_h + eval_h) / 24,
    }))


if __name__ == "__main__":
    main()
