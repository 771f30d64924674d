"""Whole-run attack table: test accuracy on real Fashion-MNIST with dishonest nodes.

Each cell is one whole run of fedshard's real ServerApp (:func:`fedshard.app.run.run_server`)
and ClientApp over the in-process grid (``tests/flower_grid.py``: real ``Message``s, every
message deep-copied as if serialized), 10 nodes on Dirichlet non-IID shares, the run-config
defaults except the size (``--width``, ``--rounds``, ``--train``, ``--test``). ``--attackers``
nodes (the first ones) answer every training message dishonestly, within the bounds the
server checks (:data:`ATTACKS`, one reply at a time):

* ``negated``: the honest update negated (sent − (honest − sent)), an honest norm;
* ``update-x10`` / ``update-x1000``: the honest update times 10 / 1000;
* ``factors-sign-flip``: factors ``U, V -> -U, -V`` (each ``UVᵀ`` unchanged: a re-signing,
  harmless once aligned); ``factors-x1e3`` / ``factors-x-1e3``: factors times ±1e3;
  ``factors-gauge``: ``U, V -> 10 U, V / 10`` (``UVᵀ`` unchanged);
* ``replay``: the node's first reply sent again each round (this round's framing);
* ``num-examples``: honest arrays with ``num-examples = 2**53``; ``num-examples+negated``,
  ``num-examples+update-x1000``: with the update negated / times 1000 too;
* ``noise``: each array's update replaced by Gaussian noise of its norm; ``constant``;
  ``zero`` (the sent arrays back);
* ``label-flip``: honest training on labels ``9 − y``;
* ``absent``: no reply at all (an error reply every round), not an attack but the floor of
  any defence that leaves these nodes out from round 1: their data never reaches the model;

and, seeing the whole round's honest replies (:data:`ROUND_ATTACKS`, omniscient): ``alie``
(mean − z·std, z = 1), ``ipm`` (−ε · the honest mean update, ε = 0.5), ``min-max`` and
``min-sum`` (the largest step against the honest mean that stays within the honest replies'
largest / summed distances).

Each defence is a set of run-config keys on top of the defaults (:data:`DEFENCES`;
``--defences`` picks them by name): ``default`` is fedshard's defaults, ``paper-mean`` the
paper's plain averages (no alignment, no spread bound). Accuracy is the mean test accuracy of
the last ``--last`` rounds; Δ in the docs is against the same defence's clean run of the same
seed. Per cell it also counts the rounds in which the server's WARNING lines named a dishonest
node, the honest nodes they named, and the round by which every dishonest node had been named
(``round-all-dishonest-named``), the honest nodes the agreement record's rule named
(``honest-nodes-distrusted``), and each node's cosine per round as that record received it
(``cosines``: node -> ``[round, cosine]`` pairs; ``--names`` replays the current rule on
them). ``trusted-data`` is the defaults with the server's own
reference update on 500 training examples held out of the nodes' (FLTrust,
:mod:`fedshard.server.trusted`). Prints one JSON object (machine, torch, date, seeds);
the tables made from it are in ``docs/robustness.md``.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/attack_table.py [--attacks a,b] [--defences d,e]
[--methods m,n] [--attackers 1,3] [--seeds 0,1,2] [--rounds 12] [--width 64] [--train 12000]
[--test 2000]``; with ``--methods`` (run-config ``method`` values: ``collective``,
``heterofl``, ``fedrolex``, ``ordered-dropout``, ...) every defence runs under each method and
its table is named ``method/defence``, the method among its keys;
``python benchmarks/attack_table.py --markdown OUT.json [...]`` prints the docs' table from
saved outputs; ``python benchmarks/attack_table.py --names OUT.json [...]`` prints, per
cell that recorded ``cosines``, the nodes the current naming rule names on them (honest ones
with the round, how many dishonest ones); ``python benchmarks/attack_table.py --merge A.json
B.json [...]`` prints one
output holding the seeds of several runs of the same cells (same size, defences and attacks,
other seeds), the means and worst seeds recomputed.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import logging
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from fakedata import write_idx  # noqa: E402
from flower_grid import InProcessGrid  # noqa: E402
from flwr.app import Array, Context, Error, Message  # noqa: E402
from machine import command, cpu_name  # noqa: E402

import client_app  # noqa: E402
from fedshard import protocol as P  # noqa: E402
from fedshard.app.config import RunConfig  # noqa: E402
from fedshard.app.results import git_commit  # noqa: E402
from fedshard.app.run import run_server  # noqa: E402
from fedshard.app.task import client_dataset, template_model  # noqa: E402
from fedshard.client import handle_train  # noqa: E402
from fedshard.server.trust_record import TrustRecord, TrustStage  # noqa: E402
from fedshard.settings import SHARDING_METHODS, WIDTH_METHODS  # noqa: E402

REAL = Path("/usr/share/datasets/fashion-mnist")
N_NODES = 10

#: What every cell runs with beyond the app's defaults and the size options: the keep-ratio mix
#: the committed tables were measured with, whatever the app's default mix is.
#: the keep-ratio mix of the tables measured before 2026-12-03 (``--keep-ratios 0.2:0.6,0.4:0.4``);
#: the default is now the app's own mix, what a user of the defaults gets
EARLIER_KEEP_RATIOS = "0.2:0.6,0.4:0.4"

#: defence name -> run-config keys
DEFENCES: dict[str, dict[str, Any]] = {
    # the paper's plain averages with FedAvg's weights
    "paper-mean": {"align-factors": False, "max-update-spread": 0.0, "max-weight-ratio": 0.0},
    "default": {},
    "align-only": {"max-update-spread": 0.0},
    # a looser spread bound and weight cap, for comparison
    "spread-5-weight-10": {"max-update-spread": 5.0, "max-weight-ratio": 10.0},
    "weight-ratio-10": {"max-weight-ratio": 10.0},
    "median": {"aggregation": "median"},
    "trimmed-mean": {"aggregation": "trimmed-mean", "trim-fraction": 0.34},
    "drop": {"update-policy": "drop"},
    "weight-ratio-1": {"max-weight-ratio": 1.0},
    # Flower's own rules over each reply's dense-equivalent model, nothing else added
    "fedmedian": {"aggregation": "dense-median", "align-factors": False,
                  "max-update-spread": 0.0},
    "krum": {"aggregation": "krum", "trim-fraction": 0.3, "align-factors": False,
             "max-update-spread": 0.0},
    # the defaults and FLTrust's reference on 500 training examples held out of the nodes'
    "trusted-data": {"trusted-data": 500},
    # without trusted data, each node's record (against the round's accepted aggregate)
    # names it and the named ones are no longer sampled: what evidence across rounds achieves
    "history": {"exclude-distrusted": True},
    # the reference and the exclusion together
    "trusted-data-exclude": {"trusted-data": 500, "exclude-distrusted": True},
}

Attack = Callable[[Message, Message, dict[str, Any]], Message]
#: a whole round's attack: the coalition sees every train message and reply of the round
#: (the omniscient attacker of ALIE, IPM and min-max/min-sum); (node -> (sent, reply)), the
#: dishonest nodes, their memory
RoundAttack = Callable[[dict[int, tuple[Message, Message]], list[int], dict[str, Any]], None]


def _factor(key: str) -> bool:
    return key.endswith((".u", ".v"))


def _floats(msg: Message) -> dict[str, np.ndarray]:
    rec = msg.content[P.ARRAYS]
    return {k: rec[k].numpy() for k in rec
            if np.issubdtype(rec[k].numpy().dtype, np.floating)}


def _map_arrays(reply: Message, fn: Callable[[str, np.ndarray], np.ndarray]) -> Message:
    rec = reply.content[P.ARRAYS]
    for k in list(rec.keys()):
        x = rec[k].numpy()
        if np.issubdtype(x.dtype, np.floating):
            rec[k] = Array(np.ascontiguousarray(fn(k, x)).astype(x.dtype))
    return reply


def _scale(factor: float) -> Attack:
    """Factors (only) times ``factor``: the gauge-style attacks of the reply checks."""
    return lambda sent, reply, memo: _map_arrays(
        reply, lambda k, x: x * factor if _factor(k) else x)


def _update_times(factor: float) -> Attack:
    """The node's whole update times ``factor``: ``sent + factor·(reply − sent)`` on every
    float array (-1: the negated update, of the honest norm)."""
    def attack(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
        before = _floats(sent)
        return _map_arrays(reply, lambda k, x: before[k].astype(np.float64)
                           + factor * (x.astype(np.float64) - before[k]))
    return attack


def _gauge(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    return _map_arrays(reply, lambda k, x: x * 10 if k.endswith(".u")
                       else x / 10 if k.endswith(".v") else x)


def _replay(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    first = memo.setdefault("first", {k: a.numpy().copy()
                                      for k, a in reply.content[P.ARRAYS].items()})
    return _map_arrays(reply, lambda k, x: first[k] if first[k].shape == x.shape else x)


def _big_n(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    reply.content[P.METRICS][P.NUM_EXAMPLES] = 2**53
    return reply


def _claim_times(times: float) -> Attack:
    """``num-examples`` set to ``times`` the node's own count: just under (99) or over (101)
    100 times a typical node's, where a rule with a threshold there would jump."""
    def attack(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
        metrics = reply.content[P.METRICS]
        metrics[P.NUM_EXAMPLES] = int(times * int(metrics[P.NUM_EXAMPLES]))
        return reply
    return attack


def _like_update(make: Callable[[np.ndarray, np.random.Generator], np.ndarray]) -> Attack:
    """Every array's update replaced by ``make(update, rng)`` scaled to the update's norm."""
    def attack(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
        calls = memo.setdefault("calls", 0) + 1
        memo["calls"] = calls
        rng = np.random.default_rng([7, calls, memo.setdefault("node", 0)])
        before = _floats(sent)

        def fn(k: str, x: np.ndarray) -> np.ndarray:
            s = before[k].astype(np.float64)
            d = x - s
            z = make(d, rng)
            return s + z * (np.linalg.norm(d) / max(np.linalg.norm(z), 1e-30))

        return _map_arrays(reply, fn)
    return attack


def _absent(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    # not an attack: the node's data never reaches the model (an error reply every round),
    # what any defence that leaves these nodes out from round 1 would at best achieve
    return Message(Error(code=0, reason="absent: this node's reply is withheld"), reply_to=sent)


def _zero(sent: Message, reply: Message, memo: dict[str, Any]) -> Message:
    before = _floats(sent)
    return _map_arrays(reply, lambda k, x: before[k])


ATTACKS: dict[str, Attack] = {
    "negated": _update_times(-1.0),
    "update-x10": _update_times(10.0),
    "update-x1000": _update_times(1000.0),
    "factors-sign-flip": _scale(-1.0),
    "factors-x1e3": _scale(1e3),
    "factors-x-1e3": _scale(-1e3),
    "replay": _replay,
    "num-examples": _big_n,
    "num-examples+negated": lambda s, r, m: _update_times(-1.0)(s, _big_n(s, r, m), m),
    "num-examples+update-x1000": lambda s, r, m: _update_times(1000.0)(s, _big_n(s, r, m), m),
    "num-examples-x99+update-x1000":
        lambda s, r, m: _update_times(1000.0)(s, _claim_times(99)(s, r, m), m),
    "num-examples-x101+update-x1000":
        lambda s, r, m: _update_times(1000.0)(s, _claim_times(101)(s, r, m), m),
    "num-examples-x99+negated":
        lambda s, r, m: _update_times(-1.0)(s, _claim_times(99)(s, r, m), m),
    "num-examples-x101+negated":
        lambda s, r, m: _update_times(-1.0)(s, _claim_times(101)(s, r, m), m),
    "noise": _like_update(lambda d, rng: rng.normal(size=d.shape)),
    "constant": _like_update(lambda d, rng: np.ones_like(d)),
    "zero": _zero,
    "absent": _absent,
    "factors-gauge": _gauge,
    "label-flip": lambda s, r, m: r,  # trained on labels 9 - y (see _Dishonest)
}


# ----------------------------------------------------------------- omniscient round attacks
def _term_space(pairs: dict[int, tuple[Message, Message]]
                ) -> tuple[dict[int, dict[str, np.ndarray]], dict[str, np.ndarray],
                           dict[str, np.ndarray]]:
    """Each node's update in whole-layer coordinates (a factor key as ``(rows, N)`` with NaN
    in the columns of terms it does not hold; a dense entry as it is), and per coordinate
    the honest mean and standard deviation over the nodes holding it."""
    full: dict[int, dict[str, np.ndarray]] = {}
    sizes: dict[str, int] = {}
    for _sent, reply in pairs.values():
        rec = reply.content[P.ARRAYS]
        for k in rec:
            if k.endswith(".indices"):
                idx = rec[k].numpy()
                if idx.size:
                    sizes[k[: -len(".indices")]] = max(sizes.get(k[: -len(".indices")], 0),
                                                       int(idx.max()) + 1)
    for node, (sent, reply) in pairs.items():
        rec, before = reply.content[P.ARRAYS], _floats(sent)
        out: dict[str, np.ndarray] = {}
        for k, x in _floats(reply).items():
            d = x.astype(np.float64) - before[k]
            if _factor(k):
                layer = k[:-2]
                idx = rec[layer + ".indices"].numpy().astype(np.int64)
                f = np.full((d.shape[0], sizes[layer]), np.nan)
                f[:, idx] = d
                out[k] = f
            else:
                out[k] = d
        full[node] = out
    keys = sorted({k for v in full.values() for k in v})
    mean, std = {}, {}
    for k in keys:
        stack = np.stack([v[k] for v in full.values() if k in v])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a coordinate nobody holds
            mean[k] = np.nan_to_num(np.nanmean(stack, axis=0))
            std[k] = np.nan_to_num(np.nanstd(stack, axis=0))
    return full, mean, std


def _write(pairs: dict[int, tuple[Message, Message]], node: int,
           update: dict[str, np.ndarray]) -> None:
    """The node's reply set to ``sent + update`` (factor keys read at the node's terms)."""
    sent, reply = pairs[node]
    rec, before = reply.content[P.ARRAYS], _floats(sent)
    for k in list(rec.keys()):
        x = rec[k].numpy()
        if not np.issubdtype(x.dtype, np.floating):
            continue
        u = update[k]
        if _factor(k):
            idx = rec[k[:-2] + ".indices"].numpy().astype(np.int64)
            u = u[:, idx]
        rec[k] = Array(np.ascontiguousarray(before[k].astype(np.float64) + u).astype(x.dtype))


def _alie(z: float) -> RoundAttack:
    """A little is enough (Baruch et al., NeurIPS 2019): every dishonest node sends
    ``μ − z·σ`` per coordinate, μ and σ over the round's honest updates."""
    def attack(pairs: dict[int, tuple[Message, Message]], bad: list[int],
               memo: dict[str, Any]) -> None:
        _, mean, std = _term_space(pairs)
        for node in bad:
            _write(pairs, node, {k: mean[k] - z * std[k] for k in mean})
    return attack


def _ipm(eps: float) -> RoundAttack:
    """Inner-product manipulation (Xie et al., UAI 2019): ``−ε·μ``."""
    def attack(pairs: dict[int, tuple[Message, Message]], bad: list[int],
               memo: dict[str, Any]) -> None:
        _, mean, _ = _term_space(pairs)
        for node in bad:
            _write(pairs, node, {k: -eps * mean[k] for k in mean})
    return attack


def _agr_agnostic(kind: str) -> RoundAttack:
    """Min-max / min-sum (Shejwalkar & Houmansadr, NDSS 2021) with the ``−σ`` perturbation:
    ``μ − γσ`` with the largest γ (binary search) whose largest (min-max) or summed squared
    (min-sum) distance to the honest updates is at most the honest updates' own. A node's
    update counts as μ in the coordinates it does not hold."""
    def attack(pairs: dict[int, tuple[Message, Message]], bad: list[int],
               memo: dict[str, Any]) -> None:
        full, mean, std = _term_space(pairs)
        keys = sorted(mean)
        flat = {n: np.concatenate([np.where(np.isnan(v[k]), mean[k], v[k]).ravel()
                                   for k in keys]) for n, v in full.items()}
        honest = np.stack([flat[n] for n in flat if n not in bad])
        mu = np.concatenate([mean[k].ravel() for k in keys])
        sd = np.concatenate([std[k].ravel() for k in keys])
        gram = honest @ honest.T
        sq = np.diag(gram)
        pair_d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * gram, 0.0)
        limit = pair_d2.max() if kind == "min-max" else pair_d2.sum(axis=1).max()

        def ok(gamma: float) -> bool:
            m = mu - gamma * sd
            d2 = np.maximum(np.sum((honest - m) ** 2, axis=1), 0.0)
            return bool((d2.max() if kind == "min-max" else d2.sum()) <= limit)

        lo, hi = 0.0, 50.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        memo.setdefault("gamma", []).append(round(lo, 3))
        for node in bad:
            _write(pairs, node, {k: mean[k] - lo * std[k] for k in keys})
    return attack


ROUND_ATTACKS: dict[str, RoundAttack] = {
    "alie": _alie(1.0),
    "ipm": _ipm(0.5),
    "min-max": _agr_agnostic("min-max"),
    "min-sum": _agr_agnostic("min-sum"),
}


class _Dishonest:
    """A ClientApp stand-in: the real ClientApp, then ``attack`` on the train replies of
    ``nodes`` (the grid calls ``app(message, context)``); ``label-flip`` nodes train on the
    labels ``9 − y`` of their own partition."""

    def __init__(self, attack: str | None, nodes: set[int]) -> None:
        self.name = attack
        self.attack = ATTACKS.get(attack) if attack else None
        self.nodes = nodes
        self.memo: dict[int, dict[str, Any]] = {}

    def __call__(self, msg: Message, context: Context) -> Message:
        if (self.name == "label-flip" and context.node_id in self.nodes
                and msg.metadata.message_type == "train"):
            return _train_flipped(msg, context)
        reply = client_app.app(msg, context)
        if (self.attack is None or context.node_id not in self.nodes
                or msg.metadata.message_type != "train" or reply.has_error()):
            return reply
        memo = self.memo.setdefault(context.node_id, {"node": context.node_id})
        return self.attack(msg, reply, memo)


def _train_flipped(msg: Message, context: Context) -> Message:
    cfg, pid, num = client_app._node(context)
    data = copy.copy(client_dataset(cfg, pid, num))
    data._labels = 9 - data._labels  # type: ignore[attr-defined]
    data.targets = 9 - data.targets  # type: ignore[attr-defined]
    data._tensors = None  # type: ignore[attr-defined]
    return handle_train(msg, template_model(cfg), data, device="cpu", fast=cfg.fast)


class _AttackGrid(InProcessGrid):
    """The in-process grid, with a round attack applied to the dishonest nodes' train
    replies once every node of the round has answered."""

    def __init__(self, app: Any, configs: list[dict[str, Any]], cfg: dict[str, Any],
                 attack: RoundAttack | None, bad: list[int]) -> None:
        super().__init__(app, configs, cfg)
        self.round_attack, self.bad, self.memo = attack, bad, {}

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        ids = list(super().push_messages(msgs))
        if self.round_attack is not None:
            pairs = {m.metadata.dst_node_id: (m, self._replies[i])
                     for m, i in zip(msgs, ids, strict=True)
                     if m.metadata.message_type == "train" and i in self._replies
                     and not self._replies[i].has_error()}
            bad = [n for n in self.bad if n in pairs]
            if bad and len(pairs) > len(bad):
                self.round_attack(pairs, bad, self.memo)
        return ids


def _subset(folder: Path, n_train: int, n_test: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        for kind in ("images-idx3", "labels-idx1"):
            name = f"{prefix}-{kind}-ubyte.gz"
            raw = gzip.decompress((REAL / name).read_bytes())
            ndim = raw[3]
            shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
            arr = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
            write_idx(folder / name, np.ascontiguousarray(arr[:n]))
    return folder


class _Named(logging.Handler):
    """Which nodes the server named in its WARNING and ERROR lines, per round."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.named: dict[int, set[int]] = {}
        self.distrusted: set[int] = set()  # named by the agreement record's rule

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        found = re.search(r"Round (\d+)", text)
        nodes = {int(n) for n in re.findall(r"node (\d+)", text)}
        if nodes:
            self.named.setdefault(int(found.group(1)) if found else 0, set()).update(nodes)
        if " is distrusted" in text:
            self.distrusted |= nodes


class _Cosines:
    """Each node's cosine per round as the server's agreement record received it (node ->
    ``[round, cosine]`` pairs): the record a naming rule reads, kept whole so that a rule can
    be replayed on it (:class:`fedshard.server.trust_record.TrustRecord` keeps a node's last rounds
    only). Wraps ``TrustStage.weigh`` (the round) and ``TrustRecord.add`` while it is open."""

    def __enter__(self) -> _Cosines:
        self.rows: dict[int, list[list[float]]] = {}
        self.round = 0
        self._weigh, self._add = TrustStage.weigh, TrustRecord.add
        weigh, add = self._weigh, self._add

        def weigh_round(stage: TrustStage, server_round: int, *a: Any, **k: Any) -> Any:
            self.round = server_round
            return weigh(stage, server_round, *a, **k)

        def add_row(record: TrustRecord, node: int, value: float) -> None:
            self.rows.setdefault(node, []).append([self.round, round(float(value), 6)])
            add(record, node, value)

        TrustStage.weigh, TrustRecord.add = weigh_round, add_row  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        TrustStage.weigh, TrustRecord.add = self._weigh, self._add  # type: ignore[method-assign]


def run_cell(root: Path, base: dict[str, Any], attack: str | None, attackers: int,
             last: int) -> dict[str, Any]:
    """One whole run; its last rounds' mean test accuracy, the rounds in which the server
    named a dishonest node (and how many honest nodes it named), and the defences' counts."""
    cfg = {**base, "results-dir": str(root), "run-name": "run"}
    bad = [1000 + i for i in range(attackers)]
    app = _Dishonest(attack if attack in ATTACKS else None, set(bad))
    grid = _AttackGrid(app, [{"partition-id": i, "num-partitions": N_NODES}
                             for i in range(N_NODES)], cfg,
                       ROUND_ATTACKS.get(attack) if attack else None, bad)
    named = _Named()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(named)
    t0 = time.perf_counter()
    try:
        with _Cosines() as cosines:
            summary = run_server(grid, RunConfig.from_mapping(cfg))
        status = summary.get("status", "finished")
    except Exception as ex:  # a run stopped on purpose (e.g. its updates kept being flagged)
        summary, status = {}, f"stopped: {type(ex).__name__}"
    finally:
        flwr_logger.removeHandler(named)
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    acc = [r["test-accuracy"] for r in rows if "test-accuracy" in r and r.get("round", 0) > 0]
    counts = {k: sum(r.get(k, 0.0) for r in rows) for k in (
        "clipped-update-spread", "clipped-update-norm", "clipped-num-examples",
        "re-signed-terms", "rebalanced-terms", "update-spread-held", "implausible-num-examples",
        "trust-zero", "distrusted-nodes")}
    honest_named = {n for nodes in named.named.values() for n in nodes if n not in bad}
    seen: set[int] = set()
    all_named = None  # the round by which every dishonest node had been named
    for rnd in sorted(named.named):
        seen |= named.named[rnd] & set(bad)
        if bad and all_named is None and seen == set(bad):
            all_named = rnd
    return {"accuracy": round(float(np.mean(acc[-last:])), 4) if acc else None,
            "final": round(float(acc[-1]), 4) if acc else None, "status": status,
            "rounds-naming-attacker": sum(1 for nodes in named.named.values()
                                          if nodes & set(bad)),
            "honest-nodes-named": len(honest_named),
            "honest-nodes-distrusted": len(named.distrusted - set(bad)),
            **({"round-all-dishonest-named": all_named} if bad else {}),
            **{k: v for k, v in counts.items() if v},
            **({"cosines": {str(n): r for n, r in sorted(cosines.rows.items())}}
               if cosines.rows else {}),
            "s": round(time.perf_counter() - t0, 1)}


#: the docs' names of the attacks, in the table's order
LABELS = {
    "update-x10": "update ×10", "update-x1000": "update ×1000", "factors-x1e3": "factors ×1e3",
    "factors-sign-flip": "factors re-signed", "num-examples": "`num-examples` 2⁵³",
    "num-examples+update-x1000": "update ×1000, `num-examples` 2⁵³",
    "num-examples+negated": "update negated, `num-examples` 2⁵³",
    "num-examples-x99+update-x1000": "update ×1000, `num-examples` ×99",
    "num-examples-x101+update-x1000": "update ×1000, `num-examples` ×101",
    "num-examples-x99+negated": "update negated, `num-examples` ×99",
    "num-examples-x101+negated": "update negated, `num-examples` ×101",
    "negated": "update negated", "replay": "replay", "noise": "noise", "zero": "zero update",
    "label-flip": "label flip", "alie": "ALIE", "ipm": "IPM", "min-max": "min-max",
    "min-sum": "min-sum", "absent": "absent (no reply: the nodes' data left out)",
}


def markdown(paths: list[str]) -> str:
    """The docs' tables from saved outputs of this script: per defence, its run-config keys and
    clean accuracy per seed, then per attack and attacker count Δ (points against the same
    seed's clean run) per seed and their mean, the rounds in which a WARNING named a
    dishonest node, and the honest nodes named."""
    lines: list[str] = []
    for path in paths:
        out = json.loads(Path(path).read_text())
        rounds = out["size"]["rounds"]
        for name, table in out["results"].items():
            clean = " / ".join(f"{c['accuracy']:.3f}" for c in table["clean"].values())
            keys = ", ".join(f"`{k} = {json.dumps(v)}`" for k, v in table["keys"].items())
            lines += ["", f"**{name}** ({keys or 'the defaults'}): clean accuracy per seed "
                      f"{clean}", "",
                      "| attack | dishonest nodes of 10 | Δ points per seed | Δ mean | rounds "
                      "naming a dishonest node | honest nodes named |",
                      "|---|---|---|---|---|---|"]
            order = sorted(table["attacks"], key=lambda a: (
                list(LABELS).index(a.split("/")[0]) if a.split("/")[0] in LABELS else 99,
                int(a.split("/")[1])))
            for key in order:
                attack, k = key.split("/")
                cell = table["attacks"][key]
                seeds = cell["seeds"].values()
                deltas = " / ".join(f"{c['delta-points']:+.1f}" for c in seeds)
                named = sum(c["rounds-naming-attacker"] for c in seeds)
                honest = sum(c["honest-nodes-named"] for c in seeds)
                lines.append(f"| {LABELS.get(attack, attack)} | {k} | {deltas} | "
                             f"{cell['delta-points-mean']:+.1f} | {named} of "
                             f"{rounds * len(cell['seeds'])} | {honest} |")
    return "\n".join(lines).strip("\n")


def replay_names(rows: dict[str, list[list[float]]], below: float) -> dict[int, int]:
    """The nodes the server's naming rule names on a cell's recorded cosines (``cosines``:
    node -> ``[round, cosine]`` pairs), each with the first round it is named in: the rule
    of the code that replays it (:meth:`fedshard.server.trust_record.TrustRecord.distrusts`), fed
    round by round as :class:`~fedshard.server.trust_record.TrustStage` feeds it."""
    record, first = TrustRecord(), {}
    by_round: dict[int, list[tuple[int, float]]] = {}
    for node, pairs in rows.items():
        for rnd, c in pairs:
            by_round.setdefault(int(rnd), []).append((int(node), c))
    for rnd in sorted(by_round):
        for node, c in by_round[rnd]:
            record.add(node, c)
        for node, _ in by_round[rnd]:
            if node not in first and record.distrusts(node, below):
                first[node] = rnd
    return first


def names(paths: list[str], with_reference: float, with_aggregate: float) -> dict[str, Any]:
    """Per table and cell of saved outputs (those that recorded ``cosines``), the nodes the
    current naming rule names: at ``distrust-below = with_reference`` in a table with trusted
    data, at ``distrust-below-aggregate = with_aggregate`` in one without; the honest ones
    (node -> first round) and how many of the dishonest ones, by which round."""
    out: dict[str, Any] = {"distrust-below": with_reference,
                           "distrust-below-aggregate": with_aggregate, "tables": {}}
    for path in paths:
        for name, table in json.loads(Path(path).read_text())["results"].items():
            below = (with_reference if table["keys"].get("trusted-data") else with_aggregate)
            cells = {f"clean/{s}": (c, 0) for s, c in table["clean"].items()}
            cells |= {f"{a}/{s}": (c, int(a.split("/")[1]))
                      for a, cell in table["attacks"].items() for s, c in cell["seeds"].items()}
            rows = {}
            for key, (cell, k) in cells.items():
                if "cosines" not in cell:
                    continue
                first = replay_names(cell["cosines"], below)
                bad = {1000 + i for i in range(k)}
                rows[key] = {"honest-named": {str(n): r for n, r in sorted(first.items())
                                              if n not in bad},
                             "dishonest-named": sum(n in first for n in bad),
                             "dishonest": k,
                             **({"round-all-dishonest-named": max(first[n] for n in bad)}
                                if bad and bad <= set(first) else {})}
            out["tables"][f"{Path(path).stem}:{name}"] = rows
    return out


def merge(paths: list[str]) -> dict[str, Any]:
    """One output from several outputs of this script that ran the same cells (the same size
    but for the seeds, the same defences with the same keys, the same attacks) on other seeds:
    every cell's seeds together, each attack's mean and worst Δ recomputed; ``runs`` keeps
    each output's date, machine, torch and wall time.

    Raises
    ------
    SystemExit
        If two outputs differ in anything but their seeds, or share a seed.
    """
    outs = [json.loads(Path(p).read_text()) for p in paths]
    first = outs[0]
    size = {k: v for k, v in first["size"].items() if k != "seeds"}
    seeds: list[int] = []
    for path, out in zip(paths, outs, strict=True):
        other = {k: v for k, v in out["size"].items() if k != "seeds"}
        cells = {n: (t["keys"], sorted(t["attacks"])) for n, t in out["results"].items()}
        want = {n: (t["keys"], sorted(t["attacks"])) for n, t in first["results"].items()}
        if other != size or cells != want:
            raise SystemExit(f"{path}: another size, defence or attack set than {paths[0]}; "
                             "only runs of the same cells on other seeds can be merged")
        if set(out["size"]["seeds"]) & set(seeds):
            raise SystemExit(f"{path}: seeds {out['size']['seeds']} overlap {seeds}; nothing "
                             "was merged")
        seeds += out["size"]["seeds"]
    results: dict[str, Any] = {}
    for name, table in first["results"].items():
        merged: dict[str, Any] = {"keys": table["keys"], "clean": {}, "attacks": {}}
        for out in outs:
            merged["clean"].update(out["results"][name]["clean"])
        for key in table["attacks"]:
            cells = {}
            for out in outs:
                cells.update(out["results"][name]["attacks"][key]["seeds"])
            deltas = [c["delta-points"] for c in cells.values() if c["delta-points"] is not None]
            merged["attacks"][key] = {
                "delta-points-mean": round(float(np.mean(deltas)), 2) if deltas else None,
                "delta-points-worst": round(float(min(deltas)), 2) if deltas else None,
                "seeds": cells}
        results[name] = merged
    return {"size": {**first["size"], "seeds": seeds},
            "runs": [{k: out[k] for k in ("date", "cpu", "torch", "threads", "wall-s")} | {
                "seeds": out["size"]["seeds"]} for out in outs],
            "results": results}


def main() -> None:
    if sys.argv[1:2] == ["--markdown"]:
        print(markdown(sys.argv[2:]))
        return
    if sys.argv[1:2] == ["--names"]:
        from fedshard.settings import ReplyPolicy

        policy = ReplyPolicy()
        print(json.dumps(names(sys.argv[2:], policy.distrust_below,
                               policy.distrust_below_aggregate)))
        return
    if sys.argv[1:2] == ["--merge"]:
        print(json.dumps(merge(sys.argv[2:])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attacks", default=",".join([*ATTACKS, *ROUND_ATTACKS]))
    ap.add_argument("--defences", default="default")
    ap.add_argument("--methods", default="",
                    help="run-config methods, each with every defence (e.g. collective,"
                         "heterofl,fedrolex,ordered-dropout); a table is then named "
                         "method/defence. Empty: the app's default method, tables named by "
                         "defence")
    ap.add_argument("--attackers", default="1,3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--last", type=int, default=3, help="rounds averaged at the end")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--train", type=int, default=12000)
    ap.add_argument("--test", type=int, default=2000)
    ap.add_argument("--keep-ratios", default="",
                    help="run-config keep-ratios of every run; empty (default): the app's "
                         f"default mix; the tables before 2026-12-03 used {EARLIER_KEEP_RATIOS}")
    args = ap.parse_args()
    table_keys: dict[str, Any] = {"keep-ratios": args.keep_ratios} if args.keep_ratios else {}
    torch.set_num_threads(1)
    for h in logging.getLogger("flwr").handlers:  # the runs' lines are counted, not shown
        h.setLevel(logging.CRITICAL)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in attacks if a not in ATTACKS and a not in ROUND_ATTACKS] + [
        d for d in args.defences.split(",") if d not in DEFENCES]
    if unknown:
        raise SystemExit(f"unknown attack or defence {unknown}; expected attacks from "
                         f"{[*ATTACKS, *ROUND_ATTACKS]}, defences from {list(DEFENCES)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    methods: list[str] = [m for m in args.methods.split(",") if m] or [""]
    known = (*SHARDING_METHODS, *WIDTH_METHODS)
    if any(m and m not in known for m in methods):
        raise SystemExit(f"unknown method in {methods}; expected methods from {list(known)}")
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "size": {"nodes": N_NODES, "rounds": args.rounds, "model": f"mlp width {args.width}",
                 "train-examples": args.train, "test-examples": args.test,
                 "dirichlet-alpha": "the data set's paper value", "seeds": seeds,
                 "accuracy": f"mean test accuracy of the last {args.last} rounds"},
        "torch": torch.__version__, "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(), "command": command(), "git-commit": git_commit(ROOT),
        "table-keys": table_keys,
        # the settings every run took that no defence set: the app's defaults when it ran
        "app-defaults": {k: v for k, v in RunConfig().as_dict().items()
                         if k not in ("results-dir", "run-name", "data-dir")},
        "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = _subset(Path(tmp) / "data", args.train, args.test)
        cell = 0
        for method, name in ((m, d) for m in methods for d in args.defences.split(",")):
            keys = {**({"method": method} if method else {}), **DEFENCES[name]}
            table: dict[str, Any] = {"keys": keys, "clean": {}, "attacks": {}}
            label = f"{method}/{name}" if method else name
            clean: dict[int, float] = {}

            def base(seed: int) -> dict[str, Any]:
                return {"dataset": "fashion-mnist", "data-dir": str(data), "model": "mlp",
                        "model-width": args.width, "num-server-rounds": args.rounds,
                        "num-partitions": N_NODES, "min-available-nodes": N_NODES,
                        **table_keys, "test-max-examples": args.test, "eval-every": 1,
                        "seed": seed, **keys}  # noqa: B023 (used in this iteration only)

            for seed in seeds:
                cell += 1
                row = run_cell(Path(tmp) / f"c{cell}", base(seed), None, 0, args.last)
                clean[seed] = row["accuracy"]
                table["clean"][str(seed)] = row
                print(label, "clean", seed, row, file=sys.stderr, flush=True)
            for attack in attacks:
                for k in (int(x) for x in args.attackers.split(",")):
                    cells = {}
                    for seed in seeds:
                        cell += 1
                        row = run_cell(Path(tmp) / f"c{cell}", base(seed), attack, k, args.last)
                        row["delta-points"] = (round(100 * (row["accuracy"] - clean[seed]), 2)
                                               if row["accuracy"] is not None else None)
                        cells[str(seed)] = row
                        print(label, attack, k, seed, row, file=sys.stderr, flush=True)
                    deltas = [c["delta-points"] for c in cells.values()
                              if c["delta-points"] is not None]
                    table["attacks"][f"{attack}/{k}"] = {
                        "delta-points-mean": round(float(np.mean(deltas)), 2) if deltas else None,
                        "delta-points-worst": round(float(min(deltas)), 2) if deltas else None,
                        "seeds": cells}
            out["results"][label] = table
    out["wall-s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
