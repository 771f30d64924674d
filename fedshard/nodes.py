"""The nodes of a run: waiting for them, asking for their capabilities, sampling them.

The one module of the strategy that talks to the grid about nodes. Capabilities (a node's keep
ratio and stable key) are asked once per node with a ``query`` message and cached; the cache
is pruned to the connected nodes every round, so a node that restarts (new node id) is asked
again. Sampling is seeded and ordered by the stable keys, so a run is reproducible although
Flower draws new node ids at every launch.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING

from flwr.common.logger import log
from flwr.serverapp import Grid

from fedshard import protocol as P
from fedshard.sampling import Stream, stream_rng

__all__ = ["NodeDirectory"]


class NodeDirectory:
    """Connected nodes and their declared capabilities.

    Parameters
    ----------
    seed : int
        Root of the sampling stream ``default_rng([seed, round, 0])``.
    min_available_nodes : int
        Nodes that must be connected before a round starts.
    query_timeout : float
        Seconds to wait for capability answers.
    node_wait_timeout : float or None
        Seconds to wait for enough nodes (``None``: forever, as FedAvg does).
    """

    def __init__(self, *, seed: int, min_available_nodes: int, query_timeout: float,
                 node_wait_timeout: float | None) -> None:
        self.seed = seed
        self.min_available_nodes = min_available_nodes
        self.query_timeout = query_timeout
        self.node_wait_timeout = node_wait_timeout
        self.capabilities: dict[int, P.Capabilities] = {}

    def wait(self, grid: Grid, need: int) -> list[int]:
        """Sorted ids of the connected nodes, once at least ``need`` are connected."""
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
        return node_ids

    def sample(self, grid: Grid, server_round: int, fraction: float,
               minimum: int) -> dict[int, P.Capabilities]:
        """Wait for enough nodes, learn the capabilities of new ones, then sample
        ``max(⌊fraction·K⌋, minimum)`` of the K connected among those with a keep ratio,
        returned in the canonical order (by stable key)."""
        node_ids = self.wait(grid, max(self.min_available_nodes, minimum))
        for gone in set(self.capabilities) - set(node_ids):
            del self.capabilities[gone]
        self.query(grid, node_ids)
        eligible = sorted((n for n in node_ids if n in self.capabilities),
                          key=lambda n: (self.capabilities[n].key, n))
        size = min(len(eligible), max(int(len(node_ids) * fraction), minimum))
        if size < len(eligible):
            rng = stream_rng(self.seed, server_round, Stream.NODES)
            eligible = [eligible[i] for i in sorted(rng.choice(len(eligible), size, replace=False))]
        if len(eligible) < min(len(node_ids), max(int(len(node_ids) * fraction), minimum)):
            log(WARNING, "Round %d: only %d of %d connected nodes declared a usable keep ratio.",
                server_round, len(self.capabilities), len(node_ids))
        return {n: self.capabilities[n] for n in eligible}

    def query(self, grid: Grid, node_ids: list[int]) -> None:
        """Ask every node not in the cache for its keep ratio (a ``query`` message)."""
        unknown = [n for n in node_ids if n not in self.capabilities]
        if not unknown:
            return
        messages = [P.query_message(node) for node in unknown]
        answered: set[int] = set()
        for reply in grid.send_and_receive(messages, timeout=self.query_timeout):
            node = reply.metadata.src_node_id
            answered.add(node)
            caps, reason = P.read_capabilities(reply)
            if caps is None:
                log(WARNING, "Node %d gave no usable keep ratio (%s); it is skipped this "
                    "round and asked again next round.", node, reason)
                continue
            self.capabilities[node] = caps
            if caps.keep_ratio == 1.0:
                log(INFO, "Node %d declares keep ratio 1: it trains all N terms of every "
                    "sharded layer (the paper's r = 1 reference), not a shard.", node)
        for node in set(unknown) - answered:
            log(WARNING, "Node %d did not answer the capability query within %.0f s; it is "
                "skipped this round and asked again next round.", node, self.query_timeout)
