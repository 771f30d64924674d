"""Is the run learning? Two of the strategy's callbacks (:mod:`fedshard.server.callbacks`):

- :class:`SlowStart` - at the first round, says how much of a sharded layer's gradient a node's
  step can follow at its keep ratio, and so why a sharded model starting from a random
  initialization learns more slowly than the dense model at the same lr (a WARNING when round 1
  was a small step of a short run, where the first rounds are most of it, and the sharded
  layers moved less than half as far as the model's dense ones), and warns when the
  dense factor step meets multipliers above 1 (the global weights then move less than a dense
  step);
- :class:`FallingAccuracy` - warns when an evaluation accuracy falls round after round while
  every reply passes the server's checks (updates that look normal: a model that gets worse,
  e.g. under DP-SGD noise, is otherwise silent);
- :class:`SpreadShrinksHonestNodes` - warns once when the spread bound keeps shrinking updates
  of nodes it does not name as out of line (honest heterogeneity, listed at INFO each round):
  the model then moves less than the paper's mean would, round after round.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedshard import protocol as P
from fedshard.server.advice import TrainingReceipts
from fedshard.server.callbacks import RoundCallback

if TYPE_CHECKING:
    from fedshard.server.base import KeepRatioStrategy
    from fedshard.server.rounds import RoundState

__all__ = ["SHORT_RUN_ROUNDS", "SMALL_STEP", "FallingAccuracy", "SlowStart", "gradient_share",
           "is_evaluation_accuracy"]

logger = logging.getLogger(__name__)

#: A run of at most this many rounds is short: its first rounds are most of it.
SHORT_RUN_ROUNDS = 10

#: A first round that moves every sharded layer's weights by less than this share of their
#: Frobenius norm is a small step: training is at its slow start (a small lr).
SMALL_STEP = 0.1

#: Where the docs explain the small-lr start (a page and its section).
SMALL_LR_DOCS = 'docs/integration.md, "A project\'s own small learning rate"'


def gradient_share(rows: int, cols: int, terms: int) -> float:
    """The share of a random isotropic gradient of a ``rows x cols`` weight that a step on
    ``terms`` of its singular terms can follow: ``n (m + k − n) / (m k)``.

    Notes
    -----
    A node trains ``U`` ``(m, n)`` and ``V`` ``(k, n)``; to first order its step moves ``W`` in
    the tangent space ``{A Vᵀ + U Bᵀ}`` of the rank-``n`` matrices at its terms, of dimension
    ``n (m + k − n)`` out of ``m k``, which it can follow of a gradient ``G`` only as
    ``P_U G + G P_V − P_U G P_V``. For a gradient with no preferred direction (a randomly
    initialized layer, whose singular vectors know nothing of the data) that is this share of
    ``‖G‖²``; 1 with every term.
    """
    return terms * (rows + cols - terms) / (rows * cols)


class SlowStart(RoundCallback):
    """At the first round, what a node's step can follow of each sharded layer's gradient, per
    keep ratio (:func:`gradient_share`), and why that makes a start from a random
    initialization slower than the dense model's at the same lr: INFO, or a WARNING when the
    first rounds are most of the run and the run is at its slow start (a keep ratio's largest
    share below one half, at most :data:`SHORT_RUN_ROUNDS` rounds or a length the strategy
    does not know, and round 1 moved every sharded layer's weights by less than
    :data:`SMALL_STEP` of their norm and by less than half as far as the model's own dense
    weight matrices moved in the same round, their median: the run's dense reference). A
    sharded model whose layers kept up with its dense ones is not slower than the dense
    model, whatever the lr: INFO, saying the lr is small for the whole model. And, at
    the first round where it applies, a WARNING for the dense factor step with multipliers ω
    above 1: it moves a node's sub-model ``U diag(ω) Vᵀ`` as a dense step would, and so the
    global weights, which carry no ω, by only ``1/ω_i`` of that along term ``i``."""

    def __init__(self) -> None:
        self.shares: dict[float, dict[str, tuple[int, int, float]]] = {}  # round 1's
        self.before: dict[str, np.ndarray] = {}  # the sharded layers' weights before round 1
        self.before_dense: dict[str, np.ndarray] = {}  # the dense weight matrices, likewise
        self.said_share = False
        self.said_dense_step = False
        #: round 1 was a small step (the slow start of a small lr): the run's lr diagnosis,
        #: which :class:`FallingAccuracy` keeps to (it never calls that lr too large)
        self.small_start = False

    def on_configure(self, strategy: KeepRatioStrategy, server_round: int,
                     config: ConfigRecord, messages: Sequence[Message]) -> None:
        want_shares = server_round == 1 and not self.said_share
        if not want_shares and self.said_dense_step:
            return  # (only shapes are read; ω only for the dense factor step, once)
        shares: dict[float, dict[str, tuple[int, int, float]]] = defaultdict(dict)
        omegas: list[np.ndarray] = []
        dense_step = False
        for msg in messages:
            content = msg.content
            arrays = content.array_records.get(P.ARRAYS)
            sent = content.config_records.get(P.CONFIG)
            if arrays is None or sent is None or not isinstance(
                    ratio := sent.get(P.KEEP_RATIO), (int, float)):
                continue
            dense = sent.get("factor-step") == "dense" and not self.said_dense_step
            dense_step = dense_step or dense
            if not (want_shares or dense):
                continue
            for key in arrays:
                if not key.endswith(".indices"):
                    continue
                layer = P.layer_of(key)
                u, v = (arrays.get(P.factor_key(layer, p)) for p in ("u", "v"))
                omega = arrays.get(P.factor_key(layer, "omega"))
                if u is None or v is None or len(u.shape) != 2 or len(v.shape) != 2:
                    continue
                rows, cols, terms = int(u.shape[0]), int(v.shape[0]), int(u.shape[1])
                shares[float(ratio)][layer] = (terms, min(rows, cols),
                                               gradient_share(rows, cols, terms))
                if dense and omega is not None:
                    omegas.append(P.decode_array(omega).astype(np.float64).ravel())
        if want_shares:
            self.shares = dict(shares)
        if dense_step and omegas and not self.said_dense_step:
            every = np.concatenate(omegas)
            if every.size and float(every.max()) > 1 + 1e-6:
                self.said_dense_step = True
                logger.warning(
                    "Round %d: factor_step='dense' with multipliers ω above 1 (this round's: "
                    "median %.3g, max %.3g). The dense factor step moves each node's "
                    "sub-model U·diag(ω)·Vᵀ as a dense step would; the global weights carry no "
                    "ω, so along term i they move 1/ω_i of that, and only along the terms the "
                    "nodes hold: the sharded layers' global update is smaller than the dense "
                    "model's. At the dense model's own lr, where the paper's step diverges, that "
                    "is its purpose; at a small lr it makes the start slower still: there keep "
                    "the paper's step (factor_step='plain', the default). See %s.",
                    server_round, float(np.median(every)), float(every.max()), SMALL_LR_DOCS)

    def on_aggregate(self, strategy: KeepRatioStrategy, server_round: int,
                     metrics: Mapping[str, float], state: RoundState | None) -> None:
        if server_round != 1 or not self.shares or state is None or not state.accepted:
            return
        current = state.current or {k: P.decode_array(a) for k, a in state.arrays.items()}
        self.before = {layer: current[f"{layer}.weight"] for layer in strategy.sharded_layers
                       if f"{layer}.weight" in current}
        # the model's dense weight matrices: the reference a sharded layer's first step is
        # judged against (the same lr, the same round, no sharding)
        sharded = {f"{layer}.weight" for layer in strategy.sharded_layers}
        self.before_dense = {key: value for key, value in current.items()
                             if key.endswith(".weight") and key not in sharded
                             and getattr(value, "ndim", 0) >= 2}

    def on_round(self, strategy: KeepRatioStrategy, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        if server_round != 1 or not self.shares or self.said_share:
            return None
        self.said_share = True
        moved = _moved(self.before, arrays, lambda layer: f"{layer}.weight")
        dense = _moved(self.before_dense, arrays, lambda key: key)
        self.before, self.before_dense = {}, {}
        self.small_start = bool(moved) and max(moved.values()) < SMALL_STEP
        self._say_share(strategy, self.shares, moved, dense)
        return None

    @staticmethod
    def _say_share(strategy: KeepRatioStrategy,
                   shares: Mapping[float, Mapping[str, tuple[int, int, float]]],
                   moved: Mapping[str, float], dense: Mapping[str, float]) -> None:
        rounds = strategy.num_rounds
        small = bool(moved) and max(moved.values()) < SMALL_STEP
        # slower than the dense model: the sharded layers moved less than half as far as the
        # model's own dense layers did in the same round (none: no reference, judged slower)
        reference = float(np.median(list(dense.values()))) if dense else None
        slower = reference is None or (bool(moved) and max(moved.values()) < 0.5 * reference)
        step = ""
        if moved:
            largest = max(moved, key=lambda layer: moved[layer])
            step = (f" Round 1 moved the sharded layers' weights by at most "
                    f"{100 * moved[largest]:.1f} % of their norm ({largest})")
            if reference is not None:
                step += (f", the dense layers' by {100 * reference:.1f} % (median of "
                         f"{len(dense)})")
            if small and slower:
                step += ": a small step, the slow start of training."
            elif small:
                step += (": a small step, but no smaller than the dense layers' (the lr is "
                         "small for the whole model, not for the sharded layers).")
            else:
                step += "."
        for ratio in sorted(shares):
            if ratio >= 1:
                continue
            layers = shares[ratio]
            low = min(s for _, _, s in layers.values())
            high = max(s for _, _, s in layers.values())
            held = ", ".join(f"{n} of {full} terms of {layer}"
                             for layer, (n, full, _) in sorted(layers.items())[:6])
            more = f" (and {len(layers) - 6} more layers)" if len(layers) > 6 else ""
            share = (f"{100 * low:.0f} %" if round(100 * low) == round(100 * high)
                     else f"{100 * low:.0f}-{100 * high:.0f} %")
            text = (f"Round 1: a node at keep ratio r = {ratio:g} trains {held}{more}: "
                    f"its step can follow at most {share} of a sharded layer's gradient (the "
                    "tangent space of its terms; all of it at r = 1). A model that starts from "
                    "a random initialization has no term aligned with the data yet, so in the "
                    "first rounds it learns more slowly than the dense model at the same "
                    f"lr.{step}")
            if small and slower and high < 0.5 and (rounds is None
                                                     or rounds <= SHORT_RUN_ROUNDS):
                length = (f"With {rounds} rounds the first rounds are most of this run"
                          if rounds is not None else
                          "The strategy does not know the run's length (pass num_rounds); in "
                          "a short run the first rounds are most of it")
                logger.warning(
                    "%s %s. If they matter: keep the paper's factor step and raise the lr "
                    "(the one the nodes' optimizers use too), or give the nodes a larger keep "
                    "ratio. See %s.", text, length, SMALL_LR_DOCS)
            else:
                logger.info("%s See %s.", text, SMALL_LR_DOCS)


def _moved(before: Mapping[str, np.ndarray], arrays: ArrayRecord,
           key: Callable[[str], str]) -> dict[str, float]:
    """Each ``before`` weight's change in round 1 over its norm, from ``arrays`` (the round's
    model; ``key`` names a weight's entry in it)."""
    moved: dict[str, float] = {}
    for name, old in before.items():
        after = arrays.get(key(name))
        if after is None:
            continue
        was = old.astype(np.float64)
        new = P.decode_array(after).astype(np.float64)
        if new.shape == was.shape and (norm := float(np.linalg.norm(was))) > 0:
            moved[name] = float(np.linalg.norm(new - was)) / norm
    return moved


class SpreadShrinksHonestNodes(RoundCallback):
    """One WARNING when the spread bound (``max_update_spread``) shrank the updates of nodes
    it did not name as out of line in at least ``min_rounds`` rounds and in at least half of
    the rounds so far. Each such round is an INFO line of the bound (honest nodes on
    different data pass κ × the round's median change on a few layers); together they are a
    steady cost on an honest federation's model, which the operator should see once."""

    def __init__(self, min_rounds: int = 3) -> None:
        if min_rounds < 1:
            raise ValueError(f"min_rounds={min_rounds!r}: expected at least 1")
        self.min_rounds = min_rounds
        self.rounds = 0
        self.shrunk = 0
        self.said = False

    def on_aggregate(self, strategy: KeepRatioStrategy, server_round: int,
                     metrics: Mapping[str, float], state: RoundState | None) -> None:
        if self.said or state is None or not state.accepted:
            return
        self.rounds += 1
        if metrics.get("clipped-update-spread", 0.0) > 0 and not metrics.get(
                "update-spread-warned", 0.0):
            self.shrunk += 1
        if self.shrunk >= self.min_rounds and 2 * self.shrunk >= self.rounds:
            self.said = True
            logger.warning(
                "Round %d: the spread bound (max-update-spread=%g) shrank updates of nodes it "
                "did not name as out of line in %d of the %d rounds so far (the INFO lines "
                "'changed a few layers or entries more than'). Honest nodes on different data "
                "get there, and each shrunk update moves the model less than the paper's mean "
                "would. Under attack this bound is what limits a node's pull; a federation "
                "whose nodes are all trusted gets the paper's mean with max-update-spread = 0.",
                server_round, strategy.replies.max_update_spread, self.shrunk, self.rounds)


#: A metric name that is an evaluation accuracy: ``test-accuracy``, ``eval-accuracy``,
#: ``client/eval_acc``, ``accuracy``, ``test-accuracy-at-r0.25`` (not a training accuracy).
_ACCURACY = re.compile(r"(^|[-_/])acc(uracy)?($|[-_/])", re.IGNORECASE)


def is_evaluation_accuracy(name: str) -> bool:
    """Whether the round metric ``name`` is an evaluation accuracy (:class:`FallingAccuracy`)."""
    return bool(_ACCURACY.search(name)) and "train" not in name.lower()


class FallingAccuracy(RoundCallback):
    """Warns when an evaluation accuracy falls :attr:`patience` evaluations in a row (each at
    least :attr:`min_drop` below the one before), while the rounds' replies are aggregated as
    usual: a model that gets worse although every reply passed the server's checks (DP-SGD
    noise that outweighs the gradients, an lr too large for the model, local drift on
    non-IID data) says so, once per such stretch, naming the metric, its values and rounds,
    the replies used and dropped, and, when the receipts say the nodes trained with DP-SGD,
    its noise multiplier.

    The accuracies are the round's metrics whose name says accuracy and not training
    (``test-accuracy`` from :class:`~fedshard.server.CentralEvaluation` or your
    ``evaluate_fn``, the client-side ``eval-accuracy``, ...); the initial model's (round 0)
    counts as the first value.

    Parameters
    ----------
    patience : int
        Falls in a row before the WARNING (≥ 1; default 2).
    min_drop : float
        The least fall (accuracy as a fraction) that counts (≥ 0; default 0.005).
    """

    def __init__(self, patience: int = 2, min_drop: float = 0.005) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1 \
                or not (isinstance(min_drop, (int, float)) and 0 <= min_drop < 1):
            raise ValueError(f"FallingAccuracy(patience={patience!r}, min_drop={min_drop!r}): "
                             "expected an integer patience ≥ 1 and a min_drop in [0, 1); no "
                             "callback was built")
        self.patience, self.min_drop = patience, float(min_drop)
        self.stretch: dict[str, list[tuple[int, float]]] = {}  # metric -> (round, value)s

    def on_round(self, strategy: KeepRatioStrategy, server_round: int, arrays: ArrayRecord,
                 metrics: Mapping[str, float]) -> Mapping[str, float] | None:
        falling = []
        for key, value in metrics.items():
            if not is_evaluation_accuracy(key) or isinstance(value, bool) \
                    or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                continue
            seen = self.stretch.setdefault(key, [])
            if seen and value < seen[-1][1] - self.min_drop:
                seen.append((server_round, float(value)))
            else:
                seen[:] = [(server_round, float(value))]  # a stretch starts here
            if len(seen) == self.patience + 1:  # once per stretch
                falling.append((key, list(seen)))
        if falling:
            logger.warning("%s", self._message(strategy, server_round, falling))
        return None

    def _message(self, strategy: KeepRatioStrategy, server_round: int,
                 falling: Sequence[tuple[str, Sequence[tuple[int, float]]]]) -> str:
        key, seen = falling[0]
        values = " → ".join(f"{v:.3f}" for _, v in seen)
        others = f" (also {', '.join(k for k, _ in falling[1:])})" if falling[1:] else ""
        rounds = [r for r, _ in seen[1:]]
        rows = [strategy.history.get(r, {}) for r in rounds]
        used = ", ".join(f"{row.get('replies-used', 0):.0f}" for row in rows)
        dropped = sum(row.get("replies-dropped", 0.0) for row in rows)
        text = (f"Round {server_round}: {key}{others} has fallen {len(seen) - 1} evaluations in "
                f"a row, {values} (rounds {seen[0][0]}-{seen[-1][0]}), while those rounds "
                f"aggregated their replies as usual (used: {used}; dropped: {dropped:.0f}): the "
                "model gets worse although every reply passed the server's checks, so the "
                "cause is in how the nodes train. ")
        private = _dp_sgd(strategy)
        if private:
            text += (f"The nodes' receipts say {private}: DP-SGD's noise (σ·C on the sum of "
                     "each batch's clipped gradients) may outweigh what the data adds at "
                     "this batch size and lr; the server averages each term over the nodes "
                     "that hold it only, fewer than all, so less of that noise averages out "
                     "than in FedAvg. Try larger batches, a smaller noise multiplier, or a "
                     "larger keep ratio, and compare with the dense model under the same "
                     "DP-SGD.")
        elif any(getattr(c, "small_start", False) for c in strategy.callbacks):
            # round 1 was a small step: the lr is not too large, and saying so would
            # contradict round 1's advice
            text += ("Round 1 was a small step (the lr is small, not too large), so likely "
                     "causes are local training that drifts on non-IID data (fewer local "
                     "epochs or steps) or a data or label problem on some nodes. Compare with "
                     "a dense run (FedAvg) of the same settings.")
        else:
            text += ("Likely causes: an lr too large for the sharded layers (a smaller lr, "
                     "or factor_step='dense'), local training that drifts on non-IID data "
                     "(fewer local epochs or steps), a data or label problem on some nodes. "
                     "Compare with a dense run (FedAvg) of the same settings.")
        return text


def _dp_sgd(strategy: KeepRatioStrategy) -> str:
    """What the receipts said of DP-SGD so far ("" if no node used it)."""
    for callback in strategy.callbacks:
        if isinstance(callback, TrainingReceipts) and callback.totals.get("dp-sgd"):
            sigmas = sorted({s for s, _ in callback.dp_settings if s is not None})
            told = (f", noise multiplier {', '.join(f'{s:g}' for s in sigmas)}"
                    if sigmas else "")
            return f"{callback.totals['dp-sgd']} node replies trained with DP-SGD{told}"
    return ""
