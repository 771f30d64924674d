"""Which keep ratio a node declares: its own ``keep-ratio``, else, for a simulated node, its
share of a keep-ratio mix such as ``"0.25:0.5,0.5:0.5"`` (:class:`KeepRatioMixture`).

The one rule for fedshard's own app (run config ``keep-ratios``) and any Flower project
(``ShardingClientApp(keep_ratios="0.25:0.5,0.5:0.5")``): :func:`node_keep_ratio`.

- A node whose node config has ``keep-ratio`` (a deployed SuperNode's
  ``--node-config "keep-ratio=0.2"``) declares it; nothing overrides a device's own capacity.
- A simulated node (:func:`is_simulated_node`: its node config is exactly Flower's
  ``partition-id`` and ``num-partitions``) gets the mix's ratio for its partition id: the
  first ``c1`` partitions the first ratio, the next ``c2`` the second, ...
  (:meth:`KeepRatioMixture.ratio_for`).
- A deployed node without ``keep-ratio`` cannot take a share of a simulated federation: an
  error saying what to set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fedshard.protocol import KEEP_RATIO
from fedshard.sampling import as_keep_ratio

__all__ = [
    "KEEP_RATIOS",
    "SIMULATION_NODE_CONFIG",
    "KeepRatioMixture",
    "KeepRatios",
    "is_simulated_node",
    "node_keep_ratio",
]

#: The run-config key of fedshard's app for the simulated nodes' mix (``"0.2:0.6,0.4:0.4"``).
KEEP_RATIOS = "keep-ratios"

#: What Flower's simulation engine puts in every node config, and nothing else.
SIMULATION_NODE_CONFIG = frozenset({"partition-id", "num-partitions"})


@dataclass(frozen=True)
class KeepRatioMixture:
    """Keep ratios of a simulated federation and the share of nodes at each.

    Parsed from strings such as ``"0.2:0.6,0.4:0.4"`` (60 % of nodes keep 20 % of the terms,
    40 % keep 40 %) or a single ratio ``"0.2"`` (every node).
    """

    ratios: tuple[float, ...]
    shares: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> KeepRatioMixture:
        """Parse ``"r1:s1,r2:s2,..."``; raise ``ValueError`` naming the bad part."""
        ratios: list[float] = []
        shares: list[float] = []
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if not parts:
            raise ValueError(
                f"keep-ratios={text!r}: expected 'ratio:share,...' such as '0.2:0.6,0.4:0.4'"
            )
        for part in parts:
            ratio_s, _, share_s = part.partition(":")
            try:
                ratio = float(ratio_s)
                share = float(share_s) if share_s else (1.0 if len(parts) == 1 else math.nan)
            except ValueError:
                raise ValueError(
                    f"keep-ratios={text!r}: cannot read {part!r}; expected 'ratio:share' numbers"
                ) from None
            if math.isnan(share):
                raise ValueError(
                    f"keep-ratios={text!r}: {part!r} has no share; with several ratios each needs "
                    "'ratio:share'"
                )
            if not 0.0 < ratio <= 1.0:
                raise ValueError(f"keep-ratios={text!r}: ratio {ratio} is outside (0, 1]")
            if not 0.0 < share <= 1.0:
                raise ValueError(f"keep-ratios={text!r}: share {share} is outside (0, 1]")
            if ratio in ratios:
                raise ValueError(f"keep-ratios={text!r}: ratio {ratio} is listed twice")
            ratios.append(ratio)
            shares.append(share)
        if abs(sum(shares) - 1.0) > 1e-6:
            raise ValueError(f"keep-ratios={text!r}: shares sum to {sum(shares):.6g}, expected 1")
        return cls(tuple(ratios), tuple(shares))

    def counts(self, num_nodes: int) -> list[int]:
        """Nodes per ratio for ``num_nodes`` nodes (largest-remainder rounding)."""
        exact = [s * num_nodes for s in self.shares]
        counts = [math.floor(e) for e in exact]
        order = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
        for i in order[: num_nodes - sum(counts)]:
            counts[i] += 1
        return counts

    def ratio_for(self, partition_id: int, num_partitions: int) -> float:
        """Keep ratio of simulated node ``partition_id`` out of ``num_partitions``.

        Deterministic: partitions ``0..c1-1`` get the first ratio, the next ``c2`` the second,
        and so on, with the counts from :meth:`counts`. Data partitions are drawn at random, so
        contiguous blocks carry no data bias.
        """
        if not 0 <= partition_id < num_partitions:
            raise ValueError(
                f"partition-id={partition_id} is outside [0, num-partitions={num_partitions})"
            )
        edge = 0
        for ratio, count in zip(self.ratios, self.counts(num_partitions), strict=True):
            edge += count
            if partition_id < edge:
                return ratio
        raise AssertionError("counts() must sum to num_partitions")


#: A mix (``"0.25:0.5,0.5:0.5"`` or a parsed :class:`KeepRatioMixture`), or a function of the
#: node config that returns the node's ratio.
KeepRatios = str | KeepRatioMixture | Callable[[Mapping[str, Any]], float]


def is_simulated_node(node_config: Mapping[str, Any]) -> bool:
    """Whether this node config is one Flower's simulation engine built.

    Flower 1.42's simulation (``flwr/server/superlink/fleet/vce/vce_api.py``) gives every node
    exactly ``{"partition-id": i, "num-partitions": n}`` and nothing else; a deployed SuperNode
    has only what its ``--node-config`` gave. So any other key (``data-dir``, ``keep-ratio``,
    ...) marks a deployed node. A deployed node started with exactly those two keys cannot be
    told apart; deployed nodes should declare ``keep-ratio`` (as ``docs/deployment.md`` does).
    """
    return set(node_config) == SIMULATION_NODE_CONFIG


def node_keep_ratio(node_config: Mapping[str, Any], keep_ratios: KeepRatios) -> float:
    """This node's keep ratio under the rule of this module's docstring.

    Parameters
    ----------
    node_config : mapping
        The node's ``context.node_config``.
    keep_ratios : str, KeepRatioMixture or callable
        The simulated federation's mix, or ``f(node_config) -> ratio`` (called only for a node
        without its own ``keep-ratio``; its answer is checked as any declared ratio).

    Raises
    ------
    ValueError
        For a bad ``keep-ratio``, a bad mix, a callable's bad answer, or a deployed node that
        declares no ``keep-ratio`` (with a mix: the message says what to set).
    """
    if KEEP_RATIO in node_config:
        return as_keep_ratio(node_config[KEEP_RATIO], f"node config {KEEP_RATIO}",
                             "this node cannot train until it is fixed")
    if callable(keep_ratios) and not isinstance(keep_ratios, KeepRatioMixture):
        return as_keep_ratio(keep_ratios(node_config), f"keep_ratios({dict(node_config)})",
                             "this node does not take part")
    mixture = (keep_ratios if isinstance(keep_ratios, KeepRatioMixture)
               else KeepRatioMixture.parse(keep_ratios))
    if not is_simulated_node(node_config):
        raise ValueError(
            f"This deployed node declares no keep-ratio (its node config has "
            f"{sorted(node_config) or 'no keys'}; only a simulated node, whose node config is "
            "exactly partition-id and num-partitions, takes its ratio from the "
            "keep-ratios mix); it takes no part until restarted with --node-config "
            "\"keep-ratio=0.2 ...\""
        )
    return mixture.ratio_for(int(node_config["partition-id"]),
                             int(node_config["num-partitions"]))
