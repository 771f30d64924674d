"""Label-skewed splits of a data set over simulated clients (pure numpy functions).

Both schemes give every client a private label distribution and then deal out the examples
*without replacement* so that

* client sizes are as equal as possible (``N // K`` or ``N // K + 1``, the first ``N % K``
  clients getting the extra example),
* every example goes to exactly one client (full coverage, no duplicates).

Dealing (shared by both schemes). Each client ``k`` still needs ``m_k`` examples; every class
``j`` still has ``s_j`` unassigned examples. In each round every client draws the classes of
all the examples it still needs, ``Multinomial(m_k, P_k)``, where ``P_k`` is its label
distribution restricted to the classes with ``s_j > 0`` and renormalized (the scheme defines
how; if all of a client's mass is on exhausted classes, ``P_k`` is proportional to ``s``).
A class requested more often than it has examples left gives them to a uniformly random subset
of the requests (multivariate hypergeometric over the clients); the other requests stay open
for the next round. Every such round exhausts at least one class, so there are at most
``C + 1`` rounds. This equals drawing the examples one at a time in a random interleaved
order while sampling from ``P_k`` renormalized over the classes still available, except that
the renormalization is applied per round instead of per draw. Finally each class's examples
are shuffled and handed out in the allocated numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["dirichlet_partition", "pachinko_partition", "partition_sizes"]

ProbsFn = Callable[[np.ndarray], np.ndarray]  # remaining supply (C,) -> (K, C) row-stochastic


def partition_sizes(num_examples: int, num_partitions: int) -> np.ndarray:
    """Sizes ``N // K`` or ``N // K + 1`` summing to ``N``, larger ones first.

    Raises
    ------
    ValueError
        If ``num_partitions`` is not in ``[1, num_examples]``.
    """
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, (int, np.integer)):
        raise TypeError(f"num_partitions must be an int, got {type(num_partitions).__name__}.")
    if not 1 <= num_partitions <= num_examples:
        raise ValueError(
            f"num_partitions={num_partitions}: expected between 1 and the number of examples "
            f"({num_examples}) so that every client gets at least one example; no split made."
        )
    base, extra = divmod(num_examples, int(num_partitions))
    sizes = np.full(int(num_partitions), base, dtype=np.int64)
    sizes[:extra] += 1
    return sizes


def _check_labels(labels: np.ndarray | Sequence[int], what: str) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array, got shape {arr.shape}.")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}.")
    return arr


def _check_alpha(alpha: float, what: str) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)):
        raise TypeError(f"{what} must be a real number, got {type(alpha).__name__}.")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"{what}={alpha}: expected a finite value > 0; no split was made.")
    return float(alpha)


def _restrict(probs: np.ndarray, available: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Rows of ``probs`` (..., C) zeroed where not ``available`` and renormalized.

    Rows left without mass become ``fallback`` (..., C) renormalized (which must have mass).
    """
    masked = np.where(available, probs, 0.0)
    total = masked.sum(axis=-1, keepdims=True)
    fb = np.where(available, fallback, 0.0)
    fb_total = fb.sum(axis=-1, keepdims=True)
    safe_fb = np.divide(fb, fb_total, out=np.zeros_like(fb), where=fb_total > 0)
    return np.where(total > 0, masked / np.where(total > 0, total, 1.0), safe_fb)


def _allocate(
    sizes: np.ndarray, supply: np.ndarray, probs_fn: ProbsFn, rng: np.random.Generator
) -> np.ndarray:
    """Per-client class counts ``(K, C)`` with row sums ``sizes`` and column sums ``supply``."""
    need = sizes.astype(np.int64).copy()
    left = supply.astype(np.int64).copy()
    counts = np.zeros((len(sizes), len(supply)), dtype=np.int64)
    for _ in range(len(supply) + 1):
        active = np.flatnonzero(need > 0)
        if active.size == 0:
            break
        probs = probs_fn(left)[active]
        draws = np.zeros((active.size, len(supply)), dtype=np.int64)
        draws[:] = rng.multinomial(need[active], probs)
        for j in np.flatnonzero(draws.sum(axis=0) > left):
            # Class j is over-requested: a uniformly random subset of the requests wins.
            draws[:, j] = rng.multivariate_hypergeometric(draws[:, j], int(left[j]))
        counts[active] += draws
        need[active] -= draws.sum(axis=1)
        left -= draws.sum(axis=0)
    assert not need.any() and not left.any(), "allocation must use every example exactly once"
    return counts


def _deal(codes: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Hand out the shuffled examples of each class code in the numbers ``counts`` (K, C)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(counts.shape[0])]
    for j in range(counts.shape[1]):
        members = rng.permutation(np.flatnonzero(codes == j))
        bounds = np.concatenate([[0], np.cumsum(counts[:, j])])
        for k in range(counts.shape[0]):
            parts[k].append(members[bounds[k] : bounds[k + 1]])
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def dirichlet_partition(
    labels: np.ndarray | Sequence[int],
    num_partitions: int,
    alpha: float,
    rng: np.random.Generator | int | None = None,
) -> list[np.ndarray]:
    """Split example indices over clients with Dir(α·p) class priors (Hsu et al., 2019).

    Parameters
    ----------
    labels : array_like of int
        ``(N,)`` class label of every example.
    num_partitions : int
        Number of clients ``K``, ``1 <= K <= N``.
    alpha : float
        Concentration ``α > 0``: small is skewed (``α = 1`` with 10 balanced classes leaves
        most clients one to three classes), large approaches i.i.d. splits.
    rng : numpy.random.Generator or int or None
        Randomness, normalized with ``numpy.random.default_rng``.

    Returns
    -------
    list of numpy.ndarray
        ``K`` sorted ``int64`` index arrays, sizes ``N // K`` or ``N // K + 1``, disjoint,
        together covering ``range(N)``.

    Raises
    ------
    ValueError
        If ``labels`` is empty or not 1-D, ``alpha`` is not finite and positive, or
        ``num_partitions`` is outside ``[1, N]``.
    TypeError
        If ``labels`` are not integers or ``num_partitions`` is not an int.

    Notes
    -----
    Client ``k``'s class prior is ``q_k ~ Dir(α p)`` with ``p`` the class proportions of
    ``labels`` (paper, Sec. 4.1: the notation of Hsu et al. (2019), not the per-class ``α`` of
    FedHM/PriSM), so the expected class share of a client is ``p`` and its variance
    ``p_j (1 - p_j) / (α + 1)``. Examples are dealt as described in the module docstring with
    ``P_k = q_k`` restricted to the classes that still have examples.
    """
    arr = _check_labels(labels, "labels")
    alpha = _check_alpha(alpha, "alpha")
    sizes = partition_sizes(arr.size, num_partitions)
    gen = np.random.default_rng(rng)
    _, codes, supply = np.unique(arr, return_inverse=True, return_counts=True)
    p = supply / arr.size
    q = gen.dirichlet(alpha * p, size=len(sizes))  # (K, C)

    def probs(left: np.ndarray) -> np.ndarray:
        return _restrict(q, left > 0, np.broadcast_to(left.astype(np.float64), q.shape))

    return _deal(codes, _allocate(sizes, supply, probs, gen), gen)


def pachinko_partition(
    fine_labels: np.ndarray | Sequence[int],
    coarse_labels: np.ndarray | Sequence[int],
    num_partitions: int,
    alpha_coarse: float,
    alpha_fine: float,
    rng: np.random.Generator | int | None = None,
) -> list[np.ndarray]:
    """Two-stage Pachinko allocation split (Li & McCallum, 2006; Reddi et al., 2021).

    Parameters
    ----------
    fine_labels, coarse_labels : array_like of int
        ``(N,)`` labels; every fine label must belong to a single coarse label (CIFAR-100: 100
        fine labels in 20 coarse groups of 5).
    num_partitions : int
        Number of clients ``K``, ``1 <= K <= N``.
    alpha_coarse : float
        Concentration of each client's distribution over the ``G`` coarse labels,
        ``Dir(α_c, ..., α_c)`` (paper: ``α_c = 1``).
    alpha_fine : float
        Concentration of each client's distribution over the fine labels of one coarse label,
        ``Dir(α_f, ..., α_f)`` (paper: ``α_f = 10``).
    rng : numpy.random.Generator or int or None
        Randomness, normalized with ``numpy.random.default_rng``.

    Returns
    -------
    list of numpy.ndarray
        ``K`` sorted ``int64`` index arrays, sizes ``N // K`` or ``N // K + 1``, disjoint,
        together covering ``range(N)``.

    Raises
    ------
    ValueError
        If the label arrays differ in length, a fine label occurs with two coarse labels, an
        α is not finite and positive, or ``num_partitions`` is outside ``[1, N]``.
    TypeError
        If labels are not integers or ``num_partitions`` is not an int.

    Notes
    -----
    The α's are per-component (symmetric Dirichlet), as in Reddi et al. (2021) and TFF's
    CIFAR-100 split; the paper (Sec. 4.1) says "sampled with α = 1" and "coarse-to-fine
    labels with α = 10" without restating the Dir(α·p) convention it uses for the other data
    sets (under which these would be ``Dir(0.05, ...)`` and ``Dir(2, ...)``).

    A client's distribution over fine labels is ``q_c[g(j)] * q_f[g(j)][j]``. Examples are
    dealt as described in the module docstring; when a fine label runs out, the client's
    fine distribution is renormalized within its coarse label, and when a whole coarse label
    runs out, the coarse distribution is renormalized over the remaining coarse labels.
    """
    fine = _check_labels(fine_labels, "fine_labels")
    coarse = _check_labels(coarse_labels, "coarse_labels")
    if fine.shape != coarse.shape:
        raise ValueError(
            f"fine_labels and coarse_labels must have the same length, got {fine.size} and "
            f"{coarse.size}."
        )
    alpha_c = _check_alpha(alpha_coarse, "alpha_coarse")
    alpha_f = _check_alpha(alpha_fine, "alpha_fine")
    sizes = partition_sizes(fine.size, num_partitions)
    gen = np.random.default_rng(rng)

    _, codes, supply = np.unique(fine, return_inverse=True, return_counts=True)
    _, coarse_codes = np.unique(coarse, return_inverse=True)
    # group[j]: coarse code of fine code j; it must be unique.
    pairs = np.unique(np.stack([codes, coarse_codes]), axis=1)  # (2, #distinct pairs)
    if pairs.shape[1] != supply.size:
        fine_values = np.unique(fine)
        clash = fine_values[np.flatnonzero(np.bincount(pairs[0]) > 1)]
        raise ValueError(
            f"fine labels {clash[:5].tolist()} occur with more than one coarse label; "
            "each fine label must belong to one coarse label. No split was made."
        )
    group = np.empty(supply.size, dtype=np.int64)
    group[pairs[0]] = pairs[1]
    num_groups = int(group.max()) + 1
    k = len(sizes)
    one_hot = np.eye(num_groups)[group]  # (C, G)

    q_coarse = gen.dirichlet(np.full(num_groups, alpha_c), size=k)  # (K, G)
    q_fine = np.empty((k, supply.size))  # (K, C), sums to 1 within each coarse group
    for g in range(num_groups):
        members = np.flatnonzero(group == g)
        q_fine[:, members] = gen.dirichlet(np.full(members.size, alpha_f), size=k)

    def probs(left: np.ndarray) -> np.ndarray:
        available = left > 0  # (C,)
        left_f = left.astype(np.float64)
        # Fine stage, renormalized within each coarse group: (K, C).
        masked = np.where(available, q_fine, 0.0)
        within = masked @ one_hot  # (K, G) remaining fine mass per group
        fallback_within = (left_f @ one_hot)[group]  # (C,) remaining supply of j's group
        own = np.divide(
            masked, within[:, group], out=np.zeros_like(masked), where=within[:, group] > 0
        )
        by_supply = np.divide(
            left_f, fallback_within, out=np.zeros(left.shape), where=fallback_within > 0
        )
        fine_p = np.where(within[:, group] > 0, own, by_supply)
        # Coarse stage over the groups with examples left: (K, G).
        group_left = left_f @ one_hot
        coarse_p = _restrict(q_coarse, group_left > 0, np.broadcast_to(group_left, q_coarse.shape))
        return coarse_p[:, group] * fine_p

    return _deal(codes, _allocate(sizes, supply, probs, gen), gen)
