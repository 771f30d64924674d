"""Central differential privacy for factor shards and width slices: clip every node's whole
update, noise every per-term and per-entry sum, account the spent (ε, δ).

The mechanism (a trusted server; :class:`~fedshard.settings.Privacy` turns it on):

1. **Clip.** Node k's update ``Δ_k`` is the change of everything it returned from what it was
   sent: its factor columns ``u'_i − u_i``, ``v'_i − v_i`` of every sharded layer and its
   dense entries (width slicing: its slice). It is scaled to L2 norm at most S as one vector,
   ``Δ_k · min(1, S / ‖Δ_k‖)`` (:func:`clip_change`).
2. **Sum and noise.** Every term ``i`` of a layer is the sum of its holders' clipped values
   plus ``N(0, σ²S²)`` per coordinate, divided by its holder count ``m_i``; every dense entry
   (width slicing: every element) the same over the nodes that returned it. Which terms and
   elements a node holds is drawn by the server from the keep ratios and its seed, not from
   the data, so the counts are public: dividing by them is post-processing.
3. **Account.** One round is one sampled Gaussian mechanism of sensitivity S (one node added
   or removed changes the vector of all the round's sums by at most S in L2) at the sampling
   rate ``q = sampled nodes / nodes that may train``; Opacus's RDP accountant composes the
   rounds (:class:`CentralPrivacy`).

The aggregate is the plain clipped mean over holders, *unweighted*: a weight from
``num-examples`` is the node's own data-dependent report, and a node reporting more would move
the aggregate by more than S / m. So the strategy switches off the weight cap
(``max_weight_ratio``: there is no weight to cap) and the centred clipping of the robustness
defaults (``max_update_spread``: its radius is the round's median change, so one node's reply
would change how far the others move). The per-node bounds (``max_update_ratio``,
``align_factors``) act on one reply against what it was sent and stay. The robust rules over
several replies (``median``, ``trimmed-mean``, the dense rules) are refused with DP on.

Randomness: the noise of entry ``j`` (in ``state_dict`` order) comes from
``default_rng([seed, round, Stream.NOISE, j, part])`` (``part`` 0: a dense entry or a layer's
``u``, 1: its ``v``), never from a global seed.

Notes
-----
The Gaussian mechanism and its RDP (Mironov, 2017; Mironov, Talwar & Zhang, 2019, for the
sampled one) as in DP-FedAvg (McMahan, Ramage, Talwar & Zhang, ICLR 2018), with the per-term
holder counts of spectral sharding (the paper's Sec. 3.1, step 3) in place of the number of
clients. The RDP accountant assumes Poisson sampling of the nodes; Flower samples a fixed
number without replacement, the usual approximation (Flower's own DP wrappers make it too).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.common.logger import log

from fedshard import protocol as P
from fedshard.sampling import Stream, stream_rng
from fedshard.settings import DP_RANGE, Privacy
from fedshard.spectral.aggregate import TermUpdate, rebuild_weight, term_means
from fedshard.spectral.decompose import LayerSpectrum
from fedshard.width.slicing import SliceIndex

__all__ = ["DP_EXTRA", "CentralPrivacy", "RoundPrivacy", "clip_change", "noise_multiplier_for",
           "noisy_slices", "noisy_state", "noisy_term_means", "rdp_accountant",
           "spent_epsilon"]

#: What a run with central DP needs installed.
DP_EXTRA = 'pip install "fedshard[dp]" (opacus)'


def _opacus_accountants() -> Any:
    """``opacus.accountants``, imported when DP is asked for (the ``dp`` extra)."""
    try:
        import opacus.accountants as accountants
    except ImportError as err:
        raise ImportError(
            f"Central differential privacy (fedshard.Privacy) needs Opacus's RDP accountant, "
            f"which is not installed ({err}); install the dp extra: {DP_EXTRA}. No round was "
            "started.") from err
    return accountants


def rdp_accountant(history: Sequence[tuple[float, float, int]] = ()) -> Any:
    """Opacus's ``RDPAccountant`` holding ``history`` (``(σ, q, rounds)`` entries)."""
    accountant = _opacus_accountants().RDPAccountant()
    accountant.history = [(float(s), float(q), int(n)) for s, q, n in history]
    return accountant


@functools.lru_cache(maxsize=64)
def _round_rdp(noise_multiplier: float, sample_rate: float) -> tuple[float, ...]:
    """The RDP of one round at Opacus's default orders (composition multiplies it by the
    rounds: what ``RDPAccountant.get_privacy_spent`` sums, computed once per (σ, q))."""
    from opacus.accountants.analysis import rdp

    accountant = _opacus_accountants().RDPAccountant
    return tuple(rdp.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                 orders=accountant.DEFAULT_ALPHAS))


def spent_epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """ε spent at ``delta`` by the rounds of ``history`` (``(σ, q, rounds)``): Opacus's RDP
    accountant (its orders, its RDP of the sampled Gaussian mechanism and its conversion to
    (ε, δ)); 0 for none."""
    if not history:
        return 0.0
    from opacus.accountants.analysis import rdp

    accountant = _opacus_accountants().RDPAccountant
    total = sum(np.asarray(_round_rdp(float(s), float(q))) * int(n) for s, q, n in history)
    eps, _ = rdp.get_privacy_spent(orders=accountant.DEFAULT_ALPHAS, rdp=total, delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=64)
def noise_multiplier_for(target_epsilon: float, target_delta: float, sample_rate: float,
                         rounds: int) -> float:
    """The smallest σ whose ``rounds`` sampled Gaussian rounds at ``sample_rate`` spend at
    most (``target_epsilon``, ``target_delta``): Opacus's ``get_noise_multiplier`` with its
    RDP accountant (ε within 0.01 below the target)."""
    _opacus_accountants()
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                      sample_rate=sample_rate, steps=rounds, accountant="rdp"))


def clip_change(sent: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray],
                clipping_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """``got`` with its change from ``sent`` scaled, as one vector over every floating entry
    ``got`` and ``sent`` share, to L2 norm at most ``clipping_norm``; other entries as they
    are.

    Returns
    -------
    clipped : dict of str to np.ndarray
        ``sent + Δ·min(1, S/‖Δ‖)`` in float64 for the floating entries.
    norm : float
        ``‖Δ‖`` before clipping.
    """
    keys = [k for k, v in got.items() if k in sent and np.issubdtype(v.dtype, np.floating)]
    change = {k: np.asarray(got[k], dtype=np.float64) - sent[k] for k in keys}
    norm = math.sqrt(sum(float(np.dot(d.ravel(), d.ravel())) for d in change.values()))
    scale = min(1.0, clipping_norm / norm) if norm > 0 else 1.0
    out = dict(got)
    for k in keys:
        out[k] = np.asarray(sent[k], dtype=np.float64) + scale * change[k]
    return out, norm


def _noise(seed: int, server_round: int, entry: int, part: int, std: float,
           shape: tuple[int, ...]) -> np.ndarray:
    """``N(0, std²)`` of ``shape`` from entry ``entry``'s own stream."""
    return stream_rng(seed, server_round, Stream.NOISE, entry, part).normal(0.0, std, shape)


def noisy_term_means(spec: LayerSpectrum, updates: Sequence[TermUpdate], std: float, *,
                     seed: int, server_round: int, entry: int,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One sharded layer's held terms and their noised means over their holders.

    Returns
    -------
    held : np.ndarray
        ``(h,)`` sorted indices of the terms at least one update holds.
    u_mean, v_mean : np.ndarray
        ``(h, c_out)``, ``(h, c_in·k·k)``: ``(Σ_{k∋i} u'_{k,i} + z) / m_i``, ``z ~ N(0,
        std²)`` per coordinate from entry ``entry``'s streams (``u``: part 0, ``v``: part 1).
    count : np.ndarray
        ``(h,)`` float64, the holders ``m_i`` of each held term.
    """
    held, u_mean, v_mean = term_means(spec, updates, "mean")  # weights 1: Σ / m_i
    count = np.bincount(np.concatenate([u.indices for u in updates]),
                        minlength=spec.lam.size)[held].astype(np.float64)
    u_mean += _noise(seed, server_round, entry, 0, std, u_mean.shape) / count[:, None]
    v_mean += _noise(seed, server_round, entry, 1, std, v_mean.shape) / count[:, None]
    return held, u_mean, v_mean, count


def noisy_state(current: Mapping[str, np.ndarray], spectra: Mapping[str, LayerSpectrum],
                dense: Sequence[Mapping[str, np.ndarray]],
                terms: Sequence[Mapping[str, TermUpdate]], std: float, *, seed: int,
                server_round: int, device: str | None = None, min_holders: int = 1,
                counts: list[int] | None = None) -> dict[str, np.ndarray]:
    """The new global state of a spectral round from clipped replies: every held term
    ``(Σ_{k∋i} u'_{k,i} + z) / m_i`` (``z ~ N(0, std²)`` per coordinate, ``m_i`` its holders;
    the same for v), W rebuilt; every floating dense entry ``(Σ_k x_k + z) / m``; integer
    entries kept. ``std`` is σS; the ``terms``' weights must be 1 (an unweighted sum). A term
    or entry held by fewer than ``min_holders`` replies keeps its value.
    ``counts``, if given, gets each layer's fewest holders of a held term and the number of
    replies (the dense entries' count)."""
    out: dict[str, np.ndarray] = {}
    for entry, (key, value) in enumerate(current.items()):
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        if layer is not None and layer in spectra:
            spec = spectra[layer]
            held, u_mean, v_mean, count = noisy_term_means(
                spec, [t[layer] for t in terms], std, seed=seed, server_round=server_round,
                entry=entry)
            keep = count >= min_holders  # (h,): the others keep their terms
            if counts is not None and keep.any():
                counts.append(int(count[keep].min()))
            out[key] = rebuild_weight(spec, held[keep], u_mean[keep], v_mean[keep],
                                      device=device)
        elif not np.issubdtype(value.dtype, np.floating) or len(dense) < max(min_holders, 1):
            out[key] = value
        else:
            total = np.zeros(value.shape, dtype=np.float64)
            for d in dense:
                total += d[key]
            total += _noise(seed, server_round, entry, 0, std, value.shape)
            out[key] = (total / len(dense)).astype(value.dtype)
            if counts is not None:
                counts.append(len(dense))
    return out


def noisy_slices(current: Mapping[str, np.ndarray], values: Sequence[Mapping[str, np.ndarray]],
                 index: Sequence[SliceIndex], std: float, *, seed: int, server_round: int,
                 min_holders: int = 1, counts: list[int] | None = None,
                 ) -> dict[str, np.ndarray]:
    """The new global state of a width-slicing round from clipped slices: every element a node
    trained is ``(Σ_k x_k + z) / m`` over the ``m`` nodes that trained it (``z ~ N(0,
    std²)``); the others (and those fewer than ``min_holders`` nodes trained), and integer
    entries, keep their value. ``counts``, if given, gets
    each entry's fewest nodes of a trained element."""
    out: dict[str, np.ndarray] = {}
    for entry, (key, now) in enumerate(current.items()):
        if not np.issubdtype(now.dtype, np.floating) or not values:
            out[key] = now.copy()
            continue
        total = np.zeros(now.shape, dtype=np.float64)
        count = np.zeros(now.shape, dtype=np.float64)
        for x, at_index in zip(values, index, strict=True):
            at = np.ix_(*at_index[key]) if now.ndim else ()
            total[at] += x[key]  # np.ix_ index sets are distinct: once per element
            count[at] += 1.0
        held = count >= max(min_holders, 1)
        if counts is not None and held.any():
            counts.append(int(count[held].min()))
        total += _noise(seed, server_round, entry, 0, std, now.shape)
        new = np.asarray(now, dtype=np.float64).copy()
        new[held] = total[held] / count[held]
        out[key] = new.astype(now.dtype)
    return out


@dataclass
class RoundPrivacy:
    """One round's mechanism: σ, S, the sampling rate, and whether its aggregate was released
    (then the round is accounted)."""

    server_round: int
    seed: int
    noise_multiplier: float
    clipping_norm: float
    sample_rate: float
    min_holders: int = 1
    released: bool = False
    clipped: int = 0  # nodes whose update was above S (the operator's log only)
    # the fewest holders of a term / nodes of an element (public: drawn by the server); its
    # mean gets the most noise, σS / that count
    fewest: int = 0

    @property
    def std(self) -> float:
        """σS, the standard deviation of the noise on each sum."""
        return self.noise_multiplier * self.clipping_norm

    def clip(self, accepted: Sequence[P.TrainReply], sent: Mapping[int, P.SentShard],
             ) -> list[dict[str, np.ndarray]]:
        """Each reply's values with its whole change from what its node was sent clipped to
        S (:func:`clip_change`)."""
        out = []
        for r in accepted:
            values, norm = clip_change(sent[r.node].values, r.values, self.clipping_norm)
            self.clipped += norm > self.clipping_norm
            out.append(values)
        return out

    def combine_terms(self, current: Mapping[str, np.ndarray],
                      spectra: Mapping[str, LayerSpectrum], accepted: Sequence[P.TrainReply],
                      sent: Mapping[int, P.SentShard], device: str | None = None,
                      ) -> dict[str, np.ndarray]:
        """A spectral round's new state (:func:`noisy_state`) from ``accepted``, clipped."""
        clipped = self.clip(accepted, sent)
        terms = [{layer: TermUpdate(1.0, v[P.factor_key(layer, "indices")],
                                    v[P.factor_key(layer, "u")], v[P.factor_key(layer, "v")])
                  for layer in r.layers} for r, v in zip(accepted, clipped, strict=True)]
        self.released = True
        counts: list[int] = []
        out = noisy_state(current, spectra, clipped, terms, self.std, seed=self.seed,
                          server_round=self.server_round, device=device,
                          min_holders=self.min_holders, counts=counts)
        self.fewest = min(counts, default=0)
        return out

    def combine_slices(self, current: Mapping[str, np.ndarray],
                       accepted: Sequence[P.TrainReply], sent: Mapping[int, P.SentShard],
                       index: Mapping[int, SliceIndex]) -> dict[str, np.ndarray]:
        """A width-slicing round's new state (:func:`noisy_slices`) from ``accepted``,
        clipped."""
        clipped = self.clip(accepted, sent)
        self.released = True
        counts: list[int] = []
        out = noisy_slices(current, clipped, [index[r.node] for r in accepted], self.std,
                           seed=self.seed, server_round=self.server_round,
                           min_holders=self.min_holders, counts=counts)
        self.fewest = min(counts, default=0)
        return out


class CentralPrivacy:
    """The run's central DP: σ (given, or calibrated at the first round), each round's
    mechanism (:meth:`start_round`) and the accountant over the released rounds
    (:meth:`account`).

    Parameters
    ----------
    privacy : fedshard.settings.Privacy
        Enabled settings.
    num_rounds : int or None
        The run's rounds (needed to calibrate σ to a target ε).
    seed : int
        The root of the noise streams (the strategy's seed).

    Raises
    ------
    ImportError
        Without Opacus (the ``dp`` extra), naming it.
    """

    def __init__(self, privacy: Privacy, num_rounds: int | None, seed: int) -> None:
        assert privacy.enabled and privacy.clipping_norm is not None
        _opacus_accountants()  # fail before round 1 without the extra
        self.privacy = privacy
        self.num_rounds = num_rounds
        self.seed = seed
        self.noise_multiplier: float | None = privacy.noise_multiplier
        self.history: list[tuple[float, float, int]] = []  # (σ, q, rounds), as Opacus keeps it
        self._checked = False  # the cohort checks, at the run's first round

    def _check_cohort(self, server_round: int, sampled: int, pool: int) -> None:
        """Refuse, before the first noised round, a δ of 1/nodes or more and a
        ``min_holders`` that no round of this cohort can reach."""
        self._checked = True
        p = self.privacy
        if pool > 0 and p.target_delta >= 1 / pool:
            raise ValueError(
                f"dp-target-delta={p.target_delta:g} with {pool} nodes that can be sampled: "
                f"expected δ < 1/{pool} = {1 / pool:.3g} (a δ of 1/nodes allows releasing one "
                "node's data outright); set dp-target-delta below it (e.g. 1e-5). The run "
                f"stops before round {server_round} trains.")
        if p.min_holders > sampled:
            raise ValueError(
                f"dp-min-holders={p.min_holders} but round {server_round} samples {sampled} "
                f"node(s): no term can have {p.min_holders} holders, so no round would update "
                f"the model; expected at most {sampled} (fraction-train, min-train-nodes "
                f"sample more). The run stops before round {server_round} trains.")

    def describe(self) -> str:
        """One line for the run's settings summary."""
        p = self.privacy
        sigma = (f"σ={p.noise_multiplier:g}" if p.noise_multiplier is not None else
                 f"σ calibrated at round 1 to ε={p.target_epsilon:g} over "
                 f"{self.num_rounds} rounds")
        return (f"central DP: each node's update clipped to S={p.clipping_norm:g}, noise "
                f"N(0, σ²S²) on every per-term and per-entry sum, {sigma}, δ="
                f"{p.target_delta:g}; the plain clipped sum / holder count (num-examples not "
                "used: max-weight-ratio off), max-update-spread off")

    def start_round(self, server_round: int, sampled: int, pool: int) -> RoundPrivacy:
        """The mechanism of a round that samples ``sampled`` of ``pool`` nodes; the first one
        calibrates σ to the target at this sampling rate (logged)."""
        q = min(1.0, sampled / pool) if pool > 0 else 1.0
        p = self.privacy
        if not self._checked:
            self._check_cohort(server_round, sampled, pool)
        if self.noise_multiplier is None:
            assert p.target_epsilon is not None and self.num_rounds is not None
            try:
                self.noise_multiplier = noise_multiplier_for(p.target_epsilon, p.target_delta,
                                                             q, self.num_rounds)
            except ValueError as err:  # Opacus: "The privacy budget is too low."
                floor = spent_epsilon([(DP_RANGE[1], q, self.num_rounds)], p.target_delta)
                raise ValueError(
                    f"dp-target-epsilon={p.target_epsilon:g} cannot be met at dp-target-delta="
                    f"{p.target_delta:g} over {self.num_rounds} rounds at sampling rate "
                    f"q={q:.4g}: Opacus's RDP accountant certifies no ε below about "
                    f"{floor:.3g} there, whatever the noise ({err}). Raise dp-target-epsilon "
                    f"or dp-target-delta; the run stops before round {server_round} trains."
                ) from err
            log(INFO, "Round %d: central DP noise multiplier σ=%.4g (target ε=%g, δ=%g over %d "
                "rounds at sampling rate q=%.4g = %d of %d nodes; Opacus RDP accountant).",
                server_round, self.noise_multiplier, p.target_epsilon, p.target_delta,
                self.num_rounds, q, sampled, pool)
        assert self.privacy.clipping_norm is not None
        return RoundPrivacy(server_round, self.seed, self.noise_multiplier,
                            self.privacy.clipping_norm, q, self.privacy.min_holders)

    def account(self, mechanism: RoundPrivacy | None) -> dict[str, float]:
        """Add a released round to the accountant; the round's metrics (``dp-epsilon``,
        ``dp-delta``, ``dp-noise-multiplier``, ``dp-sample-rate``, ``dp-clipping-norm``,
        ``dp-rounds``), logged. A round whose aggregate was not released spends nothing."""
        delta = self.privacy.target_delta
        if mechanism is not None and mechanism.released:
            step = (mechanism.noise_multiplier, mechanism.sample_rate)
            if self.history and self.history[-1][:2] == step:
                self.history[-1] = (*step, self.history[-1][2] + 1)
            else:
                self.history.append((*step, 1))
        epsilon = spent_epsilon(self.history, delta)
        rounds = sum(n for _, _, n in self.history)
        out = {"dp-epsilon": epsilon, "dp-delta": delta, "dp-rounds": float(rounds)}
        if mechanism is not None:
            out.update({"dp-noise-multiplier": mechanism.noise_multiplier,
                        "dp-sample-rate": mechanism.sample_rate,
                        "dp-clipping-norm": mechanism.clipping_norm})
            if mechanism.released:
                out["dp-fewest-holders"] = float(mechanism.fewest)
            target = self.privacy.target_epsilon
            level = WARNING if target is not None and epsilon > target * 1.001 else INFO
            log(level, "Round %d: central DP has spent ε=%.4g at δ=%g over %d noised round(s) "
                "(σ=%.4g, q=%.4g, S=%g; %d of this round's updates clipped)%s.",
                mechanism.server_round, epsilon, delta, rounds, mechanism.noise_multiplier,
                mechanism.sample_rate, mechanism.clipping_norm, mechanism.clipped,
                "" if target is None else
                f"; target ε={target:g}" + (" EXCEEDED: more nodes per round than at round 1 "
                                              "(the rate σ was calibrated to)"
                                              if level == WARNING else ""))
        return out

    def resume(self, history: Mapping[int, Mapping[str, float]]) -> None:
        """Rebuild the accountant from a run's metrics history (its ``dp-*`` entries)."""
        self.history = []
        for _, row in sorted(history.items()):
            if "dp-sample-rate" in row and row.get("dp-rounds", 0) > sum(
                    n for _, _, n in self.history):
                step = (float(row["dp-noise-multiplier"]), float(row["dp-sample-rate"]))
                if self.history and self.history[-1][:2] == step:
                    self.history[-1] = (*step, self.history[-1][2] + 1)
                else:
                    self.history.append((*step, 1))
                self.noise_multiplier = step[0]
