"""``SpectralSharding``: the Flower (Message API) strategy of spectral model sharding."""

from __future__ import annotations

import math
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedshard import protocol as P
from fedshard.config import cosine_lr
from fedshard.sampling import (
    anme,
    default_prism_exponent,
    draw_subsets,
    inclusion_probabilities,
    scaled_multipliers,
)
from fedshard.spectral import decompose, num_terms, sharded_layer_names

__all__ = ["SHARDING_METHODS", "SpectralSharding"]

SHARDING_METHODS = ("unbiased", "collective", "top-n", "prism", "prism-wallenius", "none")
SAMPLING_DESIGNS = ("cps", "brewer", "min-support")

# Tags that make the strategy's random streams independent: default_rng([seed, round, TAG, ...]).
_STREAM_NODES, _STREAM_TERMS, _STREAM_TRAIN = 0, 1, 2


@dataclass(frozen=True)
class _Node:
    """What a node declared: its keep ratio and a stable key (survives node-id changes)."""

    keep_ratio: float
    key: str

    @property
    def stream(self) -> int:
        """Integer identity of the node for its random stream."""
        return int(self.key) if self.key.isdigit() else zlib.crc32(self.key.encode())


@dataclass
class _Spectrum:
    """One sharded layer's decomposition for the current round (float64).

    Terms are stored term-major (one row per term) so that selecting, packing and averaging
    a subset of terms touches contiguous rows.
    """

    ut: np.ndarray  # (N, c_out): row i = u'_i = √λ_i u_i
    vt: np.ndarray  # (N, c_in·k·k): row i = v'_i = √λ_i v_i
    lam: np.ndarray  # (N,) descending singular values
    w: np.ndarray  # (c_out, c_in·k·k) the weight the terms were taken from
    shape: tuple[int, ...]  # original weight shape
    dtype: np.dtype[Any]  # original weight dtype


@dataclass
class _Sent:
    """What one node was sent this round: its reply is checked against it."""

    keep_ratio: float
    indices: dict[str, np.ndarray]  # layer -> (n,) term indices
    expected: dict[str, tuple[tuple[int, ...], np.dtype[Any]]]  # reply key -> (shape, dtype)
    bytes_sent: int


@dataclass
class _RoundState:
    server_round: int
    arrays: ArrayRecord
    spectra: dict[str, _Spectrum]
    sent: dict[int, _Sent]
    metrics: dict[str, float] = field(default_factory=dict)


class SpectralSharding(FedAvg):
    """Spectral model sharding (Korzhenkov & Louizos, NeurIPS 2024) as a Flower strategy.

    Each round the server (1) asks every sampled node it has not seen before for its keep ratio
    r (a ``query`` message), (2) takes the SVD ``W = Σ λ_i u_i v_iᵀ`` of every sharded layer,
    (3) groups the sampled nodes by keep ratio and, per group of C nodes and per layer, computes
    the inclusion probabilities π and multipliers ω of the chosen ``method`` and draws each
    node's n = ⌈rN⌉ terms, (4) sends each node its own sub-model, and (5) averages every term
    over the nodes that held it, weighted by their ``num-examples``, leaves the other terms
    unchanged, and rebuilds ``W = Σ u'_i v'_iᵀ``. Dense parameters are averaged as in FedAvg.

    Parameters
    ----------
    sharded_layers : sequence of str
        Module names of the sharded ``Linear``/``Conv2d`` layers; their weights are the
        ``"<name>.weight"`` arrays. Use :func:`fedshard.spectral.sharded_layer_names` on the
        model to get the paper's default (all affine layers but the first and the last).
    num_rounds : int
        Number of server rounds; sets the cosine learning-rate schedule.
    method : str
        ``"unbiased"`` (Theorem 1, ω = 1/π), ``"collective"`` (Theorem 2, C = group size),
        ``"top-n"`` (FedHM), ``"prism"`` (successive sampling ∝ λᵏ, ω = 1),
        ``"prism-wallenius"`` (same draws, ω = 1/π with π the approximate Wallenius mean), or
        ``"none"`` (no sharding: plain FedAvg of the dense model).
    design : str
        Sampling design for ``unbiased``/``collective``: ``"cps"`` (conditional Poisson,
        maximum entropy), ``"brewer"`` or ``"min-support"``. PriSM methods always use the
        successive (``numpy.random.choice``) scheme, Top-n is deterministic.
    scaled : bool
        +Scaled: each node's ω_i = sqrt(Σλ²/Σ_{sampled} λ²), keeping ‖Ŵ‖_F = ‖W‖_F; only with
        ``top-n`` or ``prism`` (it would discard the other methods' own ω).
    prism_exponent : float or None
        PriSM's k; ``None`` = 4 if n/N ≤ 0.2 else 2.5.
    lr, local_epochs, batch_size, momentum, frobenius_decay, clip_lr_tau, weight_decay :
        Local-training settings sent to every node (lr follows a cosine schedule over rounds;
        ``clip_lr_tau=None`` disables ClipLR).
    seed : int
        Root of every random stream: node sampling uses ``default_rng([seed, round, 0])``, the
        terms of layer ``l`` for keep-ratio group ``g`` ``default_rng([seed, round, 1, l, g])``
        (groups in increasing keep ratio), a node's training seed ``[seed, round, 2, node_id]``.
    query_timeout : float
        Seconds to wait for capability answers.
    node_wait_timeout : float or None
        Seconds to wait for ``min_available_nodes`` to connect before a round (``None``:
        forever, as FedAvg does).
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes :
        As in :class:`flwr.serverapp.strategy.FedAvg`.

    Notes
    -----
    The message contract (record keys, shapes, what must come back) is documented in
    :mod:`fedshard.protocol`. In short: a node receives ``L.u`` (c_out, n), ``L.v``
    (c_in·k·k, n), ``L.omega`` (n,), ``L.indices`` (n,) for each sharded layer ``L`` plus all
    dense ``state_dict`` entries, trains ``U·diag(ω)·Vᵀ`` with ω frozen, and returns the same
    keys without ``L.omega`` (indices echoed) and a ``metrics`` record with ``num-examples``.

    Every reply is validated before it is used (error replies, unknown or duplicate senders,
    missing or extra keys, shapes, dtypes, non-finite values, indices other than those sent,
    a missing or non-positive ``num-examples``); an invalid reply is dropped with a logged
    reason and never touches the global model, and when no valid reply remains the global model
    is kept unchanged. The round's metrics count the replies used and dropped per reason.
    """

    def __init__(
        self,
        *,
        sharded_layers: Sequence[str],
        num_rounds: int,
        method: str = "collective",
        design: str = "cps",
        scaled: bool = False,
        prism_exponent: float | None = None,
        lr: float = 0.05,
        local_epochs: int = 1,
        batch_size: int = 32,
        momentum: float = 0.9,
        frobenius_decay: float = 1e-4,
        clip_lr_tau: float | None = 10.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        query_timeout: float = 600.0,
        node_wait_timeout: float | None = 600.0,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        min_train_nodes: int = 1,
        min_evaluate_nodes: int = 1,
        min_available_nodes: int = 1,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=P.NUM_EXAMPLES,
            arrayrecord_key=P.ARRAYS,
            configrecord_key=P.CONFIG,
        )
        problems = []
        if method not in SHARDING_METHODS:
            problems.append(f"method={method!r}: expected one of {SHARDING_METHODS}")
        if design not in SAMPLING_DESIGNS:
            problems.append(f"design={design!r}: expected one of {SAMPLING_DESIGNS}")
        if scaled and method not in ("top-n", "prism"):
            problems.append(
                f"scaled=True with method={method!r}: +Scaled is for 'top-n' or 'prism'"
            )
        if prism_exponent is not None and not prism_exponent > 0:
            problems.append(f"prism_exponent={prism_exponent}: expected > 0 or None")
        if clip_lr_tau is not None and not clip_lr_tau >= 1:
            problems.append(f"clip_lr_tau={clip_lr_tau}: expected τ ≥ 1 or None (off)")
        if num_rounds < 1:
            problems.append(f"num_rounds={num_rounds}: expected ≥ 1")
        if not lr > 0:
            problems.append(f"lr={lr}: expected > 0")
        if len(set(sharded_layers)) != len(sharded_layers):
            problems.append(f"sharded_layers={list(sharded_layers)}: names repeat")
        if problems:
            raise ValueError("SpectralSharding: " + "; ".join(problems))
        self.sharded_layers = tuple(sharded_layers) if method != "none" else ()
        self.num_rounds = num_rounds
        self.method = method
        self.design = design
        self.scaled = scaled
        self.prism_exponent = prism_exponent
        self.lr = lr
        self.local_epochs = local_epochs
        self.batch_size = batch_size
        self.momentum = momentum
        self.frobenius_decay = frobenius_decay
        self.clip_lr_tau = clip_lr_tau
        self.weight_decay = weight_decay
        self.seed = seed
        self.query_timeout = query_timeout
        self.node_wait_timeout = node_wait_timeout
        # node_id -> declared keep ratio; pruned to the connected nodes every round, so a node
        # that restarts (new node id) is asked again.
        self.capabilities: dict[int, _Node] = {}
        # server_round -> the round's training metrics (also returned to Flower per round).
        self.history: dict[int, dict[str, float]] = {}
        # Rounds already completed before this start() (a resumed run): Flower's round r is
        # this run's round r + round_offset, for the schedule, the random streams and history.
        self.round_offset = 0
        self._round: _RoundState | None = None

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, *, example_input: torch.Tensor | None = None, **kwargs: Any
    ) -> SpectralSharding:
        """The strategy for ``model``, sharding the paper's default layers (every Linear and
        Conv2d but the first and the last; forward order from ``example_input`` if given).

        Warns when the multipliers can compound: with ω > 1 (Unbiased, Collective, PriSM +
        Wallenius) and no normalization layer, activations grow by up to ω per sharded layer.
        """
        layers = sharded_layer_names(model, example_input=example_input)
        method = kwargs.get("method", "collective")
        norms = (torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.modules.batchnorm._BatchNorm)
        if method in ("unbiased", "collective", "prism-wallenius") and layers and not any(
            isinstance(m, norms) for m in model.modules()
        ):
            log(WARNING, "The model has no normalization layer: with method=%r the multipliers "
                "ω ≥ 1 scale every sharded layer's output and can compound from layer to layer "
                "(the paper's models all normalize).", method)
        return cls(sharded_layers=layers, **kwargs)

    def resume(self, completed_rounds: int, capabilities: dict[int, tuple[float, str]],
               history: dict[int, dict[str, float]]) -> None:
        """Continue a run after ``completed_rounds`` rounds (see :mod:`fedshard.checkpoint`).

        Call ``start(initial_arrays=<checkpoint arrays>, num_rounds=num_rounds -
        completed_rounds)`` afterwards; every random stream continues as if uninterrupted.
        """
        if not 0 <= completed_rounds < self.num_rounds:
            raise ValueError(f"completed_rounds={completed_rounds}: expected in "
                             f"[0, num_rounds={self.num_rounds})")
        self.round_offset = completed_rounds
        self.capabilities = {n: _Node(r, k) for n, (r, k) in capabilities.items()}
        self.history = {int(r): dict(m) for r, m in history.items()}

    def capability_table(self) -> dict[int, tuple[float, str]]:
        """The capability cache as plain values (for checkpoints)."""
        return {n: (c.keep_ratio, c.key) for n, c in self.capabilities.items()}

    # ------------------------------------------------------------------ summary
    def summary(self) -> None:
        """Log the configuration."""
        log(INFO, "\t├──> SpectralSharding: method=%s design=%s scaled=%s", self.method,
            self.design, self.scaled)
        log(INFO, "\t│\t├── sharded layers (%d): %s", len(self.sharded_layers),
            ", ".join(self.sharded_layers))
        log(INFO, "\t│\t└── lr=%g (cosine over %d rounds), local epochs=%d, batch=%d, "
            "momentum=%g, FD=%g, ClipLR τ=%s", self.lr, self.num_rounds, self.local_epochs,
            self.batch_size, self.momentum, self.frobenius_decay, self.clip_lr_tau)
        super().summary()

    # ------------------------------------------------------------------ nodes
    def _sample_nodes(
        self, grid: Grid, server_round: int, fraction: float, minimum: int
    ) -> dict[int, _Node]:
        """Wait for enough nodes, learn the capabilities of new ones, then sample
        ``max(⌊fraction·K⌋, minimum)`` of the K connected among those with a keep ratio.

        Nodes are ordered by their stable key (``node-key``, e.g. the partition id) before the
        draw, so a run is reproducible although Flower gives nodes random ids at every launch.
        """
        need = max(self.min_available_nodes, minimum)
        start = time.monotonic()
        while len(node_ids := sorted(grid.get_node_ids())) < need:
            waited = time.monotonic() - start
            if self.node_wait_timeout is not None and waited > self.node_wait_timeout:
                raise TimeoutError(
                    f"Only {len(node_ids)} node(s) connected after {waited:.0f} s, but "
                    f"{need} are required (min_available_nodes/min nodes per round); stopping "
                    "the run. Start more SuperNodes or lower min-available-nodes."
                )
            log(INFO, "Waiting for nodes to connect: %d connected (minimum required: %d).",
                len(node_ids), need)
            time.sleep(1.0)
        # Forget capabilities of nodes that are gone (a restarted node gets a new id).
        for gone in set(self.capabilities) - set(node_ids):
            del self.capabilities[gone]
        self._query_capabilities(grid, node_ids)
        eligible = sorted((n for n in node_ids if n in self.capabilities),
                          key=lambda n: (self.capabilities[n].key, n))
        size = min(len(eligible), max(int(len(node_ids) * fraction), minimum))
        if size < len(eligible):
            rng = np.random.default_rng([self.seed, server_round, _STREAM_NODES])
            eligible = [eligible[i] for i in sorted(rng.choice(len(eligible), size, replace=False))]
        if len(eligible) < min(len(node_ids), max(int(len(node_ids) * fraction), minimum)):
            log(WARNING, "Round %d: only %d of %d connected nodes declared a usable keep ratio.",
                server_round, len(self.capabilities), len(node_ids))
        return {n: self.capabilities[n] for n in eligible}

    def _query_capabilities(self, grid: Grid, node_ids: list[int]) -> None:
        """Ask every node not in the cache for its keep ratio (a ``query`` message)."""
        unknown = [n for n in node_ids if n not in self.capabilities]
        if not unknown:
            return
        messages = [
            Message(
                RecordDict({P.QUERY: ConfigRecord({"want": [P.KEEP_RATIO, P.NODE_KEY]})}),
                dst_node_id=node,
                message_type=MessageType.QUERY,
            )
            for node in unknown
        ]
        answered: set[int] = set()
        for reply in grid.send_and_receive(messages, timeout=self.query_timeout):
            node = reply.metadata.src_node_id
            answered.add(node)
            caps, reason = _read_capabilities(reply)
            if caps is None:
                log(WARNING, "Node %d gave no usable keep ratio (%s); it is skipped this "
                    "round and asked again next round.", node, reason)
                continue
            self.capabilities[node] = caps
            if caps.keep_ratio == 1.0 and self.method != "none":
                log(INFO, "Node %d declares keep ratio 1: it trains all N terms of every "
                    "sharded layer (the paper's r = 1 reference), not a shard.", node)
        for node in set(unknown) - answered:
            log(WARNING, "Node %d did not answer the capability query within %.0f s; it is "
                "skipped this round and asked again next round.", node, self.query_timeout)

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes, shard every sharded layer per keep-ratio group, one message per node."""
        server_round += self.round_offset
        self._round = None
        if self.fraction_train == 0.0:
            return []
        nodes = self._sample_nodes(grid, server_round, self.fraction_train, self.min_train_nodes)
        if not nodes:
            log(WARNING, "Round %d: no connected node declared a keep ratio; no training this "
                "round.", server_round)
            return []
        ratios = {n: c.keep_ratio for n, c in nodes.items()}

        t0 = time.perf_counter()
        spectra = self._decompose(arrays)
        t1 = time.perf_counter()
        plan, anme_metrics = self._plan(server_round, spectra, nodes)
        t2 = time.perf_counter()
        lr = cosine_lr(self.lr, server_round, self.num_rounds)
        dense_bytes = sum(len(a.data) for a in arrays.values())
        messages, sent = [], {}
        for node, terms in plan.items():
            record, info = self._pack(arrays, spectra, terms, ratios[node])
            cfg = self._node_config(config, server_round, nodes[node], lr)
            messages.append(
                Message(RecordDict({P.ARRAYS: record, P.CONFIG: cfg}), dst_node_id=node,
                        message_type=MessageType.TRAIN, group_id=str(server_round))
            )
            sent[node] = info
        t3 = time.perf_counter()

        metrics: dict[str, float] = {
            "nodes-sampled": float(len(nodes)),
            "nodes-sent": float(len(sent)),
            "lr": lr,
            "svd-s": t1 - t0,
            "sampling-s": t2 - t1,
            "pack-s": t3 - t2,
            "dense-bytes": float(dense_bytes),
            **anme_metrics,
        }
        per_node = np.array([s.bytes_sent for s in sent.values()], dtype=np.float64)
        metrics["bytes-sent-mean"] = float(per_node.mean())
        metrics["bytes-sent-ratio-mean"] = float(per_node.mean() / dense_bytes)
        for r in sorted(set(ratios.values())):
            group = [s.bytes_sent for s in sent.values() if s.keep_ratio == r]
            metrics[f"bytes-sent-ratio-r{r:g}"] = float(np.mean(group) / dense_bytes)
        self._round = _RoundState(server_round, arrays, spectra, sent, metrics)
        log(INFO, "configure_train: round %d, %d nodes (keep ratios %s), lr=%.4g, "
            "svd %.2fs, sampling %.2fs, packing %.2fs", server_round, len(sent),
            dict(Counter(ratios.values())), lr, t1 - t0, t2 - t1, t3 - t2)
        return messages

    def _decompose(self, arrays: ArrayRecord) -> dict[str, _Spectrum]:
        spectra = {}
        for layer in self.sharded_layers:
            key = f"{layer}.weight"
            if key not in arrays:
                raise KeyError(
                    f"Sharded layer {layer!r} has no {key!r} in the global arrays; expected the "
                    "state_dict of the model whose layer names were given as sharded_layers."
                )
            w = arrays[key].numpy()
            u, v, lam = decompose(torch.from_numpy(np.ascontiguousarray(w)))
            spectra[layer] = _Spectrum(
                np.ascontiguousarray(u.numpy().T), np.ascontiguousarray(v.numpy().T),
                lam.numpy(), w.reshape(w.shape[0], -1).astype(np.float64), tuple(w.shape),
                w.dtype,
            )
        return spectra

    def _plan(
        self, server_round: int, spectra: dict[str, _Spectrum], nodes: dict[int, _Node]
    ) -> tuple[dict[int, dict[str, tuple[np.ndarray, np.ndarray]]], dict[str, float]]:
        """Per node and layer: (sorted term indices, their ω). Also the ANME per group."""
        ratios = {n: c.keep_ratio for n, c in nodes.items()}
        plan: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {n: {} for n in ratios}
        groups = sorted(set(ratios.values()))
        anme_metrics: dict[str, float] = {}
        weighted_anme = 0.0
        for g, ratio in enumerate(groups):
            members = sorted((n for n, r in ratios.items() if r == ratio),
                             key=lambda n: (nodes[n].key, n))
            pis = []
            for li, (layer, spec) in enumerate(spectra.items()):
                rng = np.random.default_rng([self.seed, server_round, _STREAM_TERMS, li, g])
                subsets, omega, pi = self._draw(spec.lam, ratio, len(members), rng)
                pis.append(pi)
                for node, subset in zip(members, subsets, strict=True):
                    if self.scaled:
                        omega_sub = np.asarray(scaled_multipliers(spec.lam, subset), np.float64)
                    else:
                        omega_sub = omega[subset]
                    plan[node][layer] = (subset, omega_sub)
            if pis:
                value = float(anme(pis))
                anme_metrics[f"anme-r{ratio:g}"] = value
                weighted_anme += value * len(members)
        if spectra:
            anme_metrics["anme"] = weighted_anme / len(ratios)
        return plan, anme_metrics

    def _draw(
        self, lam: np.ndarray, ratio: float, num_clients: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Subsets (C, n), ω (N,) and π (N,) of one layer for one keep-ratio group."""
        n = num_terms(lam.size, ratio)
        if self.method in ("prism", "prism-wallenius"):
            k = self.prism_exponent or default_prism_exponent(n, lam.size)
            pi, omega = inclusion_probabilities(lam, n, self.method, prism_exponent=k)
            # PriSM draws with numpy's choice ∝ λ^k (scaled by max λ so λ^k cannot underflow
            # for the leading terms).
            weights = (lam / lam.max()) ** k if lam.max() > 0 else np.ones_like(lam)
            subsets = draw_subsets(pi, num_clients, design="successive", rng=rng, weights=weights)
        elif self.method == "top-n":
            pi, omega = inclusion_probabilities(lam, n, "top-n")
            subsets = draw_subsets(pi, num_clients, design="top-n", rng=rng)
        else:
            pi, omega = inclusion_probabilities(lam, n, self.method, num_clients=num_clients)
            subsets = draw_subsets(pi, num_clients, design=self.design, rng=rng)
        return np.asarray(subsets, dtype=np.int64), np.asarray(omega, dtype=np.float64), pi

    def _pack(
        self,
        arrays: ArrayRecord,
        spectra: dict[str, _Spectrum],
        terms: dict[str, tuple[np.ndarray, np.ndarray]],
        keep_ratio: float,
    ) -> tuple[ArrayRecord, _Sent]:
        """One node's ArrayRecord (fresh arrays, nothing shared with other nodes)."""
        sharded_weights = {f"{layer}.weight" for layer in spectra}
        out: dict[str, Array] = {}
        expected: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
        for key, arr in arrays.items():
            if key in sharded_weights:
                continue
            out[key] = arr  # dense entries are read-only on the wire; sharing the Array is safe
            expected[key] = (tuple(arr.shape), np.dtype(arr.dtype))
        indices = {}
        for layer, spec in spectra.items():
            idx, omega = terms[layer]
            parts = {
                "u": np.ascontiguousarray(spec.ut[idx].T, dtype=spec.dtype),  # (c_out, n)
                "v": np.ascontiguousarray(spec.vt[idx].T, dtype=spec.dtype),  # (c_in·k·k, n)
                "omega": np.ascontiguousarray(omega, dtype=spec.dtype),
                "indices": np.ascontiguousarray(idx, dtype=np.int64),
            }
            for part, value in parts.items():
                key = P.factor_key(layer, part)
                out[key] = Array(value)
                if part != "omega":
                    expected[key] = (value.shape, value.dtype)
            indices[layer] = parts["indices"]
        record = ArrayRecord(out)
        return record, _Sent(keep_ratio, indices, expected, sum(len(a.data) for a in out.values()))

    def _node_config(
        self, base: ConfigRecord, server_round: int, node: _Node, lr: float
    ) -> ConfigRecord:
        cfg = ConfigRecord(dict(base))  # own copy: never write into the caller's record
        seed_rng = np.random.default_rng([self.seed, server_round, _STREAM_TRAIN, node.stream])
        keep_ratio = node.keep_ratio
        cfg.update({
            "server-round": server_round,
            "lr": lr,
            "local-epochs": self.local_epochs,
            "batch-size": self.batch_size,
            "momentum": self.momentum,
            "frobenius-decay": self.frobenius_decay,
            "clip-lr-tau": float(self.clip_lr_tau) if self.clip_lr_tau is not None else 0.0,
            "weight-decay": self.weight_decay,
            "keep-ratio": keep_ratio,
            "train-seed": int(seed_rng.integers(2**31 - 1)),
            "method": self.method,
        })
        return cfg

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate every reply, average each term over its holders, rebuild W."""
        server_round += self.round_offset
        state = self._round
        if state is None or state.server_round != server_round:
            return None, None
        t0 = time.perf_counter()
        accepted: list[tuple[int, float, dict[str, np.ndarray], Any]] = []
        dropped: Counter[str] = Counter()
        seen: set[int] = set()
        received: list[int] = []
        for msg in replies:
            node = msg.metadata.src_node_id
            reason, parsed = self._check_reply(msg, state, seen)
            seen.add(node)
            if reason is not None:
                category = reason.split(":", 1)[0]
                dropped[category] += 1
                log(WARNING, "Round %d: dropping the reply of node %d (%s); it does not touch "
                    "the global model.", server_round, node, reason)
                continue
            assert parsed is not None
            weight, values, metrics, nbytes = parsed
            accepted.append((node, weight, values, metrics))
            received.append(nbytes)
        missing = len(state.sent) - len(seen & set(state.sent))
        metrics_out = dict(state.metrics)
        metrics_out["replies-used"] = float(len(accepted))
        metrics_out["replies-dropped"] = float(sum(dropped.values()))
        metrics_out["replies-missing"] = float(missing)
        for category, count in dropped.items():
            metrics_out[f"dropped-{category}"] = float(count)
        if not accepted:
            log(WARNING, "Round %d: no valid reply (%d dropped, %d missing); the global model is "
                "kept unchanged.", server_round, sum(dropped.values()), missing)
            metrics_out["aggregate-s"] = time.perf_counter() - t0
            self.history[server_round] = metrics_out
            return None, _metric_record(metrics_out)

        new_arrays = self._aggregate(state, accepted)
        total = sum(w for _, w, _, _ in accepted)
        for key in (P.TRAIN_LOSS, P.TRAIN_ACCURACY):
            vals = [(w, float(m[key])) for _, w, _, m in accepted if key in m]
            if vals:
                metrics_out[key] = sum(w * x for w, x in vals) / sum(w for w, _ in vals)
        metrics_out[P.NUM_EXAMPLES] = float(total)
        metrics_out["bytes-received-mean"] = float(np.mean(received))
        metrics_out["bytes-received-ratio-mean"] = float(
            np.mean(received) / metrics_out["dense-bytes"]
        )
        metrics_out["aggregate-s"] = time.perf_counter() - t0
        self.history[server_round] = metrics_out
        self._round = None
        return new_arrays, _metric_record(metrics_out)

    def _check_reply(
        self, msg: Message, state: _RoundState, seen: set[int]
    ) -> tuple[str | None, tuple[float, dict[str, np.ndarray], Any, int] | None]:
        """``(None, (weight, arrays, metrics, bytes))`` for a valid reply, else
        ``(reason, None)``."""
        node = msg.metadata.src_node_id
        if msg.has_error():
            return f"error-reply: code {msg.error.code}, {msg.error.reason}", None
        sent = state.sent.get(node)
        if sent is None:
            return "unexpected-sender: this node was not sent a training message this round", None
        if node in seen:
            return "duplicate: a second reply from this node in the same round", None
        content = msg.content
        if P.ARRAYS not in content.array_records or P.METRICS not in content.metric_records:
            return (
                f"missing-record: expected an ArrayRecord {P.ARRAYS!r} and a MetricRecord "
                f"{P.METRICS!r}, got {sorted(content.keys())}",
                None,
            )
        metrics = content.metric_records[P.METRICS]
        weight = metrics.get(P.NUM_EXAMPLES)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
            math.isfinite(weight) and weight > 0
        ):
            return f"bad-num-examples: {P.NUM_EXAMPLES}={weight!r}, expected a number > 0", None
        record = content.array_records[P.ARRAYS]
        keys, want = set(record.keys()), set(sent.expected)
        if keys != want:
            return (
                f"bad-keys: missing {sorted(want - keys)[:5]}, "
                f"unexpected {sorted(keys - want)[:5]}",
                None,
            )
        values: dict[str, np.ndarray] = {}
        for key, (shape, dtype) in sent.expected.items():
            try:
                x = record[key].numpy()
            except Exception as err:  # a corrupt payload must not crash the server
                return f"bad-array: {key} cannot be decoded ({err})", None
            if tuple(x.shape) != shape:
                return f"bad-shape: {key} has shape {tuple(x.shape)}, expected {shape}", None
            if x.dtype != dtype:
                return f"bad-dtype: {key} has dtype {x.dtype}, expected {dtype}", None
            if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
                return f"non-finite: {key} holds NaN or inf", None
            values[key] = x
        for layer, idx in sent.indices.items():
            if not np.array_equal(values[P.factor_key(layer, "indices")], idx):
                return (f"bad-indices: {layer}.indices differ from the terms this node was "
                        "sent", None)
        # bytes on the wire, counted as for the sent records (serialized Array data)
        nbytes = sum(len(a.data) for a in record.values())
        return None, (float(weight), values, metrics, nbytes)

    def _aggregate(
        self, state: _RoundState, accepted: list[tuple[int, float, dict[str, np.ndarray], Any]]
    ) -> ArrayRecord:
        total = sum(w for _, w, _, _ in accepted)
        out: dict[str, Array] = {}
        for key, arr in state.arrays.items():
            layer = key[: -len(".weight")] if key.endswith(".weight") else None
            if layer is not None and layer in state.spectra:
                out[key] = Array(self._rebuild(layer, state.spectra[layer], accepted))
                continue
            current = arr.numpy()
            if not np.issubdtype(current.dtype, np.floating):
                out[key] = arr  # integer buffers (e.g. counters) are not averaged
                continue
            acc = np.zeros(current.shape, dtype=np.float64)
            for _, w, values, _ in accepted:
                acc += w * values[key]
            out[key] = Array((acc / total).astype(current.dtype))
        return ArrayRecord(out)

    @staticmethod
    def _rebuild(
        layer: str, spec: _Spectrum, accepted: list[tuple[int, float, dict[str, np.ndarray], Any]]
    ) -> np.ndarray:
        """Average u'_i, v'_i over the nodes that held term i (weights D); W = Σ u'_i v'_iᵀ.

        Only the h held terms change: W_new = W + Σ_held (ū_i v̄_iᵀ − u'_i v'_iᵀ), a rank-2h
        update, used when 2h < N; otherwise the full sum over N terms is cheaper.
        """
        ku, kv, ki = (P.factor_key(layer, p) for p in ("u", "v", "indices"))
        n_terms = spec.lam.size
        mass = np.zeros(n_terms, dtype=np.float64)
        for _, w, values, _ in accepted:
            mass[values[ki]] += w
        held = np.flatnonzero(mass > 0)
        row = np.full(n_terms, -1, dtype=np.int64)
        row[held] = np.arange(held.size)
        u_new = np.zeros((held.size, spec.ut.shape[1]))  # (h, c_out)
        v_new = np.zeros((held.size, spec.vt.shape[1]))  # (h, c_in·k·k)
        for _, w, values, _ in accepted:
            rows = row[values[ki]]
            u_new[rows] += w * values[ku].T
            v_new[rows] += w * values[kv].T
        u_new /= mass[held, None]
        v_new /= mass[held, None]
        # The products run in the weight's own precision when it is float32 (2x faster than
        # float64; their rounding, ~1e-7 relative, is that of the float32 weight itself).
        cdt = np.dtype(np.float32) if spec.dtype == np.float32 else np.dtype(np.float64)
        w_new: np.ndarray
        if 2 * held.size < n_terms:
            ut, vt = spec.ut[held].astype(cdt), spec.vt[held].astype(cdt)
            w_new = spec.w.astype(cdt)
            w_new += np.matmul(u_new.astype(cdt).T, v_new.astype(cdt))
            w_new -= np.matmul(ut.T, vt)
        else:  # in place: the round's spectrum is not used after its aggregation
            spec.ut[held], spec.vt[held] = u_new, v_new
            w_new = np.matmul(spec.ut.astype(cdt).T, spec.vt.astype(cdt))
        return w_new.reshape(spec.shape).astype(spec.dtype, copy=False)

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Client-side evaluation of the dense global model (off when fraction_evaluate = 0)."""
        server_round += self.round_offset
        if self.fraction_evaluate == 0.0:
            return []
        node_ids = list(self._sample_nodes(
            grid, server_round, self.fraction_evaluate, self.min_evaluate_nodes
        ))
        messages = []
        for node in node_ids:
            cfg = ConfigRecord(dict(config))
            cfg["server-round"] = server_round
            messages.append(Message(RecordDict({P.ARRAYS: arrays, P.CONFIG: cfg}),
                                    dst_node_id=node, message_type=MessageType.EVALUATE))
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Weighted mean of valid evaluation replies; invalid ones are logged and dropped."""
        server_round += self.round_offset
        rows: list[tuple[float, Any]] = []
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                log(WARNING, "Round %d: evaluation error from node %d: %s", server_round, node,
                    msg.error.reason)
                continue
            metrics = msg.content.metric_records.get(P.METRICS)
            weight = metrics.get(P.NUM_EXAMPLES) if metrics is not None else None
            if metrics is None or isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                    or not (math.isfinite(weight) and weight > 0):
                log(WARNING, "Round %d: dropping evaluation reply of node %d (no positive %s).",
                    server_round, node, P.NUM_EXAMPLES)
                continue
            rows.append((float(weight), metrics))
        if not rows:
            return None
        total = sum(w for w, _ in rows)
        out: dict[str, float] = {P.NUM_EXAMPLES: total, "eval-nodes": float(len(rows))}
        for key in (P.EVAL_LOSS, P.EVAL_ACCURACY):
            vals = [(w, float(m[key])) for w, m in rows if key in m]
            if vals:
                out[key] = sum(w * x for w, x in vals) / sum(w for w, _ in vals)
        return _metric_record(out)


def _metric_record(values: dict[str, float]) -> MetricRecord:
    data: dict[str, int | float | list[int] | list[float]] = {
        k: float(v) for k, v in values.items()
    }
    return MetricRecord(data)


def _read_capabilities(reply: Message) -> tuple[_Node | None, str]:
    """The node's declared capabilities, or ``None`` and the reason there are none."""
    if reply.has_error():
        return None, f"error reply: {reply.error.reason}"
    caps = reply.content.config_records.get(P.CAPABILITIES)
    if caps is None or P.KEEP_RATIO not in caps:
        return None, f"no {P.CAPABILITIES!r} record with {P.KEEP_RATIO!r}"
    value = caps[P.KEEP_RATIO]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"{P.KEEP_RATIO}={value!r} is not a number"
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        return None, f"{P.KEEP_RATIO}={value!r} is outside (0, 1]"
    key = caps.get(P.NODE_KEY, "")
    if not isinstance(key, str):
        return None, f"{P.NODE_KEY}={key!r} is not a string"
    # Without a declared key the node id is the key (stable within one launch only).
    return _Node(float(value), key or str(reply.metadata.src_node_id)), ""
