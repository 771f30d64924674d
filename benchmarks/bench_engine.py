"""Seconds per round: ``flwr run`` (Ray) vs fedshard's in-process engine vs a bare torch loop.

The same rounds three ways, side by side, interleaved (each repeat runs every path once, in
turn), on one device:

* **flower**: ``flwr run`` of this app (local SuperLink, Ray simulation engine, one ClientApp
  per node), launched as the experiment runner launches it
  (:func:`fedshard_lab.experiments.launch.run_simulation`) while holding the lock file
  ``/tmp/fedshard-flwr.lock`` (two local SuperLinks would collide on their port);
* **sequential** / **batched**: :func:`fedshard_lab.engine.engine_grid` under
  :func:`fedshard.app.run.run_server` (what :func:`fedshard_lab.engine.run_engine` runs), the
  same ServerApp code (strategy, central evaluation, results, checkpoints) over the in-process
  engine;
* **bare**: a single-process torch loop doing the same training, averaging and evaluation as
  dense FedAvg: every client copies the global model and trains it (SGD, momentum 0.9, the
  same lr, batches and epochs) on its examples held as tensors, then the weighted average,
  then the same test examples are evaluated.

A path's s/round is the median of ``round-s`` in its ``metrics.jsonl`` over the rounds after the
first (which includes reading the data and warm-up); the bare loop times its rounds the same
way. ``engine_vs_bare`` pairs rounds: in every engine run, one round of a bare loop runs right
before each engine round's training (timed apart and taken out of its ``round-s``), and the
median of the per-round ratios over all repeats is printed. The speed of a shared cloud CPU
drifts by ±30 % over seconds, so ratios of whole runs (``engine_vs_bare_per_run``, and the
``flower`` ratios: each path against that repeat's bare run, median over repeats) move by
that much from one run of this script to the next. ``max_rel_diff_float64`` is the largest
relative difference, in float64, between the engine(s) and fedshard's real ClientApp over
Flower's Message API (the in-process grid of ``tests/flower_grid.py``) after
``--equality-rounds`` rounds of every method measured: final model, every reply's arrays and
metrics (each client cut to ``--equality-examples``).

Presets:

* ``fmnist`` (default; a CPU): ``mlp`` width 200, 10 clients × 500 real Fashion-MNIST
  images (the first 5,000 of the training set, from ``--fmnist``), 1 epoch, batch 32, all
  clients every round, methods ``none`` (FedAvg) and ``collective`` at r = 0.1, 1,000 test
  images evaluated every round;
* ``cifar10`` (a GPU, ``--device cuda``): ResNet-18 (GroupNorm) width 64, 10 clients × 500
  CIFAR-10-shaped synthetic images, 2 epochs, batch 32, Collective r = 0.1; the engine is the
  batched one and ``speedup_batched_vs_sequential`` its gain over the per-client path.

``--tiny`` shrinks either preset to seconds (for a test). Prints one JSON object.

``--profile`` adds where the ``sequential`` engine's round goes: wall-clock seconds per
round, over whole rounds after the first, of each part of :data:`PARTS` (receiving the
sub-model, training and within it the client rules' step hooks, the reply, the server's
configure, reply checks, receipts, robust aggregation, the trust record, the end-of-round
callbacks, central evaluation and the checkpoint (the bare loop writes none), the array
codec), under ``profile`` (:class:`PartTimer`: each part's functions wrapped in a timer, a
microsecond a call, so Python-heavy parts are not inflated as under cProfile).

``--against REV`` is the regression guard: the ``sequential`` engine of git revision ``REV``
(its files from ``git archive``) and of this work tree, side by side on the same machine in
one invocation, each run in its own process importing its own tree (``--code``), alternating
(the side that goes first swaps every repeat), the same benchmark code on both sides; it
prints one JSON with both sides' ``engine_vs_bare`` (the median of every paired round),
s/round and, with ``--profile``, both profiles.

Usage: ``python benchmarks/bench_engine.py [--preset fmnist|cifar10] [--device cpu|cuda]
[--repeats 5] [--rounds 4] [--paths bare,sequential,flower] [--tiny] [--profile]
[--against REV] [--out FILE]``; ``--out`` also writes the JSON (with the machine, torch
version, date, command and load average) there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import functools
import importlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _code_tree(argv: list[str]) -> Path:
    """The tree whose ``fedshard`` and ``fedshard_lab`` this process runs: ``--code DIR``
    (read before anything imports them; ``--against`` starts its runs with it), else this
    repository."""
    for i, arg in enumerate(argv):
        if arg == "--code" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve()
        if arg.startswith("--code="):
            return Path(arg.split("=", 1)[1]).resolve()
    return ROOT


CODE = _code_tree(sys.argv)
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(CODE / "lab"))
sys.path.insert(0, str(CODE))

import fakedata  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.common import logger as flwr_logger  # noqa: E402
from machine import cpu_name, emit, provenance  # noqa: E402

from fedshard.app.config import RunConfig  # noqa: E402
from fedshard.app.run import run_server  # noqa: E402
from fedshard.app.task import build_model, client_dataset  # noqa: E402
from fedshard.data import load_test_set  # noqa: E402
from fedshard.data.image_files import read_idx  # noqa: E402
from fedshard_lab.engine import engine_grid  # noqa: E402
from fedshard_lab.experiments.launch import run_simulation  # noqa: E402

FLWR_LOCK = Path("/tmp/fedshard-flwr.lock")


def tensors(dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """All examples of one of fedshard's data sets (``HasTensors``) as two tensors."""
    inputs, targets = dataset.example_tensors()
    return inputs, targets


def batched_step(settings: dict[str, Any]) -> str:
    """The batched engine's own choice of step (``step_route``) for this run's model, asked
    of the dense model (its sub-models keep its forward and, at these settings, fold the same
    layers). A tree from before folding had only vmap."""
    try:
        from fedshard_lab.engine.batched import step_route
    except ImportError:
        return "vmap (this tree has no folded step)"
    return step_route(build_model(RunConfig.from_mapping(settings)))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- data

def _idx_file(folder: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (folder / name).is_file():
            return folder / name
    found = sorted(folder.rglob(f"{stem}*"))
    if not found:
        raise SystemExit(f"bench_engine: {stem} not found under {folder}; give --fmnist")
    return found[0]


def write_data(preset: str, root: Path, n_train: int, n_test: int, fmnist: Path) -> None:
    """``n_train`` training and ``n_test`` test images in the data set's own file format."""
    if preset == "cifar10":  # synthetic: this measures time, not accuracy
        fakedata.write_cifar10(root, -(-n_train // 5), n_test, np.random.default_rng(0))
        return
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = read_idx(_idx_file(fmnist, f"{prefix}-images-idx3-ubyte"))[:n]
        labels = read_idx(_idx_file(fmnist, f"{prefix}-labels-idx1-ubyte"))[:n]
        fakedata.write_idx(root / f"{prefix}-images-idx3-ubyte.gz", np.ascontiguousarray(images))
        fakedata.write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", np.ascontiguousarray(labels))


# ---------------------------------------------------------------------------- paths
def _round_s(folder: Path) -> float:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steady = [float(r["round-s"]) for r in rows if int(r.get("round", 0)) >= 2]
    if not steady:
        raise SystemExit(f"bench_engine: {folder} has no round ≥ 2 (use --rounds ≥ 2)")
    return statistics.median(steady)


@contextlib.contextmanager
def flwr_lock() -> Iterator[None]:
    with FLWR_LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_flower(settings: dict[str, Any], clients: int, gpus: float) -> float:
    with flwr_lock():
        sim = run_simulation(ROOT, settings, num_supernodes=clients, client_num_cpus=1,
                             client_num_gpus=gpus, timeout_s=3600)
    folder = Path(settings["results-dir"]) / settings["run-name"]
    if sim.returncode != 0 or not (folder / "summary.json").is_file():
        raise SystemExit(f"bench_engine: flwr run failed ({sim.returncode}):\n"
                         + sim.output[-3000:])
    return _round_s(folder)


def run_in_process(settings: dict[str, Any], clients: int, engine: str,
                   device: str) -> tuple[float, list[float]]:
    """The engine's s/round, and its per-round ratios to a bare round run just before it.

    Each round, right before the engine trains its clients, the bare loop runs one round of
    its own (timed apart and taken out of the engine's ``round-s``): the two are measured
    within a second of each other, so a machine whose speed drifts over seconds (a shared
    cloud CPU) moves both alike."""
    cfg = RunConfig.from_mapping(settings)
    grid = engine_grid(cfg, clients, engine=engine, device=device)
    bare = BareLoop(cfg, clients, device)
    inner, bare_s = grid.trainer, dict[int, float]()

    def paired(jobs: Any) -> Any:
        server_round = len(bare_s) + 1
        bare_s[server_round] = bare.round(server_round)
        return inner(jobs)

    grid.trainer = paired
    run_server(grid, cfg, device=device)
    folder = Path(settings["results-dir"]) / settings["run-name"]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    engine_s = {int(r["round"]): float(r["round-s"]) - bare_s[int(r["round"])]
                for r in rows if int(r.get("round", 0)) >= 2}
    return (statistics.median(engine_s.values()),
            [engine_s[r] / bare_s[r] for r in sorted(engine_s)])


class BareLoop:
    """Dense FedAvg in a plain loop: local SGD-m per client, weighted average, evaluation."""

    def __init__(self, cfg: RunConfig, clients: int, device: str) -> None:
        self.cfg, self.device = cfg, device
        self.model = build_model(cfg).to(device)
        self.work = copy.deepcopy(self.model)
        self.data = []
        for pid in range(clients):
            x, y = tensors(client_dataset(cfg, pid, clients))
            self.data.append((x.to(device), y.to(device)))
        test = load_test_set(cfg.dataset, data_dir=cfg.data_dir,
                             max_examples=cfg.test_max_examples or None)
        tx, ty = tensors(test)
        self.test = (tx.to(device), ty.to(device))

    def round(self, server_round: int) -> float:
        cfg, recipe = self.cfg, self.cfg.training
        sync(self.device)
        t0 = time.perf_counter()
        total = {k: torch.zeros_like(v) for k, v in self.model.state_dict().items()}
        weight = 0
        for pid, (x, y) in enumerate(self.data):
            self.work.load_state_dict(self.model.state_dict())
            opt = torch.optim.SGD(self.work.parameters(), lr=recipe.base_lr,
                                  momentum=recipe.momentum, weight_decay=recipe.weight_decay)
            seed = int(np.random.default_rng([cfg.seed, server_round, pid]).integers(2**62))
            gen = torch.Generator().manual_seed(seed)
            for _ in range(recipe.local_epochs):
                order = torch.randperm(len(x), generator=gen).to(self.device)
                for start in range(0, len(x), recipe.batch_size):
                    idx = order[start:start + recipe.batch_size]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(self.work(x[idx]), y[idx]).backward()
                    opt.step()
            for k, v in self.work.state_dict().items():
                total[k] += len(x) * v
            weight += len(x)
        self.model.load_state_dict({k: v / weight for k, v in total.items()})
        self.model.eval()
        with torch.no_grad():
            tx, ty = self.test
            correct = sum(int((self.model(tx[i:i + 256]).argmax(-1) == ty[i:i + 256]).sum())
                          for i in range(0, len(tx), 256))
        self.model.train()
        sync(self.device)
        assert 0 <= correct <= len(tx)
        return time.perf_counter() - t0


def run_bare(cfg: RunConfig, clients: int, device: str, rounds: int) -> float:
    loop = BareLoop(cfg, clients, device)
    return statistics.median([loop.round(r) for r in range(1, rounds + 1)][1:])


# ---------------------------------------------------------------------------- equality
def max_rel_diff_float64(settings: dict[str, Any], clients: int, engines: list[str],
                         rounds: int, examples: int) -> float:
    """Largest relative difference, in float64, of the engines against the real ClientApp
    over Flower's Message API (final model, every train/evaluate reply)."""
    from flower_grid import InProcessGrid
    from flwr.app import ArrayRecord, ConfigRecord
    from torch.utils.data import TensorDataset

    import client_app
    from fedshard.app import task
    from fedshard.app.run import build_strategy
    from fedshard_lab.engine import engine_grid

    cfg = RunConfig.from_mapping({**settings, "num-server-rounds": rounds,
                                  "client-device": "cpu", "server-device": "cpu",
                                  "cuda-graph": False})

    def data(c: RunConfig, pid: int, num: int) -> TensorDataset:
        x, y = tensors(client_dataset(c, pid, num))
        return TensorDataset(x[:examples].double(), y[:examples])

    def drive(grid: Any, first: int) -> tuple[dict[str, np.ndarray], dict[Any, Any]]:
        model = build_model(cfg)
        strategy = build_strategy(cfg, model, "cpu")
        replies: dict[Any, Any] = {}
        calls: dict[str, int] = {}
        inner = grid.send_and_receive

        def send(messages: Any, *, timeout: float | None = None) -> list[Any]:
            sent = list(messages)
            for kind in {m.metadata.message_type for m in sent}:
                calls[kind] = calls.get(kind, 0) + 1
            out = list(inner(sent, timeout=timeout))
            for r in out:
                kind = r.metadata.message_type
                if kind in ("train", "evaluate"):
                    replies[(calls[kind], kind, r.metadata.src_node_id - first)] = r
            return out

        grid.send_and_receive = send
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=rounds, timeout=600, train_config=ConfigRecord())
        return {k: a.numpy() for k, a in result.arrays.items()}, replies

    def rel(a: Any, b: Any) -> float:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300)) \
            if b.size else 0.0

    old = torch.get_default_dtype()
    old_data, old_templates = client_app.client_dataset, task._TEMPLATES
    torch.set_default_dtype(torch.float64)
    client_app.client_dataset = data  # type: ignore[assignment]  # float64 data
    task._TEMPLATES = {}
    worst = 0.0
    try:
        ref_model, ref = drive(InProcessGrid(client_app.app, [
            {"partition-id": i, "num-partitions": clients} for i in range(clients)],
            cfg.as_dict(), first_node_id=1000), 1000)
        for engine in engines:
            grid = engine_grid(cfg, clients, engine=engine, device="cpu",
                               data=lambda pid, num: data(cfg, pid, num))
            got_model, got = drive(grid, 1)
            if got.keys() != ref.keys() or any(r.has_error() for r in got.values()):
                raise SystemExit(f"bench_engine: the {engine} engine's replies differ in kind "
                                 "or are errors")
            worst = max(worst, *(rel(got_model[k], ref_model[k]) for k in ref_model))
            for key, r in ref.items():
                g = got[key]
                for name, record in r.content.array_records.items():
                    for k in record:
                        worst = max(worst, rel(g.content.array_records[name][k].numpy(),
                                               record[k].numpy()))
                for name, metrics in r.content.metric_records.items():
                    for k, v in metrics.items():
                        worst = max(worst, rel(g.content.metric_records[name][k], v))
    finally:
        torch.set_default_dtype(old)
        client_app.client_dataset, task._TEMPLATES = old_data, old_templates
    return worst


# ---------------------------------------------------------------------------- profile
#: The parts of a round that ``--profile`` reports, by name ("a/b": part b, inside part a):
#: the functions (``"module:qualname"``) whose wall-clock time, with what they call, is that
#: part.
PARTS: dict[str, tuple[str, ...]] = {
    # the nodes' side (the engine's grid calls fedshard's handlers)
    "client/receive": ("fedshard.client.shard:Shard.from_message",),
    "client/receive/settings": ("fedshard.protocol.settings:TrainSettings.from_record",),
    "client/receive/submodel": ("fedshard.client.shard:submodel_from_record",),
    "client/train": ("fedshard.client.train.loop:_epochs",),
    "client/train/forward-loss": ("fedshard.client.train.step:EagerStep.loss",),
    "client/train/backward": ("torch._tensor:Tensor.backward",),
    "client/train/optimizer-step": ("torch.optim.sgd:SGD.step",),
    "client/train/optimizer-step/rules": ("fedshard.client.train.rules:ClientRules.before_step",
                                          "fedshard.client.train.rules:ClientRules.after_step"),
    "client/reply": ("fedshard.client.shard:Shard.reply",),
    # the server's side
    "server/configure": ("fedshard.server.base:KeepRatioStrategy.configure_train",),
    "server/configure/callbacks": ("fedshard.server.callbacks:run_configure",),
    "server/aggregate": ("fedshard.server.rounds:RoundState.finish",),
    "server/aggregate/reply-checks": ("fedshard.protocol.shards:check_train_reply",),
    "server/aggregate/receipts": ("fedshard.protocol.receipts:read_receipt",),
    "server/aggregate/robust": ("fedshard.server.robust:align_replies",
                                "fedshard.server.robust:spread_replies",
                                "fedshard.server.rounds:RoundState.bound_weights"),
    "server/aggregate/trust-record": ("fedshard.server.trust_record:TrustStage.weigh",
                                      "fedshard.server.trusted:TrustStage.weigh"),  # (before)
    "server/aggregate/combine": ("fedshard.server.rounds:RoundState.aggregate",),
    "server/end-round": ("fedshard.server.callbacks:run_round",),
    "server/end-round/central-evaluation": ("fedshard.client.train.loop:evaluate",),
    "server/end-round/checkpoint": ("fedshard.app.checkpoint:Checkpoint.save",),
    # across both sides
    "array-codec": ("fedshard.protocol.arrays:decode_array",
                    "fedshard.protocol.arrays:encode_array"),
}


def resolve_function(spec: str) -> tuple[Any, str, Any] | None:
    """``"module:qualname"`` -> (the module or class holding it, its name there, the object
    as stored: a function, or a ``staticmethod``/``classmethod``); ``None`` if the code
    measured has no such function."""
    module_name, qualname = spec.split(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    found = (inspect.getattr_static(owner, name, None) if inspect.isclass(owner)
             else getattr(owner, name, None))
    raw = found.__func__ if isinstance(found, (staticmethod, classmethod)) else found
    return (owner, name, found) if callable(raw) else None


class PartTimer:
    """Wall-clock seconds of each of :data:`PARTS`, summed over the calls made while
    :attr:`active`: each function is replaced, in its class or module and in every loaded
    ``fedshard``/``fedshard_lab`` module that imported it by name, by a wrapper that times the
    outermost call (a recursive call counts once); :meth:`installed` puts the originals back.
    A wrapper costs about a microsecond a call, much less than cProfile's per-call cost, so
    Python-heavy parts are not inflated against torch's kernels."""

    def __init__(self, parts: dict[str, tuple[str, ...]]) -> None:
        self.parts = parts
        self.active = False
        self.seconds: dict[str, float] = {}
        self.found: set[str] = set()

    @contextlib.contextmanager
    def installed(self) -> Iterator[PartTimer]:
        undo: list[tuple[Any, str, Any]] = []
        try:
            for part, specs in self.parts.items():
                for spec in specs:
                    hit = resolve_function(spec)
                    if hit is None:
                        continue
                    self.found.add(part)
                    owner, name, stored = hit
                    wrapped = self._wrap(part, stored)
                    raw = stored.__func__ if isinstance(stored, (staticmethod, classmethod)) \
                        else stored
                    undo.append((owner, name, stored))
                    setattr(owner, name, wrapped)
                    for module in list(sys.modules.values()):
                        held = getattr(module, "__dict__", None)
                        if not held or not str(getattr(module, "__name__", "")).startswith(
                                ("fedshard", "fedshard_lab")) or module is owner:
                            continue
                        for attr, value in list(held.items()):
                            if value is raw:
                                undo.append((module, attr, value))
                                setattr(module, attr, wrapped)
            yield self
        finally:
            for owner, name, stored in reversed(undo):
                setattr(owner, name, stored)

    def _wrap(self, part: str, stored: Any) -> Any:
        raw = stored.__func__ if isinstance(stored, (staticmethod, classmethod)) else stored
        depth = [0]

        @functools.wraps(raw)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active or depth[0]:
                return raw(*args, **kwargs)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return raw(*args, **kwargs)
            finally:
                depth[0] -= 1
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t0

        return type(stored)(timed) if isinstance(stored, (staticmethod, classmethod)) \
            else timed

    def per_round(self, rounds: int) -> dict[str, float | None]:
        """Seconds per round of each part, ``None`` for a part none of whose functions
        exists in the code measured."""
        return {part: round(self.seconds.get(part, 0.0) / rounds, 4)
                if part in self.found else None for part in self.parts}


def profile_round(settings: dict[str, Any], clients: int, device: str) -> dict[str, Any]:
    """Where the engine's round goes: wall-clock time of each of :data:`PARTS`
    (:class:`PartTimer`) over the rounds after the first (from the training of round 2 to
    the training of the last round: whole rounds, warm), in seconds per round, with
    ``round`` the whole round and ``other`` what no top-level part holds (Flower's strategy
    loop, the engine's grid, logging, the metrics file)."""
    cfg = RunConfig.from_mapping(settings)
    if cfg.num_server_rounds < 3:
        raise SystemExit("bench_engine: --profile needs --rounds ≥ 3 (it profiles whole "
                         "rounds after the first)")
    grid = engine_grid(cfg, clients, engine="sequential", device=device)
    inner, calls, marks = grid.trainer, [0], dict[str, float]()
    timer = PartTimer(PARTS)

    def trainer(jobs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            timer.active, marks["start"] = True, time.perf_counter()
        elif calls[0] == cfg.num_server_rounds:
            timer.active, marks["stop"] = False, time.perf_counter()
        return inner(jobs)

    grid.trainer = trainer
    with timer.installed():
        run_server(grid, cfg, device=device)
    rounds = cfg.num_server_rounds - 2
    parts = timer.per_round(rounds)
    total = (marks["stop"] - marks["start"]) / rounds
    top = [v for k, v in parts.items() if k.count("/") == 1
           and k.split("/")[0] in ("client", "server") and v is not None]
    return {"round": round(total, 4), **parts, "other": round(total - sum(top), 4)}


# ---------------------------------------------------------------------------- against
def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench_engine: git {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip()


def resolve_revision(rev: str) -> str:
    """The commit ``rev`` names in this repository.

    Raises
    ------
    SystemExit
        Naming ``rev`` when git does not know it (nothing was run)."""
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                          f"{rev}^{{commit}}"], capture_output=True, text=True, check=False)
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"bench_engine: --against {rev!r}: not a commit of {ROOT} (expected "
                         "a revision git knows, e.g. a commit hash, tag or branch); nothing "
                         "was run")
    return out.stdout.strip()


def child_command(args: argparse.Namespace, code: Path) -> list[str]:
    """One side of ``--against``: this script, one repeat of the bare loop and the
    ``sequential`` engine, over the ``fedshard``/``fedshard_lab`` of ``code``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--code", str(code),
           "--preset", args.preset, "--device", args.device, "--repeats", "1",
           "--rounds", str(args.rounds), "--paths", "bare,sequential",
           "--equality-rounds", "0", "--fmnist", str(args.fmnist)]
    if args.methods:
        cmd += ["--methods", args.methods]
    if args.tiny:
        cmd.append("--tiny")
    if args.profile:
        cmd.append("--profile")
    return cmd


def against_plan(args: argparse.Namespace, trees: dict[str, Path]
                 ) -> list[tuple[str, list[str]]]:
    """The runs of ``--against``, in order: ``args.repeats`` of each side, alternating, the
    side that goes first swapping every repeat (ABBA: a drift of the machine's speed over
    the runs moves both sides alike)."""
    names = list(trees)
    plan = []
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            plan.append((name, child_command(args, trees[name])))
    return plan


def run_against(args: argparse.Namespace) -> dict[str, Any]:
    """The engine of revision ``args.against`` and of this work tree side by side: each run
    in its own process (:func:`child_command`, over :func:`against_plan`), the revision's
    files from ``git archive`` into a temporary folder."""
    commit = resolve_revision(args.against)
    runs: dict[str, list[dict[str, Any]]] = {"against": [], "work-tree": []}
    with tempfile.TemporaryDirectory(prefix="bench-engine-against-") as tmp:
        tree = Path(tmp) / commit[:12]
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit],
                                 capture_output=True, check=False)
        if archive.returncode != 0:
            raise SystemExit(f"bench_engine: git archive {commit} failed: "
                             f"{archive.stderr.decode(errors='replace').strip()}")
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        env = {**os.environ, "PYTHONPATH": ""}  # each side imports its own tree (--code)
        for name, cmd in against_plan(args, {"against": tree, "work-tree": ROOT}):
            out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env,
                                 cwd=ROOT)
            if out.returncode != 0:
                raise SystemExit(f"bench_engine: the {name} run failed ({out.returncode}):\n"
                                 + out.stderr[-3000:])
            runs[name].append(json.loads(out.stdout))
    first = runs["work-tree"][0]
    methods = list(first["s_per_round"]["sequential"])

    def median_of(side: str, pick: Any) -> dict[str, float]:
        return {m: round(statistics.median(x for r in runs[side] for x in pick(r, m)), 4)
                for m in methods}

    def per_part(side: str, m: str) -> dict[str, float | None]:
        rows = [r["profile"][m] for r in runs[side]]
        out: dict[str, float | None] = {}
        for k in rows[0]:
            vals = [row.get(k) for row in rows]
            out[k] = (round(statistics.median(v for v in vals if v is not None), 4)
                      if all(v is not None for v in vals) else None)
        return out

    sides = ("against", "work-tree")
    status = _git("status", "--porcelain")
    return {
        "against": {"revision": args.against, "commit": commit},
        "work_tree": {"commit": _git("rev-parse", "HEAD"),
                      "uncommitted_changes": len(status.splitlines())},
        "preset": first["preset"], "shape": first["shape"], "repeats": args.repeats,
        "rounds": args.rounds, "engine": "sequential", "torch_threads": first["torch_threads"],
        "engine_vs_bare": {side: median_of(side, lambda r, m: r["engine_vs_bare_rounds"][m])
                           for side in sides},
        "s_per_round": {side: {path: median_of(side, lambda r, m, p=path:
                                               [r["s_per_round"][p][m]])
                               for path in ("bare", "sequential")} for side in sides},
        "profile": {side: {m: per_part(side, m) for m in methods} for side in sides}
        if args.profile else None,
        "runs": {side: [{"engine_vs_bare": r["engine_vs_bare"],
                         "load-average": r["load-average"]} for r in runs[side]]
                 for side in sides},
    }


# ---------------------------------------------------------------------------- pfl
PFL_DRIVER = ROOT / "benchmarks" / "pfl_fedavg.py"


def _settings(args: argparse.Namespace, data_dir: Path, out_dir: Path) -> dict[str, Any]:
    """The run config of both presets' rounds (``method`` and ``keep-ratios`` apart)."""
    cifar = args.preset == "cifar10"
    clients, _, test = _sizes(args)
    return {"dataset": "cifar10" if cifar else "fashion-mnist",
            "data-dir": str(data_dir), "model": "resnet18" if cifar else "mlp",
            "model-width": _width(args), "num-partitions": clients,
            "min-available-nodes": clients, "fraction-train": 1.0, "fraction-evaluate": 0.0,
            "batch-size": 32, "local-epochs": 2 if cifar else 1,
            "num-server-rounds": args.rounds, "test-max-examples": test, "eval-every": 1,
            "seed": 0, "client-device": args.device, "server-device": args.device,
            "results-dir": str(out_dir), "overwrite": True, "cuda-graph": args.cuda_graph}


def _sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """Clients, examples per client, test examples."""
    return (2, 40, 40) if args.tiny else (10, 500, 1000)


def _width(args: argparse.Namespace) -> int:
    if args.preset == "cifar10":
        return 4 if args.tiny else 64
    return 16 if args.tiny else 200


def pfl_unavailable(python: Path | None) -> str | None:
    """Why pfl's side cannot run with the interpreter ``python`` (``None``: it can)."""
    if python is None:
        return "no --pfl-python given"
    if not python.is_file():
        return f"--pfl-python {python}: no such file"
    probe = subprocess.run([str(python), "-c", "import pfl.model.pytorch"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"--pfl-python {python}: pfl[pytorch] is not importable there ({last})"
    return None


def pfl_input(cfg: RunConfig, clients: int, rounds: int) -> dict[str, Any]:
    """What ``pfl_fedavg.py`` reads: the same model, client examples, test examples and
    recipe as the bare loop's (:class:`BareLoop`), as torch objects only."""
    model = build_model(cfg)
    net = getattr(model, "net", None)
    if not isinstance(net, torch.nn.Sequential):
        raise SystemExit(f"bench_engine: pfl's side needs the MLP (a torch Sequential), "
                         f"got {type(model).__name__}; nothing was run for pfl")
    test = load_test_set(cfg.dataset, data_dir=cfg.data_dir,
                         max_examples=cfg.test_max_examples or None)
    recipe = cfg.training
    return {"net": net, "clients": [tensors(client_dataset(cfg, pid, clients))
                                    for pid in range(clients)],
            "test": tensors(test), "lr": recipe.base_lr, "momentum": recipe.momentum,
            "weight_decay": recipe.weight_decay, "batch": recipe.batch_size,
            "epochs": recipe.local_epochs, "rounds": rounds, "seed": cfg.seed,
            "threads": 1}  # as the bare loop and the engine on a CPU


def run_pfl(args: argparse.Namespace) -> dict[str, Any]:
    """pfl's FedAvg against the bare loop (``pfl_fedavg.py``, run ``--repeats`` times with
    ``--pfl-python``): ``{"pfl": {...}}``, or ``{"pfl": None, "pfl_reason": why}`` when
    it cannot run (no ``--pfl-python``, pfl not importable there, not the fmnist preset)."""
    if args.preset != "fmnist" or args.device != "cpu":
        return {"pfl": None, "pfl_reason": "pfl's side runs the fmnist preset on a CPU only"}
    why = pfl_unavailable(args.pfl_python)
    if why is not None:
        return {"pfl": None, "pfl_reason": why}
    clients, examples, test = _sizes(args)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-pfl-") as tmp:
        root = Path(tmp)
        write_data(args.preset, root / "data", clients * examples, test, args.fmnist)
        cfg = RunConfig.from_mapping({**_settings(args, root / "data", root / "out"),
                                      "method": "none", "keep-ratios": "1.0",
                                      "run-name": "pfl"})
        torch.save(pfl_input(cfg, clients, args.rounds), root / "pfl.pt")
        for _ in range(args.repeats):
            out = subprocess.run([str(args.pfl_python), str(PFL_DRIVER), str(root / "pfl.pt")],
                                 capture_output=True, text=True, check=False,
                                 env={**os.environ, "PYTHONPATH": ""}, cwd=ROOT)
            if out.returncode != 0:
                raise SystemExit(f"bench_engine: pfl's run failed ({out.returncode}):\n"
                                 + out.stderr[-3000:])
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ratios = [x for r in runs for x in r["pfl_vs_bare_rounds"]]
    return {"pfl": {"pfl_vs_bare": round(statistics.median(ratios), 4),
                    "s_per_round": {k: round(statistics.median(r["s_per_round"][k]
                                                               for r in runs), 4)
                                    for k in ("bare", "pfl")},
                    "version": runs[0]["pfl"], "torch": runs[0]["torch"],
                    "torch_threads": runs[0]["torch_threads"], "method": "none",
                    "repeats": args.repeats, "rounds": args.rounds,
                    "pfl_vs_bare_rounds": ratios}}


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("fmnist", "cifar10"), default="fmnist")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (≥ 2)")
    ap.add_argument("--paths", default=None,
                    help="comma-separated among bare, sequential, batched, flower (default: "
                    "bare,sequential,flower for fmnist; bare,sequential,batched for cifar10)")
    ap.add_argument("--methods", default=None,
                    help="comma-separated sharding methods (default: none,collective for "
                    "fmnist; collective for cifar10)")
    ap.add_argument("--tiny", action="store_true", help="a size that runs in seconds")
    ap.add_argument("--fmnist", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    ap.add_argument("--cuda-graph", action="store_true",
                    help="cuda-graph=true for the per-client paths (sequential, flower): the "
                    "fastest per-client baseline on a GPU; the batched engine does not use it")
    ap.add_argument("--equality-rounds", type=int, default=1, help="0: skip the check")
    ap.add_argument("--equality-examples", type=int, default=100)
    ap.add_argument("--profile", action="store_true",
                    help="also profile the sequential engine's round (wall-clock timers, rounds "
                    "after the first): seconds per round of each part (PARTS), under "
                    "'profile'")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="run the sequential engine of git revision REV and of this work "
                    "tree side by side (alternating, one process per run, --repeats of each; "
                    "paths bare,sequential) and print one JSON with both")
    ap.add_argument("--code", type=Path, default=None,
                    help="the tree whose fedshard and fedshard_lab run (default: this "
                    "repository; --against sets it for its runs)")
    ap.add_argument("--pfl-python", type=Path, default=None, metavar="PATH",
                    help="an interpreter with pfl[pytorch] installed: also run pfl-research's "
                    "FedAvg on the same rounds against the bare loop (benchmarks/pfl_fedavg.py, "
                    "--repeats runs; fmnist on a CPU), under 'pfl'; without it 'pfl' is null "
                    "and 'pfl_reason' says why")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.against is not None:
        if args.rounds < (3 if args.profile else 2) or args.repeats < 1 or args.paths:
            raise SystemExit("bench_engine: --against runs the paths bare,sequential (no "
                             "--paths) and needs --repeats ≥ 1 and --rounds ≥ 2 (≥ 3 with "
                             "--profile); nothing was run")
        emit({**provenance(args.device), **run_against(args), **run_pfl(args)}, args.out)
        return
    if args.device == "cpu":
        torch.set_num_threads(1)  # the bare loop and the engine; Ray's workers set their own
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    flwr_logger.update_console_handler(level=30)  # WARNING: keep the output to the JSON
    cifar = args.preset == "cifar10"
    paths = (args.paths or ("bare,sequential,batched" if cifar else "bare,sequential,flower")
             ).split(",")
    methods = (args.methods or ("collective" if cifar else "none,collective")).split(",")
    unknown = set(paths) - {"bare", "sequential", "batched", "flower"}
    if unknown or args.rounds < 2 or args.repeats < 1:
        raise SystemExit(f"bench_engine: paths {sorted(unknown)} unknown, or --rounds < 2, "
                         "or --repeats < 1")
    clients, examples, test = _sizes(args)
    width = _width(args)
    epochs = 2 if cifar else 1
    engine = "batched" if cifar else "sequential"
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        root = Path(tmp)
        write_data(args.preset, root / "data", clients * examples, test, args.fmnist)
        base = {**_settings(args, root / "data", root / "out"), "client-device": device,
                "server-device": device}
        per_method = {m: {**base, "method": m, "keep-ratios": "1.0" if m == "none" else "0.1"}
                      for m in methods}
        times: dict[str, dict[str, list[float]]] = {p: {m: [] for m in methods} for p in paths}
        paired: dict[str, dict[str, list[float]]] = {p: {m: [] for m in methods} for p in paths}
        profiles: dict[str, dict[str, Any]] = {}
        for rep in range(args.repeats):
            for path in paths:
                for m in methods:
                    s = {**per_method[m], "run-name": f"{path}-{m}-{rep}"}
                    if path == "bare":
                        t = run_bare(RunConfig.from_mapping(s), clients, device, args.rounds)
                    elif path == "flower":
                        t = run_flower(s, clients, 1.0 if device.startswith("cuda") else 0.0)
                    else:
                        t, ratios = run_in_process(s, clients, path, device)
                        paired[path][m] += ratios
                    times[path][m].append(t)
        if args.profile:
            for m in methods:
                profiles[m] = profile_round({**per_method[m], "run-name": f"profile-{m}"},
                                            clients, device)
        equality = None
        if args.equality_rounds > 0:
            engines = [p for p in paths if p in ("sequential", "batched")] or [engine]
            equality = max(max_rel_diff_float64({**per_method[m], "run-name": "eq"}, clients,
                                                engines, args.equality_rounds,
                                                args.equality_examples) for m in methods)

    pfl = run_pfl(args) if args.code is None else {"pfl": None,
                                                    "pfl_reason": "a run of --against"}

    def ratio(a: str, b: str) -> dict[str, float] | None:
        if a not in times or b not in times:
            return None
        return {m: round(statistics.median(x / y for x, y in zip(times[a][m], times[b][m],
                                                                   strict=True)), 3)
                for m in methods}

    emit({
        **provenance(device),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "preset": args.preset,
        "shape": {"clients": clients, "examples_per_client": examples, "epochs": epochs,
                  "batch": 32, "model": base["model"], "width": width,
                  "test_examples": test, "cuda_graph": args.cuda_graph,
                  "keep_ratio": {m: 1.0 if m == "none" else 0.1 for m in methods}},
        "repeats": args.repeats, "rounds": args.rounds, "engine": engine,
        "batched_step": {m: batched_step(per_method[m]) for m in methods}
        if "batched" in paths else None,
        "s_per_round": {p: {m: round(statistics.median(v), 4) for m, v in t.items()}
                        for p, t in times.items()},
        "engine_vs_bare": {m: round(statistics.median(v), 3) for m, v in paired[engine].items()}
        if engine in paired else None,
        "engine_vs_bare_per_run": ratio(engine, "bare"),
        "flower_vs_bare": ratio("flower", "bare"),
        "speedup_vs_flower": ratio("flower", engine),
        "speedup_batched_vs_sequential": ratio("sequential", "batched"),
        "max_rel_diff_float64": equality,
        "engine_vs_bare_rounds": {m: [round(x, 4) for x in v] for m, v in paired[engine].items()}
        if engine in paired else None,
        "profile": profiles or None,
        "code": "this repository" if CODE == ROOT else "another tree (--code)",
        **pfl,
    }, args.out)


if __name__ == "__main__":
    main()
