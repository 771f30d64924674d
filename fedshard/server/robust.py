"""Robust aggregation of a round's checked replies: sign- and scale-aware rules for factor
terms, and the robust rules of Flower's ``FedMedian``, ``FedTrimmedAvg`` and ``Krum`` over the
dense-equivalent models.

A returned term ``(u'_i, v'_i)`` stands for the product ``u'_i v'_iᵀ``, which every pair
``(c·u'_i, v'_i/c)`` shares; the server averages ``u`` and ``v`` separately, so a node that
returns its terms sign-flipped (``c = −1``, update ratio 2) or re-balanced (``c = 10``) keeps its
own ``UVᵀ`` and still shrinks or inflates the averaged terms. The rules here run after the
reply checks (:mod:`fedshard.protocol`) and before the per-term averages
(:mod:`fedshard.spectral.aggregate`), each as the operator's
:class:`~fedshard.settings.ReplyPolicy` says; every change is logged with the node and
counted in the round's metrics:

* :func:`align_replies` (``align_factors``, on by default): each term in the sign and balance of
  the term sent (``re-signed-terms``, ``rebalanced-terms``); a no-op for honest nodes;
* :func:`bounded_weights` (``max_weight_ratio``, 2 in the robust preset): a ``num-examples``
  above the round's median weighs at most that multiple of it, however large, and the nodes
  above the median share one budget of ``(max_weight_ratio − 1)`` medians
  (``clipped-num-examples``); a claim beyond :data:`FAR_WEIGHT` times the median is also named
  in a WARNING (``implausible-num-examples``);
* :func:`spread_replies` (``max_update_spread`` = κ, 2 by default): a node's change of a layer
  or dense entry beyond κ times the round's median is shrunk to it (``clipped-update-spread``,
  ``update-spread-max``); a node whose update is out of line as a whole, beyond what its
  ``num-examples`` explains, is aggregated as a typical node: each of its changes shrunk to
  the round's median change, its weight to the median weight (``update-spread-held``);
* :func:`dense_rule` (``aggregation`` = ``dense-median`` / ``dense-trimmed-mean`` / ``krum``):
  :func:`coordinatewise_median` / :func:`coordinatewise_trimmed_mean` / :func:`krum` over each
  reply's whole model, the rules of Flower's ``FedMedian`` / ``FedTrimmedAvg`` / ``Krum``
  computed as Flower computes them, to the last bit.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from logging import INFO, WARNING

import numpy as np
from flwr.common.logger import log

from fedshard import protocol as P
from fedshard.server.metrics import one_line
from fedshard.settings import ReplyPolicy
from fedshard.spectral.aggregate import (
    align_factors,
    dense_equivalents,
    relative_change,
    shrink_change,
    spread_scales,
    squared_norm,
)
from fedshard.spectral.decompose import LayerSpectrum

__all__ = [
    "FAR_WEIGHT",
    "align_replies",
    "bounded_weights",
    "coordinatewise_median",
    "coordinatewise_trimmed_mean",
    "dense_rule",
    "krum",
    "spread_replies",
    "weight_bound",
]

#: A ``num-examples`` beyond this multiple of the round's median is implausible: the node is
#: named in a WARNING. Its weight is what :func:`bounded_weights` gives any claim above the
#: median (no threshold changes it), and :func:`spread_replies` reads at most this multiple
#: of the median as the data that explains a large update.
FAR_WEIGHT = 100.0


def _count(metrics: dict[str, float], name: str, k: float) -> None:
    metrics[name] = metrics.get(name, 0.0) + k


def bounded_weights(weights: Sequence[float], ratio: float) -> list[float]:
    """The weights a round's replies are aggregated with, from their ``num-examples``
    ``weights``, under ``max_weight_ratio`` = ``ratio`` (0: off, FedAvg's weights).

    With ``m`` the round's lower median (``statistics.median_low``), a reply claiming ``w``
    gets ``min(w, m) + s·e``: ``e = min(w, ratio·m) − m`` is its excess over the median (0 at
    or below it), and ``s = min(1, (ratio − 1)·m / Σ e)`` one scale for the round, so that the
    nodes above the median share one budget of ``(ratio − 1)·m`` between them. One data-rich
    node is weighted up to ``ratio × m``, as an honest node holding more data than most
    should be; several share that extra weight in proportion to their excess.

    Every weight is continuous and non-decreasing in every claim: there is no threshold a
    claim can sit under for more pull (a claim just under 100 times the median weighs what
    one far above it does), and :func:`spread_replies` judges an update against this weight,
    not the claim. ``f`` colluding nodes weigh at most ``f + ratio − 1`` typical nodes
    whatever they claim, so inflated claims cannot out-weigh an honest majority of typical
    nodes; the price is that honest nodes holding more data than the median, together, gain
    at most ``(ratio − 1)`` median nodes' weight (a heterogeneous federation is weighted
    closer to uniformly than FedAvg weights it; ``max_weight_ratio = 0`` keeps FedAvg's).
    """
    if not ratio or not weights:
        return [float(w) for w in weights]
    m = float(statistics.median_low(weights))
    excess = [max(0.0, min(float(w), ratio * m) - m) for w in weights]
    total = sum(excess)
    scale = 1.0 if total <= (ratio - 1.0) * m else (ratio - 1.0) * m / total
    return [min(float(w), m) + scale * e for w, e in zip(weights, excess, strict=True)]


def weight_bound(weight: float, median: float, ratio: float) -> float:
    """The weight a reply claiming ``weight`` examples is aggregated with, in a round whose
    (lower) median claim is ``median``, under ``max_weight_ratio`` = ``ratio``.

    Parameters
    ----------
    weight : float
        The reply's ``num-examples`` (checked: a whole number in ``[1, 2**53]``).
    median : float
        The round's lower median ``num-examples`` (``statistics.median_low``).
    ratio : float
        ``max_weight_ratio``: 0 (off: FedAvg's weights) or at least 1.

    Returns
    -------
    float
        ``weight`` up to ``ratio × median``; above it ``ratio × median`` (an honest node
        holding more data than most gets there); beyond :data:`FAR_WEIGHT` × ``median`` the
        claim is not believed and the reply is weighted as the median, a typical node.
        With ``ratio`` 0, ``weight`` itself.

    .. deprecated::
        The jump at :data:`FAR_WEIGHT` is a threshold an attacker can sit under; the rounds
        use :func:`bounded_weights`, continuous in the claim. ``weight_bound`` is removed in
        the next release.
    """
    warnings.warn("weight_bound is deprecated: the rounds use bounded_weights (continuous in "
                  "the claim)", DeprecationWarning, stacklevel=2)
    if not ratio or weight <= ratio * median:
        return weight
    return median if weight > FAR_WEIGHT * median else ratio * median


def align_replies(server_round: int, accepted: Sequence[P.TrainReply],
                  sent: Mapping[int, P.SentShard], policy: ReplyPolicy,
                  metrics: dict[str, float]) -> list[P.TrainReply]:
    """``accepted`` with every returned term re-signed (and re-balanced) to the gauge of the
    term sent (:func:`~fedshard.spectral.aggregate.align_factors`); unchanged when
    ``policy.align_factors`` is off. Each node whose terms changed is logged once: in a
    WARNING where it re-signed or re-balanced at least half of a layer's terms (a deliberate
    change of gauge touches them all), else at INFO (honest training with a large step moves a
    few terms' balance); ``re-signed-terms`` / ``rebalanced-terms`` in ``metrics`` count the
    terms. Honest replies come back as the same objects."""
    if not policy.align_factors:
        return list(accepted)
    out = []
    for r in accepted:
        before, values, notes = sent[r.node].values, dict(r.values), []
        sweeping = False  # at least half of one layer's terms changed
        for layer in r.layers:
            ku, kv = P.factor_key(layer, "u"), P.factor_key(layer, "v")
            a = align_factors(before[ku], before[kv], values[ku], values[kv])
            if a.flipped or a.rebalanced:
                values[ku], values[kv] = a.u, a.v
                notes.append(f"{layer}: {a.flipped} re-signed, {a.rebalanced} re-balanced of "
                             f"{a.u.shape[1]}")
                _count(metrics, "re-signed-terms", a.flipped)
                _count(metrics, "rebalanced-terms", a.rebalanced)
                sweeping |= 2 * (a.flipped + a.rebalanced) >= a.u.shape[1]
        if notes:
            log(WARNING if sweeping else INFO, "Round %d: node %d returned terms in another "
                "sign or balance than it was sent (%s); they are averaged in the sent terms' "
                "sign and balance, which keeps each of its products u v^T.", server_round,
                r.node, one_line("; ".join(notes[:5]), 600))
            r = replace(r, values=values)
        out.append(r)
    return out


def _groups(reply: P.TrainReply, spectra: Mapping[str, LayerSpectrum]
            ) -> dict[str, tuple[str, ...]]:
    """What the spread rule compares: each sharded layer's ``u`` and ``v`` together, and
    each dense floating entry alone."""
    groups: dict[str, tuple[str, ...]] = {
        layer: (P.factor_key(layer, "u"), P.factor_key(layer, "v")) for layer in spectra}
    factors = {k for keys in groups.values() for k in keys}
    for key, x in reply.values.items():
        if (key not in factors and not key.endswith(".indices")
                and np.issubdtype(x.dtype, np.floating)):
            groups[key] = (key,)
    return groups


def _checked_change(reply: P.TrainReply, values: Mapping[str, np.ndarray],
                    keys: tuple[str, ...]) -> float | None:
    """A one-key group's squared change as the update bound took it, when ``values`` still
    holds the array it was taken of (``None``: take it again)."""
    if len(keys) != 1:
        return None
    known = reply.changes.get(keys[0])
    return known[1] if known is not None and known[0] is values[keys[0]] else None


def spread_replies(server_round: int, accepted: Sequence[P.TrainReply],
                   sent: Mapping[int, P.SentShard], spectra: Mapping[str, LayerSpectrum],
                   policy: ReplyPolicy, metrics: dict[str, float],
                   claimed: Mapping[int, float] | None = None) -> list[P.TrainReply]:
    """``accepted`` with each node's change of a sharded layer (``u`` and ``v`` together)
    or of a dense floating entry, relative to what it was sent, shrunk to
    ``policy.max_update_spread`` (κ) times the round's median change of it
    (:func:`~fedshard.spectral.aggregate.spread_scales`; off below 3 replies or with κ = 0).

    Every shrunk change is logged; the level says what the evidence says. A node whose
    update as a whole is out of line is named in a WARNING (what was shrunk and by how much,
    its weight and the round's median weight, what it reports) and *held to the median*: out
    of line means beyond κ times the median on at least half of the layers and entries it
    returned and beyond ``2κ`` on one of them (a scaled update moves every layer), or beyond
    ``10κ`` on any one (a targeted one), both thresholds multiplied by k, its weight over the
    round's median weight where that is above 1 (k times the data, k times the steps). The
    weight is the one it is aggregated with, after :func:`bounded_weights`: at most
    ``max_weight_ratio`` times the median when that is on, else at most :data:`FAR_WEIGHT`
    times it, so that no claim buys a larger allowance and no claim sits under a threshold.
    Honest nodes on different data pass the bound on a few entries (a bias, a norm's scale,
    one layer) while the rest of their update is typical, and honest data-rich nodes move in
    proportion to their data up to k: they are listed in one INFO line per round with their
    largest excess.

    A held node's changes are each shrunk to the round's median change of that layer or
    entry and its weight to the round's median weight, so that it pulls on every average it
    enters as a typical node does. The two bounds alone leave such a node
    ``κ × max_weight_ratio`` (4) times a typical node's pull on each average. An honest node
    holding more than ``max_weight_ratio`` times the median's data that moves that much
    further than typical is held too: the price of no claim buying pull. In ``metrics``,
    ``clipped-update-spread`` counts the (node, layer or entry) pairs shrunk to κ,
    ``update-spread-max`` is the largest change over its median, before shrinking, and
    ``update-spread-warned`` and ``update-spread-held`` the nodes named and held (the same
    nodes).

    ``claimed`` maps each node to the ``num-examples`` it reported, before the weight cap
    (default: the replies' weights). Width slicing's replies go through the same rule: every
    entry of a node's narrow ``state_dict`` is a group, its change taken over the slice the
    node holds.

    Notes
    -----
    One step of centred clipping (Karimireddy, He & Jaggi, ICML 2021, Alg. 2) with the sent
    model as the centre and a radius taken from the round's own median, so that no tuning is
    needed: a minority of nodes cannot move the median, and a node's pull on each average is
    at most κ times a typical node's. Holding a node to the median change is FLTrust's
    normalization (Cao, Fang, Liu & Gong, NDSS 2021: every update rescaled to the magnitude
    of a trusted reference update, so that scaling an update buys no influence) with the
    round's median change as the reference, applied to the nodes the evidence names only.
    """
    kappa = policy.max_update_spread
    if not kappa or len(accepted) < 3:
        return list(accepted)
    values = [dict(r.values) for r in accepted]
    notes: dict[int, list[str]] = {}
    excess: dict[int, float] = {}  # a node's largest change over the median
    over: dict[int, int] = {}  # how many of a node's layers and entries were beyond κ
    groups = _groups(accepted[0], spectra)
    # per group: what each node was sent, each node's change and the round's median change
    seen: dict[str, tuple[list[list[np.ndarray]], list[float], float]] = {}
    for name, keys in groups.items():
        before = [[sent[r.node].values[k] for k in keys] for r in accepted]
        # a dense entry was sent to every node as the same array: its norm is taken once
        norms: dict[tuple[int, ...], float] = {}
        for arrays in before:
            if tuple(map(id, arrays)) not in norms:
                norms[tuple(map(id, arrays))] = squared_norm(arrays)
        changes = [relative_change(arrays, [v[k] for k in keys], dense=name not in spectra,
                                   sent_sq=norms[tuple(map(id, arrays))],
                                   change_sq=_checked_change(r, v, keys))
                   for arrays, v, r in zip(before, values, accepted, strict=True)]
        median = float(np.median(changes))
        seen[name] = (before, changes, median)
        if median > 0:
            metrics["update-spread-max"] = max(metrics.get("update-spread-max", 0.0),
                                               max(changes) / median)
        for i, scale in enumerate(spread_scales(changes, kappa)):
            if scale < 1.0:
                for k, b in zip(keys, before[i], strict=True):
                    values[i][k] = shrink_change(b, values[i][k], float(scale))
                notes.setdefault(accepted[i].node, []).append(
                    f"{name} {changes[i] / median:.3g}x")
                excess[accepted[i].node] = max(excess.get(accepted[i].node, 0.0),
                                               changes[i] / median)
                over[accepted[i].node] = over.get(accepted[i].node, 0) + 1
                _count(metrics, "clipped-update-spread", 1.0)
    weights = {r.node: r.weight for r in accepted}
    claims = weights if claimed is None else {n: claimed.get(n, w) for n, w in weights.items()}
    typical = statistics.median_low(weights.values())  # as max-weight-ratio's median
    held = {n for n in notes if _out_of_line(excess[n], over[n], len(groups), kappa,
                                             _explained(weights[n], typical))}
    for i, r in enumerate(accepted):
        if r.node in held:  # every change from the aligned reply to the median, κ or not
            for name, keys in groups.items():
                before, changes, median = seen[name]
                if changes[i] > median:
                    for k, b in zip(keys, before[i], strict=True):
                        values[i][k] = shrink_change(b, r.values[k], median / changes[i])
    near = sorted(set(notes) - held)
    if near:
        log(INFO, "Round %d: %d node(s) changed a few layers or entries more than "
            "max-update-spread=%g times the round's median change; shrunk to it (node: "
            "largest change over the median: %s). Honest nodes on different data get there; a "
            "node whose update is out of line as a whole is named in a warning.",
            server_round, len(near), kappa,
            ", ".join(f"{n}: {excess[n]:.3g}x" for n in near[:20]))
    if held:
        metrics["update-spread-warned"] = metrics["update-spread-held"] = float(len(held))
    for node, what in notes.items():
        if node in held:
            log(WARNING, "Round %d: node %d changed more than max-update-spread=%g times the "
                "round's median change (%s), further than the data it is weighted for "
                "explains (%g examples, the round's median %g; it reports %.0f); it is "
                "aggregated as a typical node: each of its changes is shrunk to the round's "
                "median change and it is weighted as %g examples.", server_round, node, kappa,
                one_line(", ".join(what[:8]), 600), weights[node], typical, claims[node],
                min(weights[node], typical))
    return [replace(r, values=v, weight=min(r.weight, typical)) if r.node in held
            else replace(r, values=v) if r.node in notes else r
            for r, v in zip(accepted, values, strict=True)]


def _explained(weight: float, typical: float) -> float:
    """The data a node's update is judged against, over the round's median weight: the weight
    it is aggregated with (after :func:`bounded_weights`, so at most ``max_weight_ratio``
    times the median when that is on), at least 1, and at most :data:`FAR_WEIGHT`; 1 in a
    round whose median weight is 0. Continuous in the weight: no claim sits under a
    threshold."""
    if typical <= 0:
        return 1.0
    return max(1.0, min(weight, FAR_WEIGHT * typical) / typical)


def _out_of_line(excess: float, over: int, groups: int, kappa: float,
                 data: float = 1.0) -> bool:
    """Whether a node's shrunk update is evidence against it, not honest heterogeneity:
    beyond κ on at least half of its ``groups`` layers and entries and beyond 2κ on one, or
    beyond 10κ on any (``excess``: its largest change over the round's median). ``data``:
    its weight over the round's median weight; a node holding k times the typical data takes
    k times the steps, so both thresholds grow with it (k ≥ 1)."""
    k = max(1.0, data)
    return (2 * over >= groups and excess > 2 * kappa * k) or excess > 10 * kappa * k


def _entries(models: Sequence[Sequence[np.ndarray]], rule: str) -> list[np.ndarray]:
    """Each entry of the models stacked over them: ``(m, *shape)`` per entry."""
    if not models:
        raise ValueError(f"{rule}: expected at least one model, got none; nothing to aggregate")
    sizes = {len(model) for model in models}
    if len(sizes) > 1:
        raise ValueError(f"{rule}: expected every model to have the same entries, got models "
                         f"of {sorted(sizes)} entries; nothing is aggregated")
    return [np.stack(entry) for entry in zip(*models, strict=True)]


def coordinatewise_median(models: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Coordinate-wise median of ``m`` models, unweighted (Flower's ``FedMedian``).

    Parameters
    ----------
    models : sequence of sequence of np.ndarray
        ``m`` models, each a list of its entries in one order; entry ``j`` has one shape in
        all of them.

    Returns
    -------
    list of np.ndarray
        Entry by entry, the median over the ``m`` models of every coordinate (the mean of
        the two middle values for even ``m``), in NumPy's result dtype (``np.median``).

    Raises
    ------
    ValueError
        No models, or models of different numbers of entries.

    Notes
    -----
    The coordinate-wise median of Yin et al. (ICML 2018, Def. 1). Each coordinate's median
    depends only on its ``m`` values, so the result equals ``FedMedian``'s to the last bit.
    """
    return [np.asarray(np.median(stack, axis=0))
            for stack in _entries(models, "coordinate-wise median")]


def coordinatewise_trimmed_mean(models: Sequence[Sequence[np.ndarray]],
                                trim_fraction: float) -> list[np.ndarray]:
    """Coordinate-wise trimmed mean of ``m`` models, unweighted (Flower's ``FedTrimmedAvg``).

    Parameters
    ----------
    models : sequence of sequence of np.ndarray
        ``m`` models, each a list of its entries in one order; entry ``j`` has one shape in
        all of them.
    trim_fraction : float
        In ``[0, 0.5)``: ``β``; the ``⌊β·m⌋`` smallest and as many largest values of every
        coordinate are dropped.

    Returns
    -------
    list of np.ndarray
        Entry by entry, the mean of every coordinate's ``m − 2⌊β·m⌋`` middle values.

    Raises
    ------
    ValueError
        ``trim_fraction`` outside ``[0, 0.5)``, no models, or models of different numbers of
        entries.

    Notes
    -----
    The coordinate-wise trimmed mean of Yin et al. (ICML 2018, Def. 2). The middle values are
    found with ``np.partition`` and summed in the order it leaves them, as SciPy's
    ``trim_mean`` and Flower's ``FedTrimmedAvg`` do: a sum in another order (e.g. sorted)
    may differ in the last bit, this one does not.
    """
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction={trim_fraction}: expected in [0, 0.5) (the share "
                         "dropped at each end); nothing is aggregated")
    stacks = _entries(models, "coordinate-wise trimmed mean")
    m = len(models)
    low = int(trim_fraction * m)  # ⌊β·m⌋ for β ≥ 0
    high = m - low
    out = []
    for stack in stacks:  # (m, *shape)
        part = np.partition(stack, (low, high - 1), axis=0)
        out.append(np.asarray(np.mean(part[low:high], axis=0)))
    return out


def krum(models: Sequence[Sequence[np.ndarray]], num_malicious: int) -> int:
    """The index of the model Krum selects among ``m`` (Flower's ``Krum``).

    Parameters
    ----------
    models : sequence of sequence of np.ndarray
        ``m`` models, each a list of its entries in one order; each is flattened into one
        vector (entries in order, each in C order).
    num_malicious : int
        ``f`` ≥ 0: how many of the ``m`` models may be dishonest.

    Returns
    -------
    int
        The index of the model of the smallest score (the first of equal scores).

    Raises
    ------
    ValueError
        ``num_malicious`` < 0, no models, or models of different sizes.

    Notes
    -----
    Blanchard et al. (NeurIPS 2017, Sec. 4): model ``i``'s score is the sum of its squared
    distances ``‖V_i − V_j‖²`` to its ``m − f − 2`` nearest other models (at least one), and
    the model of the smallest score is selected. Each distance is computed as Flower computes
    it (``np.linalg.norm`` of the difference, squared, in the models' dtype), and the nearest
    distances are summed from the smallest up, so the selection is ``Krum``'s also where two
    scores differ only in the last bit.
    """
    if num_malicious < 0:
        raise ValueError(f"num_malicious={num_malicious}: expected >= 0; no model is selected")
    if not models:
        raise ValueError("krum: expected at least one model, got none; no model is selected")
    # (m, P), in the dtype the entries promote to
    flat = np.stack([np.concatenate(list(model), axis=None) for model in models])
    m = len(models)
    distances = np.zeros((m, m))  # float64 whatever the models' dtype
    for i in range(m):
        for j in range(m):
            if i != j:  # each ordered pair on its own, as Flower's distance matrix
                distances[i, j] = np.linalg.norm(flat[i] - flat[j]) ** 2
    nearest = max(1, m - num_malicious - 2)
    # sorted row: its own distance 0 first, then the others from the nearest
    scores = [np.sum(np.sort(row)[1:nearest + 1]) for row in distances]
    return int(np.argmin(scores))


def dense_rule(current: Mapping[str, np.ndarray], spectra: Mapping[str, LayerSpectrum],
               accepted: Sequence[P.TrainReply], policy: ReplyPolicy) -> dict[str, np.ndarray]:
    """The new state by a robust rule over the replies' dense-equivalent models
    (:func:`~fedshard.spectral.aggregate.dense_equivalents`): ``dense-median``
    (:func:`coordinatewise_median`, Flower's ``FedMedian``), ``dense-trimmed-mean``
    (:func:`coordinatewise_trimmed_mean`, ``FedTrimmedAvg``, cutting
    ``policy.trim_fraction`` at each end) or ``krum`` (:func:`krum`, ``Krum``, assuming
    ``⌊trim_fraction·m⌋`` of the m replies dishonest). Integer buffers are kept."""
    states = dense_equivalents(current, spectra, [r.values for r in accepted],
                               [r.terms() for r in accepted])
    keys = list(states[0])
    models = [[st[k] for k in keys] for st in states]
    rule, frac = policy.aggregation, policy.trim_fraction
    if rule == "dense-median":
        arrays = coordinatewise_median(models)
    elif rule == "dense-trimmed-mean":
        arrays = coordinatewise_trimmed_mean(models, frac)
    else:
        arrays = models[krum(models, int(np.floor(frac * len(models))))]
    new = dict(current)
    new.update({k: np.asarray(a).astype(current[k].dtype)
                for k, a in zip(keys, arrays, strict=True)})
    return new
