"""The keep ratios of a simulated federation: which share of the nodes keeps which ratio r.

Parsed from the run config's ``keep-ratios`` (``"0.2:0.6,0.4:0.4"``); the simulated node with
partition id p gets its ratio from :meth:`KeepRatioMixture.ratio_for`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["KeepRatioMixture"]


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
